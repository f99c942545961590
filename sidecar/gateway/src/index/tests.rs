//! Unit tests of the index's own behaviour; the oracle and concurrency tests are in
//! sidecar/gateway/tests/index_*.rs.

use super::*;
use kvroute_shared::protocol::Tier;

fn chain(seed: u64, n: usize) -> Vec<u64> {
    let ns = kvroute_shared::Namespace {
        mode: kvroute_shared::Mode::Tokens,
        block_size: 4,
        model: "m",
        adapter: "",
        cache_salt: "",
    };
    let toks: Vec<u32> = (0..n as u32 * 4)
        .map(|t| t.wrapping_mul(seed as u32 + 1))
        .collect();
    ns.chain_tokens(&toks)
}

fn depths(ix: &ModelIndex, c: &[u64]) -> Vec<(String, u32)> {
    ix.lookup(c)
        .into_iter()
        .map(|m| (m.pod.to_string(), m.depth))
        .collect()
}

#[test]
fn lookup_ranks_by_depth_in_both_strategies() {
    let ix = ModelIndex::new(1 << 20);
    let c = chain(1, 40);
    let a = ix.join("a").expect("a");
    let b = ix.join("b").expect("b");
    let d = ix.join("d").expect("d");
    ix.store(a, Tier::Gpu, &c[..30]).expect("store");
    ix.store(b, Tier::Gpu, &c[..12]).expect("store");
    ix.store(d, Tier::Gpu, &c[..40]).expect("store");
    for s in [
        Strategy::Linear,
        Strategy::Binary,
        Strategy::Auto { linear_max: 8 },
    ] {
        ix.set_strategy(s);
        assert_eq!(
            depths(&ix, &c),
            [("d".into(), 40), ("a".into(), 30), ("b".into(), 12)],
            "{s:?}"
        );
        assert_eq!(
            depths(&ix, &c[..5]),
            [("a".into(), 5), ("b".into(), 5), ("d".into(), 5)],
            "{s:?}"
        );
        assert!(depths(&ix, &chain(2, 40)).is_empty());
        assert!(depths(&ix, &[]).is_empty());
    }
}

#[test]
fn events_are_idempotent() {
    let ix = ModelIndex::new(1 << 20);
    let c = chain(3, 20);
    let a = ix.join("a").expect("a");
    assert_eq!(ix.store(a, Tier::Gpu, &c).expect("s").changed, 20);
    assert_eq!(
        ix.store(a, Tier::Gpu, &c).expect("s"),
        Applied {
            changed: 0,
            unchanged: 20
        }
    );
    assert_eq!(ix.pod_blocks(a), 20);
    assert_eq!(ix.remove(a, Tier::Gpu, &c[10..]).expect("r").changed, 10);
    assert_eq!(ix.remove(a, Tier::Gpu, &c[10..]).expect("r").changed, 0);
    assert_eq!(ix.pod_blocks(a), 10);
    assert_eq!(depths(&ix, &c), [("a".into(), 10)]);
    assert_eq!(ix.join("a"), Ok(a), "join is idempotent");
}

#[test]
fn retire_excludes_at_once_and_cleanup_frees_the_slot() {
    let ix = ModelIndex::new(1 << 20);
    let c = chain(4, 16);
    let a = ix.join("a").expect("a");
    let b = ix.join("b").expect("b");
    ix.store(a, Tier::Gpu, &c).expect("s");
    ix.store(b, Tier::Gpu, &c[..4]).expect("s");
    let r = ix.retire("a").expect("retired");
    assert_eq!(
        depths(&ix, &c),
        [("b".into(), 4)],
        "phase 1 alone hides the pod"
    );
    assert_eq!(
        ix.store(a, Tier::Gpu, &c),
        Err(IndexError::Stale),
        "no writes to a retired slot"
    );
    assert_eq!(ix.stats().draining_pods, 1);
    assert_eq!(ix.cleanup(r), 16);
    let st = ix.stats();
    assert_eq!((st.entries, st.draining_pods, st.live_pods), (4, 0, 1));
    // The slot is reused by a new pod, which inherits nothing.
    let n = ix.join("new").expect("new");
    assert_eq!(n.slot, a.slot);
    assert_ne!(n.gen, a.gen);
    assert_eq!(depths(&ix, &c), [("b".into(), 4)]);
    assert!(ix.retire("nobody").is_none());
}

