//! The routing decision: Filter → Score → Pick, as pure functions over cache facts and
//! load views, so the service, the simulator and the tests run the same policy.
//!
//! - **Filter** ([`admissible`]): the pod serves the model and the adapter, has the role
//!   asked for, and its circuit breaker is closed. (Liveness is the index's alive bitmap
//!   and the registry; both are applied before candidates are built.)
//! - **Score** ([`cost`]): the work the request would wait for on that pod, in blocks of
//!   prefill: its own uncached blocks plus the prefill already queued there, plus a
//!   decode term. A hit counts fully when engine-confirmed, at `predicted_weight` when
//!   only predicted, at `1 − tier_cost` when the block is off GPU, and a pod with an event
//!   gap has its hits scaled by `stale_factor`. A prefix that is common (on most pods) or
//!   hot (many requests in flight, the fleet not saturated) is credited to every pod; a
//!   request that no pod holds more of than that is *cold*, and choosing its home also
//!   weighs the work each pod drew lately ([`RecentWork`]) and, while the fleet is busy,
//!   whether another gateway replica places new prompts on the pod first
//!   (`Candidate::peer_home`), so replicas that have not yet heard of each other's
//!   placements do not send them to the same pod.
//! - **Pick** ([`pick`]): lowest cost among pods within the bounded load, per pod and per
//!   routing prefix, so a shared system prompt cannot pin all traffic to one pod, and
//!   among pods whose engines report no request waiting for a batch slot; ties go
//!   to the rendezvous hash of the first block no pod holds, so independent replicas agree;
//!   with a temperature, a softmax sample instead of the argmin. A pod that stores the
//!   conversation a request continues (`Candidate::pinned`) is chosen whenever it is
//!   within the bounded load.

use kvroute_shared::protocol::{PolicyConfig, Role, Tier, TierHint};

/// What the policy knows about a pod's load.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadView {
    /// Prompt tokens routed to the pod whose prefill has not been reported done.
    pub pending_prefill_tokens: u64,
    /// KV blocks held by its running requests.
    pub decode_blocks: u64,
    /// Requests in flight (router's projection, or the engine's own count if larger).
    pub inflight: u32,
    /// Requests the engine reports waiting.
    pub queued: u32,
    /// Requests in flight on this pod that were routed by the same cached prefix as this
    /// one (the deepest prefix any pod holds); see [`pick`].
    pub prefix_inflight: u32,
    /// Prompt blocks routed to the pod lately (see [`RecentWork`]).
    pub recent_blocks: f64,
    /// The ledger's count of this pod's requests released so far (monotone): the
    /// registry subtracts those released since the engine's last load report from it.
    pub finished: u64,
}

/// When a pod's queued prefills should be done: prefills run one at a time, so each
/// routed request pushes the horizon by `tokens / prefill_tps`. The prefill work still
/// ahead of a new request is what is left before the horizon. Without this, load routed
/// to a pod would count until its completion report, long after its prefill ended, and
/// the router would shun exactly the pods whose caches it should use.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillHorizon {
    /// Seconds (on the caller's clock) when the pod's known prefills end.
    pub until: f64,
}

impl PrefillHorizon {
    pub fn add(&mut self, now: f64, tokens: u64, tps: f64) {
        self.until = self.until.max(now) + tokens as f64 / tps.max(1.0);
    }

    /// Prefill tokens still ahead at `now`.
    pub fn pending(&self, now: f64, tps: f64) -> u64 {
        ((self.until - now).max(0.0) * tps) as u64
    }

    /// A request ended (report): whatever of its prefill is still counted goes.
    pub fn release(&mut self, now: f64, tokens: u64, tps: f64) {
        self.until = (self.until - tokens as f64 / tps.max(1.0)).max(now.min(self.until));
    }
}

/// The prompt blocks routed to a pod lately, decayed exponentially. In-flight counts
/// only see the requests running now; a pod whose cached prefixes drew much traffic in
/// the last seconds will keep drawing it, which is what a new prefix's home should avoid.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RecentWork {
    blocks: f64,
    /// Seconds (on the caller's clock) of the last update.
    at: f64,
}

impl RecentWork {
    pub fn add(&mut self, now: f64, blocks: u64, window_s: f64) {
        self.blocks = self.value(now, window_s) + blocks as f64;
        self.at = self.at.max(now);
    }

    pub fn value(&self, now: f64, window_s: f64) -> f64 {
        self.blocks * (-(now - self.at).max(0.0) / window_s.max(1e-3)).exp()
    }
}

/// One candidate pod for a request.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// Where the pod is in the caller's table (not an id: only the caller knows
    /// which pod that is).
    pub index: usize,
    /// Rendezvous key of the pod (a hash of its name).
    pub key: u64,
    /// Engine-confirmed cached prefix, in blocks.
    pub matched: u32,
    /// Predicted cached prefix, in blocks.
    pub predicted: u32,
    /// The prefix a request in flight on the pod holds, in blocks (the ledger's): its
    /// engine is computing or using those blocks, so they count as hits in full, not as
    /// a guess about what the cache kept.
    pub in_flight: u32,
    /// Of `in_flight`, the prefix of one whose prefill is still under way.
    pub prefilling: u32,
    /// Where the confirmed hits live, when known.
    pub tiers: Option<TierHint>,
    pub stale: bool,
    pub load: LoadView,
    /// Blocks a binding credits to this pod (its session's last turn went here, or the
    /// response this request continues is stored here; see the sidecar's `affinity`).
    pub bound: f64,
    /// The pod stores the conversation this request continues (a Responses
    /// `previous_response_id`): no other pod can serve it, so it is chosen whenever it
    /// is within the bounded load.
    pub pinned: bool,
    /// How much the pod's engine evicts of what the router expected it to hold (0–1; see
    /// [`cost`] and [`load_weight`]): for text requests, the recent share of its
    /// predicted hits that the engine had already evicted; for token requests, the share
    /// of sessions' returning prompts it had evicted, past a floor (the sidecar's
    /// `returns`).
    pub pressure: f64,
    /// Another gateway replica takes this pod first for new prompts (the ledger's
    /// `home_slot`): a request choosing a home pays `peer_home_weight` per prompt
    /// block here.
    pub peer_home: bool,
}

/// The request's side of the decision (the default: no prompt, every option off).
#[derive(Clone, Copy, Debug, Default)]
pub struct Ask {
    /// Blocks of the whole prompt (full and partial).
    pub prompt_blocks: u32,
    /// Engine tokens one of the request's blocks stands for (turns the pods' pending
    /// prefill tokens into the request's blocks): the block size for token chains, the
    /// learned estimate for text chains.
    pub block_size: u32,
    /// Rendezvous key for ties: the first block's hash (or a session/request hash).
    pub tie_key: u64,
    /// Seed for softmax sampling.
    pub seed: u64,
    /// Ignore cache hits (choosing a decode pod of a disaggregated model).
    pub load_only: bool,
    /// The request goes through the admission gate: the fleet is run at its limit and
    /// the queue keeps pods' backlogs short, so replicas keep new prompts apart whatever
    /// the backlog (`peer_home_backlog_s`).
    pub gated: bool,
    /// Other replicas route to the same pods: for a request choosing a home, treat costs
    /// within `near_tie_cost` of the best as ties (see [`pick`]).
    pub spread_ties: bool,
    /// The candidates' `pressure` was read off returning turns (token chains, the
    /// sidecar's `returns`), not off reports of guesses: see [`load_weight`].
    pub pressure_from_returns: bool,
}

