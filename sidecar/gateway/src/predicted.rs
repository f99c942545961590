//! Predicted residency, for engines that publish no KV events and for text-mode chains
//! (which no engine computes): each route decision records the request's chain as
//! cached on the chosen pod, with a TTL and a per-pod capacity.
//!
//! Kept in its own per-model index (the same structure as the confirmed one), so a
//! confirmed hit and a guess are never mixed up and the policy can weigh them apart.
//! Each pod's capacity adapts to the engines' reports (AIMD): a report of fewer cached
//! tokens than predicted means the pod evicts sooner than assumed, so its capacity is cut
//! by 30% and the oldest guesses beyond it go; a correct prediction grows it back by the
//! request's size, up to the configured cap.
//!
//! A guess is *settled* once the decision that first made it has left the ledger (its
//! report came, or it timed out): before that the engine may still be prefilling it, so
//! a request routed onto it meanwhile that finds it missing says nothing about eviction.
//! Each guess remembers the decision that made it, and each pod the decisions still
//! outstanding on it; a decision's expectation counts settled guesses only, and only a
//! shortfall on those cuts capacity. Either shortfall raises the pod's eviction
//! pressure: a prefix sent there while still being computed was not served from cache,
//! and the live chat load on evicting caches needs that signal (with `eviction_weight`
//! at 2, 10 of 12 runs at `smg`'s hit rate counting it, 0 of 12 without).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_shared::protocol::Tier;
use parking_lot::Mutex;

use crate::index::{Indexes, ModelIndex};

/// How long a guess is trusted to still be in the index before a repeat stores it again
/// (the index's own capacity bound may have dropped it).
const REFRESH: Duration = Duration::from_secs(1);

/// Weight of the newest report in a pod's eviction pressure: about the last ten
/// predicted reports count, so a run of fresh prompts after a quiet spell still sees
/// what the cache did a moment ago.
const PRESSURE_GAIN: f64 = 0.1;

struct PodLru {
    model: String,
    /// Current (adaptive) capacity in blocks.
    cap: f64,
    /// The most blocks of one prompt the engine has reported holding at once: a lower
    /// bound on its real capacity, so no run of mispredictions cuts below it.
    floor: f64,
    /// Moving share of the reports that found a guess evicted (see [`PRESSURE_GAIN`]).
    pressure: f64,
    order: VecDeque<(u64, Instant)>,
    /// Block → its guess (older queue entries are stale). hashbrown's default hasher
    /// (foldhash, seeded per process): keys come from clients' prompts, so the map must
    /// resist crafted collisions, and SipHash cost a fifth of each insert.
    live: hashbrown::HashMap<u64, Guess>,
    /// Decisions on this pod still in the ledger, with when they were made (a bound for
    /// ones whose release never reaches here).
    outstanding: hashbrown::HashMap<u64, Instant>,
}

/// What a report of a predicted decision found, against what the router expected.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Shortfall {
    /// The engine held what was guessed (within the slack).
    None,
    /// Short only on guesses still being prefilled when the request was routed.
    InFlight,
    /// Short on settled guesses: the engine evicted them.
    Evicted,
}

#[derive(Clone, Copy)]
struct Guess {
    /// The latest insertion (the one the recency queue's live entry carries).
    at: Instant,
    /// The decision that first made it.
    by: u64,
}

impl PodLru {
    fn settled(&self, block: u64) -> bool {
        self.live
            .get(&block)
            .is_some_and(|g| !self.outstanding.contains_key(&g.by))
    }
}

/// Outstanding decisions a pod keeps beyond which the oldest are taken as settled: the
/// ledger releases every decision within its timeout, so this only bounds a pod whose
/// releases are lost.
const MAX_OUTSTANDING: usize = 1 << 16;

#[derive(Default)]
pub struct Predicted {
    pub indexes: Indexes,
    pods: Mutex<HashMap<Arc<str>, PodLru>>,
}

impl Predicted {
    fn index(&self, model: &str, max_blocks: u64) -> Arc<ModelIndex> {
        self.indexes.get_or_create(model, max_blocks)
    }

