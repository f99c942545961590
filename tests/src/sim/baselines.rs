//! The policies the simulator compares kvroute with, each a [`Selector`] over the very
//! candidates the sidecar's routing path builds (same index, registry and ledger), so
//! the comparison differs only in how a pod is picked.
//!
//! Every baseline has a fallback for a request that lacks its key: `session` without a
//! session id behaves as `consistent-hash` on the prompt's first block, and
//! `consistent-hash` without a chain uses the policy's tie key.

use std::collections::{HashMap, VecDeque};

use kvroute_shared::protocol::{PolicyConfig, RouteRequest};
use kvroute_sidecar::policy::{self, Ask, Candidate, LoadView, Ranking};
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
    VllmRouter,
    /// kvroute as it was before data-parallel ranks were pods: each engine address is one
    /// pod to the router (its ranks' caches merged, their loads summed), and the engine
    /// runs the request on its least-busy rank (vLLM's own balancing), whichever rank holds
    /// the prefix. Only meaningful with `dp_ranks` > 1.
    RankBlind,
}

impl Policy {
    pub const ALL: [Policy; 10] = [
        Policy::Kvroute,
        Policy::Random,
        Policy::RoundRobin,
        Policy::LeastLoaded,
        Policy::ConsistentHash,
        Policy::Session,
        Policy::PrefixGreedy,
        Policy::Dynamo,
        Policy::Sglang,
        Policy::VllmRouter,
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
            Policy::VllmRouter => "vllm-router",
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
            Policy::Sglang => Box::new(Sglang::default()),
            Policy::VllmRouter => Box::new(Sglang {
                vllm_router: true,
                ..Sglang::default()
            }),
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

/// SGLang's model gateway (`smg` 1.13, `cache_aware` over HTTP), as its code and
/// `--help` describe it and `kvroute-bench peers` measures it:
///
/// - a tree of the prompts **it routed** (not of what the engines hold: it never hears
///   of an eviction), one tree for all workers, bounded by `--max-tree-size` (64 Mi
///   characters; a block counts as 4 characters a token), least recently routed first out;
/// - the worker whose routed prefix is deepest wins when that prefix is more than
///   `--cache-threshold` (0.3) of the prompt, the most recent of equals;
/// - unless it spills: its requests in flight exceed the fleet's mean by the margin
///   (`--balance-abs-threshold` 64, capped at two standard deviations of the mean's
///   natural swing, 2√mean, and never under 4) and by `--balance-rel-threshold` (1.5×);
/// - a spill, or a shorter match, goes to the fewest requests in flight (first of equals).
///
/// Its load signal is its own count of requests in flight; its worker-overload guard
/// reads SGLang's `/v1/loads`, which vLLM-style engines do not serve, so it is off here
/// as it is in front of vLLM.
///
/// With `vllm_router`, vLLM's router (`vllm-router` 0.1.17, `cache_aware`, a fork of the
/// same lineage), as its `--help` describes it and its live choices show: the fleet is
/// *imbalanced* when the busiest and the idlest worker's requests in flight differ by
/// more than `--balance-abs-threshold` (64) and the busiest has more than
/// `--balance-rel-threshold` (1.5) times the idlest's; then the fewest in flight wins,
/// whatever the tree says. Otherwise a match of more than `--cache-threshold` (0.3) goes
/// to the deepest match, and a shorter one to the fewest in flight (first of equals).
/// (Its source reads as if a new prompt went to the worker whose tree is smallest; replayed
/// against a live run, that rule named its pod for 34 of 89 new prompts, the fewest in
/// flight for 87: `kvroute-bench imitate`.) Its trees are bounded per worker
/// (`--max-tree-size`, 32 Mi characters, trimmed every 120 s); the imitation bounds
/// the one tree by the workers' sum, which no workload here reaches.
#[derive(Default)]
struct Sglang {
    /// Chain block (whose hash names its whole prefix) → the pods it was routed to and
    /// the stamp of the last time.
    tree: HashMap<u64, Vec<(u64, u64)>>,
    /// `(block, pod, stamp)` in routing order: least recently routed first.
    lru: VecDeque<(u64, u64, u64)>,
    entries: usize,
    clock: u64,
    vllm_router: bool,
}

/// vLLM router's `--max-tree-size` default, characters per worker.
const VLLM_ROUTER_MAX_TREE_CHARS: usize = 32 << 20;

/// smg's `--max-tree-size` default, in characters.
const SMG_MAX_TREE_CHARS: usize = 64 << 20;

impl Sglang {
    /// The deepest routed prefix of `chain` and the pods that routed it, newest last.
    fn deepest(&self, chain: &[u64]) -> (usize, Option<&Vec<(u64, u64)>>) {
        let depth = chain
            .iter()
            .take_while(|b| self.tree.contains_key(b))
            .count();
        (
            depth,
            depth.checked_sub(1).and_then(|i| self.tree.get(&chain[i])),
        )
    }

    fn insert(&mut self, chain: &[u64], pod: u64, max_entries: usize) {
        self.clock += 1;
        let stamp = self.clock;
        for &b in chain {
            let pods = self.tree.entry(b).or_default();
            match pods.iter_mut().find(|e| e.0 == pod) {
                Some(e) => e.1 = stamp,
                None => {
                    pods.push((pod, stamp));
                    self.entries += 1;
                }
            }
            self.lru.push_back((b, pod, stamp));
        }
        while self.entries > max_entries {
            let Some((b, p, st)) = self.lru.pop_front() else {
                break;
            };
            if let Some(pods) = self.tree.get_mut(&b) {
                // Only the entry's last routing evicts it; older stamps are stale.
                if let Some(i) = pods.iter().position(|e| *e == (p, st)) {
                    pods.swap_remove(i);
                    self.entries -= 1;
                    if pods.is_empty() {
                        self.tree.remove(&b);
                    }
                }
            }
        }
        // Stale stamps pile up in the queue; drop them once they outnumber the live.
        if self.lru.len() > 4 * self.entries.max(1024) {
            let tree = &self.tree;
            self.lru
                .retain(|(b, p, st)| tree.get(b).is_some_and(|v| v.contains(&(*p, *st))));
        }
    }
}

/// One decision of an imitated router, before it records the routing: the pod it picks
/// (a candidate index), every pod its rule ranks level with that one (its tie-break
/// is the router's detail, not its policy), and which branch of the rule decided.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub pick: usize,
    pub equals: Vec<usize>,
    pub case: &'static str,
}

impl Sglang {
    /// The rule described on [`Sglang`], read-only: the same request against the same
    /// state decides the same.
    fn decide(&self, ask: &Ask, req: &RouteRequest, c: &[Candidate]) -> Option<Decision> {
        let inflight = |k: usize| c[k].load.inflight;
        let fewest = (0..c.len()).map(inflight).min()?;
        let least: Vec<usize> = (0..c.len()).filter(|&k| inflight(k) == fewest).collect();
        let (depth, pods) = self.deepest(&req.chain);
        let tenant = pods.and_then(|v| {
            v.iter()
                .filter_map(|&(pod, st)| c.iter().position(|x| x.key == pod).map(|k| (st, k)))
                .max()
                .map(|(_, k)| k)
        });
        let rate = depth as f64 / ask.prompt_blocks.max(1) as f64;
        let only = |k: usize, case| Decision {
            pick: k,
            equals: vec![k],
            case,
        };
        let first_of = |equals: Vec<usize>, case| Decision {
            pick: equals[0],
            equals,
            case,
        };
        if self.vllm_router {
            let load = |k: usize| inflight(k) as f64;
            let (lo, hi) = (0..c.len()).fold((f64::INFINITY, 0.0f64), |(lo, hi), k| {
                (lo.min(load(k)), hi.max(load(k)))
            });
            return Some(match tenant {
                _ if hi - lo > 64.0 && hi > 1.5 * lo => first_of(least, "imbalanced"),
                Some(k) if rate > 0.3 => only(k, "match"),
                _ => first_of(least, "new"),
            });
        }
        Some(match tenant {
            Some(k) if rate > 0.3 => {
                let mean = c.iter().map(|x| x.load.inflight as f64).sum::<f64>() / c.len() as f64;
                let margin = (2.0 * mean.sqrt()).clamp(4.0, 64.0);
                let load = inflight(k) as f64;
                if load > mean + margin && load > 1.5 * mean {
                    first_of(least, "spill")
                } else {
                    only(k, "match")
                }
            }
            _ => first_of(least, "new"),
        })
    }

