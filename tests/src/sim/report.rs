//! What the simulator prints: the comparison table, one JSON line per result, the
//! no-router bound beside them, and an SVG bar chart for the docs.

use std::collections::{BTreeMap, HashSet};

use super::{simulate_labelled, Policy, SimOpts, SimResult};
use crate::bench::Samples;
use crate::workload::Request;

/// What no router can beat: one infinite cache shared by all pods and no queueing. Its
/// hit rate is the ceiling; its TTFT (each request prefills only what that cache lacks)
/// is the floor. On the generated workloads the floor's p99 is the cold prefill of each
/// new group or conversation, which every policy pays.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bound {
    pub hit_rate: f64,
    pub ttft_mean_ms: f64,
    pub ttft_p99_ms: f64,
}

pub fn infinite_cache_bound(reqs: &[Request], o: &SimOpts) -> Bound {
    let mut seen = HashSet::new();
    let (mut hits, mut total) = (0u64, 0u64);
    let mut ttft = Samples(Vec::with_capacity(reqs.len()));
    for r in reqs {
        let hit = r.chain.iter().take_while(|b| seen.contains(*b)).count() as u64;
        hits += hit;
        total += r.chain.len() as u64;
        let cached = (hit * o.block_tokens as u64).min(r.input_tokens as u64);
        ttft.push((o.cost.prefill_s(r.input_tokens as u64 - cached) * 1e6) as u64);
        seen.extend(r.chain.iter().copied());
    }
    Bound {
        hit_rate: hits as f64 / total.max(1) as f64,
        ttft_mean_ms: ttft.mean() / 1e3,
        ttft_p99_ms: ttft.pct(99.0) as f64 / 1e3,
    }
}

/// Run `policies` on `reqs`; print the table; return the results.
pub fn compare(label: &str, reqs: &[Request], o: &SimOpts, policies: &[Policy]) -> Vec<SimResult> {
    let results: Vec<SimResult> = policies
        .iter()
        .map(|&p| simulate_labelled(reqs, o, p, label))
        .collect();
    let mut results = results;
    // Several gateways: kvroute with one gateway, and without replica sync, beside them.
    if o.gateways > 1 && policies.contains(&Policy::Kvroute) {
        let one = SimOpts {
            gateways: 1,
            ..o.clone()
        };
        let mut r = simulate_labelled(reqs, &one, Policy::Kvroute, label);
        r.policy = "kvroute/1-gateway".into();
        results.push(r);
        let nosync = SimOpts {
            replica_sync: false,
            ..o.clone()
        };
        let mut r = simulate_labelled(reqs, &nosync, Policy::Kvroute, label);
        r.policy = "kvroute/no-sync".into();
        results.push(r);
    }
    let bound = infinite_cache_bound(reqs, o);
    println!(
        "{label}: {} requests, {} pods x {} blocks, {} gateway(s), infinite-cache hit-rate ceiling {:.3}, TTFT floor (that cache, no queueing) mean {:.1} ms, p99 {:.0} ms",
        reqs.len(),
        o.pods,
        o.capacity_blocks,
        o.gateways.max(1),
        bound.hit_rate,
        bound.ttft_mean_ms,
        bound.ttft_p99_ms
    );
    println!(
        "  {:<18} {:>8} {:>11} {:>10} {:>10} {:>11} {:>10} {:>9} {:>9}",
        "policy",
        "hit",
        "TTFT mean",
        "TTFT p50",
        "TTFT p99",
        "E2E mean",
        "E2E p99",
        "req/s",
        "max/mean"
    );
    for r in &results {
        println!(
            "  {:<18} {:>8.3} {:>9.1}ms {:>8.0}ms {:>8.0}ms {:>9.0}ms {:>8.0}ms {:>9.2} {:>9.2}",
            r.policy,
            r.hit_rate,
            r.ttft_mean_ms,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.e2e_mean_ms,
            r.e2e_p99_ms,
            r.throughput_rps,
            r.max_mean_load
        );
    }
    results
}

/// A grouped bar chart of mean and p99 TTFT per policy.
pub fn svg_bars(title: &str, results: &[SimResult]) -> String {
    let (w, h, ml, mb, mt) = (80.0 + 70.0 * results.len() as f64, 360.0, 60.0, 90.0, 40.0);
    let ymax = results.iter().map(|r| r.ttft_p99_ms).fold(1.0, f64::max) * 1.1;
    let y = |v: f64| h - mb - v / ymax * (h - mb - mt);
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" font-size="14" text-anchor="middle">{title}</text><line x1="{ml}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
        w / 2.0,
        h - mb,
        w - 10.0,
        h - mb
    );
    for i in 0..=4 {
        let v = ymax / 4.0 * i as f64;
        s += &format!(
            r#"<text x="{}" y="{:.1}" text-anchor="end">{v:.0} ms</text>"#,
            ml - 4.0,
            y(v) + 4.0
        );
    }
    for (i, r) in results.iter().enumerate() {
        let x0 = ml + 10.0 + 70.0 * i as f64;
        for (j, (v, c)) in [(r.ttft_mean_ms, "#1f77b4"), (r.ttft_p99_ms, "#ff7f0e")]
            .iter()
            .enumerate()
        {
            s += &format!(
                r#"<rect x="{:.1}" y="{:.1}" width="24" height="{:.1}" fill="{c}"/>"#,
                x0 + 26.0 * j as f64,
                y(*v),
                (h - mb) - y(*v)
            );
        }
        s += &format!(
            r#"<text x="{:.1}" y="{}" transform="rotate(40 {:.1} {})">{}</text>"#,
            x0,
            h - mb + 14.0,
            x0,
            h - mb + 14.0,
            r.policy
        );
    }
    s += &format!(
        r##"<rect x="{ml}" y="{}" width="10" height="10" fill="#1f77b4"/><text x="{}" y="{}">TTFT mean</text><rect x="{}" y="{}" width="10" height="10" fill="#ff7f0e"/><text x="{}" y="{}">TTFT p99</text>"##,
        h - 20.0,
        ml + 14.0,
        h - 11.0,
        ml + 100.0,
        h - 20.0,
        ml + 114.0,
        h - 11.0
    );
    s + "</svg>\n"
}

/// Summary rows for docs: policy → (mean, p99, max/mean).
pub fn by_policy(results: &[SimResult]) -> BTreeMap<String, (f64, f64, f64)> {
    results
        .iter()
        .map(|r| {
            (
                r.policy.clone(),
                (r.ttft_mean_ms, r.ttft_p99_ms, r.max_mean_load),
            )
        })
        .collect()
}