/// The per-pod breakdown of a cost.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Score {
    pub hits: f64,
    pub uncached: f64,
    pub queued_prefill: f64,
    pub decode: f64,
    pub cost: f64,
}

/// Hits worth counting for a candidate.
pub fn hits(cfg: &PolicyConfig, c: &Candidate) -> f64 {
    let confirmed = c.matched.max(c.in_flight);
    let mut h =
        confirmed as f64 + c.predicted.saturating_sub(confirmed) as f64 * cfg.predicted_weight;
    if let Some(t) = c.tiers {
        let tc = |tier: Tier| cfg.tier_cost.get(&tier).copied().unwrap_or(0.0);
        h -= t.cpu as f64 * tc(Tier::Cpu)
            + t.disk as f64 * tc(Tier::Disk)
            + t.remote as f64 * tc(Tier::Remote);
    }
    if c.stale {
        h *= cfg.stale_factor;
    }
    h.max(0.0).max(c.bound)
}

/// What every candidate's cost shares: read once from all of them by [`pick`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Fleet {
    /// Hits credited to every candidate ([`shared_hits`]).
    pub shared: f64,
    /// No candidate holds more than `shared`: this places a new home and the pods'
    /// recent work counts.
    pub cold: bool,
    /// How much more an uncached block weighs because the whole fleet is behind (0
    /// unless saturated, see [`saturation`]).
    pub saturation: f64,
    /// The weight of queued prefill ([`load_weight`]).
    pub load_weight: f64,
    /// The deepest prefix of the prompt any candidate is prefilling right now: what a
    /// pod with fewer hits would compute a second time.
    pub held: f64,
    /// The fleet is busy enough that new prompts keep to this replica's own pods
    /// (`peer_home_backlog_s`; see `Candidate::peer_home`).
    pub apart: bool,
}

pub fn cost(cfg: &PolicyConfig, ask: &Ask, c: &Candidate, fleet: &Fleet) -> Score {
    let Fleet {
        shared,
        cold,
        saturation,
        load_weight,
        held,
        apart,
    } = *fleet;
    let hits = if ask.load_only {
        0.0
    } else {
        hits(cfg, c).max(shared)
    };
    let uncached = (ask.prompt_blocks as f64 - hits).max(0.0);
    let bs = ask.block_size.max(1) as f64;
    let queued_prefill = c.load.pending_prefill_tokens as f64 / bs;
    let decode = c.load.decode_blocks as f64;
    let prefill_w = if ask.load_only {
        0.0
    } else {
        cfg.prefill_weight
    };
    // On a pod that evicts what it is sent, a prefill also costs the hits of the
    // prompts it pushes out: a prefix copied there to save a short wait (a shared
    // system prompt's second user while the first is still prefilling) lives on two
    // pods, and each evicts the other's prompts sooner (the live chat load on caches
    // smaller than its working set: 0.71 hit rate when every prompt kept one pod,
    // 0.36-0.56 when the first turns of a run split them).
    let evicting = cfg.eviction_weight * c.pressure.clamp(0.0, 1.0);
    // A prefix another pod is prefilling right now, recomputed here, is work the fleet
    // does twice and a copy that crowds both caches, while waiting for it costs this
    // request about what recomputing it does: a shared system prompt's second user
    // would otherwise skip the first one's prefill by a block or two of cost, and every
    // such prompt end up on two pods. (A prefix already settled in a cache is the
    // cost's usual trade against load, see `shared_hits`.)
    let recompute = cfg.recompute_weight * (held - hits).max(0.0);
    let cost = prefill_w * (uncached * (1.0 + saturation + evicting) + recompute)
        + load_weight * queued_prefill
        + cfg.decode_weight * decode
        + cfg.queue_weight * c.load.queued as f64
        + if cold {
            cfg.home_weight * c.load.recent_blocks
                + if apart && c.peer_home {
                    cfg.peer_home_weight * ask.prompt_blocks as f64
                } else {
                    0.0
                }
        } else {
            0.0
        };
    Score {
        hits,
        uncached,
        queued_prefill,
        decode,
        cost,
    }
}

/// The key that breaks ties: the first block no candidate holds (the chain's first
/// block for a cold prompt). Requests that share a prefix cached everywhere — a common
/// system prompt — then spread by what follows it instead of piling onto one pod, while
/// every replica still computes the same key.
pub fn tie_key(chain: &[u64], deepest_match: usize) -> Option<u64> {
    chain.get(deepest_match).or_else(|| chain.last()).copied()
}