    /// Records that `chain` was routed to the pod `key` (of `pods`), trimming the tree
    /// to the router's bound (its characters as blocks of `block_size` tokens, 4
    /// characters a token).
    fn record(&mut self, chain: &[u64], key: u64, block_size: u32, pods: usize) {
        let chars = if self.vllm_router {
            // One tree per worker in that router; the imitation bounds the one tree by
            // the workers' sum.
            pods * VLLM_ROUTER_MAX_TREE_CHARS
        } else {
            SMG_MAX_TREE_CHARS
        };
        self.insert(chain, key, chars / (4 * block_size.max(1) as usize));
    }
}

impl Selector for Sglang {
    fn select(
        &mut self,
        _: &PolicyConfig,
        ask: &Ask,
        req: &RouteRequest,
        c: &[Candidate],
    ) -> Option<Ranking> {
        let d = self.decide(ask, req, c)?;
        self.record(&req.chain, c[d.pick].key, ask.block_size, c.len());
        chose(d.pick)
    }
}

/// An imitated router driven from outside the simulator: [`Imitation::decide`] asks its
/// rule, [`Imitation::record`] tells it what was really routed (so a replay of a real
/// router's choices keeps the imitation's state where the real router's was).
pub struct Imitation(Sglang);

impl Imitation {
    /// `sglang` or `vllm-router`.
    pub fn of(policy: Policy) -> Option<Imitation> {
        match policy {
            Policy::Sglang => Some(Imitation(Sglang::default())),
            Policy::VllmRouter => Some(Imitation(Sglang {
                vllm_router: true,
                ..Sglang::default()
            })),
            _ => None,
        }
    }