#[test]
fn reset_moves_to_a_fresh_slot() {
    let ix = ModelIndex::new(1 << 20);
    let c = chain(5, 8);
    let a = ix.join("a").expect("a");
    ix.store(a, Tier::Gpu, &c).expect("s");
    let (a2, old) = ix.reset("a").expect("reset");
    assert_ne!(a2.slot, a.slot);
    assert!(depths(&ix, &c).is_empty(), "old blocks are gone at once");
    ix.store(a2, Tier::Gpu, &c[..2]).expect("s");
    assert_eq!(depths(&ix, &c), [("a".into(), 2)]);
    assert_eq!(ix.cleanup(old.expect("old slot")), 8);
    assert_eq!(depths(&ix, &c), [("a".into(), 2)]);
}

#[test]
fn the_257th_pod_is_refused_and_a_reset_when_full_scrubs_nothing_inline() {
    let ix = ModelIndex::new(1 << 20);
    for i in 0..256 {
        ix.join(&format!("p{i}")).expect("fits");
    }
    assert!(matches!(ix.join("p256"), Err(IndexError::Full { .. })));
    let c = chain(6, 4);
    let h = ix.handle("p7").expect("p7");
    ix.store(h, Tier::Gpu, &c).expect("s");
    // No free slot: the pod leaves every lookup at once, with no slot and no
    // synchronous scrub; its old slot waits for phase 2 like any retired one.
    let u = ix.reset("p7").expect_err("no slot is free");
    assert!(depths(&ix, &c).is_empty());
    assert!(ix.handle("p7").is_none());
    ix.cleanup(u.retired.expect("the old slot"));
    let h2 = ix.join("p7").expect("a slot again");
    assert_eq!(h2.slot, h.slot);
    assert_ne!(h2.gen, h.gen);
    // A pod holding nothing resets in place, for free.
    assert_eq!(ix.reset("p7").expect("empty").0, h2);
    assert_eq!(ix.stats().live_pods, 256);
}

#[test]
fn tiers_stay_off_the_index_but_shape_the_hint() {
    let ix = ModelIndex::new(1 << 20);
    let c = chain(7, 12);
    let a = ix.join("a").expect("a");
    ix.store(a, Tier::Gpu, &c).expect("s");
    ix.store(a, Tier::Cpu, &c[8..]).expect("s"); // offloaded copies
    ix.remove(a, Tier::Gpu, &c[10..]).expect("r"); // GPU copies evicted, CPU stays
    assert_eq!(
        depths(&ix, &c),
        [("a".into(), 12)],
        "a CPU-only block is still held"
    );
    let h = ix.tier_hint(a.slot, &c, 12);
    assert_eq!((h.gpu, h.cpu), (10, 2));
    ix.remove(a, Tier::Cpu, &c[10..]).expect("r");
    assert_eq!(depths(&ix, &c), [("a".into(), 10)]);
    ix.remove(a, Tier::Disk, &c).expect("no-op");
    assert_eq!(depths(&ix, &c), [("a".into(), 10)]);
    let h = ix.tier_hint(a.slot, &c, 10);
    assert_eq!(
        (h.gpu, h.cpu),
        (10, 0),
        "blocks in GPU and CPU count as GPU hits"
    );
}

#[test]
fn the_cap_bounds_entries() {
    let ix = ModelIndex::new(256 * 4);
    let a = ix.join("a").expect("a");
    let c = chain(8, 20_000);
    ix.store(a, Tier::Gpu, &c).expect("s");
    let st = ix.stats();
    assert!(st.entries <= 256 * 4, "entries {}", st.entries);
    assert_eq!(st.evicted, 20_000 - st.entries);
    assert_eq!(ix.pod_blocks(a), st.entries);
}

