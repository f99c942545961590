//! `kvroute-bench index`: the index on Dynamo's micro-benchmark shape (1M indexed blocks,
//! chains of depth 128, 16 pods, also 256), against a naive per-pod scan and a radix tree.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_shared::protocol::Tier;
use kvroute_shared::{Mode, Namespace};
use kvroute_sidecar::index::{ModelIndex, PodHandle, Strategy};
use serde_json::json;

use super::{Rng, Samples};
use crate::radix::RadixIndex;

pub struct Opts {
    pub blocks: usize,
    pub depth: usize,
    pub pods: usize,
    pub lookups: usize,
    pub seed: u64,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            blocks: 1 << 20,
            depth: 128,
            pods: 16,
            lookups: 200_000,
            seed: 7,
        }
    }
}

/// Each sequence lives fully on pod `i % P` and on pod `(i+1) % P` up to a varying depth,
/// so a lookup finds two pods at different depths.
struct Data {
    seqs: Vec<Vec<u64>>,
    partial: Vec<usize>,
}

fn data(o: &Opts) -> Data {
    let ns = Namespace {
        mode: Mode::Tokens,
        block_size: 16,
        model: "bench",
        adapter: "",
        cache_salt: "",
    };
    let n = o.blocks / o.depth;
    let mut rng = Rng(o.seed);
    let seqs: Vec<Vec<u64>> = (0..n)
        .map(|_| {
            let toks: Vec<u32> = (0..o.depth * 16).map(|_| rng.next_u64() as u32).collect();
            ns.chain_tokens(&toks)
        })
        .collect();
    let partial = (0..n).map(|i| 1 + (i * 37) % o.depth).collect();
    Data { seqs, partial }
}

fn build(o: &Opts, d: &Data, pods: usize) -> (ModelIndex, Vec<PodHandle>, f64) {
    let ix = ModelIndex::new(u64::MAX / 2);
    let hs: Vec<PodHandle> = (0..pods)
        .map(|p| {
            ix.join(&format!("10.0.{}.{}:8000", p / 250, p % 250))
                .expect("join")
        })
        .collect();
    let t = Instant::now();
    let mut n = 0u64;
    for (i, s) in d.seqs.iter().enumerate() {
        ix.store(hs[i % pods], Tier::Gpu, s).expect("store");
        ix.store(hs[(i + 1) % pods], Tier::Gpu, &s[..d.partial[i]])
            .expect("store");
        n += (s.len() + d.partial[i]) as u64;
    }
    let rate = n as f64 / t.elapsed().as_secs_f64();
    let _ = o;
    (ix, hs, rate)
}

fn lookups(ix: &ModelIndex, d: &Data, n: usize, len: usize, seed: u64) -> Samples {
    let mut rng = Rng(seed);
    let mut s = Samples::with_capacity(n);
    let mut out = Vec::with_capacity(16);
    for _ in 0..n {
        let c = &d.seqs[rng.below(d.seqs.len())][..len];
        out.clear();
        s.time(|| ix.lookup_slots(c, &mut out));
        std::hint::black_box(&out);
    }
    s
}

/// One untimed lookup of every chain: the index settled, as a router's is after its
/// prefixes have been seen (the depth memo remembers them; caches are warm). The radix
/// baseline gets the same pass.
fn settle(ix: &ModelIndex, d: &Data) {
    for s in &d.seqs {
        std::hint::black_box(ix.lookup(s));
    }
}

fn radix_settle(radix: &RadixIndex, d: &Data) {
    for s in &d.seqs {
        std::hint::black_box(radix.find_matches(s));
    }
}

/// The radix baseline on kvroute's shape with `pods` pods: (store rate, hit p50, hit p99).
fn radix_shape(o: &Opts, d: &Data, pods: usize) -> (f64, u64, u64) {
    let mut radix = RadixIndex::default();
    let t = Instant::now();
    let mut pairs = 0u64;
    for (i, s) in d.seqs.iter().enumerate() {
        radix.store((i % pods) as u16, None, s);
        radix.store(((i + 1) % pods) as u16, None, &s[..d.partial[i]]);
        pairs += (s.len() + d.partial[i]) as u64;
    }
    let rate = pairs as f64 / t.elapsed().as_secs_f64();
    radix_settle(&radix, d);
    let mut rs = Samples::with_capacity(o.lookups);
    let mut rng = Rng(1);
    for _ in 0..o.lookups {
        let c = &d.seqs[rng.below(d.seqs.len())];
        let r = rs.time(|| radix.find_matches(c));
        std::hint::black_box(r);
    }
    (rate, rs.pct(50.0), rs.pct(99.0))
}

