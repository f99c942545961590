//! `kvroute-bench trace`: replay a Mooncake trace through the index as a router would.
//!
//! Each request is routed by the index's own best match (ties and misses round-robin); its
//! pod's LRU cache admits the chain, producing `stored`/`removed` events that are applied
//! to the index. The operations (lookups and event blocks) are logged, then the log is
//! replayed as fast as possible on a fresh kvroute index and on the radix baseline, so
//! both do exactly the same work.

use std::time::Instant;

use kvroute_shared::protocol::Tier;
use kvroute_sidecar::index::{ModelIndex, PodHandle, Strategy};
use serde_json::json;

use super::Samples;
use crate::cache::BlockCache;
use crate::radix::RadixIndex;
use crate::workload::Request;

pub struct Opts {
    pub pods: usize,
    pub capacity_blocks: usize,
    pub sweep: bool,
}

enum Op {
    Lookup(usize),
    /// pod, parent (chain position before the run), blocks
    Store(u16, Option<u64>, Vec<u64>),
    Remove(u16, Vec<u64>),
}

pub fn run(reqs: &[Request], o: &Opts) -> serde_json::Value {
    println!(
        "kvroute-bench trace: {} requests, {} pods x {} blocks",
        reqs.len(),
        o.pods,
        o.capacity_blocks
    );
    // 1. Route with the index, simulate caches, log the ops.
    let ix = ModelIndex::new(u64::MAX / 2);
    let hs: Vec<PodHandle> = (0..o.pods)
        .map(|p| ix.join(&format!("pod{p}")).expect("join"))
        .collect();
    let mut caches: Vec<BlockCache> = (0..o.pods)
        .map(|_| BlockCache::new(o.capacity_blocks))
        .collect();
    let mut ops = Vec::new();
    let mut rr = 0usize;
    let (mut hit_blocks, mut total_blocks, mut mismatches) = (0u64, 0u64, 0u64);
    let mut out = Vec::new();
    let mut exact = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        out.clear();
        ix.set_strategy(Strategy::default());
        ix.lookup_slots(&r.chain, &mut out);
        exact.clear();
        ix.set_strategy(Strategy::Linear);
        ix.lookup_slots(&r.chain, &mut exact);
        if out != exact {
            mismatches += 1;
        }
        ops.push(Op::Lookup(i));
        let pod = match out.first() {
            Some(&(_, best)) => {
                let ties: Vec<u8> = out
                    .iter()
                    .take_while(|m| m.1 == best)
                    .map(|m| m.0)
                    .collect();
                rr += 1;
                hs.iter()
                    .position(|h| h.slot == ties[rr % ties.len()])
                    .unwrap_or(0)
            }
            None => {
                rr += 1;
                rr % o.pods
            }
        };
        let adm = caches[pod].admit(&r.chain);
        hit_blocks += adm.hit_blocks as u64;
        total_blocks += r.chain.len() as u64;
        if !adm.removed.is_empty() {
            ix.remove(hs[pod], Tier::Gpu, &adm.removed).expect("remove");
            ops.push(Op::Remove(pod as u16, adm.removed));
        }
        if !adm.stored.is_empty() {
            ix.store(hs[pod], Tier::Gpu, &adm.stored).expect("store");
            // Contiguous runs with their parents, as an engine would publish them.
            let mut run: Vec<u64> = Vec::new();
            let mut parent = None;
            let stored: std::collections::HashSet<u64> = adm.stored.iter().copied().collect();
            for (j, b) in r.chain.iter().enumerate() {
                if stored.contains(b) {
                    if run.is_empty() {
                        parent = j.checked_sub(1).map(|p| r.chain[p]);
                    }
                    run.push(*b);
                } else if !run.is_empty() {
                    ops.push(Op::Store(pod as u16, parent, std::mem::take(&mut run)));
                }
            }
            if !run.is_empty() {
                ops.push(Op::Store(pod as u16, parent, run));
            }
        }
    }
    let hit_rate = hit_blocks as f64 / total_blocks.max(1) as f64;
    println!(
        "  routed by longest match: block hit rate {:.3}; the default (k-ary) walk differed from the exact linear walk on {mismatches} of {} lookups",
        hit_rate,
        reqs.len()
    );
    drop(ix);

    // 2. Replay the log, timed, on kvroute and on the radix tree; the trace is short, so
    //    take the median of five replays of each.
    let mut runs: Vec<(f64, Samples, u64)> = (0..5)
        .map(|_| replay_kvroute(reqs, &ops, o.pods, None))
        .collect();
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (k_rate, mut k_lat, n_ops) = runs.swap_remove(2);
    let mut rruns: Vec<(f64, Samples)> = (0..5).map(|_| replay_radix(reqs, &ops)).collect();
    rruns.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (r_rate, mut r_lat) = rruns.swap_remove(2);
    let (k50, k99, r99) = (k_lat.pct(50.0), k_lat.pct(99.0), r_lat.pct(99.0));
    println!(
        "  kvroute: {:.2} M block ops/s ({n_ops} ops), lookup p50 {k50} ns p99 {k99} ns; radix: {:.2} M ops/s, lookup p99 {r99} ns",
        k_rate / 1e6,
        r_rate / 1e6
    );
    let mut v = json!({
        "requests": reqs.len(), "pods": o.pods, "capacity_blocks": o.capacity_blocks,
        "block_ops_per_s": k_rate, "lookup_p50_ns": k50, "lookup_p99_ns": k99,
        "hit_rate": hit_rate, "nonprefix_mismatches": mismatches,
        "radix_block_ops_per_s": r_rate, "radix_lookup_p99_ns": r99, "ops": n_ops,
    });
    if o.sweep {
        println!("  sweep: offered M ops/s -> achieved, lookup p99 ns");
        let mut saturation = 0.0;
        let mut rows = Vec::new();
        let mut rate = 1e6;
        while rate < k_rate * 2.0 {
            let (achieved, mut lat, _) = replay_kvroute(reqs, &ops, o.pods, Some(rate));
            let p99 = lat.pct(99.0);
            println!("    {:>6.1} -> {:>6.2}, {p99}", rate / 1e6, achieved / 1e6);
            // Past saturation the achieved rate stops following the offered one.
            if achieved > saturation {
                saturation = achieved;
            }
            rows.push(json!({"offered": rate, "achieved": achieved, "lookup_p99_ns": p99}));
            rate *= 1.5;
        }
        println!("  saturation ≈ {:.2} M ops/s", saturation / 1e6);
        v["saturation_ops_per_s"] = json!(saturation);
        v["sweep"] = json!(rows);
    }
    v
}