    pub fn decide(&self, ask: &Ask, req: &RouteRequest, c: &[Candidate]) -> Option<Decision> {
        self.0.decide(ask, req, c)
    }

    pub fn record(&mut self, chain: &[u64], key: u64, block_size: u32, pods: usize) {
        self.0.record(chain, key, block_size, pods)
    }
}

/// Candidates that differ only in their requests in flight (all these routers read; what
/// the engines hold plays no part: they never hear of it).
pub(super) fn candidates(inflight: &[u32]) -> Vec<Candidate> {
    inflight
        .iter()
        .enumerate()
        .map(|(i, &n)| Candidate {
            index: i,
            key: 100 + i as u64,
            matched: 0,
            predicted: 0,
            in_flight: 0,
            prefilling: 0,
            tiers: None,
            stale: false,
            load: LoadView {
                inflight: n,
                ..LoadView::default()
            },
            bound: 0.0,
            pinned: false,
            pressure: 0.0,
            peer_home: false,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_shared::Mode;

    fn req(chain: Vec<u64>) -> RouteRequest {
        RouteRequest {
            mode: Mode::Text,
            ..RouteRequest::tokens("m", 16, chain)
        }
    }

    fn ask(blocks: usize) -> Ask {
        Ask {
            prompt_blocks: blocks as u32,
            block_size: 64,
            ..Ask::default()
        }
    }

    fn pick(s: &mut Sglang, chain: &[u64], inflight: &[u32]) -> usize {
        s.select(
            &PolicyConfig::default(),
            &ask(chain.len()),
            &req(chain.to_vec()),
            &candidates(inflight),
        )
        .expect("a pick")
        .chosen()
    }

    #[test]
    fn the_smg_imitation_follows_what_it_routed_and_spills_only_past_its_margin() {
        let mut s = Sglang::default();
        // A new prompt goes to the fewest in flight.
        assert_eq!(pick(&mut s, &[1, 2, 3, 4], &[3, 1, 2, 5]), 1);
        // Its next turn (4 of 5 blocks routed) follows it there, busier or not, whatever
        // the engines hold (mean 1.25, margin 4: 5 is not past 5.25)...
        assert_eq!(pick(&mut s, &[1, 2, 3, 4, 5], &[0, 5, 0, 0]), 1);
        // ...until the pod spills: mean 3, margin max(2√3, 4) = 4, so 8 > 7 and > 4.5.
        assert_eq!(pick(&mut s, &[1, 2, 3, 4, 5, 6], &[1, 8, 0, 3]), 2);
        // Both pods routed [1..5]: the newest routing of it wins.
        assert_eq!(pick(&mut s, &[1, 2, 3, 4, 5, 99], &[0, 0, 0, 0]), 2);
        // A match of 0.3 or less is a new prompt: fewest in flight (first of equals).
        assert_eq!(pick(&mut s, &[1, 2, 30, 40, 50, 60, 70], &[2, 1, 1, 2]), 1);
    }

    #[test]
    fn the_vllm_router_imitation_balances_only_a_lopsided_fleet() {
        let mut s = Sglang {
            vllm_router: true,
            ..Sglang::default()
        };
        // A new prompt goes to the fewest in flight (first of equals).
        assert_eq!(pick(&mut s, &[1, 2, 3, 4], &[3, 1, 2, 1]), 1);
        // A follow-up stays on its prompt's pod while the fleet is balanced enough: 70
        // in flight against 10 is not 64 more, so it stays, busy or not ...
        assert_eq!(pick(&mut s, &[1, 2, 3, 4, 5], &[10, 70, 20, 30]), 1);
        // ... 80 against 10 is, and 1.5× too: the fewest in flight.
        assert_eq!(pick(&mut s, &[1, 2, 3, 4, 5], &[10, 80, 20, 30]), 0);
        // 60 against 0: within the absolute margin, it follows the tree (pod 0 routed
        // [1..5] last), where smg would spill (60 is past its margin over a mean of 15).
        assert_eq!(pick(&mut s, &[1, 2, 3, 4, 5, 6], &[60, 0, 0, 0]), 0);
    }

    #[test]
    fn the_smg_imitation_forgets_the_least_recently_routed_past_its_bound() {
        let mut s = Sglang::default();
        for b in 0..10u64 {
            s.insert(&[b], 7, 4);
        }
        assert_eq!(s.entries, 4);
        assert_eq!(s.deepest(&[5]).0, 0);
        assert_eq!(s.deepest(&[9]).0, 1);
        // Routing a block again renews it: the older stamp in the queue is stale.
        s.insert(&[6], 7, 4);
        s.insert(&[10], 7, 4);
        assert_eq!(s.deepest(&[6]).0, 1, "renewed, so not the oldest");
        assert_eq!(s.deepest(&[7]).0, 0);
    }
}
