//! The load ledger: the one owner of projected load — what the router has sent to each
//! pod and not yet seen finish. It holds this replica's outstanding decisions, other
//! replicas' decisions (their load deltas), in-flight requests per routing prefix, the
//! prefill horizon and the recent work of every pod; and the prompts in flight — this
//! replica's by their chains, other replicas' by the chain marks their deltas carry — so
//! a request whose prefix is being computed somewhere goes there, whichever replica
//! sent the first (with four gateways on the overloaded Mooncake trace, replicas that
//! knew only their own sent followers elsewhere: 37.0 s mean TTFT against one gateway's
//! 17.9 s, now 18.7 s).
//!
//! Its rules, kept here and nowhere else:
//! - a decision is added once, under an id the ledger issues (never a client's header),
//!   and released at most once — by its report, its timeout, or its pod's removal;
//! - every add of another replica's decision is keyed by (replica, id): a repeat is
//!   ignored and a release undoes exactly the add it names;
//! - a pod's entry goes with the pod ([`Ledger::forget_pod`]), with every decision on it.
//!
//! One mutex over all of it: a route reads the views of all candidates and commits its
//! decision in one short critical section, so the projection it read is the one it
//! changes. Lock order: the pod registry first, then the ledger (see
//! docs/architecture.md); nothing here calls out while holding it.
//!
//! Every method takes `now`, so the simulator drives it on a virtual clock.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_shared::protocol::{chain_marks, marks_depth, LoadDelta, LoadOp, PolicyConfig};
use parking_lot::Mutex;

use crate::policy::LoadView;

mod book;
#[cfg(test)]
mod tests;

use book::{view_of, Book, RemoteChain, RemoteShare};

/// Seconds on a process-wide monotonic clock, the time base of
/// [`crate::policy::PrefillHorizon`] and [`crate::policy::RecentWork`].
pub fn clock(now: Instant) -> f64 {
    now.checked_duration_since(clock_origin())
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The instant [`clock`] counts from (fixed at its first use). A simulator that starts
/// its virtual time here gets the same clock readings on every run.
pub fn clock_origin() -> Instant {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// Where a route placed a request and what it costs there, as the route hands it to
/// the ledger.
#[derive(Clone, Debug)]
pub struct Placement {
    pub model: String,
    /// The pod that serves (decodes) the request.
    pub pod: Arc<str>,
    /// A separate pod that prefills and caches the prompt (disaggregated models).
    pub prefill_pod: Option<Arc<str>>,
    /// Prompt tokens the cache pod must prefill.
    pub prefill_tokens: u64,
    /// Prompt blocks (the decode pod holds them while the request runs).
    pub blocks: u64,
    /// The cached prefix the request was routed by (its last block).
    pub prefix: Option<u64>,
    /// Tokens the router expected the engine to find cached.
    pub expected_cached: u64,
    /// How many fewer cached tokens than expected the engine may report before the guess
    /// counts as wrong: one block, plus the tokens-per-block estimate's error over the
    /// blocks expected (text chains).
    pub slack_tokens: u64,
    /// Of `expected_cached`, the tokens on guesses already settled when the decision was
    /// made (their first request's report had come): a shortfall beyond these is a prefill
    /// still running when this request arrived, not an eviction.
    pub settled_cached: u64,
    /// The cache pod's residency was a guess (predicted mode).
    pub predicted: bool,
    pub chain_blocks: u64,
    /// A text-mode prompt's canonical length in bytes (its report's `prompt_tokens` is a
    /// sample of the model's tokens per byte).
    pub text_bytes: Option<u64>,
    /// The chain's last block (keys the conversation's own tokens-per-byte sample).
    pub last_block: Option<u64>,
    /// A text turn sent back to the pod its session's last turn went to, continuing that
    /// prompt: the last prompt's blocks up to its tip. The report's cached tokens say how
    /// many of them the pod kept (`returns`), as the index says for token chains.
    pub returning: Option<u64>,
    /// The chain's blocks (at most [`IN_FLIGHT_BLOCKS`]), kept while the request is in
    /// flight: a request arriving meanwhile with the same prefix sees them
    /// ([`Ledger::in_flight`]).
    pub chain: Arc<[u64]>,
}

/// An outstanding decision of this replica.
#[derive(Clone, Debug)]
pub struct Decision {
    pub id: u64,
    pub at: Instant,
    pub placement: Placement,
    /// When its prefill is projected to end, on [`clock`] (the cache pod's horizon once
    /// it was added).
    pub prefill_until: f64,
}

impl Decision {
    /// The pod that prefills and caches the prompt.
    pub fn cache_pod(&self) -> &Arc<str> {
        self.placement
            .prefill_pod
            .as_ref()
            .unwrap_or(&self.placement.pod)
    }
}

/// A pod's share of a chain in this replica's requests in flight ([`Ledger::in_flight`]).
#[derive(Clone, Debug, PartialEq)]
pub struct InFlight {
    pub pod: Arc<str>,
    /// Blocks of the chain a request in flight there holds.
    pub held: u32,
    /// Of those, the blocks of one whose prefill is still under way.
    pub prefilling: u32,
}

/// How a decision's load was released (a metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    Report,
    Timeout,
}

impl Release {
    pub fn label(self) -> &'static str {
        match self {
            Release::Report => "report",
            Release::Timeout => "timeout",
        }
    }
}

