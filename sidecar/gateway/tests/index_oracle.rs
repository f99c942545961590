//! The index against a naive oracle (per-pod sets, per-pod scans): random interleavings
//! of stores, tail evictions, clears (engine restarts), pod joins and removals must give
//! exactly the oracle's lookups while residency is prefix-closed; on arbitrary residency
//! the linear walk stays exact and binary search never underestimates.

use std::collections::{HashMap, HashSet};

use kvroute_shared::protocol::Tier;
use kvroute_shared::{Mode, Namespace};
use kvroute_sidecar::index::{ModelIndex, Retired, Strategy as Walk};
use proptest::prelude::*;

const PODS: [&str; 5] = ["p0", "p1", "p2", "p3", "p4"];

/// Six chains of 24 blocks; chains 2k and 2k+1 share their first 6k+3 blocks, so removals
/// and lookups cross shared prefixes.
fn chains() -> Vec<Vec<u64>> {
    let ns = Namespace {
        mode: Mode::Tokens,
        block_size: 2,
        model: "m",
        adapter: "",
        cache_salt: "",
    };
    (0..6u32)
        .map(|c| {
            let shared = (c / 2) * 6 + 3;
            let toks: Vec<u32> = (0..48u32)
                .map(|t| {
                    if t / 2 < shared {
                        t + 1000 * (c / 2)
                    } else {
                        t + 100_000 * c
                    }
                })
                .collect();
            ns.chain_tokens(&toks)
        })
        .collect()
}

#[derive(Clone, Debug)]
enum Op {
    Join(usize),
    Store {
        pod: usize,
        chain: usize,
        len: usize,
    },
    EvictLeaves {
        pod: usize,
        n: usize,
    },
    Clear(usize),
    Remove(usize),
    Cleanup,
    Lookup {
        chain: usize,
        len: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..5usize).prop_map(Op::Join),
        5 => (0..5usize, 0..6usize, 1..25usize).prop_map(|(pod, chain, len)| Op::Store { pod, chain, len }),
        3 => (0..5usize, 1..6usize).prop_map(|(pod, n)| Op::EvictLeaves { pod, n }),
        1 => (0..5usize).prop_map(Op::Clear),
        1 => (0..5usize).prop_map(Op::Remove),
        2 => Just(Op::Cleanup),
        6 => (0..6usize, 0..25usize).prop_map(|(chain, len)| Op::Lookup { chain, len }),
    ]
}

struct Oracle {
    held: HashMap<&'static str, HashSet<u64>>,
}

impl Oracle {
    fn depth(&self, pod: &str, chain: &[u64]) -> u32 {
        let s = &self.held[pod];
        chain.iter().take_while(|h| s.contains(h)).count() as u32
    }
    fn lookup(&self, chain: &[u64]) -> Vec<(String, u32)> {
        let mut v: Vec<_> = self
            .held
            .keys()
            .map(|p| (p.to_string(), self.depth(p, chain)))
            .filter(|(_, d)| *d > 0)
            .collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v
    }
}

/// Leaves of a pod's residency: held blocks none of whose children (on any chain) are held.
fn leaves(held: &HashSet<u64>, chains: &[Vec<u64>]) -> Vec<u64> {
    let mut out = Vec::new();
    for c in chains {
        for (i, b) in c.iter().enumerate() {
            if !held.contains(b) || out.contains(b) {
                continue;
            }
            let has_child = chains
                .iter()
                .any(|c2| c2.get(i) == Some(b) && c2.get(i + 1).is_some_and(|n| held.contains(n)));
            if !has_child {
                out.push(*b);
            }
        }
    }
    out.sort_unstable();
    out
}

