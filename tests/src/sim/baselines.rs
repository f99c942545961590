//! The policies the simulator compares kvroute with, each a [`Selector`] over the very
//! candidates the sidecar's routing path builds (same index, registry and ledger), so
//! the comparison differs only in how a pod is picked.
//!
//! Every baseline has a fallback for a request that lacks its key: `session` without a
//! session id behaves as `consistent-hash` on the prompt's first block, and
//! `consistent-hash` without a chain uses the policy's tie key.

use std::collections::HashMap;

use kvroute_shared::protocol::{PolicyConfig, RouteRequest};
use kvroute_sidecar::policy::{self, Ask, Candidate, Ranking};
use kvroute_sidecar::{PolicySelector, Selector};

use crate::bench::Rng;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Policy {
    Kvroute,
    Random,
    RoundRobin,
    LeastLoaded,
    ConsistentHash,
    Session,
    PrefixGreedy,
    Dynamo,
    Sglang,
    /// kvroute as it was before data-parallel ranks were pods: each engine address is one
    /// pod to the router (its ranks' caches merged, their loads summed), and the engine
    /// runs the request on its least-busy rank (vLLM's own balancing), whichever rank holds
    /// the prefix. Only meaningful with `dp_ranks` > 1.
    RankBlind,
}

impl Policy {
    pub const ALL: [Policy; 9] = [
        Policy::Kvroute,
        Policy::Random,
        Policy::RoundRobin,
        Policy::LeastLoaded,
        Policy::ConsistentHash,
        Policy::Session,
        Policy::PrefixGreedy,
        Policy::Dynamo,
        Policy::Sglang,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Kvroute => "kvroute",
            Policy::Random => "random",
            Policy::RoundRobin => "round-robin",
            Policy::LeastLoaded => "least-loaded",
            Policy::ConsistentHash => "consistent-hash",
            Policy::Session => "session",
            Policy::PrefixGreedy => "prefix-greedy",
            Policy::Dynamo => "dynamo",
            Policy::Sglang => "sglang",
            Policy::RankBlind => "rank-blind",
        }
    }

    pub fn parse(s: &str) -> Option<Policy> {
        Policy::ALL
            .into_iter()
            .chain([Policy::RankBlind])
            .find(|p| p.name() == s || p.name().replace('-', "_") == s)
    }

    /// A fresh selector for one simulated gateway; `dp_ranks` ranks share each engine
    /// address (1: none).
    pub fn selector(self, seed: u64, dp_ranks: usize) -> Box<dyn Selector> {
        match self {
            Policy::Kvroute => Box::new(PolicySelector),
            Policy::Random => Box::new(Random(Rng(seed))),
            Policy::RoundRobin => Box::new(RoundRobin(seed as usize)),
            Policy::LeastLoaded => Box::new(LeastLoaded),
            Policy::ConsistentHash => Box::new(ConsistentHash),
            Policy::Session => Box::new(Session::default()),
            Policy::PrefixGreedy => Box::new(PrefixGreedy(seed as usize)),
            Policy::Dynamo => Box::new(Dynamo),
            Policy::Sglang => Box::new(Sglang),
            Policy::RankBlind => Box::new(RankBlind {
                ranks: dp_ranks.max(1),
            }),
        }
    }
}

/// See [`Policy::RankBlind`]. The candidates come in pod-id order, so the ranks of one
/// address (`ip:port@0`, `@1`, ...) are contiguous; with any missing, it falls back to
/// kvroute's own pick.
struct RankBlind {
    ranks: usize,
}

impl Selector for RankBlind {
    fn select(
        &mut self,
        cfg: &PolicyConfig,
        ask: &Ask,
        req: &RouteRequest,
        c: &[Candidate],
    ) -> Option<Ranking> {
        if self.ranks <= 1 || c.is_empty() || !c.len().is_multiple_of(self.ranks) {
            return PolicySelector.select(cfg, ask, req, c);
        }
        let merged: Vec<Candidate> = c
            .chunks(self.ranks)
            .enumerate()
            .map(|(g, ranks)| {
                let mut m = ranks[0].clone();
                m.index = g;
                for r in &ranks[1..] {
                    m.matched = m.matched.max(r.matched);
                    m.predicted = m.predicted.max(r.predicted);
                    m.bound = m.bound.max(r.bound);
                    m.pinned |= r.pinned;
                    m.stale |= r.stale;
                    let (l, x) = (&mut m.load, &r.load);
                    l.pending_prefill_tokens += x.pending_prefill_tokens;
                    l.decode_blocks += x.decode_blocks;
                    l.inflight += x.inflight;
                    l.queued += x.queued;
                    l.prefix_inflight += x.prefix_inflight;
                    l.recent_blocks += x.recent_blocks;
                }
                m.tiers = None;
                m
            })
            .collect();
        let g = PolicySelector.select(cfg, ask, req, &merged)?.chosen();
        // The engine's own choice among its ranks: the least busy.
        let first = g * self.ranks;
        (first..first + self.ranks)
            .min_by_key(|&k| (c[k].load.queued * 4 + c[k].load.inflight, k))
            .and_then(chose)
    }
}

/// A ranking that names only the chosen candidate.
fn chose(i: usize) -> Option<Ranking> {
    Some(Ranking::only(i))
}

struct Random(Rng);