/// Rendezvous hash of (tie key, pod key): the highest wins a tie.
pub fn rendezvous(tie: u64, pod: u64) -> u64 {
    let mut z = tie ^ pod.rotate_left(17) ^ 0x9E37_79B9_7F4A_7C15;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hits on a prefix that at least half the candidates, and at least three, hold (a
/// common system prompt), credited to every candidate. Such a prefix will be everywhere soon anyway, so the few
/// pods still without it must not be shunned for it: otherwise the pods that cached it
/// first draw every new conversation, which then stays there while the others idle.
pub fn shared_hits(cfg: &PolicyConfig, cands: &[Candidate]) -> f64 {
    let half = cands.len().div_ceil(2).max(3);
    if half > cands.len() {
        return 0.0;
    }
    let mut h: Vec<f64> = cands.iter().map(|c| hits(cfg, c)).collect();
    h.sort_by(|a, b| b.total_cmp(a));
    h.get(half - 1).copied().unwrap_or(0.0)
}

/// The weight of a pod's queued prefill against an uncached block for a request whose
/// prompt has a home (`cold` false): `load_weight`, cut by the candidates' mean eviction
/// pressure (`eviction_load_cut`). Skipping a queue is the TTFT-greedy choice, but where
/// the caches evict, the prompt sent elsewhere is prefilled whole there and evicts the
/// prompts that pod held (the live agentic sessions: kvroute moved one turn in seven off
/// its cache and reused 35% of prompt blocks, SGLang's gateway one in a hundred and 40%;
/// docs/policy.md). The mean, not each pod's own: a pod that evicts less would otherwise
/// draw the moves. A new prompt keeps the full weight: placing new prompts by load is
/// what spreads them over pods whose caches hold one each.
///
/// Pressure read off returning turns (`Ask::pressure_from_returns`) steps aside while the
/// fleet is far behind (the saturation weight past [`RETURNS_MAX_SATURATION`]): there a
/// turn that waited minutes finds its pod has evicted its prompt for the ones served
/// meanwhile, which the queue did, not moves, and the saturation rule already keeps
/// prompts on their caches (with the cut as well, the agentic sessions on 4 × 1,024
/// blocks lost 32% of mean TTFT, seeds 1–8).
pub fn load_weight(
    cfg: &PolicyConfig,
    ask: &Ask,
    cands: &[Candidate],
    cold: bool,
    saturation: f64,
) -> f64 {
    let far_behind = ask.pressure_from_returns && saturation > RETURNS_MAX_SATURATION;
    if cold || far_behind || cfg.eviction_load_cut <= 0.0 || cands.is_empty() {
        return cfg.load_weight;
    }
    let pressure = cands
        .iter()
        .map(|c| c.pressure.clamp(0.0, 1.0))
        .sum::<f64>()
        / cands.len() as f64;
    cfg.load_weight / (1.0 + cfg.eviction_load_cut * pressure)
}

/// The saturation weight (an uncached block weighs `1 +` this) past which pressure read
/// off returning turns no longer cuts the queue's weight (see [`load_weight`]). On the
/// live-shaped agentic case in token chains, seeds 1–6: 8 leaves hit rate 0.393 and mean
/// TTFT 2,165 ms, 16 0.396 and 2,357 ms, no gate 0.396 and 2,305 ms (but the deeply
/// saturated fleets lose up to 32%), the cut off 0.354 and 1,650 ms.
const RETURNS_MAX_SATURATION: f64 = 16.0;

/// The candidates' mean queued prefill, in tokens: the backlog both the saturation weight
/// and keeping new prompts apart are judged by.
fn mean_backlog(cands: &[Candidate]) -> f64 {
    let tokens: f64 = cands
        .iter()
        .map(|c| c.load.pending_prefill_tokens as f64)
        .sum();
    tokens / cands.len().max(1) as f64
}

/// The engines' waiting lines as prefill backlog, in tokens, when
/// `saturation_waiting_over` is set: the candidates' mean count of requests waiting for a
/// batch slot past that many, each taken as a prompt of this request's size.
fn waiting_backlog(cfg: &PolicyConfig, ask: &Ask, cands: &[Candidate]) -> f64 {
    let Some(over) = cfg.saturation_waiting_over else {
        return 0.0;
    };
    if cands.is_empty() {
        return 0.0;
    }
    let waiting = cands.iter().map(|c| c.load.queued as f64).sum::<f64>() / cands.len() as f64;
    (waiting - over).max(0.0) * ask.prompt_blocks.max(1) as f64 * ask.block_size.max(1) as f64
}

/// How far behind the whole fleet is, as the extra weight of an uncached block: 0 while
/// the candidates have less than `saturation_backlog_s` of prefill queued on average;
/// past it, the mean backlog above that threshold in prompts of this request's size (at
/// most `saturation_max_prompts` of them), times `saturation_weight`. Past that point
/// every pod has work waiting, so a prompt recomputed off its cache delays each request
/// queued behind it on its new pod: greedy per-request choices then spill prompts off
/// their caches, the spilled work makes the next pod busy too, and the fleet's hit rate
/// collapses (agentic sessions on 2-4 pods: 0.72-0.74 where session affinity held
/// 0.85-0.94).
///
/// `backlog` is the candidates' mean queued prefill (`mean_backlog`): the mean, not the
/// least, because one pod that is briefly idle does not make room for every conversation
/// the others hold (the least let the fleet spill first and measure saturation after:
/// 0.853 hit on 4 pods against the mean's 0.935).
pub fn saturation(cfg: &PolicyConfig, ask: &Ask, backlog: f64) -> f64 {
    if ask.load_only || cfg.saturation_backlog_s <= 0.0 {
        return 0.0;
    }
    let threshold = cfg.saturation_backlog_s * cfg.prefill_tokens_per_s;
    if backlog < threshold {
        return 0.0;
    }
    // From 0 at the threshold (a step there made every pod's choice jump at once), and
    // never 0 past it: past the threshold the guards step aside.
    let bs = ask.block_size.max(1) as f64;
    let over = ((backlog - threshold) / bs / ask.prompt_blocks.max(1) as f64)
        .min(cfg.saturation_max_prompts);
    (cfg.saturation_weight * over).max(f64::MIN_POSITIVE)
}

/// One candidate's place in a ranking.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rank {
    /// The candidate: its position in the slice [`pick`] was given.
    pub candidate: usize,
    pub score: Score,
    /// Passed the bounded-load guards (per pod, per prefix) and the full-batch guard.
    pub within_balance: bool,
}

/// The ranked candidates and the pick.
#[derive(Clone, Debug, PartialEq)]
pub struct Ranking {
    /// Every candidate, best first.
    pub order: Vec<Rank>,
    /// Index into `order` of the chosen pod.
    pub pick: usize,
}

impl Ranking {
    /// A ranking of one candidate, chosen (for selectors that pick without scoring).
    pub fn only(candidate: usize) -> Ranking {
        Ranking {
            order: vec![Rank {
                candidate,
                score: Score::default(),
                within_balance: true,
            }],
            pick: 0,
        }
    }

    /// The chosen candidate's position in the slice [`pick`] was given.
    pub fn chosen(&self) -> usize {
        self.order[self.pick].candidate
    }
}

/// Score every candidate and pick one. `None` when there is no candidate.
pub fn pick(cfg: &PolicyConfig, ask: &Ask, cands: &[Candidate]) -> Option<Ranking> {
    if cands.is_empty() {
        return None;
    }
    let total: u64 = cands.iter().map(|c| c.load.inflight as u64).sum();
    let mean = (total + 1) as f64 / cands.len() as f64;
    // (1 + ε) × mean, but never tighter than `balance_slack` requests above the mean: with
    // a handful of requests per pod the rounding alone would otherwise evict sessions from
    // the pods that hold their caches.
    let cap = ((1.0 + cfg.balance_epsilon) * mean)
        .ceil()
        .max(mean.ceil() + cfg.balance_slack)
        .max(1.0) as u64;
    let shared = shared_hits(cfg, cands);
    // The same bound per prefix: a prefix that many concurrent requests are routed by (a
    // system prompt while it is on few pods) spreads over more pods as its own load grows,
    // while the pod-wide bound can stay loose enough not to split a prefix that is merely
    // on a busy pod (which costs a full prefill of it elsewhere).
    let ptotal: u64 = cands.iter().map(|c| c.load.prefix_inflight as u64).sum();
    let pmean = (ptotal + 1) as f64 / cands.len() as f64;
    let pcap = ((1.0 + cfg.balance_epsilon) * pmean)
        .ceil()
        .max(pmean.ceil() + cfg.prefix_balance_slack) as u64;
    // A routing prefix this busy will be needed on every pod: credit it to all, so that
    // its new conversations spread by load rather than pile onto its first holders (who
    // would keep them, and their later turns, for good).
    let deepest = cands.iter().map(|c| hits(cfg, c)).fold(0.0, f64::max);
    let backlog = mean_backlog(cands);
    let saturated = saturation(cfg, ask, backlog + waiting_backlog(cfg, ask, cands));
    // Never while one pod may keep all of them under the per-prefix bound: with a few pods
    // a handful of requests for one prompt (reports not yet in) is not a hot prefix. Nor
    // while the fleet is saturated: each pod the prefix spreads to must prefill it, work a
    // fleet with a backlog everywhere has no room for. (A coding agent's parallel
    // sub-agents share the front of its prompt. On the agentic sessions over 16 seeds,
    // not spreading them cut mean TTFT 1-15% on 2-4 pods, with 1 gateway or 4; every
    // fleet and workload that never saturates routes exactly as before.)
    let hot = cfg.hot_prefix_per_pod > 0.0
        && saturated == 0.0
        && ptotal as f64
            >= (cfg.hot_prefix_per_pod * cands.len() as f64).max(cfg.prefix_balance_slack + 1.0);
    let shared = if hot { deepest } else { shared };
    // Nobody holds more than what is credited to all: the request is choosing a home.
    let cold = !ask.load_only && deepest < shared + 1.0;
    // A pod whose engine has requests waiting for a batch slot makes a new one wait for
    // decodes to finish, which no cache hit repays; the slack above cannot see that (a
    // batch fills at a few requests per pod with long outputs, well within the slack).
    let full_batch = cfg.full_batch_guard && cands.iter().any(|c| c.load.queued == 0);
    let fleet = Fleet {
        apart: cfg.peer_home_weight > 0.0
            && cands.iter().any(|c| c.peer_home)
            && (ask.gated || backlog >= cfg.peer_home_backlog_s * cfg.prefill_tokens_per_s),
        shared,
        cold,
        saturation: saturated,
        load_weight: load_weight(cfg, ask, cands, cold, saturated),
        held: if ask.load_only {
            0.0
        } else {
            cands
                .iter()
                .map(|c| c.prefilling as f64)
                .fold(0.0, f64::max)
        },
    };
    let mut order: Vec<Rank> = cands
        .iter()
        .enumerate()
        .map(|(i, c)| Rank {
            candidate: i,
            score: cost(cfg, ask, c, &fleet),
            // Saturated, the guards would send prompts off their caches to pods that are
            // behind as well: the cost alone decides.
            within_balance: saturated > 0.0
                || ((c.load.inflight as u64) < cap
                    && (c.load.prefix_inflight as u64) < pcap
                    && !(full_batch && c.load.queued > 0)),
        })
        .collect();
    order.sort_by(|a, b| {
        a.score.cost.total_cmp(&b.score.cost).then_with(|| {
            rendezvous(ask.tie_key, cands[b.candidate].key)
                .cmp(&rendezvous(ask.tie_key, cands[a.candidate].key))
        })
    });
    // Nobody passes the guard only in degenerate cases; then the guard steps aside.
    let any_ok = order.iter().any(|o| o.within_balance);
    let eligible = |o: &Rank| o.within_balance || !any_ok;
    let pinned = order
        .iter()
        .position(|o| cands[o.candidate].pinned && eligible(o));
    let pick = if let Some(p) = pinned {
        p
    } else if cfg.temperature > 0.0 {
        softmax_pick(cfg.temperature, ask.seed, &order, eligible)
    } else {
        // Only a request choosing a home spreads: concurrent cold requests on replicas
        // that have not heard of each other would all take the one pod that looks
        // idlest, while a request with a home that takes a near-tie elsewhere gives up
        // cache for nothing (4 gateways, multi-turn chat: TTFT mean 83 → 75 ms, p99
        // 478 → 201 ms, where one gateway has 74 / 262).
        let margin = if ask.spread_ties && cold {
            cfg.near_tie_cost
        } else {
            0.0
        };
        near_tie_pick(margin, ask.tie_key, cands, &order, eligible)
    };
    Some(Ranking { order, pick })
}

/// The best eligible candidate, or, among the eligible ones within `margin` of its
/// cost, the one the tie key's rendezvous hash prefers.
fn near_tie_pick(
    margin: f64,
    tie_key: u64,
    cands: &[Candidate],
    order: &[Rank],
    eligible: impl Fn(&Rank) -> bool,
) -> usize {
    let Some(best) = order.iter().position(&eligible) else {
        return 0;
    };
    if margin <= 0.0 {
        return best;
    }
    let limit = order[best].score.cost + margin;
    (best..order.len())
        .take_while(|&i| order[i].score.cost <= limit)
        .filter(|&i| eligible(&order[i]))
        .max_by_key(|&i| rendezvous(tie_key, cands[order[i].candidate].key))
        .unwrap_or(best)
}

fn softmax_pick(t: f64, seed: u64, order: &[Rank], eligible: impl Fn(&Rank) -> bool) -> usize {
    let best = order
        .iter()
        .filter(|o| eligible(o))
        .map(|o| o.score.cost)
        .fold(f64::INFINITY, f64::min);
    let weights: Vec<f64> = order
        .iter()
        .map(|o| {
            if eligible(o) {
                (-(o.score.cost - best) / t).exp()
            } else {
                0.0
            }
        })
        .collect();
    let sum: f64 = weights.iter().sum();
    let mut r = (rendezvous(seed, 0x5eed) >> 11) as f64 / (1u64 << 53) as f64 * sum;
    for (i, w) in weights.iter().enumerate() {
        if *w > 0.0 {
            if r < *w {
                return i;
            }
            r -= w;
        }
    }
    weights.iter().rposition(|w| *w > 0.0).unwrap_or(0)
}

/// What the Filter stage checks of a pod.
#[derive(Clone, Debug, Default)]
pub struct PodFacts<'a> {
    pub role: Role,
    pub adapters: &'a [String],
    /// The breaker is open (recent failures) until this many seconds from now.
    pub breaker_open: bool,
}

