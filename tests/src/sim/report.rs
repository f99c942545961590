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
    if let Some(b) = session_balance(reqs, o.pods, o.seed) {
        println!(
            "  {} sessions, starting within {:.0} s, living a median {:.0} s; dealt at random, as many to each pod, they load it max/mean {:.2} (p10 {:.2}, p90 {:.2})",
            b.sessions, b.start_span_s, b.median_life_s, b.median, b.p10, b.p90
        );
        println!(
            "  placed as each starts on the pod with the fewest sessions so far: {:.2}; with the fewest requests so far: {:.2}; knowing every session's size (largest first): {:.2}",
            b.fewest_sessions, b.fewest_requests, b.known_sizes
        );
    }
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

/// One policy over several seeds of a workload. On the agentic sessions a single seed is
/// a poor judge: which pods the few largest sessions share decides the run, and a setting
/// that wins one seed loses the next. Means of TTFT are geometric, so that one seed's
/// collapse (minutes of queueing on an overloaded fleet) does not outweigh the others.
#[derive(Clone, Debug, PartialEq)]
pub struct SeedSummary {
    pub policy: String,
    pub seeds: usize,
    pub ttft_mean_ms: f64,
    pub ttft_p99_ms: f64,
    pub hit_rate: f64,
    pub max_mean_load: f64,
    pub session_moves: f64,
    /// Prompt blocks missed by requests that stayed on their session's pod, and by
    /// those moved off it (shares of all prompt blocks; see `SimResult::missed`).
    pub missed_stayed: f64,
    pub missed_moved: f64,
    /// Seeds on which this policy had the lowest TTFT mean of those compared (a tie goes
    /// to the one listed first).
    pub best_mean: usize,
}

impl SeedSummary {
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({"summary": true, "policy": self.policy, "seeds": self.seeds,
            "ttft_mean_geo_ms": (self.ttft_mean_ms * 10.0).round() / 10.0,
            "ttft_p99_geo_ms": self.ttft_p99_ms.round(),
            "hit_rate": (self.hit_rate * 1e4).round() / 1e4,
            "max_mean_load": (self.max_mean_load * 100.0).round() / 100.0,
            "session_moves": (self.session_moves * 1e3).round() / 1e3,
            "missed_stayed": (self.missed_stayed * 1e4).round() / 1e4,
            "missed_moved": (self.missed_moved * 1e4).round() / 1e4,
            "best_mean": self.best_mean})
    }
}

/// `per_seed[s]` is one seed's results (the same policies, in the same order).
pub fn summarize_seeds(per_seed: &[Vec<SimResult>]) -> Vec<SeedSummary> {
    let Some(first) = per_seed.first() else {
        return Vec::new();
    };
    // Each seed's policy with the lowest TTFT mean.
    let winners: Vec<&str> = per_seed
        .iter()
        .filter_map(|rs| {
            rs.iter()
                .min_by(|a, b| a.ttft_mean_ms.total_cmp(&b.ttft_mean_ms))
                .map(|r| r.policy.as_str())
        })
        .collect();
    first
        .iter()
        .map(|r0| {
            let runs: Vec<&SimResult> = per_seed
                .iter()
                .filter_map(|rs| rs.iter().find(|r| r.policy == r0.policy))
                .collect();
            let n = runs.len().max(1) as f64;
            let mean = |f: fn(&SimResult) -> f64| runs.iter().map(|r| f(r)).sum::<f64>() / n;
            let geo = |f: fn(&SimResult) -> f64| {
                (runs.iter().map(|r| f(r).max(1e-9).ln()).sum::<f64>() / n).exp()
            };
            SeedSummary {
                policy: r0.policy.clone(),
                seeds: runs.len(),
                ttft_mean_ms: geo(|r| r.ttft_mean_ms),
                ttft_p99_ms: geo(|r| r.ttft_p99_ms),
                hit_rate: mean(|r| r.hit_rate),
                max_mean_load: mean(|r| r.max_mean_load),
                session_moves: mean(|r| r.session_moves),
                missed_stayed: mean(|r| r.missed.stayed),
                missed_moved: mean(|r| r.missed.moved),
                best_mean: winners.iter().filter(|w| **w == r0.policy).count(),
            }
        })
        .collect()
}