    /// Record `chain` as cached on `pod` by `decision` (outstanding until [`Self::settle`]).
    pub fn insert(
        &self,
        model: &str,
        pod: &str,
        chain: &[u64],
        cap: u64,
        decision: u64,
        now: Instant,
    ) {
        if chain.is_empty() {
            return;
        }
        let ix = self.index(model, cap.saturating_mul(256));
        let Ok(h) = ix.join(pod) else { return };
        // A prompt mostly repeats what the pod was just given (a system prompt, the earlier
        // turns): those blocks only renew their place in the LRU; only new ones (or ones
        // whose guess is older than REFRESH, in case the index's own cap dropped them) are
        // stored in the index again, which was most of the cost of a long prompt.
        let mut fresh = Vec::new();
        let evicted = {
            let mut pods = self.pods.lock();
            // Every pod's guesses together stay within the predicted indexes' budget.
            let limit = self.indexes.budget() / (pods.len() as u64 + 1);
            let lru = pods.entry(Arc::from(pod)).or_insert_with(|| PodLru {
                model: model.to_string(),
                cap: cap as f64,
                floor: 0.0,
                pressure: 0.0,
                order: VecDeque::new(),
                live: hashbrown::HashMap::new(),
                outstanding: hashbrown::HashMap::new(),
            });
            if lru.outstanding.len() >= MAX_OUTSTANDING {
                // Settle the older half at once: amortized O(1) a decision.
                let mut ats: Vec<Instant> = lru.outstanding.values().copied().collect();
                let mid = ats.len() / 2;
                let cut = *ats.select_nth_unstable(mid).1;
                lru.outstanding.retain(|_, at| *at > cut);
            }
            lru.outstanding.insert(decision, now);
            for &b in chain {
                let by = lru.live.get(&b).map_or(decision, |g| g.by);
                match lru.live.insert(b, Guess { at: now, by }) {
                    Some(before) if now.saturating_duration_since(before.at) < REFRESH => {}
                    _ => fresh.push(b),
                }
                lru.order.push_back((b, now));
            }
            // Bounded by content, not traffic: a block sent again leaves its earlier queue
            // entry stale; once stale entries outnumber live ones they are dropped (each
            // pass removes at least half the queue, so this is amortized O(1) a block).
            if lru.order.len() > 2 * lru.live.len() + 64 {
                let live = &lru.live;
                lru.order
                    .retain(|(b, at)| live.get(b).map(|g| g.at) == Some(*at));
            }
            let keep = (lru.cap as u64).min(limit);
            evict(lru, usize::try_from(keep).unwrap_or(usize::MAX), None)
        };
        if !fresh.is_empty() {
            let _ = ix.store(h, Tier::Gpu, &fresh);
        }
        if !evicted.is_empty() {
            let _ = ix.remove(h, Tier::Gpu, &evicted);
        }
    }

    /// Drop guesses older than `ttl`.
    pub fn expire(&self, ttl: Duration, now: Instant) {
        let mut work = Vec::new();
        {
            let mut pods = self.pods.lock();
            for (pod, lru) in pods.iter_mut() {
                // A decision older than the TTL counts as settled (a prefill takes
                // seconds): this bounds decisions whose release never reached here.
                lru.outstanding
                    .retain(|_, at| now.saturating_duration_since(*at) <= ttl);
                let gone = evict(lru, usize::MAX, Some((ttl, now)));
                if !gone.is_empty() {
                    work.push((lru.model.clone(), pod.clone(), gone));
                }
            }
        }
        for (model, pod, gone) in work {
            if let (Some(ix), Some(h)) = (
                self.indexes.get(&model),
                self.indexes.get(&model).and_then(|i| i.handle(&pod)),
            ) {
                let _ = ix.remove(h, Tier::Gpu, &gone);
            }
        }
    }

    /// How many of `chain`'s first `depth` blocks are settled guesses on `pod`. Guesses
    /// settle in chain order almost always (a prompt's later blocks come from later
    /// turns), so this bisects: a request routed onto a 100k-token prompt still
    /// prefilling costs a few lookups, not one a block. A turn that finishes before an
    /// earlier one still decoding can make it count a few in-flight blocks as settled,
    /// which at worst calls that shortfall an eviction, as before settling existed.
    pub fn settled_depth(&self, pod: &str, chain: &[u64], depth: usize) -> usize {
        let pods = self.pods.lock();
        let Some(lru) = pods.get(pod) else { return 0 };
        let hit = &chain[..depth.min(chain.len())];
        hit.partition_point(|&b| lru.settled(b))
    }

    /// `decision` left the ledger: the guesses it made are settled.
    pub fn settle(&self, pod: &str, decision: u64) {
        if let Some(lru) = self.pods.lock().get_mut(pod) {
            lru.outstanding.remove(&decision);
        }
    }