/// Ops counted: one per lookup plus one per event block.
fn count(ops: &[Op]) -> u64 {
    ops.iter()
        .map(|op| match op {
            Op::Lookup(_) => 1,
            Op::Store(_, _, b) | Op::Remove(_, b) => b.len() as u64,
        })
        .sum()
}

fn replay_kvroute(
    reqs: &[Request],
    ops: &[Op],
    pods: usize,
    pace: Option<f64>,
) -> (f64, Samples, u64) {
    let ix = ModelIndex::new(u64::MAX / 2);
    let hs: Vec<PodHandle> = (0..pods)
        .map(|p| ix.join(&format!("pod{p}")).expect("join"))
        .collect();
    let mut lat = Samples::with_capacity(reqs.len());
    let mut out = Vec::with_capacity(pods);
    let n = count(ops);
    let t0 = Instant::now();
    let mut done = 0u64;
    for op in ops {
        if let Some(rate) = pace {
            let due = done as f64 / rate;
            while t0.elapsed().as_secs_f64() < due {
                std::hint::spin_loop();
            }
        }
        match op {
            Op::Lookup(i) => {
                out.clear();
                lat.time(|| ix.lookup_slots(&reqs[*i].chain, &mut out));
                done += 1;
            }
            Op::Store(p, _, b) => {
                let _ = ix.store(hs[*p as usize], Tier::Gpu, b);
                done += b.len() as u64;
            }
            Op::Remove(p, b) => {
                let _ = ix.remove(hs[*p as usize], Tier::Gpu, b);
                done += b.len() as u64;
            }
        }
    }
    (n as f64 / t0.elapsed().as_secs_f64(), lat, n)
}

fn replay_radix(reqs: &[Request], ops: &[Op]) -> (f64, Samples) {
    let mut rx = RadixIndex::default();
    let mut lat = Samples::with_capacity(reqs.len());
    let n = count(ops);
    let t0 = Instant::now();
    for op in ops {
        match op {
            Op::Lookup(i) => {
                let r = lat.time(|| rx.find_matches(&reqs[*i].chain));
                std::hint::black_box(r);
            }
            Op::Store(p, parent, b) => rx.store(*p, *parent, b),
            Op::Remove(p, b) => rx.remove(*p, b),
        }
    }
    (n as f64 / t0.elapsed().as_secs_f64(), lat)
}