/// The table of [`summarize_seeds`].
/// `over` names the runs summarized (their seeds, or the speedups a trace was replayed at).
pub fn seed_table(label: &str, over: &str, rows: &[SeedSummary]) -> String {
    let mut s = format!(
        "{label}: over {over} (TTFT: geometric means)\n  {:<18} {:>8} {:>11} {:>10} {:>9} {:>7} {:>12} {:>11} {:>10}\n",
        "policy",
        "hit",
        "TTFT mean",
        "TTFT p99",
        "max/mean",
        "moved",
        "missed/stay",
        "missed/move",
        "best mean"
    );
    for r in rows {
        s += &format!(
            "  {:<18} {:>8.4} {:>9.1}ms {:>8.1}s {:>9.2} {:>7.3} {:>12.4} {:>11.4} {:>5} of {}\n",
            r.policy,
            r.hit_rate,
            r.ttft_mean_ms,
            r.ttft_p99_ms / 1e3,
            r.max_mean_load,
            r.session_moves,
            r.missed_stayed,
            r.missed_moved,
            r.best_mean,
            r.seeds
        );
    }
    s
}

/// What placing whole sessions can do for max/mean load (requests per pod) when a
/// session's size is unknown as it starts: sessions dealt out at random, the same number
/// to every pod. When the sessions all start within minutes and run for an hour, the
/// placement of new sessions cannot know which of them will be the long ones, so this is
/// about where any policy that never moves a session lands.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SessionBalance {
    pub sessions: usize,
    /// Max/mean over 1,000 random deals: median, 10th and 90th percentile.
    pub median: f64,
    pub p10: f64,
    pub p90: f64,
    /// Seconds from the first session's start to the last one's.
    pub start_span_s: f64,
    /// The median session's life, first request to last, seconds.
    pub median_life_s: f64,
    /// Max/mean when each session, as it starts, goes to the pod that has the fewest
    /// sessions so far — the best of the rules that see only the past that were tried
    /// (docs/policy.md) — and to the one that has served the fewest requests so far.
    pub fewest_sessions: f64,
    pub fewest_requests: f64,
    /// Max/mean knowing every session's size in advance (largest first, each onto the
    /// least loaded pod): what only a move of sessions could approach.
    pub known_sizes: f64,
}