fn full_lookups(ix: &ModelIndex, d: &Data, n: usize, seed: u64) -> Samples {
    let mut rng = Rng(seed);
    let mut s = Samples::with_capacity(n);
    for _ in 0..n {
        let c = &d.seqs[rng.below(d.seqs.len())];
        let r = s.time(|| ix.lookup(c));
        std::hint::black_box(r);
    }
    s
}

pub fn run(o: &Opts) -> serde_json::Value {
    println!(
        "kvroute-bench index: {} blocks, depth {}, {} pods, {} lookups",
        o.blocks, o.depth, o.pods, o.lookups
    );
    let d = data(o);
    let (ix, hs, store_rate) = build(o, &d, o.pods);
    let st = ix.stats();
    let bpb16 = st.heap_bytes as f64 / st.entries as f64;
    println!(
        "  built: {} entries, {:.1} bytes/block, store {:.2} M blocks/s (one thread)",
        st.entries,
        bpb16,
        store_rate / 1e6
    );

    // Hits through the full API (names resolved), settled; then the same with the depth
    // memo off (every lookup a cold k-ary search), then the slot-level walk.
    settle(&ix, &d);
    let mut hit = full_lookups(&ix, &d, o.lookups, 1);
    let (hit50, hit99) = (hit.pct(50.0), hit.pct(99.0));
    ix.set_strategy(Strategy::Kary);
    let mut cold = full_lookups(&ix, &d, o.lookups, 1);
    let (cold50, cold99) = (cold.pct(50.0), cold.pct(99.0));
    ix.set_strategy(Strategy::default());
    let mut miss = Samples::with_capacity(o.lookups);
    let mut rng = Rng(99);
    for _ in 0..o.lookups {
        let c: Vec<u64> = (0..o.depth).map(|_| rng.next_u64()).collect();
        let r = miss.time(|| ix.lookup(&c));
        std::hint::black_box(r);
    }
    let miss50 = miss.pct(50.0);
    println!("  lookup hit p50 {hit50} ns, p99 {hit99} ns; miss p50 {miss50} ns");
    println!("  without the depth memo (cold k-ary): hit p50 {cold50} ns, p99 {cold99} ns");

    // Strategy table: linear vs binary by chain length.
    println!("  strategy (hit p50 ns by chain length):");
    println!(
        "    {:>6} {:>8} {:>8} {:>8} {:>8}",
        "len", "linear", "binary", "k-ary", "memo"
    );
    let mut strategy = Vec::new();
    for len in [2usize, 4, 8, 16, 32, 64, 128] {
        if len > o.depth {
            break;
        }
        ix.set_strategy(Strategy::Linear);
        let l = lookups(&ix, &d, o.lookups / 4, len, 5).pct(50.0);
        ix.set_strategy(Strategy::Binary);
        let b = lookups(&ix, &d, o.lookups / 4, len, 5).pct(50.0);
        ix.set_strategy(Strategy::Kary);
        let k = lookups(&ix, &d, o.lookups / 4, len, 5).pct(50.0);
        ix.set_strategy(Strategy::Memo);
        let _ = lookups(&ix, &d, d.seqs.len(), len, 6); // settle the memo at this length
        let m = lookups(&ix, &d, o.lookups / 4, len, 5).pct(50.0);
        println!("    {len:>6} {l:>8} {b:>8} {k:>8} {m:>8}");
        strategy.push(json!({"len": len, "linear_p50_ns": l, "binary_p50_ns": b,
            "kary_p50_ns": k, "memo_p50_ns": m}));
    }
    ix.set_strategy(Strategy::default());
    settle(&ix, &d);

    // Naive: per-pod sets scanned pod by pod.
    let mut per_pod: Vec<hashbrown::HashSet<u64>> = vec![hashbrown::HashSet::new(); o.pods];
    for (i, s) in d.seqs.iter().enumerate() {
        per_pod[i % o.pods].extend(s.iter().copied());
        per_pod[(i + 1) % o.pods].extend(s[..d.partial[i]].iter().copied());
    }
    let mut naive = Samples::with_capacity(o.lookups);
    let mut rng = Rng(1);
    for _ in 0..o.lookups {
        let c = &d.seqs[rng.below(d.seqs.len())];
        let r = naive.time(|| {
            per_pod
                .iter()
                .map(|set| c.iter().take_while(|h| set.contains(*h)).count())
                .filter(|&x| x > 0)
                .count()
        });
        std::hint::black_box(r);
    }
    let naive50 = naive.pct(50.0);
    drop(per_pod);

    // Radix tree baseline.
    let (radix_store_rate, radix50, radix99) = radix_shape(o, &d, o.pods);
    println!(
        "  baselines: naive per-pod scan p50 {naive50} ns; radix tree p50 {radix50} ns p99 {radix99} ns, store {:.2} M blocks/s",
        radix_store_rate / 1e6
    );
    println!(
        "  kvroute vs radix: {:.1}x faster (hit p50)",
        radix50 as f64 / hit50.max(1) as f64
    );

    // Concurrency: one reader, one writer at full speed (2 cores).
    let (conc99, conc_rate) = concurrent(&ix, &hs, &d, Duration::from_millis(1500));
    println!(
        "  concurrent: lookup p99 {conc99} ns ({:.2}x idle) while the writer sustains {:.2} M block ops/s",
        conc99 as f64 / hit99.max(1) as f64,
        conc_rate / 1e6
    );

    // Removal throughput: drop every pod's blocks.
    let t = Instant::now();
    let mut removed = 0u64;
    for (i, s) in d.seqs.iter().enumerate() {
        removed += ix
            .remove(hs[i % o.pods], Tier::Gpu, s)
            .expect("remove")
            .changed;
        removed += ix
            .remove(hs[(i + 1) % o.pods], Tier::Gpu, &s[..d.partial[i]])
            .expect("remove")
            .changed;
    }
    let remove_rate = removed as f64 / t.elapsed().as_secs_f64();
    println!(
        "  remove {:.2} M blocks/s; entries left {}",
        remove_rate / 1e6,
        ix.stats().entries
    );
    drop(ix);

    // 256-pod width.
    let (ix256, _, _) = build(o, &d, 256);
    let st = ix256.stats();
    let bpb256 = st.heap_bytes as f64 / st.entries as f64;
    settle(&ix256, &d);
    let mut h256 = full_lookups(&ix256, &d, o.lookups, 1);
    let (h256_50, h256_99) = (h256.pct(50.0), h256.pct(99.0));
    drop(ix256);
    let (_, r256_50, r256_99) = radix_shape(o, &d, 256);
    println!("  256 pods: {bpb256:.1} bytes/block, lookup hit p50 {h256_50} ns p99 {h256_99} ns; radix p50 {r256_50} ns p99 {r256_99} ns");

    // Two-phase removal of a pod holding 1M blocks, with lookups running.
    let (flip, cleanup_ms, base99, during99, cleared) = removal(o, &d);
    println!(
        "  removal of a {cleared}-block pod: flip {flip} ns, cleanup {cleanup_ms:.1} ms; lookup p99 {base99} ns before, {during99} ns during"
    );

    let hashers = hasher_table(o.blocks, o.lookups);
    let dyn_shape = dynamo_shape(o, &d, o.pods.max(15));
    let dyn256 = dynamo_shape(o, &d, 256);

    json!({
        "blocks": o.blocks, "depth": o.depth, "pods": o.pods,
        "lookup_hit_p50_ns": hit50, "lookup_hit_p99_ns": hit99, "lookup_miss_p50_ns": miss50,
        "lookup_hit_p50_ns_256": h256_50, "lookup_hit_p99_ns_256": h256_99,
        "radix_lookup_hit_p50_ns_256": r256_50, "radix_lookup_hit_p99_ns_256": r256_99,
        "lookup_hit_cold_p50_ns": cold50, "lookup_hit_cold_p99_ns": cold99,
        "naive_lookup_hit_p50_ns": naive50, "radix_lookup_hit_p50_ns": radix50, "radix_lookup_hit_p99_ns": radix99,
        "radix_speedup": radix50 as f64 / hit50.max(1) as f64,
        "store_blocks_per_s": store_rate, "radix_store_blocks_per_s": radix_store_rate, "remove_blocks_per_s": remove_rate,
        "concurrent_lookup_p99_ns": conc99, "concurrent_store_blocks_per_s": conc_rate,
        "concurrent_vs_idle_p99": conc99 as f64 / hit99.max(1) as f64,
        "bytes_per_block": bpb256, "bytes_per_block_16": bpb16,
        "pod_removal_flip_ns": flip, "pod_removal_cleanup_ms": cleanup_ms,
        "removal_baseline_lookup_p99_ns": base99, "removal_during_lookup_p99_ns": during99,
        "strategy": strategy, "hashers": hashers,
        "dynamo_shape_hit_p50_ns": dyn_shape.0, "dynamo_shape_hit_p99_ns": dyn_shape.1,
        "dynamo_shape_miss_p50_ns": dyn_shape.2,
        "dynamo_shape_radix_hit_p50_ns": dyn_shape.3, "dynamo_shape_radix_hit_p99_ns": dyn_shape.4,
        "dynamo_shape_cold_hit_p50_ns": dyn_shape.5, "dynamo_shape_cold_hit_p99_ns": dyn_shape.6,
        "dynamo_shape_hit_p50_ns_256": dyn256.0, "dynamo_shape_hit_p99_ns_256": dyn256.1,
        "dynamo_shape_radix_hit_p50_ns_256": dyn256.3, "dynamo_shape_radix_hit_p99_ns_256": dyn256.4,
    })
}