fn sorted(ix: &ModelIndex, chain: &[u64]) -> Vec<(String, u32)> {
    let mut v: Vec<_> = ix
        .lookup(chain)
        .into_iter()
        .map(|m| (m.pod.to_string(), m.depth))
        .collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn agrees_with_the_oracle_on_prefix_closed_residency(ops in proptest::collection::vec(op(), 1..120)) {
        let chains = chains();
        let ix = ModelIndex::new(1 << 20);
        let mut oracle = Oracle { held: HashMap::new() };
        let mut pending: Vec<Retired> = Vec::new();
        for op in ops {
            match op {
                Op::Join(p) => {
                    ix.join(PODS[p]).expect("fits");
                    oracle.held.entry(PODS[p]).or_default();
                }
                Op::Store { pod, chain, len } => {
                    let Some(h) = ix.handle(PODS[pod]) else { continue };
                    ix.store(h, Tier::Gpu, &chains[chain][..len]).expect("live");
                    oracle.held.get_mut(PODS[pod]).expect("joined").extend(&chains[chain][..len]);
                }
                Op::EvictLeaves { pod, n } => {
                    let Some(h) = ix.handle(PODS[pod]) else { continue };
                    let held = oracle.held.get_mut(PODS[pod]).expect("joined");
                    for _ in 0..n {
                        let ls = leaves(held, &chains);
                        let Some(&leaf) = ls.first() else { break };
                        ix.remove(h, Tier::Gpu, &[leaf]).expect("live");
                        held.remove(&leaf);
                    }
                }
                Op::Clear(p) => {
                    if ix.handle(PODS[p]).is_none() { continue }
                    match ix.reset(PODS[p]) {
                        Ok((_, old)) => pending.extend(old),
                        Err(u) => pending.extend(u.retired),
                    }
                    oracle.held.insert(PODS[p], HashSet::new());
                }
                Op::Remove(p) => {
                    if let Some(r) = ix.retire(PODS[p]) {
                        pending.push(r);
                    }
                    oracle.held.remove(PODS[p]);
                }
                Op::Cleanup => {
                    if let Some(r) = pending.pop() {
                        ix.cleanup(r);
                    }
                }
                Op::Lookup { chain, len } => {
                    let c = &chains[chain][..len];
                    let want = oracle.lookup(c);
                    // Memo twice: the first may start from another chain's depths (or
                    // stale ones), the second from this chain's own.
                    for s in [Walk::Linear, Walk::Binary, Walk::Kary, Walk::Memo, Walk::Memo] {
                        ix.set_strategy(s);
                        prop_assert_eq!(sorted(&ix, c), want.clone(), "{:?}", s);
                    }
                }
            }
            for (name, h, blocks) in ix.pods() {
                prop_assert_eq!(blocks as usize, oracle.held[&*name].len(), "count of {}", name);
                prop_assert_eq!(ix.blocks_of(h).len(), oracle.held[&*name].len());
            }
        }
        for r in pending.drain(..) {
            ix.cleanup(r);
        }
        let total: HashSet<u64> = oracle.held.values().flatten().copied().collect();
        prop_assert_eq!(ix.stats().entries as usize, total.len(), "cleanup leaves no stray entries");
    }

    #[test]
    fn on_holes_linear_is_exact_and_the_searches_never_underestimate(
        removals in proptest::collection::vec((0..3usize, 0..24usize), 0..40),
    ) {
        let chains = chains();
        let ix = ModelIndex::new(1 << 20);
        let mut held: HashMap<&str, HashSet<u64>> = HashMap::new();
        for p in &PODS[..3] {
            let h = ix.join(p).expect("join");
            ix.store(h, Tier::Gpu, &chains[0]).expect("store");
            held.insert(p, chains[0].iter().copied().collect());
        }
        for (p, i) in removals {
            let h = ix.handle(PODS[p]).expect("live");
            ix.remove(h, Tier::Gpu, &chains[0][i..=i]).expect("remove");
            held.get_mut(PODS[p]).expect("pod").remove(&chains[0][i]);
        }
        let oracle = Oracle { held };
        ix.set_strategy(Walk::Linear);
        prop_assert_eq!(sorted(&ix, &chains[0]), oracle.lookup(&chains[0]));
        for s in [Walk::Binary, Walk::Kary, Walk::Memo, Walk::Memo] {
            ix.set_strategy(s);
            for m in ix.lookup(&chains[0]) {
                let exact = oracle.depth(&m.pod, &chains[0]);
                prop_assert!(m.depth >= exact, "{:?} {} < exact {}", s, m.depth, exact);
                let d = m.depth as usize;
                prop_assert!(oracle.held[&*m.pod].contains(&chains[0][d - 1]));
                prop_assert!(d == chains[0].len() || !oracle.held[&*m.pod].contains(&chains[0][d]));
            }
        }
    }
}