pub struct Ledger {
    book: Mutex<Book>,
    /// This replica's id: names its decisions to the others and to the filter.
    replica: String,
    next: std::sync::atomic::AtomicU64,
    /// Deltas are built for other replicas (someone publishes them); off, the ledger's
    /// methods return none and a route allocates nothing for them.
    announce: std::sync::atomic::AtomicBool,
    /// When another replica's delta last arrived, as nanoseconds on [`clock`] (0: never);
    /// read on every route, so outside the book's lock.
    peer_seen_ns: std::sync::atomic::AtomicU64,
}

/// Another replica is taken to share our pods while its deltas arrived this recently.
/// The most blocks one decision carries: a route's longest chain.
pub const MAX_DECISION_BLOCKS: u64 = 1 << 20;
/// Other replicas' shares one replica may hold here at once (a replica that really has
/// this many requests in flight is past what any pod fleet serves).
pub const MAX_REMOTE_PER_REPLICA: usize = 1 << 16;
/// Other replicas' shares held here in all.
pub const MAX_REMOTE_SHARES: usize = 1 << 18;
/// The longest decision id a replica may send (ours are `<replica id ≤ 64>-<n>`).
const MAX_REMOTE_ID: usize = 96;

const PEER_FRESH: Duration = Duration::from_secs(30);
/// Other replicas remembered by id (more than any gateway fleet runs; a flood of made-up
/// ids can only shift which pods this replica prefers for new prompts).
pub const MAX_PEERS: usize = 256;
/// Blocks of a decision's chain kept for [`Ledger::in_flight`] (a longer prompt in flight
/// is seen to this depth).
pub const IN_FLIGHT_BLOCKS: usize = 1 << 14;
/// Decisions whose chains are kept per first block, the newest: a system prompt shared
/// by every request in flight costs a route at most this many comparisons of chains.
const CHAINS_PER_PREFIX: usize = 32;
/// Other replicas' requests in flight whose chain marks are kept, in all (each at most
/// [`kvroute_shared::protocol::MAX_CHAIN_MARKS`] marks: about 3 MB at the bound).
pub const MAX_REMOTE_CHAINS: usize = 1 << 14;