/// Dynamo's micro-benchmark shape: for every sequence, 14 pods hold the same 32-block
/// prefix and one more pod the whole chain (15 holders of the prefix); random full-chain
/// lookups after the index has settled, beside the radix baseline on the same data.
/// Returns (hit p50, hit p99, miss p50, radix hit p50, radix hit p99, cold hit p50,
/// cold hit p99), ns; "cold" is without the depth memo.
fn dynamo_shape(o: &Opts, d: &Data, pods: usize) -> (u64, u64, u64, u64, u64, u64, u64) {
    const SHARED: usize = 32;
    const HOLDERS: usize = 14;
    let ix = ModelIndex::new(u64::MAX / 2);
    let hs: Vec<PodHandle> = (0..pods)
        .map(|p| {
            ix.join(&format!("10.1.{}.{}:8000", p / 250, p % 250))
                .expect("join")
        })
        .collect();
    let mut radix = RadixIndex::default();
    for (i, s) in d.seqs.iter().enumerate() {
        let prefix = &s[..SHARED.min(s.len())];
        for k in 1..=HOLDERS {
            ix.store(hs[(i + k) % pods], Tier::Gpu, prefix)
                .expect("store");
            radix.store(((i + k) % pods) as u16, None, prefix);
        }
        ix.store(hs[i % pods], Tier::Gpu, s).expect("store");
        radix.store((i % pods) as u16, None, s);
    }
    settle(&ix, d);
    let mut hit = full_lookups(&ix, d, o.lookups, 7);
    ix.set_strategy(Strategy::Kary);
    let mut cold = full_lookups(&ix, d, o.lookups, 7);
    ix.set_strategy(Strategy::default());
    let mut miss = Samples::with_capacity(o.lookups);
    let mut rng = Rng(98);
    for _ in 0..o.lookups {
        let c: Vec<u64> = (0..o.depth).map(|_| rng.next_u64()).collect();
        let r = miss.time(|| ix.lookup(&c));
        std::hint::black_box(r);
    }
    radix_settle(&radix, d);
    let mut rs = Samples::with_capacity(o.lookups);
    let mut rng = Rng(7);
    for _ in 0..o.lookups {
        let c = &d.seqs[rng.below(d.seqs.len())];
        let r = rs.time(|| radix.find_matches(c));
        std::hint::black_box(r);
    }
    let r = (
        hit.pct(50.0),
        hit.pct(99.0),
        miss.pct(50.0),
        rs.pct(50.0),
        rs.pct(99.0),
        cold.pct(50.0),
        cold.pct(99.0),
    );
    println!(
        "  Dynamo's shape, {pods} pods (14 x {SHARED}-block prefix + 1 x {}): hit p50 {} ns p99 {} ns, miss p50 {} ns; radix hit p50 {} ns p99 {} ns ({:.1}x); without memo p50 {} ns p99 {} ns",
        o.depth,
        r.0,
        r.1,
        r.2,
        r.3,
        r.4,
        r.3 as f64 / r.0.max(1) as f64,
        r.5,
        r.6
    );
    r
}