/// The Filter stage: may this pod serve this request at all?
pub fn admissible(pod: &PodFacts<'_>, adapter: &str, want: Option<Role>) -> bool {
    if pod.breaker_open {
        return false;
    }
    if !adapter.is_empty() && !pod.adapters.is_empty() && !pod.adapters.iter().any(|a| a == adapter)
    {
        return false;
    }
    match want {
        None => true,
        Some(Role::Both) => pod.role == Role::Both,
        Some(r) => pod.role == r || pod.role == Role::Both,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(id: usize, matched: u32, inflight: u32, pending: u64) -> Candidate {
        Candidate {
            index: id,
            key: id as u64 * 7919,
            matched,
            predicted: 0,
            in_flight: 0,
            prefilling: 0,
            tiers: None,
            stale: false,
            bound: 0.0,
            pinned: false,
            pressure: 0.0,
            peer_home: false,
            load: LoadView {
                pending_prefill_tokens: pending,
                decode_blocks: 0,
                inflight,
                queued: 0,
                prefix_inflight: 0,
                recent_blocks: 0.0,
                finished: 0,
            },
        }
    }

    /// `c` with its load view changed by `f`.
    fn with_load(mut c: Candidate, f: impl FnOnce(&mut LoadView)) -> Candidate {
        f(&mut c.load);
        c
    }

    fn ask(blocks: u32) -> Ask {
        Ask {
            prompt_blocks: blocks,
            block_size: 16,
            tie_key: 42,
            seed: 1,
            load_only: false,
            gated: false,
            spread_ties: false,
            pressure_from_returns: false,
        }
    }

    #[test]
    fn cache_wins_until_the_queue_outweighs_it() {
        let cfg = PolicyConfig::default();
        // Pod 0 holds 60 of 64 blocks but has 40 blocks of prefill queued; pod 1 is cold and idle.
        let c = [cand(0, 60, 1, 40 * 16), cand(1, 0, 0, 0)];
        let r = pick(&cfg, &ask(64), &c).expect("pick");
        assert_eq!(r.chosen(), 0, "4 + 40 < 64");
        let c = [cand(0, 60, 1, 70 * 16), cand(1, 0, 0, 0)];
        let r = pick(&cfg, &ask(64), &c).expect("pick");
        assert_eq!(r.chosen(), 1, "4 + 70 > 64");
    }

    /// Saturated, a prompt stays with its cache on a busier pod (moving it would add its
    /// whole prefill to a fleet with none to spare), and the bounded-load guard that
    /// would have pushed it off steps aside; below saturation nothing changes.
    #[test]
    fn a_saturated_fleet_keeps_prompts_on_their_caches() {
        let cfg = PolicyConfig::default();
        let tps = cfg.prefill_tokens_per_s as u64;
        // 200-block prompt; pod 0 holds 196 of it. Backlogs: 0 has 5 s more than 1.
        let at = |b0: u64, b1: u64, inflight0: u32| {
            [
                cand(0, 196, inflight0, (b0 + 5) * tps),
                cand(1, 0, 0, b1 * tps),
            ]
        };
        // Barely loaded (mean backlog 0.8 s): not saturated, the idle pod wins by load.
        let c = [cand(0, 196, 1, 5 * tps / 4), cand(1, 0, 0, 0)];
        assert_eq!(saturation(&cfg, &ask(200), mean_backlog(&c)), 0.0);
        // 400 blocks of queue on pod 0 against 200 blocks of prefill on pod 1.
        let c = [cand(0, 196, 1, 400 * 16), cand(1, 0, 0, 0)];
        assert_eq!(pick(&cfg, &ask(200), &c).expect("pick").chosen(), 1);
        // Both behind (mean 22.5 s): the cached pod, though 5 s more behind.
        let c = at(20, 20, 1);
        assert!(saturation(&cfg, &ask(200), mean_backlog(&c)) > 0.0);
        assert_eq!(pick(&cfg, &ask(200), &c).expect("pick").chosen(), 0);
        // Far over the bounded-load cap too: saturated, the guard does not veto it.
        let c = at(20, 20, 50);
        let r = pick(&cfg, &ask(200), &c).expect("pick");
        assert_eq!(r.chosen(), 0);
        assert!(r.order.iter().all(|o| o.within_balance));
        // Off (0): the old choice.
        let off = PolicyConfig {
            saturation_backlog_s: 0.0,
            ..PolicyConfig::default()
        };
        assert_eq!(saturation(&off, &ask(200), mean_backlog(&c)), 0.0);
        assert_eq!(pick(&off, &ask(200), &c).expect("pick").chosen(), 1);
    }

    /// Engines holding requests behind full batches are behind though little prefill is
    /// queued: with `saturation_waiting_over` set (the default, 0), their waiting lines
    /// count toward the backlog and a prompt keeps its cache; unset, the idle pod wins.
    #[test]
    fn waiting_lines_count_as_backlog() {
        let cfg = PolicyConfig::default();
        assert_eq!(cfg.saturation_waiting_over, Some(0.0));
        let tps = cfg.prefill_tokens_per_s as u64;
        // Pod 0 holds 196 of 200 blocks with 1.5 s of prefill queued; pod 1 none. Each
        // engine reports 6 requests waiting for a batch slot.
        let mut c = [cand(0, 196, 8, 3 * tps / 2), cand(1, 0, 8, 0)];
        for x in &mut c {
            x.load.queued = 6;
        }
        let backlog = mean_backlog(&c);
        let off = PolicyConfig {
            saturation_waiting_over: None,
            ..PolicyConfig::default()
        };
        assert_eq!(
            saturation(
                &off,
                &ask(200),
                backlog + waiting_backlog(&off, &ask(200), &c)
            ),
            0.0
        );
        assert_eq!(pick(&off, &ask(200), &c).expect("pick").chosen(), 1);
        // Six prompts of 200 blocks waiting per pod: saturated.
        assert_eq!(waiting_backlog(&cfg, &ask(200), &c), 6.0 * 200.0 * 16.0);
        assert!(
            saturation(
                &cfg,
                &ask(200),
                backlog + waiting_backlog(&cfg, &ask(200), &c)
            ) > 0.0
        );
        assert_eq!(pick(&cfg, &ask(200), &c).expect("pick").chosen(), 0);
        // Lines no longer than the setting: no backlog from them.
        let over_one = PolicyConfig {
            saturation_waiting_over: Some(1.0),
            ..PolicyConfig::default()
        };
        assert_eq!(
            waiting_backlog(&over_one, &ask(200), &c),
            5.0 * 200.0 * 16.0
        );
        for x in &mut c {
            x.load.queued = 1;
        }
        assert_eq!(waiting_backlog(&over_one, &ask(200), &c), 0.0);
    }

    /// Far behind, the extra weight stops growing at `saturation_max_prompts` prompts of
    /// backlog: a pod whose queue has drifted 100 s past another's gives up a cached
    /// prompt, where an uncapped weight would keep it there whatever the gap.
    #[test]
    fn a_fleet_far_behind_counts_its_backlog_up_to_a_cap() {
        let cfg = PolicyConfig::default();
        let tps = cfg.prefill_tokens_per_s as u64;
        // 200-block prompt (16-token blocks), 196 cached on pod 0; 300 s queued there
        // against 200 s on pod 1.
        let c = [cand(0, 196, 1, 300 * tps), cand(1, 0, 0, 200 * tps)];
        assert_eq!(
            saturation(&cfg, &ask(200), mean_backlog(&c)),
            cfg.saturation_weight * cfg.saturation_max_prompts
        );
        assert_eq!(pick(&cfg, &ask(200), &c).expect("pick").chosen(), 1);
        let uncapped = PolicyConfig {
            saturation_max_prompts: f64::MAX,
            ..PolicyConfig::default()
        };
        assert!(saturation(&uncapped, &ask(200), mean_backlog(&c)) > 1_000.0);
        assert_eq!(pick(&uncapped, &ask(200), &c).expect("pick").chosen(), 0);
        // A gap of 5 s at the same depth: the cache still wins.
        let c = [cand(0, 196, 1, 255 * tps), cand(1, 0, 0, 250 * tps)];
        assert_eq!(pick(&cfg, &ask(200), &c).expect("pick").chosen(), 0);
    }

    #[test]
    fn a_prefix_most_pods_hold_does_not_shun_the_rest() {
        let cfg = PolicyConfig::default();
        // A 60-block system prompt on pods 0-2 (busy), not yet on pod 3 (idle): credited to
        // every pod, so the new conversation goes to the idle pod by load.
        let busy = |id| with_load(cand(id, 60, 3, 0), |l| l.decode_blocks = 400);
        let c = [busy(0), busy(1), busy(2), cand(3, 0, 0, 0)];
        assert_eq!(shared_hits(&cfg, &c), 60.0);
        let r = pick(&cfg, &ask(64), &c).expect("pick");
        assert_eq!(r.chosen(), 3);
        // Held by one pod of four (a conversation's own history): no credit, the holder wins.
        let c = [
            busy(0),
            cand(1, 0, 0, 0),
            cand(2, 0, 0, 0),
            cand(3, 0, 0, 0),
        ];
        assert_eq!(shared_hits(&cfg, &c), 0.0);
        let r = pick(&cfg, &ask(64), &c).expect("pick");
        assert_eq!(r.chosen(), 0);
        // Two or three candidates: too few to call anything common.
        assert_eq!(shared_hits(&cfg, &[busy(0), busy(1)]), 0.0);
        assert_eq!(
            shared_hits(&cfg, &[busy(0), busy(1), cand(2, 0, 0, 0)]),
            0.0
        );
    }

    #[test]
    fn bounded_load_breaks_hot_spots() {
        let cfg = PolicyConfig::default();
        // Everyone shares the prefix; pod 0 holds it and already has far more in flight
        // (16 against a mean of 4.75: above the mean plus the slack of 10).
        let c = [
            cand(0, 64, 16, 0),
            cand(1, 0, 1, 0),
            cand(2, 0, 1, 0),
            cand(3, 0, 1, 0),
        ];
        let r = pick(&cfg, &ask(64), &c).expect("pick");
        assert_eq!(r.order[0].candidate, 0, "pod 0 is cheapest");
        assert!(!r.order[0].within_balance, "but above the pod-wide bound");
        assert_ne!(r.chosen(), 0);
        // Within the pod-wide bound, but this prefix alone has 9 of its 12 requests there.
        let hot = |id, inflight, prefix_inflight| {
            with_load(cand(id, if id == 0 { 64 } else { 0 }, inflight, 0), |l| {
                l.prefix_inflight = prefix_inflight
            })
        };
        let c = [hot(0, 9, 9), hot(1, 6, 1), hot(2, 6, 1), hot(3, 6, 1)];
        let r = pick(&cfg, &ask(64), &c).expect("pick");
        let pod0 = r.order.iter().find(|o| o.candidate == 0).expect("pod 0");
        assert!(
            !pod0.within_balance && r.chosen() != 0,
            "the prefix spreads"
        );
        // The same pod load from other prefixes: the holder keeps the request.
        let c = [hot(0, 9, 1), hot(1, 6, 0), hot(2, 6, 0), hot(3, 6, 0)];
        let r = pick(&cfg, &ask(64), &c).expect("pick");
        assert_eq!(r.chosen(), 0);
    }

    #[test]
    fn a_full_batch_is_avoided_while_another_pod_has_room() {
        let cfg = PolicyConfig::default();
        let waiting =
            |id, matched, queued| with_load(cand(id, matched, 4, 0), |l| l.queued = queued);
        // The holder's engine reports 2 requests waiting for a batch slot: a cold pod with
        // room wins although the holder is far cheaper by cache.
        let c = [waiting(0, 60, 2), waiting(1, 0, 0)];
        let r = pick(&cfg, &ask(64), &c).expect("pick");
        assert_eq!(r.chosen(), 1);
        // Every batch full: the guard steps aside and the cache decides again.
        let c = [waiting(0, 60, 2), waiting(1, 0, 1)];
        let r = pick(&cfg, &ask(64), &c).expect("pick");
        assert_eq!(r.chosen(), 0);
        // Switched off.
        let off = PolicyConfig {
            full_batch_guard: false,
            ..PolicyConfig::default()
        };
        let c = [waiting(0, 60, 2), waiting(1, 0, 0)];
        let r = pick(&off, &ask(64), &c).expect("pick");
        assert_eq!(r.chosen(), 0);
    }

    #[test]
    fn a_hot_prefix_spreads_its_new_conversations() {
        let cfg = PolicyConfig::default();
        // A 60-block system prompt on pods 0 and 1 only; each has 3 of its requests in flight.
        let holder = |id| {
            with_load(cand(id, 60, 3, 0), |l| {
                l.prefix_inflight = 3;
                l.decode_blocks = 190;
            })
        };
        let c = [holder(0), holder(1), cand(2, 0, 0, 0), cand(3, 0, 0, 0)];
        // 6 in flight over 4 pods is above one per pod: hot, credited to all, an idle pod wins.
        let r = pick(&cfg, &ask(64), &c).expect("pick");
        assert!(r.chosen() >= 2, "{r:?}");
        // The same prefix with one request in flight: not hot, the holders keep it.
        let quiet = |id| with_load(holder(id), |l| l.prefix_inflight = u32::from(id == 0));
        let c = [quiet(0), quiet(1), cand(2, 0, 0, 0), cand(3, 0, 0, 0)];
        let r = pick(&cfg, &ask(64), &c).expect("pick");
        assert!(r.chosen() < 2, "{r:?}");
        // Three pods: 3 in flight is one per pod, but one pod may keep up to the prefix
        // slack (4) of them, so the prefix is not hot yet and the holder keeps it.
        let one = with_load(holder(0), |l| l.prefix_inflight = 4);
        let c = [one, cand(1, 0, 0, 0), cand(2, 0, 0, 0)];
        let r = pick(&cfg, &ask(64), &c).expect("pick");
        assert_eq!(r.chosen(), 0, "{r:?}");
        // Switched off.
        let off = PolicyConfig {
            hot_prefix_per_pod: 0.0,
            ..PolicyConfig::default()
        };
        let c = [holder(0), holder(1), cand(2, 0, 0, 0), cand(3, 0, 0, 0)];
        let r = pick(&off, &ask(64), &c).expect("pick");
        assert!(r.chosen() < 2, "{r:?}");
    }

    /// Saturated, a hot prefix is not credited to every pod: its requests stay with the
    /// pods that hold it rather than prefill it on more pods of a fleet that is behind.
    #[test]
    fn a_saturated_fleet_does_not_spread_a_hot_prefix() {
        let cfg = PolicyConfig::default();
        let tps = cfg.prefill_tokens_per_s as u64;
        let holder = |id, backlog_s: u64| {
            with_load(cand(id, 60, 3, backlog_s * tps), |l| {
                l.prefix_inflight = 3;
                l.decode_blocks = 190;
            })
        };
        let idle = |id, backlog_s: u64| cand(id, 0, 0, backlog_s * tps);
        // Every pod 3 s behind (threshold 2 s): saturated, the holders keep it.
        let c = [holder(0, 3), holder(1, 3), idle(2, 3), idle(3, 3)];
        assert!(saturation(&cfg, &ask(64), mean_backlog(&c)) > 0.0);
        let r = pick(&cfg, &ask(64), &c).expect("pick");
        assert!(r.chosen() < 2, "{r:?}");
        // Under the threshold, the same prefix spreads to an idle pod as before.
        let c = [holder(0, 1), holder(1, 1), idle(2, 0), idle(3, 0)];
        assert_eq!(saturation(&cfg, &ask(64), mean_backlog(&c)), 0.0);
        let r = pick(&cfg, &ask(64), &c).expect("pick");
        assert!(r.chosen() >= 2, "{r:?}");
    }

    #[test]
    fn replicas_place_new_prompts_on_their_own_pods_unless_much_busier() {
        let cfg = PolicyConfig {
            peer_home_weight: 0.25,
            peer_home_backlog_s: 0.0,
            ..PolicyConfig::default()
        };
        // Pod 0 looks idlest, but another replica places new prompts there first (and may
        // just have sent one, not yet heard of): ours, pod 1, is 2 blocks behind.
        let theirs = Candidate {
            peer_home: true,
            ..cand(0, 0, 0, 0)
        };
        let ours = cand(1, 0, 0, 2 * 16);
        let r = pick(&cfg, &ask(64), &[theirs.clone(), ours.clone()]).expect("pick");
        assert_eq!(r.chosen(), 1, "64 + 2 < 64 + 0.25 x 64");
        // More than a quarter of the prompt behind: the idle pod after all.
        let ours_busy = cand(1, 0, 0, 20 * 16);
        let r = pick(&cfg, &ask(64), &[theirs.clone(), ours_busy]).expect("pick");
        assert_eq!(r.chosen(), 0, "64 + 20 > 64 + 16");
        // A prompt with a home keeps it, whoever places new prompts there.
        let holder = Candidate {
            matched: 60,
            ..theirs.clone()
        };
        let r = pick(&cfg, &ask(64), &[holder, ours.clone()]).expect("pick");
        assert_eq!(r.chosen(), 0);
        // Off, the idlest pod as before.
        let off = PolicyConfig {
            peer_home_weight: 0.0,
            ..cfg.clone()
        };
        let r = pick(&off, &ask(64), &[theirs.clone(), ours.clone()]).expect("pick");
        assert_eq!(r.chosen(), 0);
        // The default applies it only once the fleet is busy: with these two pods'
        // backlogs (0 and 2 blocks, a few ms) the idlest pod as before; with a second of
        // prefill queued on both, its own pod.
        let default = PolicyConfig::default();
        let r = pick(&default, &ask(64), &[theirs.clone(), ours.clone()]).expect("pick");
        assert_eq!(r.chosen(), 0);
        let second = default.prefill_tokens_per_s as u64;
        let busy = |c: Candidate| with_load(c, |l| l.pending_prefill_tokens += second);
        let r = pick(&default, &ask(64), &[busy(theirs), busy(ours)]).expect("pick");
        assert_eq!(r.chosen(), 1);
    }

    #[test]
    fn a_cold_prefix_gets_the_home_with_least_recent_work() {
        let cfg = PolicyConfig::default();
        let busy_lately = |id, recent| with_load(cand(id, 0, 1, 0), |l| l.recent_blocks = recent);
        // Nobody holds the prompt: the pod that drew the least work lately is its home,
        // whatever the tie hash says.
        let c = [
            busy_lately(0, 900.0),
            busy_lately(1, 300.0),
            busy_lately(2, 600.0),
        ];
        for tie in 0..20 {
            let r = pick(
                &cfg,
                &Ask {
                    tie_key: tie,
                    ..ask(64)
                },
                &c,
            )
            .expect("pick");
            assert_eq!(r.chosen(), 1);
        }
        // A prompt that has a home stays there: recent work is not a cost then.
        let c = [
            Candidate {
                matched: 40,
                ..busy_lately(0, 900.0)
            },
            busy_lately(1, 300.0),
            busy_lately(2, 600.0),
        ];
        let r = pick(&cfg, &ask(64), &c).expect("pick");
        assert_eq!(r.chosen(), 0);
        // The decayed count itself.
        let mut w = RecentWork::default();
        w.add(0.0, 100, 10.0);
        w.add(10.0, 100, 10.0);
        assert!((w.value(10.0, 10.0) - (100.0 / std::f64::consts::E + 100.0)).abs() < 1e-9);
        assert!(
            w.value(5.0, 10.0) <= w.value(10.0, 10.0),
            "no growth backwards"
        );
    }

    #[test]
    fn ties_follow_the_first_block_consistently() {
        let cfg = PolicyConfig::default();
        let c: Vec<_> = (0..8).map(|i| cand(i, 0, 0, 0)).collect();
        let mut picks = std::collections::HashSet::new();
        for tie in 0..200u64 {
            let a = Ask {
                tie_key: tie,
                ..ask(8)
            };
            let r1 = pick(&cfg, &a, &c).expect("pick");
            // Same tie key, candidates in another order: same pod.
            let rev: Vec<_> = c.iter().rev().cloned().collect();
            let r2 = pick(&cfg, &a, &rev).expect("pick");
            assert_eq!(c[r1.chosen()].index, rev[r2.chosen()].index);
            picks.insert(r1.chosen());
        }
        assert_eq!(picks.len(), 8, "cold prefixes spread over all pods");
    }

    #[test]
    fn predicted_stale_and_tiers_discount_hits() {
        let cfg = PolicyConfig::default();
        let mut c = cand(0, 10, 0, 0);
        assert_eq!(hits(&cfg, &c), 10.0);
        c.predicted = 20;
        assert_eq!(hits(&cfg, &c), 10.0 + 10.0 * cfg.predicted_weight);
        c.predicted = 0;
        c.tiers = Some(TierHint {
            gpu: 8,
            cpu: 2,
            disk: 0,
            remote: 0,
        });
        assert!((hits(&cfg, &c) - (10.0 - 2.0 * 0.2)).abs() < 1e-9);
        c.tiers = None;
        c.stale = true;
        assert_eq!(hits(&cfg, &c), 10.0 * cfg.stale_factor);
        assert_eq!(
            cost(
                &cfg,
                &Ask {
                    load_only: true,
                    ..ask(64)
                },
                &c,
                &Fleet {
                    load_weight: cfg.load_weight,
                    ..Fleet::default()
                }
            )
            .cost,
            0.0
        );
    }

    #[test]
    fn temperature_samples_near_the_best() {
        let cfg = PolicyConfig {
            temperature: 2.0,
            ..PolicyConfig::default()
        };
        let c = [cand(0, 60, 0, 0), cand(1, 59, 0, 0), cand(2, 0, 0, 0)];
        let mut seen = [0; 3];
        for seed in 0..300 {
            let r = pick(&cfg, &Ask { seed, ..ask(64) }, &c).expect("pick");
            seen[r.chosen()] += 1;
        }
        assert!(seen[0] > 0 && seen[1] > 0, "{seen:?}");
        assert!(seen[2] < 5, "a far worse pod is rarely sampled: {seen:?}");
    }

    #[test]
    fn filter_checks_adapter_role_breaker() {
        let adapters = vec!["sql".to_string()];
        let p = PodFacts {
            role: Role::Prefill,
            adapters: &adapters,
            breaker_open: false,
        };
        assert!(admissible(&p, "sql", Some(Role::Prefill)));
        assert!(!admissible(&p, "chat", None));
        assert!(!admissible(&p, "", Some(Role::Decode)));
        let both = PodFacts {
            role: Role::Both,
            adapters: &[],
            breaker_open: false,
        };
        assert!(admissible(&both, "any", Some(Role::Decode)));
        assert!(!admissible(
            &PodFacts {
                breaker_open: true,
                ..both
            },
            "",
            None
        ));
    }

    /// With peers routing to the same pods, costs within `near_tie_cost` of the best are
    /// ties the request's own key breaks, so concurrent cold requests that replicas place
    /// before hearing of each other spread; alone, the strict argmin stands.
    #[test]
    fn near_ties_spread_by_tie_key_only_when_replicas_share_the_pods() {
        let cfg = PolicyConfig::default();
        let c: Vec<_> = (0..8)
            .map(|i| with_load(cand(i, 0, 0, 0), |l| l.recent_blocks = i as f64))
            .collect();
        let mut alone = std::collections::HashSet::new();
        let mut shared = std::collections::HashSet::new();
        for tie in 0..64u64 {
            let a = Ask {
                tie_key: tie,
                ..ask(8)
            };
            let r = pick(&cfg, &a, &c).expect("pick");
            alone.insert(r.chosen());
            let r = pick(
                &cfg,
                &Ask {
                    gated: false,
                    spread_ties: true,
                    pressure_from_returns: false,
                    ..a
                },
                &c,
            )
            .expect("pick");
            let chosen = r.chosen();
            // Only pods whose cost is within the margin of the best are candidates.
            assert!(r.order[r.pick].score.cost <= r.order[0].score.cost + cfg.near_tie_cost);
            shared.insert(chosen);
        }
        assert_eq!(alone, std::collections::HashSet::from([0]));
        assert!(shared.len() > 1, "{shared:?}");
    }

    /// A new prompt's second request, sent while the first is still prefilling it on
    /// its home: waiting there costs about what a copy elsewhere costs. Where caches
    /// evict what they are sent (and the weight is on) the prompt stays on one pod.
    #[test]
    fn a_prompt_still_prefilling_is_not_copied_where_caches_evict() {
        let on = PolicyConfig {
            eviction_weight: 2.0,
            ..PolicyConfig::default()
        };
        let chosen = |cfg: &PolicyConfig, pressure: f64| {
            let home = Candidate {
                predicted: 18,
                pressure,
                ..cand(0, 0, 1, 312)
            };
            let idle = |i: usize| Candidate {
                pressure,
                ..cand(i, 0, 0, 0)
            };
            let c = [home, idle(1), idle(2), idle(3)];
            pick(cfg, &ask(20), &c).expect("pick").chosen()
        };
        assert_ne!(
            chosen(&on, 0.0),
            0,
            "no sign of eviction: the copy starts sooner"
        );
        assert_eq!(chosen(&on, 0.4), 0, "a cache that evicts: stay");
        let neither = PolicyConfig {
            eviction_load_cut: 0.0,
            ..PolicyConfig::default()
        };
        assert_ne!(chosen(&neither, 0.4), 0, "the weight is off by default");
        // The default's cut of the queue's weight keeps it home as well.
        assert_eq!(chosen(&PolicyConfig::default(), 0.4), 0);
    }

    #[test]
    fn where_caches_evict_a_session_waits_for_its_home_but_new_prompts_spread() {
        let on = PolicyConfig::default();
        let off = PolicyConfig {
            eviction_load_cut: 0.0,
            ..PolicyConfig::default()
        };
        // The home holds 180 of the prompt's 200 blocks (predicted) behind 250 blocks of
        // queued prefill; three pods are idle and hold none of it.
        let chosen = |cfg: &PolicyConfig, pressure: f64, home_holds: u32| {
            let home = Candidate {
                predicted: home_holds,
                pressure,
                ..cand(0, 0, 1, 250 * 16)
            };
            let idle = |i: usize| Candidate {
                pressure,
                ..cand(i, 0, 0, 0)
            };
            let c = [home, idle(1), idle(2), idle(3)];
            pick(cfg, &ask(200), &c).expect("pick").chosen()
        };
        assert_ne!(chosen(&on, 0.0, 180), 0, "no eviction seen: skip the queue");
        assert_eq!(
            chosen(&on, 0.2, 180),
            0,
            "caches that evict: wait for the home"
        );
        assert_ne!(
            chosen(&off, 0.2, 180),
            0,
            "with the cut off: skip the queue"
        );
        // A prompt no pod holds is placed by load whatever the pressure.
        assert_ne!(
            chosen(&on, 0.9, 0),
            0,
            "a new prompt goes where there is no queue"
        );
        assert_eq!(load_weight(&on, &ask(200), &[], false, 0.0), on.load_weight);
    }

    /// Pressure read off returning turns cuts the queue's weight as reports' pressure
    /// does, except while the fleet is far behind: there the queue, not moves, is what
    /// evicts a waiting turn's prompt.
    #[test]
    fn pressure_from_returning_turns_steps_aside_when_the_fleet_is_far_behind() {
        let cfg = PolicyConfig::default();
        let c = [
            Candidate {
                pressure: 0.2,
                ..cand(0, 0, 0, 0)
            },
            Candidate {
                pressure: 0.2,
                ..cand(1, 0, 0, 0)
            },
        ];
        let reports = ask(200);
        let returns = Ask {
            pressure_from_returns: true,
            ..ask(200)
        };
        let cut = cfg.load_weight / (1.0 + cfg.eviction_load_cut * 0.2);
        for a in [&reports, &returns] {
            assert_eq!(load_weight(&cfg, a, &c, false, 0.0), cut);
            assert_eq!(load_weight(&cfg, a, &c, false, RETURNS_MAX_SATURATION), cut);
        }
        let far = 2.0 * RETURNS_MAX_SATURATION;
        assert_eq!(load_weight(&cfg, &reports, &c, false, far), cut);
        assert_eq!(load_weight(&cfg, &returns, &c, false, far), cfg.load_weight);
    }

    /// A shared system prompt's second user, routed while the first one's prefill (22
    /// blocks: the prompt and its question) is still running on pod 0: waiting costs it
    /// a few blocks more than prefilling its 19 blocks on idle pod 1, but that would be
    /// the prompt prefilled twice. Only work under way counts so: a settled guess is the
    /// usual trade of cache against load.
    #[test]
    fn a_prefix_being_prefilled_is_not_prefilled_twice() {
        let cfg = PolicyConfig::default();
        let first = |inflight: u32| Candidate {
            predicted: 17,
            in_flight: inflight,
            prefilling: inflight,
            ..cand(0, 0, 1, 22 * 16)
        };
        let c = [first(17), cand(1, 0, 0, 0)];
        let r = pick(&cfg, &ask(19), &c).expect("pick");
        assert_eq!(r.chosen(), 0, "2 + 22 against 19 + 17 recomputed");
        assert_eq!(r.order[0].score.hits, 17.0, "work under way counts in full");
        let off = PolicyConfig {
            recompute_weight: 0.0,
            ..cfg.clone()
        };
        let r = pick(&off, &ask(19), &c).expect("pick");
        assert_eq!(r.chosen(), 1, "TTFT alone: 2 + 22 > 19");
        // The same blocks settled (their request is done): 17 × 0.7 guessed hits and the
        // queue is someone else's; the idle pod wins as before.
        let c = [first(0), cand(1, 0, 0, 0)];
        let r = pick(&cfg, &ask(19), &c).expect("pick");
        assert_eq!(r.chosen(), 1);
        assert!((r.order[1].score.hits - 17.0 * cfg.predicted_weight).abs() < 1e-9);
    }
}