impl Selector for Random {
    fn select(
        &mut self,
        _: &PolicyConfig,
        _: &Ask,
        _: &RouteRequest,
        c: &[Candidate],
    ) -> Option<Ranking> {
        (!c.is_empty())
            .then(|| self.0.below(c.len()))
            .and_then(chose)
    }
}

struct RoundRobin(usize);

impl Selector for RoundRobin {
    fn select(
        &mut self,
        _: &PolicyConfig,
        _: &Ask,
        _: &RouteRequest,
        c: &[Candidate],
    ) -> Option<Ranking> {
        if c.is_empty() {
            return None;
        }
        self.0 += 1;
        chose(self.0 % c.len())
    }
}

struct LeastLoaded;

impl Selector for LeastLoaded {
    fn select(
        &mut self,
        _: &PolicyConfig,
        _: &Ask,
        _: &RouteRequest,
        c: &[Candidate],
    ) -> Option<Ranking> {
        (0..c.len())
            .min_by_key(|&k| (c[k].load.inflight, k))
            .and_then(chose)
    }
}

/// Rendezvous hashing on a key with bounded load ((1 + ε) × mean in flight).
fn bounded_hash(cfg: &PolicyConfig, key: u64, c: &[Candidate]) -> Option<usize> {
    let n = c.len();
    if n == 0 {
        return None;
    }
    let total: u64 = c.iter().map(|x| x.load.inflight as u64).sum();
    let cap = ((1.0 + cfg.balance_epsilon) * (total + 1) as f64 / n as f64).ceil() as u32;
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&k| std::cmp::Reverse(policy::rendezvous(key, c[k].key)));
    order
        .iter()
        .copied()
        .find(|&k| c[k].load.inflight < cap.max(1))
        .or(order.first().copied())
}

fn first_block_key(ask: &Ask, req: &RouteRequest) -> u64 {
    req.chain.first().copied().unwrap_or(ask.tie_key)
}

struct ConsistentHash;

impl Selector for ConsistentHash {
    fn select(
        &mut self,
        cfg: &PolicyConfig,
        ask: &Ask,
        req: &RouteRequest,
        c: &[Candidate],
    ) -> Option<Ranking> {
        bounded_hash(cfg, first_block_key(ask, req), c).and_then(chose)
    }
}

/// Sticky sessions: a session's first request is placed by bounded consistent hashing
/// on its id, later ones follow it. Requests without a session id are placed as
/// `consistent-hash` places them (no stickiness to pin them all on one pod).
#[derive(Default)]
struct Session(HashMap<String, u64>);

impl Selector for Session {
    fn select(
        &mut self,
        cfg: &PolicyConfig,
        ask: &Ask,
        req: &RouteRequest,
        c: &[Candidate],
    ) -> Option<Ranking> {
        let Some(s) = &req.session else {
            return bounded_hash(cfg, first_block_key(ask, req), c).and_then(chose);
        };
        if let Some(&key) = self.0.get(s) {
            if let Some(k) = c.iter().position(|x| x.key == key) {
                return chose(k);
            }
        }
        let k = bounded_hash(cfg, xxhash_rust::xxh3::xxh3_64(s.as_bytes()), c)?;
        self.0.insert(s.clone(), c[k].key);
        chose(k)
    }
}

/// The deepest cached prefix wins; ties rotate.
struct PrefixGreedy(usize);

impl Selector for PrefixGreedy {
    fn select(
        &mut self,
        _: &PolicyConfig,
        _: &Ask,
        _: &RouteRequest,
        c: &[Candidate],
    ) -> Option<Ranking> {
        let best = c.iter().map(|x| x.matched).max()?;
        let ties: Vec<usize> = (0..c.len()).filter(|&k| c[k].matched == best).collect();
        self.0 += 1;
        chose(ties[self.0 % ties.len()])
    }
}

/// Dynamo's default cost: overlap-weighted new prefill blocks plus decode blocks.
struct Dynamo;

impl Selector for Dynamo {
    fn select(
        &mut self,
        _: &PolicyConfig,
        ask: &Ask,
        req: &RouteRequest,
        c: &[Candidate],
    ) -> Option<Ranking> {
        let bs = ask.block_size.max(1) as f64;
        let cost = |x: &Candidate| {
            (x.load.pending_prefill_tokens as f64 + req.prompt_tokens as f64
                - x.matched as f64 * bs)
                / bs
                + x.load.decode_blocks as f64
        };
        (0..c.len())
            .min_by(|&a, &b| cost(&c[a]).total_cmp(&cost(&c[b])).then(a.cmp(&b)))
            .and_then(chose)
    }
}

/// SGLang's router: the deepest match unless load is imbalanced or the match is short.
struct Sglang;

impl Selector for Sglang {
    fn select(
        &mut self,
        _: &PolicyConfig,
        _: &Ask,
        req: &RouteRequest,
        c: &[Candidate],
    ) -> Option<Ranking> {
        let loads: Vec<u32> = c.iter().map(|x| x.load.inflight).collect();
        let (mx, mn) = (*loads.iter().max()?, *loads.iter().min()?);
        let imbalanced = mx.saturating_sub(mn) > 64 && mx as f64 > 1.5 * mn as f64;
        let best = (0..c.len()).max_by_key(|&k| (c[k].matched, std::cmp::Reverse(k)))?;
        let ratio = c[best].matched as f64 / req.chain.len().max(1) as f64;
        if imbalanced || ratio < 0.3 {
            (0..c.len()).min_by_key(|&k| (loads[k], k)).and_then(chose)
        } else {
            chose(best)
        }
    }
}