/// `None` when the workload has fewer sessions than pods (nothing to deal).
pub fn session_balance(reqs: &[Request], pods: usize, seed: u64) -> Option<SessionBalance> {
    let mut by: BTreeMap<u64, (u64, f64, f64)> = BTreeMap::new();
    for r in reqs {
        let s = r.session?;
        let e = by.entry(s).or_insert((0, r.ts_ms, r.ts_ms));
        e.0 += 1;
        e.1 = e.1.min(r.ts_ms);
        e.2 = e.2.max(r.ts_ms);
    }
    if pods == 0 || by.len() < pods {
        return None;
    }
    let mut sizes: Vec<u64> = by.values().map(|v| v.0).collect();
    let total: u64 = sizes.iter().sum();
    let mean = total as f64 / pods as f64;
    let mut rng = crate::bench::Rng(seed ^ 0x5E55_1045);
    let mut ratios: Vec<f64> = (0..1000)
        .map(|_| {
            for i in (1..sizes.len()).rev() {
                sizes.swap(i, rng.below(i + 1));
            }
            let mut load = vec![0u64; pods];
            for (i, s) in sizes.iter().enumerate() {
                load[i % pods] += s;
            }
            load.iter().copied().max().unwrap_or(0) as f64 / mean.max(1e-9)
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    let starts = by.values().map(|v| v.1);
    let start_span_s =
        (starts.clone().fold(f64::MIN, f64::max) - starts.fold(f64::MAX, f64::min)) / 1e3;
    let mut lives: Vec<f64> = by.values().map(|v| (v.2 - v.1) / 1e3).collect();
    lives.sort_by(f64::total_cmp);
    let max_mean = |load: &[u64]| load.iter().copied().max().unwrap_or(0) as f64 / mean.max(1e-9);
    let mut order: Vec<&Request> = reqs.iter().filter(|r| r.session.is_some()).collect();
    order.sort_by(|a, b| a.ts_ms.total_cmp(&b.ts_ms));
    let online = |by_sessions: bool| {
        let (mut pod_of, mut load, mut homed) =
            (BTreeMap::new(), vec![0u64; pods], vec![0u64; pods]);
        for r in &order {
            let s = r.session.unwrap_or_default();
            let p = *pod_of.entry(s).or_insert_with(|| {
                // Ties go by a hash of (session, pod, seed), as the router's rendezvous
                // ties do, not to the first pod (which would make this round-robin).
                let key = |k: &usize| {
                    let tie = crate::bench::Rng(s ^ seed ^ ((*k as u64) << 40)).next_u64();
                    (if by_sessions { homed[*k] } else { load[*k] }, tie)
                };
                let p = (0..pods).min_by_key(key).unwrap_or(0);
                homed[p] += 1;
                p
            });
            load[p] += 1;
        }
        max_mean(&load)
    };
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    let mut lpt = vec![0u64; pods];
    for s in &sizes {
        if let Some(k) = (0..pods).min_by_key(|k| lpt[*k]) {
            lpt[k] += s;
        }
    }
    Some(SessionBalance {
        sessions: by.len(),
        median: ratios[500],
        p10: ratios[100],
        p90: ratios[900],
        start_span_s,
        median_life_s: lives[lives.len() / 2],
        fewest_sessions: online(true),
        fewest_requests: online(false),
        known_sizes: max_mean(&lpt),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(policy: &str, ttft: f64, hit: f64) -> SimResult {
        SimResult {
            policy: policy.into(),
            ttft_mean_ms: ttft,
            ttft_p99_ms: 10.0 * ttft,
            hit_rate: hit,
            ..Default::default()
        }
    }

    #[test]
    fn seeds_summarize_by_geometric_means_and_count_the_wins() {
        let runs = vec![
            vec![res("a", 100.0, 0.5), res("b", 200.0, 0.7)],
            vec![res("a", 400.0, 0.7), res("b", 300.0, 0.9)],
        ];
        let rows = summarize_seeds(&runs);
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].policy.as_str(), rows[0].seeds), ("a", 2));
        assert!((rows[0].ttft_mean_ms - 200.0).abs() < 1e-9);
        assert!((rows[0].ttft_p99_ms - 2000.0).abs() < 1e-6);
        assert!((rows[0].hit_rate - 0.6).abs() < 1e-12);
        assert_eq!((rows[0].best_mean, rows[1].best_mean), (1, 1));
        assert!(seed_table("w", "seeds 3-4", &rows).contains("over seeds 3-4"));
        assert!(summarize_seeds(&[]).is_empty());
    }

    fn session_reqs(sizes: &[usize]) -> Vec<Request> {
        let mut out = Vec::new();
        for (s, &n) in sizes.iter().enumerate() {
            for k in 0..n {
                out.push(Request {
                    ts_ms: (s * 1000 + k * 10_000) as f64,
                    input_tokens: 16,
                    output_tokens: 1,
                    chain: vec![s as u64],
                    session: Some(s as u64),
                });
            }
        }
        out
    }

    #[test]
    fn sessions_of_one_size_deal_evenly_and_a_giant_cannot() {
        let even = session_balance(&session_reqs(&[5; 8]), 4, 1).expect("8 sessions");
        assert_eq!((even.sessions, even.median, even.p90), (8, 1.0, 1.0));
        assert_eq!(even.start_span_s, 7.0);
        assert_eq!(even.median_life_s, 40.0);
        // One session as large as all the others together: its pod carries half the load.
        let giant =
            session_balance(&session_reqs(&[21, 3, 3, 3, 3, 3, 3, 3]), 4, 1).expect("8 sessions");
        assert!(giant.p10 >= 2.0, "{giant:?}");
        // No placement beats the giant; knowing the sizes reaches exactly that bound.
        assert_eq!(giant.known_sizes, 2.0);
        assert!(giant.fewest_sessions >= 2.0 && giant.fewest_requests >= 2.0);
        // Equal sessions: one per pod in turn, whatever the rule.
        assert_eq!(
            (even.fewest_sessions, even.fewest_requests, even.known_sizes),
            (1.0, 1.0, 1.0)
        );
        // Two large and two small on two pods: knowing the sizes pairs them.
        let pairs = session_balance(&session_reqs(&[10, 1, 1, 10]), 2, 1).expect("4 sessions");
        assert_eq!(pairs.known_sizes, 1.0);
        assert!(session_balance(&session_reqs(&[5; 3]), 4, 1).is_none());
        let mut anonymous = session_reqs(&[5; 8]);
        anonymous[0].session = None;
        assert!(session_balance(&anonymous, 4, 1).is_none());
    }
}