fn concurrent(ix: &ModelIndex, hs: &[PodHandle], d: &Data, dur: Duration) -> (u64, f64) {
    let stop = AtomicBool::new(false);
    let ops = AtomicU64::new(0);
    let mut samples = Samples::default();
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut i = 0usize;
            let t = Instant::now();
            while t.elapsed() < dur {
                // Store a sequence's tail on another pod, then remove it again.
                let seq = &d.seqs[(i * 7919) % d.seqs.len()];
                let h = hs[(i + 3) % hs.len()];
                let a = ix.store(h, Tier::Gpu, &seq[64..]).expect("store");
                let r = ix.remove(h, Tier::Gpu, &seq[64..]).expect("remove");
                ops.fetch_add(
                    a.changed + a.unchanged + r.changed + r.unchanged,
                    Ordering::Relaxed,
                );
                i += 1;
            }
            stop.store(true, Ordering::Relaxed);
        });
        let mut rng = Rng(3);
        while !stop.load(Ordering::Relaxed) {
            let c = &d.seqs[rng.below(d.seqs.len())];
            let r = samples.time(|| ix.lookup(c));
            std::hint::black_box(r);
        }
    });
    (
        samples.pct(99.0),
        ops.load(Ordering::Relaxed) as f64 / dur.as_secs_f64(),
    )
}