    /// Feedback from a completion report (AIMD on the pod's capacity): `held` is how
    /// many of the prompt's blocks the engine reported cached.
    ///
    /// The cut stops at the most blocks the engine has ever been seen to hold. Below
    /// that the router forgets residency the engine really has: a shared prefix's home
    /// is forgotten, its next request goes wherever load says, the prefix then lives
    /// on two pods, each evicts the other's prompts sooner, and more mispredictions cut
    /// deeper (the live chat load on caches smaller than its working set fell from a
    /// 0.71 hit rate to 0.36–0.52 that way, run after run).
    pub fn feedback(
        &self,
        pod: &str,
        short: Shortfall,
        held: Option<u64>,
        grow_by: u64,
        max_cap: u64,
    ) {
        let mut evicted = Vec::new();
        let mut model = String::new();
        {
            let mut pods = self.pods.lock();
            let Some(lru) = pods.get_mut(pod) else { return };
            if let Some(held) = held {
                lru.floor = lru.floor.max(held.min(max_cap) as f64);
            }
            let missed = if short == Shortfall::None { 0.0 } else { 1.0 };
            lru.pressure += PRESSURE_GAIN * (missed - lru.pressure);
            match short {
                Shortfall::Evicted => {
                    lru.cap = (lru.cap * 0.7).max(lru.floor).max(16.0);
                    evicted = evict(lru, lru.cap as usize, None);
                    model = lru.model.clone();
                }
                Shortfall::None => lru.cap = (lru.cap + grow_by as f64).min(max_cap as f64),
                Shortfall::InFlight => {}
            }
        }
        if !evicted.is_empty() {
            if let Some(ix) = self.indexes.get(&model) {
                if let Some(h) = ix.handle(pod) {
                    let _ = ix.remove(h, Tier::Gpu, &evicted);
                }
            }
        }
    }

    /// Forget a pod (removed or restarted). Returns the slot to clean.
    pub fn forget(
        &self,
        model: &str,
        pod: &str,
    ) -> Option<(Arc<ModelIndex>, crate::index::Retired)> {
        self.pods.lock().remove(pod);
        let ix = self.indexes.get(model)?;
        let r = ix.retire(pod)?;
        Some((ix, r))
    }

    /// Entries in `pod`'s recency queue (tests: bounded by its live blocks).
    #[cfg(test)]
    pub fn queued(&self, pod: &str) -> usize {
        self.pods.lock().get(pod).map_or(0, |l| l.order.len())
    }

    /// Each pod's eviction pressure (0 before its first report), in the order given,
    /// under one lock.
    pub fn pressures(&self, pods: &[Arc<str>]) -> Vec<f64> {
        let lru = self.pods.lock();
        pods.iter()
            .map(|p| lru.get(p).map_or(0.0, |l| l.pressure))
            .collect()
    }

    pub fn pressure_of(&self, pod: &str) -> Option<f64> {
        self.pods.lock().get(pod).map(|l| l.pressure)
    }

    pub fn capacity_of(&self, pod: &str) -> Option<f64> {
        self.pods.lock().get(pod).map(|l| l.cap)
    }

    pub fn entries(&self) -> u64 {
        self.indexes
            .all()
            .iter()
            .map(|(_, i)| i.stats().entries)
            .sum()
    }
}