impl Ledger {
    pub fn new(replica: String) -> Ledger {
        Ledger {
            book: Mutex::new(Book::default()),
            replica,
            next: std::sync::atomic::AtomicU64::new(1),
            announce: std::sync::atomic::AtomicBool::new(false),
            peer_seen_ns: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Build deltas for other replicas from now on (`on`), or stop.
    pub fn set_announce(&self, on: bool) {
        self.announce
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// The id the filter echoes in its report: `<replica>-<n>`, so a report from before
    /// a restart (another replica id) can never release a new decision.
    pub fn external_id(&self, id: u64) -> String {
        format!("{}-{id}", self.replica)
    }

    /// The decision an external id names, if it is one of this replica's.
    pub fn parse_id(&self, s: &str) -> Option<u64> {
        let (replica, n) = s.rsplit_once('-')?;
        (replica == self.replica).then(|| n.parse().ok()).flatten()
    }

    /// The projected part of a pod's load view (the registry adds the engine's own
    /// report); `prefix` is the routing prefix of the request being routed.
    pub fn view(
        &self,
        pod: &str,
        prefix: Option<u64>,
        now: Instant,
        cfg: &PolicyConfig,
    ) -> LoadView {
        let book = self.book.lock();
        view_of(&book, pod, prefix, now, cfg)
    }

    /// The pod's released requests so far ([`LoadView::finished`]), to stamp an engine
    /// load report with when it arrives.
    pub fn finished(&self, pod: &str) -> u64 {
        self.book.lock().pods.get(pod).map_or(0, |p| p.finished)
    }

    /// Views of several pods in one critical section.
    pub fn views(
        &self,
        pods: &[Arc<str>],
        prefix: Option<u64>,
        now: Instant,
        cfg: &PolicyConfig,
    ) -> Vec<LoadView> {
        let book = self.book.lock();
        pods.iter()
            .map(|p| view_of(&book, p, prefix, now, cfg))
            .collect()
    }

    /// How deep into `chain` each pod holds a prefix for one of this replica's requests
    /// in flight, and how deep one whose prefill is still under way (pods with neither
    /// are left out). A running request's blocks are in its engine's cache (engines do
    /// not evict what a running request uses), and blocks being prefilled will be there
    /// in a moment: for a request arriving meanwhile they are as good as cached, and
    /// sent elsewhere it would compute them again.
    pub fn in_flight(&self, chain: &[u64], now: Instant) -> Vec<InFlight> {
        let Some(&first) = chain.first() else {
            return Vec::new();
        };
        let t = clock(now);
        let book = self.book.lock();
        let mut out: Vec<InFlight> = Vec::new();
        let mut note = |pod: &Arc<str>, depth: u32, prefilling: u32| match out
            .iter_mut()
            .find(|f| &f.pod == pod)
        {
            Some(f) => {
                f.held = f.held.max(depth);
                f.prefilling = f.prefilling.max(prefilling);
            }
            None => out.push(InFlight {
                pod: pod.clone(),
                held: depth,
                prefilling,
            }),
        };
        // Other replicas' requests, as deep as their marks vouch for: held, never counted
        // as prefilling. When their prefills end is this replica's projection of another's
        // work, and waiting for them was worse than weighing them as cached (four
        // gateways: multi-turn chat 77.2 -> 79.4 ms over seeds 1-8, agentic 4 x 4,096
        // 3,468 against 3,249 ms; docs/policy.md).
        for c in book.remote_chains.get(&first).into_iter().flatten() {
            let depth = marks_depth(&c.marks, chain).unwrap_or(0);
            if depth > 0 {
                note(&c.pod, depth, 0);
            }
        }
        let ids = book.chains.get(&first).into_iter().flatten();
        for d in ids.filter_map(|id| book.decisions.get(id)) {
            let theirs = &d.placement.chain;
            // Chains hash every block with all before it: equal at i means equal up to i.
            let (mut lo, mut hi) = (0, theirs.len().min(chain.len()));
            while lo < hi {
                let mid = lo + (hi - lo) / 2;
                if theirs[mid] == chain[mid] {
                    lo = mid + 1;
                } else {
                    hi = mid;
                }
            }
            let depth = u32::try_from(lo).unwrap_or(u32::MAX);
            note(
                d.cache_pod(),
                depth,
                if d.prefill_until > t { depth } else { 0 },
            );
        }
        out
    }

    /// Add a decision's load; returns its id and the deltas to broadcast.
    pub fn commit(
        &self,
        placement: Placement,
        now: Instant,
        cfg: &PolicyConfig,
    ) -> (u64, Vec<LoadDelta>) {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let t = clock(now);
        let mut dec = Decision {
            id,
            at: now,
            placement,
            prefill_until: t,
        };
        let mut book = self.book.lock();
        let cache = dec.cache_pod().clone();
        {
            let p = book.pod(&cache);
            p.horizon
                .add(t, dec.placement.prefill_tokens, cfg.prefill_tokens_per_s);
            p.recent.add(t, dec.placement.blocks, cfg.home_window_s);
            dec.prefill_until = p.horizon.until;
        }
        book.chains_add(&dec);
        {
            let p = book.pod(&dec.placement.pod);
            p.decode_blocks += dec.placement.blocks;
            p.inflight += 1;
        }
        if let Some(k) = dec.placement.prefix {
            book.prefix_add(k, &dec.placement.pod);
        }
        let deltas = self.deltas(&dec, LoadOp::Add);
        book.decisions.insert(id, dec);
        (id, deltas)
    }

    /// Release a decision once; `None` if it is not outstanding (released already,
    /// expired, its pod removed, or never ours).
    pub fn release(
        &self,
        id: u64,
        now: Instant,
        cfg: &PolicyConfig,
    ) -> Option<(Decision, Vec<LoadDelta>)> {
        let mut book = self.book.lock();
        let d = book.decisions.remove(&id)?;
        book.unload(&d, clock(now), cfg.prefill_tokens_per_s);
        let deltas = self.deltas(&d, LoadOp::Release);
        Some((d, deltas))
    }

    /// Release everything older than `timeout`: this replica's decisions whose report
    /// never came, and other replicas' whose release never came (that replica died).
    pub fn expire(
        &self,
        now: Instant,
        timeout: Duration,
        cfg: &PolicyConfig,
    ) -> (Vec<Decision>, Vec<LoadDelta>) {
        let (t, tps) = (clock(now), cfg.prefill_tokens_per_s);
        let mut book = self.book.lock();
        let old: Vec<u64> = book
            .decisions
            .values()
            .filter(|d| now.saturating_duration_since(d.at) > timeout)
            .map(|d| d.id)
            .collect();
        let mut gone = Vec::with_capacity(old.len());
        let mut deltas = Vec::new();
        for id in old {
            if let Some(d) = book.decisions.remove(&id) {
                book.unload(&d, t, tps);
                deltas.extend(self.deltas(&d, LoadOp::Release));
                gone.push(d);
            }
        }
        let stale: Vec<(Arc<str>, (String, String))> = book
            .pods
            .iter()
            .flat_map(|(id, p)| {
                p.remote
                    .iter()
                    .filter(|(_, r)| now.saturating_duration_since(r.at) > timeout)
                    .map(move |(k, _)| (id.clone(), k.clone()))
            })
            .collect();
        for (pod, key) in stale {
            book.remote_remove(&pod, &key, t, tps);
        }
        (gone, deltas)
    }

    /// Apply another replica's delta for a pod the caller knows. Returns whether it
    /// changed anything (a repeated add, an unknown release, or an add past the bounds
    /// does not).
    ///
    /// Another replica is trusted with no more than it could really send: a share is
    /// clamped to what one decision on this model can carry (a route's longest chain,
    /// its blocks' tokens, no more prefill than drains within `load_timeout_s`, after
    /// which an unreported share expires anyway), sums saturate, and one replica holds at most
    /// [`MAX_REMOTE_PER_REPLICA`] shares ([`MAX_REMOTE_SHARES`] in all).
    pub fn apply_remote(
        &self,
        pod: &Arc<str>,
        l: &LoadDelta,
        now: Instant,
        cfg: &PolicyConfig,
    ) -> bool {
        if l.replica == self.replica
            || l.id.len() > MAX_REMOTE_ID
            || (!l.marks.is_empty() && !kvroute_shared::protocol::marks_valid(&l.marks))
        {
            return false;
        }
        let (t, tps) = (clock(now), cfg.prefill_tokens_per_s);
        let key = (l.replica.clone(), l.id.clone());
        let mut book = self.book.lock();
        self.peer_seen_ns.fetch_max(
            ((t * 1e9) as u64).max(1),
            std::sync::atomic::Ordering::Relaxed,
        );
        book.heard(&l.replica, t);
        match l.op {
            LoadOp::Add => {
                if book
                    .pods
                    .get(pod)
                    .is_some_and(|p| p.remote.contains_key(&key))
                {
                    return false;
                }
                let held = book.per_replica.get(&l.replica).copied().unwrap_or(0);
                if held >= MAX_REMOTE_PER_REPLICA || book.remote_total >= MAX_REMOTE_SHARES {
                    return false;
                }
                let blocks = l.blocks.min(MAX_DECISION_BLOCKS);
                let m = cfg.model(&l.model);
                let block_tokens = u64::from(m.block_size.max(m.text_block_bytes).max(1));
                // Nor more prefill than drains before the share expires unreported.
                let drains = (tps.max(1.0) * cfg.load_timeout_s as f64) as u64;
                let share = RemoteShare {
                    at: now,
                    prefill_tokens: l
                        .prefill_tokens
                        .min(blocks.saturating_mul(block_tokens))
                        .min(drains),
                    blocks,
                    prefix: l.prefix.filter(|_| l.inflight),
                    inflight: l.inflight,
                    first: l.marks.first().map(|m| m[1]),
                };
                if let Some(k) = share.prefix {
                    book.prefix_add(k, pod);
                }
                *book.per_replica.entry(l.replica.clone()).or_insert(0) += 1;
                book.remote_total += 1;
                let p = book.pod(pod);
                p.horizon.add(t, share.prefill_tokens, tps);
                p.recent.add(t, share.blocks, cfg.home_window_s);
                p.remote_blocks = p.remote_blocks.saturating_add(share.blocks);
                if share.inflight {
                    p.remote_inflight = p.remote_inflight.saturating_add(1);
                }
                p.remote.insert(key.clone(), share);
                if let Some(first) = share.first {
                    book.remote_chain_add(
                        first,
                        RemoteChain {
                            key,
                            pod: pod.clone(),
                            marks: l.marks.clone().into(),
                        },
                    );
                }
                true
            }
            LoadOp::Release => {
                let had = book
                    .pods
                    .get(pod)
                    .is_some_and(|p| p.remote.contains_key(&key));
                book.remote_remove(pod, &key, t, tps);
                had
            }
        }
    }

    /// A pod left the registry: its load goes, and so does every decision it serves
    /// (their releases are broadcast); a decision it only prefilled keeps its decode
    /// share elsewhere.
    pub fn forget_pod(&self, pod: &str, now: Instant, cfg: &PolicyConfig) -> Vec<LoadDelta> {
        let (t, tps) = (clock(now), cfg.prefill_tokens_per_s);
        let mut book = self.book.lock();
        let serving: Vec<u64> = book
            .decisions
            .values()
            .filter(|d| &*d.placement.pod == pod)
            .map(|d| d.id)
            .collect();
        let mut deltas = Vec::new();
        for id in serving {
            if let Some(d) = book.decisions.remove(&id) {
                book.unload(&d, t, tps);
                deltas.extend(self.deltas(&d, LoadOp::Release));
            }
        }
        for d in book.decisions.values_mut() {
            if d.placement.prefill_pod.as_deref() == Some(pod) {
                d.placement.prefill_pod = None;
                d.placement.prefill_tokens = 0;
            }
        }
        book.pods.remove(pod);
        book.remote_chains.retain(|_, q| {
            q.retain(|c| &*c.pod != pod);
            !q.is_empty()
        });
        book.prefixes.retain(|_, per_pod| {
            per_pod.remove(pod);
            !per_pod.is_empty()
        });
        deltas
    }

    /// Other replicas route to the same pods (their deltas arrived lately).
    pub fn has_peers(&self, now: Instant) -> bool {
        let seen = self.peer_seen_ns.load(std::sync::atomic::Ordering::Relaxed);
        seen > 0 && clock(now) - (seen as f64 / 1e9) < PEER_FRESH.as_secs_f64()
    }

    /// This replica's place among the replicas routing to the same pods, `(rank, count)`,
    /// ranked by id: the others heard within the last 30 s and this one. Every replica
    /// that hears the same others computes the same ranks, so each can take every
    /// `count`-th pod as its own for new prompts (`PolicyConfig::peer_home_weight`).
    /// None while it hears no one.
    pub fn home_slot(&self, now: Instant) -> Option<(usize, usize)> {
        if !self.has_peers(now) {
            return None;
        }
        let t = clock(now);
        let book = self.book.lock();
        let fresh = book
            .peers
            .iter()
            .filter(|(_, at)| t - **at < PEER_FRESH.as_secs_f64());
        let (mut rank, mut count) = (0, 1);
        for (id, _) in fresh {
            count += 1;
            rank += usize::from(id.as_str() < self.replica.as_str());
        }
        (count > 1).then_some((rank, count))
    }

    /// Outstanding decisions of this replica.
    pub fn outstanding(&self) -> usize {
        self.book.lock().decisions.len()
    }

    /// In-flight requests routed by prefix `k`, per pod (tests and the API).
    pub fn prefix_inflight(&self, k: u64) -> HashMap<Arc<str>, u32> {
        self.book
            .lock()
            .prefixes
            .get(&k)
            .cloned()
            .unwrap_or_default()
    }

    /// Routing prefixes with requests in flight.
    pub fn prefixes_in_flight(&self) -> usize {
        self.book.lock().prefixes.len()
    }

    /// Other replicas' decisions held for `pod`.
    pub fn remote_count(&self, pod: &str) -> usize {
        self.book.lock().pods.get(pod).map_or(0, |p| p.remote.len())
    }

    /// The deltas that tell other replicas about `d` (one per pod it loads).
    fn deltas(&self, d: &Decision, op: LoadOp) -> Vec<LoadDelta> {
        if !self.announce.load(std::sync::atomic::Ordering::Relaxed) {
            return Vec::new();
        }
        let id = self.external_id(d.id);
        let mut v = Vec::with_capacity(2);
        let split = d
            .placement
            .prefill_pod
            .as_ref()
            .filter(|p| **p != d.placement.pod);
        let model = &d.placement.model;
        v.push(LoadDelta {
            prefill_tokens: if split.is_some() {
                0
            } else {
                d.placement.prefill_tokens
            },
            blocks: d.placement.blocks,
            prefix: d.placement.prefix,
            // Where the prompt is computed: its cache pod (a split decision's prefill
            // share carries them instead).
            marks: match (op, split) {
                (LoadOp::Add, None) => chain_marks(&d.placement.chain),
                _ => Vec::new(),
            },
            ..LoadDelta::new(&self.replica, &id, &d.placement.pod, model, op)
        });
        if let Some(pp) = split {
            v.push(LoadDelta {
                prefill_tokens: d.placement.prefill_tokens,
                inflight: false,
                marks: match op {
                    LoadOp::Add => chain_marks(&d.placement.chain),
                    LoadOp::Release => Vec::new(),
                },
                ..LoadDelta::new(&self.replica, &format!("{id}#prefill"), pp, model, op)
            });
        }
        v
    }
}