#[test]
fn binary_search_on_holes_never_underestimates() {
    let ix = ModelIndex::new(1 << 20);
    let c = chain(9, 64);
    let a = ix.join("a").expect("a");
    ix.store(a, Tier::Gpu, &c).expect("s");
    ix.remove(a, Tier::Gpu, &c[5..6]).expect("hole at 5");
    ix.set_strategy(Strategy::Linear);
    assert_eq!(depths(&ix, &c), [("a".into(), 5)], "exact: first miss");
    ix.set_strategy(Strategy::Binary);
    let d = depths(&ix, &c)[0].1;
    assert!(d >= 5, "binary {d}");
    assert!(d == 64 || !ix.holders(c[d as usize]).contains(a.slot));
    assert!(ix.holders(c[d as usize - 1]).contains(a.slot));
}

/// A chain whose first block nobody holds is answered after one table probe, whatever
/// its length and the strategy.
#[test]
fn a_miss_costs_one_probe() {
    let ix = ModelIndex::new(1 << 20);
    let a = ix.join("10.0.0.1:8000").expect("join");
    let held = chain(1, 128);
    ix.store(a, Tier::Gpu, &held).expect("store");
    let miss = chain(2, 128);
    for s in [
        Strategy::default(),
        Strategy::Memo,
        Strategy::Kary,
        Strategy::Binary,
        Strategy::Linear,
    ] {
        ix.set_strategy(s);
        let before = super::lookup::PROBES.with(|p| p.get());
        assert!(ix.lookup(&miss).is_empty());
        let probes = super::lookup::PROBES.with(|p| p.get()) - before;
        assert_eq!(probes, 1, "{s:?}");
        // And a hit still finds the whole chain.
        assert_eq!(
            ix.lookup(&held).first().map(|m| m.depth),
            Some(128),
            "{s:?}"
        );
    }
}

/// A chain looked up again is settled in one round: its first block and the two sides
/// of each remembered depth, probed together.
#[test]
fn a_repeat_lookup_takes_one_round() {
    let ix = ModelIndex::new(1 << 20);
    let a = ix.join("10.0.0.1:8000").expect("join");
    let b = ix.join("10.0.0.2:8000").expect("join");
    let c = chain(3, 128);
    ix.store(a, Tier::Gpu, &c).expect("store");
    ix.store(b, Tier::Gpu, &c[..40]).expect("store");
    let depths = |ix: &ModelIndex| -> Vec<u32> { ix.lookup(&c).iter().map(|m| m.depth).collect() };
    let count = |ix: &ModelIndex| {
        let before = super::lookup::PROBES.with(|p| p.get());
        let d = depths(ix);
        (d, super::lookup::PROBES.with(|p| p.get()) - before)
    };
    let (cold, cold_probes) = count(&ix);
    assert_eq!(cold, vec![128, 40]);
    let (warm, warm_probes) = count(&ix);
    assert_eq!(warm, vec![128, 40]);
    // First block + {40, 41} + {128}: four probes in one batch.
    assert_eq!(warm_probes, 4, "cold took {cold_probes}");
    // The memo is a guess: when b's prefix grows, the answer follows the index.
    ix.store(b, Tier::Gpu, &c[40..90]).expect("store");
    assert_eq!(depths(&ix), vec![128, 90]);
    assert_eq!(depths(&ix), vec![128, 90]);
}

/// Random block hashes (an attacker's "new" blocks need no chain).
fn hashes(seed: u64, n: usize) -> Vec<u64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })
        .collect()
}