fn removal(o: &Opts, d: &Data) -> (u64, f64, u64, u64, u64) {
    let (ix, _, _) = build(o, d, o.pods);
    let ix = Arc::new(ix);
    let victim = ix.join("victim:1").expect("join");
    for s in &d.seqs {
        ix.store(victim, Tier::Gpu, s).expect("store");
    }
    let phase = AtomicU64::new(0); // 0 baseline, 1 during cleanup, 2 done
    let mut base = Samples::default();
    let mut during = Samples::default();
    let mut flip = 0u64;
    let mut flip_cold = 0u64;
    let mut cleanup_ms = 0.0;
    let mut cleared = 0;
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            let t = Instant::now();
            ix.flip("victim:1").expect("victim");
            flip_cold = t.elapsed().as_nanos() as u64;
            // The same flip again, warm (idempotent): its steady-state cost.
            let mut warm = Samples::with_capacity(1000);
            for _ in 0..1000 {
                warm.time(|| ix.flip("victim:1"));
            }
            flip = warm.pct(50.0);
            let r = ix.retire("victim:1").expect("victim");
            phase.store(1, Ordering::SeqCst);
            let t = Instant::now();
            cleared = ix.cleanup(r);
            cleanup_ms = t.elapsed().as_secs_f64() * 1e3;
            phase.store(2, Ordering::SeqCst);
        });
        let mut rng = Rng(4);
        loop {
            let p = phase.load(Ordering::SeqCst);
            if p == 2 {
                break;
            }
            let c = &d.seqs[rng.below(d.seqs.len())];
            let t = Instant::now();
            let r = ix.lookup(c);
            let ns = t.elapsed().as_nanos() as u64;
            std::hint::black_box(r);
            if p == 0 {
                base.push(ns)
            } else {
                during.push(ns)
            }
        }
    });
    println!("  flip: first (cold) {flip_cold} ns, warm median {flip} ns");
    (flip, cleanup_ms, base.pct(99.0), during.pct(99.0), cleared)
}

/// The in-shard hasher, chosen by measurement: a map of `n` random u64 keys probed at
/// random, for each candidate.
fn hasher_table(n: usize, probes: usize) -> serde_json::Value {
    use std::hash::{BuildHasherDefault, Hasher};
    #[derive(Default)]
    struct Ident(u64);
    impl Hasher for Ident {
        fn write(&mut self, _: &[u8]) {}
        fn write_u64(&mut self, k: u64) {
            self.0 = k;
        }
        fn finish(&self) -> u64 {
            self.0
        }
    }
    fn bench<S: std::hash::BuildHasher>(s: S, keys: &[u64], probes: usize) -> u64 {
        let mut m = hashbrown::HashMap::with_hasher(s);
        for &k in keys {
            m.insert(k, k);
        }
        let mut rng = Rng(11);
        let t = Instant::now();
        let mut acc = 0u64;
        for _ in 0..probes {
            acc = acc.wrapping_add(*m.get(&keys[rng.below(keys.len())]).unwrap_or(&0));
        }
        std::hint::black_box(acc);
        t.elapsed().as_nanos() as u64 / probes as u64
    }
    let mut rng = Rng(10);
    let keys: Vec<u64> = (0..n / 256 * 16).map(|_| rng.next_u64()).collect(); // one shard's worth ×16
    let ident = bench(BuildHasherDefault::<Ident>::default(), &keys, probes);
    let mix = bench(kvroute_sidecar::index::KeyHasher::new(12345), &keys, probes);
    let fold = bench(hashbrown::DefaultHashBuilder::default(), &keys, probes);
    let ahash = bench(ahash::RandomState::with_seed(12345), &keys, probes);
    let sip = bench(
        std::collections::hash_map::RandomState::new(),
        &keys,
        probes,
    );
    println!("  in-shard hasher, ns per probe: identity {ident}, seeded mix {mix}, ahash {ahash}, foldhash {fold}, SipHash {sip}");
    let mut m = HashMap::new();
    m.insert("identity", ident);
    m.insert("seeded_mix", mix);
    m.insert("foldhash", fold);
    m.insert("ahash", ahash);
    m.insert("siphash", sip);
    json!(m)
}