/// Pop least-recent blocks until at most `cap` are live, or (with a TTL) all older than it.
fn evict(lru: &mut PodLru, cap: usize, ttl: Option<(Duration, Instant)>) -> Vec<u64> {
    let mut out = Vec::new();
    while let Some(&(b, at)) = lru.order.front() {
        let over = lru.live.len() > cap;
        let expired = ttl.is_some_and(|(ttl, now)| now.duration_since(at) > ttl);
        if !over && !expired {
            break;
        }
        lru.order.pop_front();
        // Only the latest insertion of a block counts; earlier queue entries are stale.
        if lru.live.get(&b).map(|g| g.at) == Some(at) {
            lru.live.remove(&b);
            out.push(b);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depth(p: &Predicted, chain: &[u64]) -> u32 {
        depth_on(p, "p", chain)
    }

    fn depth_on(p: &Predicted, pod: &str, chain: &[u64]) -> u32 {
        p.indexes
            .get("m")
            .map(|ix| ix.lookup(chain))
            .unwrap_or_default()
            .iter()
            .find(|m| &*m.pod == pod)
            .map_or(0, |m| m.depth)
    }

    #[test]
    fn repeats_refresh_at_most_once_per_interval_and_expire_by_ttl() {
        let p = Predicted::default();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let chain: Vec<u64> = (1..=64).collect();
        p.insert("m", "p", &chain, 1 << 16, 0, at(0));
        assert_eq!(depth(&p, &chain), 64);
        // A repeat renews the guess (its TTL runs from the latest use)...
        p.insert("m", "p", &chain, 1 << 16, 0, at(500));
        p.expire(Duration::from_millis(900), at(1000));
        assert_eq!(depth(&p, &chain), 64, "renewed at 0.5 s");
        // ...and a guess unused for longer than the TTL goes.
        p.expire(Duration::from_millis(900), at(1500));
        assert_eq!(depth(&p, &chain), 0, "expired");
        assert_eq!(p.entries(), 0);
        p.insert("m", "p", &chain, 1 << 16, 0, at(2000));
        assert_eq!(depth(&p, &chain), 64, "stored again after expiry");
        // Capacity still bounds what is held: the oldest guesses go first.
        let long: Vec<u64> = (1000..1100).collect();
        p.insert("m", "q", &long, 32, 0, at(3600));
        p.insert("m", "q", &long, 32, 0, at(3700));
        assert_eq!(depth_on(&p, "q", &long), 0, "the prefix was evicted");
        assert_eq!(depth_on(&p, "q", &long[68..]), 32, "the last 32 are held");
    }

    /// A conversation's history sent again and again (every turn of every chat) costs
    /// memory in proportion to what is cached, not to how often it was sent.
    #[test]
    fn repeated_prompts_do_not_grow_the_queue() {
        let p = Predicted::default();
        let chain: Vec<u64> = (1..=64).collect();
        let t0 = Instant::now();
        for i in 0..10_000u64 {
            p.insert(
                "m",
                "10.0.0.1:8000",
                &chain,
                4096,
                i,
                t0 + Duration::from_millis(i),
            );
        }
        assert!(
            p.queued("10.0.0.1:8000") <= 2 * 64 + 64 + 64,
            "{}",
            p.queued("10.0.0.1:8000")
        );
        let ix = p.indexes.get("m").expect("index");
        assert_eq!(
            ix.lookup(&chain).first().map(|m| m.depth),
            Some(64),
            "still predicted"
        );
    }

    /// Pressure rises with reports of evicted guesses and falls with held ones; the
    /// capacity cuts stop at the most the engine was seen holding.
    #[test]
    fn pressure_follows_the_reports() {
        let p = Predicted::default();
        let t0 = Instant::now();
        let pods: Vec<Arc<str>> = vec![Arc::from("a"), Arc::from("b")];
        let chain: Vec<u64> = (1..=8).collect();
        p.insert("m", "a", &chain, 1 << 16, 0, t0);
        assert_eq!(p.pressures(&pods), vec![0.0, 0.0]);
        for _ in 0..20 {
            p.feedback("a", Shortfall::Evicted, Some(4), 8, 1 << 16);
        }
        let high = p.pressure_of("a").expect("a");
        assert!(high > 0.85, "{high}");
        for _ in 0..40 {
            p.feedback("a", Shortfall::None, Some(8), 8, 1 << 16);
        }
        let low = p.pressure_of("a").expect("a");
        assert!(low < 0.05, "{low}");
        // The cuts stopped at what the engine was seen holding.
        assert!(p.capacity_of("a").expect("a") >= 8.0);
    }

    /// A guess is settled once the decision that made it has left the ledger; a later
    /// decision renewing it does not make it its own, and the TTL settles what no
    /// release reached.
    #[test]
    fn guesses_settle_when_their_decision_leaves() {
        let p = Predicted::default();
        let t0 = Instant::now();
        let system: Vec<u64> = (1..=32).collect();
        p.insert("m", "a", &system, 1 << 16, 1, t0);
        assert_eq!(p.settled_depth("a", &system, 32), 0, "still prefilling");
        // A second user of the prompt, routed while the first one's prefill runs.
        let mut turn = system.clone();
        turn.extend(100..110);
        p.insert("m", "a", &turn, 1 << 16, 2, t0);
        p.settle("a", 2);
        assert_eq!(
            p.settled_depth("a", &turn, 32),
            0,
            "the system prompt is 1's"
        );
        p.settle("a", 1);
        assert_eq!(p.settled_depth("a", &turn, 32), 32);
        assert_eq!(p.settled_depth("a", &turn, 42), 42);
        assert_eq!(
            p.settled_depth("b", &turn, 42),
            0,
            "another pod guessed nothing"
        );
        // A third turn on top of the settled ones: only its new blocks are in flight.
        let mut third = turn.clone();
        third.extend(200..210);
        p.insert("m", "a", &third, 1 << 16, 3, t0);
        assert_eq!(p.settled_depth("a", &third, 52), 42);
        // Its release was lost: the TTL settles it.
        p.expire(Duration::from_secs(60), t0 + Duration::from_secs(30));
        assert_eq!(p.settled_depth("a", &third, 52), 42, "within the TTL");
        p.insert("m", "a", &third, 1 << 16, 4, t0 + Duration::from_secs(59));
        p.settle("a", 4);
        p.expire(Duration::from_secs(60), t0 + Duration::from_secs(61));
        assert_eq!(p.settled_depth("a", &third, 52), 52, "settled by age");
    }
}