/// Many models under their own caps used to add up without bound. One budget: every
/// model filled far past it, the entries and the heap stay within it.
#[test]
fn fill_to_budget() {
    let budget_bytes: u64 = 48 << 20;
    let ixs = Indexes::default();
    ixs.set_budget(budget_bytes / BUDGET_BYTES_PER_ENTRY);
    let models = ["a", "b", "c", "d"];
    for (m, name) in models.iter().enumerate() {
        let ix = ixs.get_or_create(name, 4 << 20);
        for p in 0..4u64 {
            let h = ix.join(&format!("10.0.0.{p}:8000")).expect("join");
            ix.store(h, Tier::Gpu, &hashes(m as u64 * 16 + p + 1, 400_000))
                .expect("store");
        }
    }
    // Earlier models filled before later ones took their share: the cleaner's trim.
    ixs.trim();
    let (mut entries, mut heap) = (0, 0);
    for (_, ix) in ixs.all() {
        let st = ix.stats();
        assert_eq!(st.max_blocks, ixs.budget() / models.len() as u64);
        assert!(st.entries <= st.max_blocks + SHARDS as u64, "{st:?}");
        entries += st.entries;
        heap += st.heap_bytes;
    }
    assert!(entries <= ixs.budget() + (models.len() * SHARDS) as u64);
    assert!(
        heap <= budget_bytes,
        "heap {heap} bytes for {entries} entries, budget {budget_bytes}"
    );
}

/// One pod storing millions of new blocks used to evict every other pod's blocks of its
/// model. Past its share (and a quarter) it replaces its own, or its new blocks are not
/// indexed: the others keep theirs.
#[test]
fn a_pod_over_its_share_evicts_its_own_blocks_first() {
    let cap = 256 * 1024;
    let ix = ModelIndex::new(cap);
    let pods: Vec<_> = (0..4)
        .map(|p| ix.join(&format!("10.0.0.{p}:8000")).expect("join"))
        .collect();
    let honest: Vec<Vec<u64>> = (0..3).map(|p| hashes(p + 1, cap as usize / 5)).collect();
    for (p, blocks) in honest.iter().enumerate() {
        ix.store(pods[p], Tier::Gpu, blocks).expect("store");
    }
    let flood = hashes(99, 4 * cap as usize);
    ix.store(pods[3], Tier::Gpu, &flood).expect("store");
    // Caps are per shard: a shard the honest pods filled before the flooder passed its
    // share may evict a few of theirs (2 of 52,428 here; before, half of them went).
    for (p, blocks) in honest.iter().enumerate() {
        let kept = ix.pod_blocks(pods[p]);
        assert!(
            kept * 1000 >= blocks.len() as u64 * 999,
            "pod {p} kept {kept} of {}",
            blocks.len()
        );
    }
    let st = ix.stats();
    assert!(st.entries <= cap + SHARDS as u64, "{st:?}");
    // It took the room that was free, then only replaced its own.
    let honest_total: u64 = honest.iter().map(|b| b.len() as u64).sum();
    assert!(ix.pod_blocks(pods[3]) <= cap - honest_total + SHARDS as u64);
    assert!(st.over_share > 0, "{st:?}");
    // The honest pods' chains still route to them.
    assert_eq!(
        depths(&ix, &honest[0][..1]),
        vec![("10.0.0.0:8000".into(), 1)]
    );
}

/// Tier exceptions of blocks CLOCK evicted used to stay in their pod's map for good; the
/// cleaner's trim drops them.
#[test]
fn trimming_drops_the_tiers_of_evicted_blocks() {
    let ix = ModelIndex::new(64 * 1024);
    let a = ix.join("10.0.0.1:8000").expect("a");
    let b = ix.join("10.0.0.2:8000").expect("b");
    ix.store(a, Tier::Cpu, &hashes(1, 40_000)).expect("a");
    ix.store(b, Tier::Gpu, &hashes(2, 40_000)).expect("b");
    assert!(ix.stats().evicted > 0, "the cap evicted some of a's blocks");
    ix.trim();
    let held = ix.pod_blocks(a);
    assert!(held < 40_000);
    assert_eq!(
        u64::from(ix.tier_counts(a).cpu),
        held,
        "one exception per block still held"
    );
}
