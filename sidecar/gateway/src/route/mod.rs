//! Route requests and completion reports. A route runs named steps, one way:
//! `validate` → `lookup` (confirmed and predicted index) → `candidates` (registry
//! facts and the ledger's load views, under a registry view) → a [`Selector`] (the
//! policy, or a simulator baseline) → `commit` (the ledger issues the decision) →
//! `answer`. A completion report releases its decision by the id the route answer
//! gave, and feeds the circuit breaker and predicted residency.
//!
//! Every step takes `now`, so the simulator drives this same code on a virtual clock
//! ([`route_with`]).

mod error;
pub mod precise;
mod report;

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use kvroute_shared::protocol::{
    LoadDelta, PolicyConfig, Ranked, Role, RouteRequest, RouteResponse,
};
use kvroute_shared::Mode;
use serde_json::json;

use crate::affinity::{self, Bound, Kind};
use crate::index::{ModelIndex, PodMatch};
use crate::ledger::{Placement, IN_FLIGHT_BLOCKS};
use crate::policy::{self, Ask, Candidate, PodFacts, Ranking};
use crate::registry::{Pod, View};
use crate::state::Sidecar;

pub use error::RouteError;
pub use report::{report, report_at};

const MAX_CHAIN: usize = crate::ledger::MAX_DECISION_BLOCKS as usize;
/// Candidates whose tier detail is looked up for scoring (the deepest few).
const TIER_TOP: usize = 2;

/// Picks a pod among the candidates. The service uses [`PolicySelector`]; the
/// simulator's baselines implement it too, so every policy it compares sees the same
/// candidates, loads and ledger.
pub trait Selector {
    fn select(
        &mut self,
        cfg: &PolicyConfig,
        ask: &Ask,
        req: &RouteRequest,
        cands: &[Candidate],
    ) -> Option<Ranking>;
}

/// kvroute's policy ([`policy::pick`]).
pub struct PolicySelector;

impl Selector for PolicySelector {
    fn select(
        &mut self,
        cfg: &PolicyConfig,
        ask: &Ask,
        _req: &RouteRequest,
        cands: &[Candidate],
    ) -> Option<Ranking> {
        policy::pick(cfg, ask, cands)
    }
}

pub fn route(sc: &Sidecar, req: &RouteRequest) -> Result<RouteResponse, RouteError> {
    route_until(sc, req, None)
}

/// [`route`], answered only before `deadline` (the filter's, on the node's clock): a
/// decision that would come later is not committed, since its caller has given up and
/// would never report it — its load would sit on a pod the request never reached.
pub fn route_until(
    sc: &Sidecar,
    req: &RouteRequest,
    deadline: Option<SystemTime>,
) -> Result<RouteResponse, RouteError> {
    route_within(sc, req, deadline, None)
}

/// [`route_until`] choosing only among the pods named in `subset` (the data plane's
/// subset hint, `ip:port` each): none of them eligible is [`RouteError::OutsideSubset`].
pub fn route_within(
    sc: &Sidecar,
    req: &RouteRequest,
    deadline: Option<SystemTime>,
    subset: Option<&[String]>,
) -> Result<RouteResponse, RouteError> {
    let t0 = Instant::now();
    let r = past(deadline).and_then(|()| {
        let tokenized = precise::precise(sc, req);
        let req = tokenized.as_ref().unwrap_or(req);
        let r = route_inner(sc, req, t0, &mut PolicySelector, deadline, subset, None);
        // The decision is recorded as routed: in token mode once the sidecar tokenized.
        if let Ok(resp) = &r {
            if !req.dry_run {
                sc.recent.record(req, resp);
            }
        }
        r
    });
    sc.metrics.route_seconds.observe(t0.elapsed().as_secs_f64());
    if let Err(e) = &r {
        sc.metrics.route_errors.inc(e.reason(), 1);
    }
    r
}

/// `req` as it is routed: a request whose prompt the sidecar tokenizes as its token
/// chain (precise mode), else as it came. The admission queue holds this form, so a
/// request is tokenized once however often it is routed again.
pub fn tokenized(sc: &Sidecar, req: RouteRequest) -> RouteRequest {
    precise::precise(sc, &req).unwrap_or(req)
}

/// [`route_until`] of a request already [`tokenized`], through an admission gate: with
/// no pod within `gate`'s room for it the answer is [`RouteError::Saturated`] and
/// nothing is committed (the caller queues it; `crate::admission::waiting`). A
/// saturated answer is not a route error: admission counts what becomes of it.
pub fn route_gated(
    sc: &Sidecar,
    req: &RouteRequest,
    deadline: Option<SystemTime>,
    gate: &crate::admission::Headroom,
) -> Result<RouteResponse, RouteError> {
    let t0 = Instant::now();
    let r = past(deadline)
        .and_then(|()| route_inner(sc, req, t0, &mut PolicySelector, deadline, None, Some(gate)));
    if let Ok(resp) = &r {
        if !req.dry_run {
            sc.recent.record(req, resp);
        }
    }
    sc.metrics.route_seconds.observe(t0.elapsed().as_secs_f64());
    match &r {
        Err(RouteError::Saturated) | Ok(_) => {}
        Err(e) => sc.metrics.route_errors.inc(e.reason(), 1),
    }
    r
}

/// A candidate and the pod it stands for.
#[derive(Clone, Debug)]
struct PodCandidate {
    candidate: Candidate,
    pod: Arc<str>,
}

/// The pods a route chose: the one that serves the request and, for a disaggregated
/// model, the one that prefills (and so caches) its prompt.
struct Chosen {
    serving: PodCandidate,
    prefill: Option<PodCandidate>,
}

impl Chosen {
    /// The prompt's home: where it is prefilled and cached.
    fn cache(&self) -> &PodCandidate {
        self.prefill.as_ref().unwrap_or(&self.serving)
    }
}

/// A prompt's size in the engine's tokens, as a decision assumes it.
struct PromptTokens {
    prompt: u64,
    per_block: f64,
    /// Relative error of `per_block`.
    rel_err: f64,
    text_bytes: Option<u64>,
}

/// A decision the ledger took: its external id and the deltas for the other replicas.
struct Committed {
    id: String,
    deltas: Vec<LoadDelta>,
}

/// What one route knows once its chain is looked up, shared by its later steps.
struct Route<'a> {
    sc: &'a Sidecar,
    req: &'a RouteRequest,
    cfg: &'a PolicyConfig,
    facts: Facts,
    ask: Ask,
    now: Instant,
    /// The only pods this route may choose (the data plane's subset hint).
    subset: Option<&'a [String]>,
}

/// `Err` once `deadline` has passed.
fn past(deadline: Option<SystemTime>) -> Result<(), RouteError> {
    match deadline {
        Some(d) if SystemTime::now() >= d => Err(RouteError::DeadlinePassed),
        _ => Ok(()),
    }
}

/// The whole route at `now`, picking with `sel`.
pub fn route_with(
    sc: &Sidecar,
    req: &RouteRequest,
    now: Instant,
    sel: &mut dyn Selector,
) -> Result<RouteResponse, RouteError> {
    route_inner(sc, req, now, sel, None, None, None)
}

/// [`route_with`] through an admission gate: when no candidate has the `gate`'s room
/// for the request ([`crate::admission::room`]) nothing is chosen or committed and the
/// answer is [`RouteError::Saturated`], for the caller to hold the request in its
/// queue and route it again (scored as things are then) when room appears.
pub fn route_gated_with(
    sc: &Sidecar,
    req: &RouteRequest,
    now: Instant,
    sel: &mut dyn Selector,
    gate: &crate::admission::Headroom,
) -> Result<RouteResponse, RouteError> {
    route_inner(sc, req, now, sel, None, None, Some(gate))
}

fn route_inner(
    sc: &Sidecar,
    req: &RouteRequest,
    now: Instant,
    sel: &mut dyn Selector,
    deadline: Option<SystemTime>,
    subset: Option<&[String]>,
    gate: Option<&crate::admission::Headroom>,
) -> Result<RouteResponse, RouteError> {
    let cfg = sc.config();
    validate(&cfg, req)?;
    let mut r = Route::new(sc, req, &cfg, lookup(sc, req, now), now);
    r.subset = subset;
    let pods = sc.registry().view();
    let disaggregated = req.role.is_none() && pods.disaggregated(&req.model);
    let main_role = if disaggregated {
        Some(Role::Decode)
    } else {
        req.role
    };
    let mut cands = r.candidates(&pods, main_role);
    if cands.is_empty() {
        return Err(r.none_left(&pods, main_role, gate.is_some()));
    }
    let main_ask = Ask {
        load_only: disaggregated,
        gated: gate.is_some(),
        ..r.ask
    };
    if let Some(h) = gate {
        // Only pods with room compete: one sent past its room would queue the request
        // inside the engine, where no priority applies.
        let all: Vec<Candidate> = cands.iter().map(|c| c.candidate.clone()).collect();
        let room = crate::admission::room(&cfg, h, &main_ask, &all);
        if room.is_empty() {
            return Err(RouteError::Saturated);
        }
        let mut keep = room.into_iter().peekable();
        let mut at = 0;
        cands.retain(|_| {
            let k = keep.next_if_eq(&at).is_some();
            at += 1;
            k
        });
    }
    tier_hints(&r.facts, req, &mut cands);
    let only: Vec<Candidate> = cands.iter().map(|c| c.candidate.clone()).collect();
    let ranking = sel
        .select(&cfg, &main_ask, req, &only)
        .ok_or_else(|| r.no_pod())?;
    let chosen = Chosen {
        serving: cands[ranking.chosen()].clone(),
        // Disaggregated: the prefill pod by cache and prefill load.
        prefill: disaggregated.then(|| r.prefill_pod(&pods)).flatten(),
    };
    // The last moment to give up: after this the decision holds load until reported.
    past(deadline)?;
    let committed = (!req.dry_run).then(|| r.commit(&pods, &chosen));
    drop(pods);
    if let Some(c) = &committed {
        sc.publish(c.deltas.clone());
    }
    Ok(r.answer(&cands, &ranking, &chosen, committed.map(|c| c.id)))
}

fn validate(cfg: &PolicyConfig, req: &RouteRequest) -> Result<(), RouteError> {
    if req.model.is_empty() {
        return Err(RouteError::EmptyModel);
    }
    if req.chain.len() > MAX_CHAIN {
        return Err(RouteError::ChainTooLong(req.chain.len()));
    }
    let want = cfg.block_size(&req.model, req.mode);
    if req.block_size != want {
        return Err(RouteError::BlockSizeMismatch {
            given: req.block_size,
            want,
            mode: req.mode,
            model: req.model.clone(),
        });
    }
    Ok(())
}

/// Tokens at the end of a session's prompt that its next turn may not repeat: the
/// generation prompt the chat template appended, a partial message the client rewrites,
/// a block of text whose tokens merge with what follows.
const TIP_SLACK_TOKENS: u32 = 256;

/// A conversation without a session id is keyed by its prompt at a place on a grid of
/// [`TIP_SLACK_TOKENS`] (`affinity::tip_key`), so its next turn probes one place in
/// that many tokens of its own chain instead of every block, and at most this many.
const MAX_TIP_PROBES: usize = 1024;

/// Blocks between two places a conversation without a session id may be keyed at.
fn tip_grid(block_size: u32) -> usize {
    (TIP_SLACK_TOKENS / block_size.max(1)).max(1) as usize
}

/// The place and block a conversation without a session id is bound by after this turn:
/// the last grid place at least [`TIP_SLACK_TOKENS`] before the chain's end.
fn grid_tip(chain: &[u64], block_size: u32) -> Option<(u32, u64)> {
    let (n, _) = tip(chain, block_size)?;
    let g = tip_grid(block_size);
    let n = n as usize / g * g;
    Some((u32::try_from(n).ok()?, *chain.get(n.checked_sub(1)?)?))
}

/// The keys a turn without a session id may continue, deepest first: its chain's grid
/// places.
fn tip_probes<'c>(
    model: &str,
    chain: &'c [u64],
    block_size: u32,
) -> impl Iterator<Item = u64> + 'c {
    let (g, m) = (tip_grid(block_size), affinity::model_key(model));
    (1..=chain.len() / g)
        .rev()
        .take(MAX_TIP_PROBES)
        .map(move |k| affinity::tip_key(m, chain[k * g - 1]))
}

/// The block of a token chain a session's next turn is checked against (`Bound::tip`):
/// its place (blocks up to and including it) and hash, [`TIP_SLACK_TOKENS`] before the
/// chain's end. `None` for a chain shorter than that.
fn tip(chain: &[u64], block_size: u32) -> Option<(u32, u64)> {
    let slack = TIP_SLACK_TOKENS.div_ceil(block_size.max(1)) as usize;
    let n = chain.len().checked_sub(slack)?;
    let last = *chain.get(n.checked_sub(1)?)?;
    Some((u32::try_from(n).ok()?, last))
}

/// What the indexes say about a request's chain, and the keys derived from it.
pub struct Facts {
    pub index: Option<Arc<ModelIndex>>,
    pub confirmed: Vec<PodMatch>,
    pub predicted: Vec<PodMatch>,
    /// The prefix the request is routed by: the last block of the deepest one held.
    pub prefix_key: Option<u64>,
    pub tie_key: u64,
    pub prompt_blocks: u32,
    /// The request's session and the response it continues, as binding keys, with
    /// what they are bound to now.
    pub session: Option<(u64, Option<Bound>)>,
    pub response: Option<Bound>,
    /// A token request that names no session: the conversation its chain continues, by
    /// the key it is bound under (`Kind::Prompt`), if this sidecar routed its last turn.
    pub prompt: Option<(u64, Bound)>,
}

fn lookup(sc: &Sidecar, req: &RouteRequest, now: Instant) -> Facts {
    let index = sc.indexes.get(&req.model);
    let confirmed = index
        .as_ref()
        .map(|ix| ix.lookup(&req.chain))
        .unwrap_or_default();
    let predicted = sc
        .predicted
        .indexes
        .get(&req.model)
        .map(|ix| ix.lookup(&req.chain))
        .unwrap_or_default();
    // A text prompt's `prompt_tokens` is the filter's count at four bytes a token, so
    // this is its length in blocks either way.
    let bs = req.block_size.max(1);
    let approx_tokens_per_block = if req.mode == Mode::Tokens {
        bs
    } else {
        (bs / 4).max(1)
    };
    let prompt_blocks =
        (req.chain.len() as u32).max(req.prompt_tokens.div_ceil(approx_tokens_per_block));
    let deepest = confirmed
        .iter()
        .chain(&predicted)
        .map(|m| m.depth)
        .max()
        .unwrap_or(0);
    let tie_key = match (
        policy::tie_key(&req.chain, deepest as usize),
        &req.session,
        &req.request_id,
    ) {
        (Some(h), _, _) => h,
        (None, Some(s), _) => xxhash_rust::xxh3::xxh3_64(s.as_bytes()),
        (None, None, Some(r)) => xxhash_rust::xxh3::xxh3_64(r.as_bytes()),
        _ => 0,
    };
    let prefix_key = (deepest as usize)
        .checked_sub(1)
        .and_then(|d| req.chain.get(d))
        .copied();
    let cfg = sc.config();
    let ttl = std::time::Duration::from_secs(cfg.binding_ttl_s);
    let session = req.session.as_deref().map(|s| {
        let k = affinity::key(&req.model, s);
        (k, sc.bindings.get(Kind::Session, k, now, ttl))
    });
    // A continued response not bound (yet: its report may still be on its way) is most
    // likely where its session's last turn went, with that turn's whole conversation.
    let response = req.previous_response.as_deref().and_then(|r| {
        sc.bindings
            .get(Kind::Response, affinity::key(&req.model, r), now, ttl)
            .or_else(|| session.as_ref().and_then(|(_, b)| b.clone()))
    });
    let prompt = if session.is_none() && req.mode == Mode::Tokens {
        let probes = tip_probes(&req.model, &req.chain, req.block_size);
        sc.bindings.find(Kind::Prompt, probes, now, ttl)
    } else {
        None
    };
    Facts {
        index,
        confirmed,
        predicted,
        prefix_key,
        tie_key,
        prompt_blocks,
        session,
        response,
        prompt,
    }
}

impl<'a> Route<'a> {
    fn new(
        sc: &'a Sidecar,
        req: &'a RouteRequest,
        cfg: &'a PolicyConfig,
        facts: Facts,
        now: Instant,
    ) -> Route<'a> {
        // The pods' pending prefill is in engine tokens, and a text block is bytes: the
        // policy compares them in the request's blocks, so a text block counts as the
        // tokens it stands for (left in bytes, text load weighed a quarter of token load
        // or less, and a shared system prompt's predicted home drew every conversation).
        let block_tokens = match req.mode {
            Mode::Tokens => req.block_size.max(1),
            Mode::Text => {
                let e = sc.text_tokens.estimate(&req.model, None, facts.prefix_key);
                (req.block_size as f64 * e.tokens_per_byte).round().max(1.0) as u32
            }
        };
        // A continued response's history is on its pod only: every pod's prompt is that
        // long, and only the bound pod holds it.
        let history = facts
            .response
            .as_ref()
            .map_or(0, |b| (b.tokens / block_tokens.max(1) as u64) as u32);
        let ask = Ask {
            prompt_blocks: facts.prompt_blocks.saturating_add(history),
            block_size: block_tokens,
            tie_key: facts.tie_key,
            seed: facts.tie_key ^ (crate::ledger::clock(now) * 1e9) as u64,
            load_only: false,
            gated: false,
            spread_ties: sc.ledger().has_peers(now),
            pressure_from_returns: req.mode == Mode::Tokens,
        };
        Route {
            sc,
            req,
            cfg,
            facts,
            ask,
            now,
            subset: None,
        }
    }

    /// Blocks a binding credits to `pod`: a continued response's whole history, a
    /// session's last prompt at `session_weight` (never more than this prompt) when the
    /// indexes hold none of this one, unless the pod `keeps` what returning turns come
    /// back for.
    ///
    /// `keeps`: token chains, the pod's events followed without a gap, and no eviction
    /// pressure past its floor ([`crate::returns`]). Such a pod holding none of the
    /// session's prompt lost it to the session's own absence: the prompt is gone from
    /// every cache, and the session chooses a home again by load as a new one does, which
    /// keeps homes balanced as sessions end (the agentic sessions on 2–16 pods, seeds
    /// 1–16: max/mean 1.62 → 1.50 on 8 × 4,096 and 2.05 → 1.81 on 16 × 2,048, docs/policy.md).
    /// Where a pod evicts returning prompts the loss says nothing of the session, and
    /// where the index cannot tell (text chains, a pod not followed yet or with a gap, a
    /// restarted sidecar) the binding is what there is: both keep the session home.
    fn bound_blocks(&self, pod: &str, keeps: bool) -> f64 {
        let bt = self.ask.block_size.max(1) as f64;
        let mut b: f64 = 0.0;
        if let Some(r) = self.facts.response.as_ref().filter(|r| &*r.pod == pod) {
            b = b.max((r.tokens as f64 / bt).floor());
        }
        // Only where the indexes know nothing of the prompt (a cold or restarted index,
        // a prompt whose front changed): what they do know is fact, a binding a guess.
        // A conversation followed by its prompt (`Facts::prompt`, no session id) is not
        // credited: on the Mooncake trace the credit kept prompts on pods that had
        // evicted them at 10% of mean TTFT and 35% of p99 (docs/policy.md); it only
        // tells `returns` what its pod evicted.
        let blind = self.facts.confirmed.is_empty() && self.facts.predicted.is_empty();
        if let (true, Some((_, Some(s)))) = (blind, self.facts.session.as_ref()) {
            if &*s.pod == pod {
                let blocks = (s.tokens as f64 / bt)
                    .floor()
                    .min(self.ask.prompt_blocks as f64);
                if !keeps {
                    b = b.max(self.cfg.session_weight * blocks);
                }
            }
        }
        b
    }

    fn no_pod(&self) -> RouteError {
        RouteError::NoPod {
            model: self.req.model.clone(),
            adapter: self.req.adapter.clone(),
        }
    }

    /// The pods that pass the Filter stage, with their cache facts and load, in pod-id
    /// order (so every selector, and every replica, sees them in the same order).
    /// `p` passes the Filter stage; `breakers` false looks past an open breaker.
    fn eligible(&self, p: &Pod, want: Option<Role>, breakers: bool) -> bool {
        let f = PodFacts {
            role: p.reg.role,
            adapters: &p.reg.adapters,
            breaker_open: breakers && p.breaker_open(self.now),
        };
        policy::admissible(&f, &self.req.adapter, want)
            && self.subset.is_none_or(|s| s.iter().any(|x| **x == *p.id))
            // Alive in the index (a pod in phase 1 of removal is already out).
            && self
                .facts
                .index
                .as_ref()
                .is_none_or(|ix| ix.handle(&p.id).is_some())
    }

    /// Why no candidate was left. A model whose pods are all out only because their
    /// breakers are open (the engines answered 5xx) has no ready pod: with admission on,
    /// the client is told `503` and when the first breaker closes, rather than being
    /// sent on to an engine that fails. Anything else (no pod known, none alive in the
    /// index: the sidecar may be the one that is blind) stays `no_pod`, which fails open.
    fn none_left(&self, pods: &View<'_>, want: Option<Role>, gated: bool) -> RouteError {
        if self.subset.is_some() {
            return RouteError::OutsideSubset;
        }
        let soonest = pods
            .of_model(&self.req.model)
            .filter(|p| self.eligible(p, want, false))
            .filter_map(|p| p.breaker_left(self.now))
            .min();
        match soonest {
            Some(left) if gated => RouteError::NoReadyPod {
                model: self.req.model.clone(),
                retry_after_s: u32::try_from(left.as_secs_f64().ceil() as u64)
                    .unwrap_or(u32::MAX)
                    .max(1),
            },
            _ => self.no_pod(),
        }
    }

    fn candidates(&self, pods: &View<'_>, want: Option<Role>) -> Vec<PodCandidate> {
        let (req, facts, now) = (self.req, &self.facts, self.now);
        let mut ids: Vec<&Arc<str>> = pods
            .of_model(&req.model)
            .filter(|p| self.eligible(p, want, true))
            .map(|p| &p.id)
            .collect();
        ids.sort_unstable();
        let ids: Vec<Arc<str>> = ids.into_iter().cloned().collect();
        let loads = self
            .sc
            .ledger()
            .views(&ids, facts.prefix_key, now, self.cfg);
        let depth =
            |ms: &[PodMatch], id: &str| ms.iter().find(|m| &*m.pod == id).map_or(0, |m| m.depth);
        let in_flight = if self.ask.load_only {
            Vec::new()
        } else {
            self.sc.ledger().in_flight(&self.req.chain, now)
        };
        // Each chain weighs the eviction it can see: token chains, what their sessions'
        // returning turns found in the index; text chains, the same from the engines'
        // reports, or what their guesses' reports found, whichever is more.
        let returns = self.sc.returns.pressures(&ids);
        let pressures = match req.mode {
            Mode::Text => (self.sc.predicted.pressures(&ids).into_iter())
                .zip(returns)
                .map(|(p, r)| p.max(r))
                .collect(),
            Mode::Tokens => returns,
        };
        // With other replicas routing here, every `count`-th pod from this one's rank is its
        // own for new prompts (ranks and pod order agree across replicas).
        let slot = (self.cfg.peer_home_weight > 0.0)
            .then(|| self.sc.ledger().home_slot(now))
            .flatten();
        ids.into_iter()
            .zip(loads.into_iter().zip(pressures))
            .enumerate()
            .filter_map(|(i, (id, (load, pressure)))| {
                let p = pods.get(&id)?;
                let f = in_flight.iter().find(|f| f.pod == id);
                let candidate = Candidate {
                    index: i,
                    key: p.key,
                    matched: depth(&facts.confirmed, &id),
                    predicted: depth(&facts.predicted, &id),
                    in_flight: f.map_or(0, |f| f.held),
                    prefilling: f.map_or(0, |f| f.prefilling),
                    tiers: None,
                    stale: p.stale,
                    load: p.load_view(load, now),
                    bound: self.bound_blocks(
                        &id,
                        req.mode == Mode::Tokens && p.events_seen && !p.stale && pressure == 0.0,
                    ),
                    pinned: facts.response.as_ref().is_some_and(|r| r.pod == id),
                    pressure,
                    peer_home: slot.is_some_and(|(rank, count)| i % count != rank),
                };
                Some(PodCandidate { candidate, pod: id })
            })
            .collect()
    }

    /// A disaggregated model's prefill pod, by cache and prefill load (kvroute's policy,
    /// whatever selected the serving pod).
    fn prefill_pod(&self, pods: &View<'_>) -> Option<PodCandidate> {
        let pc = self.candidates(pods, Some(Role::Prefill));
        let only: Vec<Candidate> = pc.iter().map(|c| c.candidate.clone()).collect();
        policy::pick(self.cfg, &self.ask, &only).map(|r| pc[r.chosen()].clone())
    }

    /// Record the decision in the ledger (under the registry view, so a pod removed
    /// meanwhile cannot get load or predicted blocks after its removal) and guess the
    /// residency it creates where engines send no events.
    fn commit(&self, pods: &View<'_>, chosen: &Chosen) -> Committed {
        let (sc, req, facts) = (self.sc, self.req, &self.facts);
        let (serving, cache) = (&chosen.serving, chosen.cache());
        let hit_blocks = cache.candidate.matched.max(cache.candidate.predicted) as u64;
        let tokens = self.tokens_at(&cache.pod);
        let expected_cached = ((hit_blocks as f64 * tokens.per_block) as u64).min(tokens.prompt);
        let predicted =
            req.mode == Mode::Text || pods.get(&cache.pod).is_some_and(|p| !p.events_seen);
        let settled_blocks = if predicted {
            let guessed = cache.candidate.predicted as usize;
            (sc.predicted.settled_depth(&cache.pod, &req.chain, guessed) as u64)
                .max(cache.candidate.matched as u64)
        } else {
            hit_blocks
        };
        let settled_cached =
            ((settled_blocks as f64 * tokens.per_block) as u64).min(expected_cached);
        sc.metrics.decisions.inc(&serving.pod, 1);
        sc.metrics
            .matched_blocks
            .observe(serving.candidate.matched.max(cache.candidate.matched) as f64);
        // A turn continuing its session's (or, naming none, its prompt's) last prompt
        // tells what the pod that prompt was sent to has evicted of it since (a prompt
        // that starts afresh — a sub-agent under the same session id, a compacted
        // history — tells nothing): token chains now, from the index; text chains sent
        // back to that pod from the engine's report (`Placement::returning`).
        let continued = match &facts.session {
            Some((_, bound)) => bound.as_ref(),
            None => facts.prompt.as_ref().map(|(_, b)| b),
        }
        .and_then(|b| Some((b, b.tip?)))
        .filter(|(_, (n, last))| req.chain.get((*n as usize).wrapping_sub(1)) == Some(last));
        let returning = continued
            .filter(|(b, _)| req.mode == Mode::Text && b.pod == cache.pod)
            .map(|(_, (n, _))| u64::from(n));
        let (id, deltas) = sc.ledger().commit(
            Placement {
                model: req.model.clone(),
                pod: serving.pod.clone(),
                prefill_pod: chosen
                    .prefill
                    .as_ref()
                    .map(|p| p.pod.clone())
                    .filter(|p| *p != serving.pod),
                prefill_tokens: tokens.prompt.saturating_sub(expected_cached),
                blocks: facts.prompt_blocks as u64,
                prefix: facts.prefix_key,
                expected_cached,
                slack_tokens: (tokens.per_block * (1.0 + hit_blocks as f64 * tokens.rel_err)).ceil()
                    as u64,
                settled_cached,
                predicted,
                chain_blocks: req.chain.len() as u64,
                text_bytes: tokens.text_bytes,
                last_block: req.chain.last().copied(),
                returning,
                chain: Arc::from(&req.chain[..req.chain.len().min(IN_FLIGHT_BLOCKS)]),
            },
            self.now,
            self.cfg,
        );
        // A pod whose events the index does not have (none yet, or a gap in them) tells
        // nothing.
        if let Some((Bound { pod, .. }, (n, _))) = continued {
            let known = req.mode == Mode::Tokens
                && pods.get(pod).is_some_and(|p| p.events_seen && !p.stale);
            if known {
                let held = facts
                    .confirmed
                    .iter()
                    .find(|m| m.pod == *pod)
                    .map_or(0, |m| m.depth.min(n));
                sc.returns.observe(pod, n as u64, held as u64);
            }
        }
        // The session is where this turn went now, with this turn's whole prompt (a
        // continued response's history included).
        let mut deltas = deltas;
        let history = facts.response.as_ref().map_or(0, |r| r.tokens);
        let tip_now = (facts.session.is_none() && req.mode == Mode::Tokens)
            .then(|| grid_tip(&req.chain, req.block_size))
            .flatten();
        if let Some((n, last)) = tip_now {
            // A conversation without a session id moves its key to this turn's tip.
            let next = affinity::tip_key(affinity::model_key(&req.model), last);
            let was = facts.prompt.as_ref().filter(|(k, _)| *k != next);
            if let Some((key, _)) = was {
                sc.bindings.unbind(Kind::Prompt, *key);
            }
            let bound = Bound {
                pod: serving.pod.clone(),
                tokens: tokens.prompt + history,
                tip: Some((n, last)),
            };
            // The other replicas follow the conversation too.
            if let Some(d) = deltas.first_mut() {
                d.tip = Some([u64::from(n), last]);
                d.tip_was = was.and_then(|(_, b)| b.tip).map(|(_, h)| h);
                d.bound_tokens = bound.tokens;
            }
            let max = self.cfg.max_bindings as usize;
            sc.bindings.bind(Kind::Prompt, next, bound, self.now, max);
        } else if let Some((key, was)) = &facts.session {
            let key = *key;
            let outcome = match was {
                None => "new",
                Some(b) if b.pod == serving.pod => "stayed",
                Some(_) => "moved",
            };
            sc.metrics.session_turns.inc(outcome, 1);
            let bound = Bound {
                pod: serving.pod.clone(),
                tokens: tokens.prompt + history,
                tip: tip(&req.chain, req.block_size),
            };
            if let Some(d) = deltas.first_mut() {
                d.session = Some(key);
                d.bound_tokens = bound.tokens;
                d.tip = bound.tip.map(|(n, h)| [u64::from(n), h]);
            }
            sc.bindings.bind(
                Kind::Session,
                key,
                bound,
                self.now,
                self.cfg.max_bindings as usize,
            );
        }
        if predicted {
            sc.predicted.insert(
                &req.model,
                &cache.pod,
                &req.chain,
                self.cfg.predicted_capacity_blocks,
                id,
                self.now,
            );
        }
        Committed {
            id: sc.ledger().external_id(id),
            deltas,
        }
    }

    /// The prompt in the engine's tokens as the router believes them at `pod`: exact for
    /// token chains; for text chains, the canonical bytes (the filter counts them at four
    /// a token) times the tokens per byte learned from the engines' reports.
    fn tokens_at(&self, pod: &str) -> PromptTokens {
        let req = self.req;
        let bs = req.block_size.max(1) as f64;
        match req.mode {
            Mode::Tokens => PromptTokens {
                prompt: req.prompt_tokens as u64,
                per_block: bs,
                rel_err: 0.0,
                text_bytes: None,
            },
            Mode::Text => {
                // The conversation's own last ratio when its previous turn is the prefix.
                let prefix = self.facts.prefix_key;
                let e = self.sc.text_tokens.estimate(&req.model, Some(pod), prefix);
                let bytes = req.prompt_tokens as u64 * 4;
                PromptTokens {
                    prompt: (bytes as f64 * e.tokens_per_byte).round() as u64,
                    per_block: bs * e.tokens_per_byte,
                    rel_err: e.rel_err,
                    text_bytes: Some(bytes),
                }
            }
        }
    }

    fn answer(
        &self,
        cands: &[PodCandidate],
        ranking: &Ranking,
        chosen: &Chosen,
        decision: Option<String>,
    ) -> RouteResponse {
        let (req, facts, cfg) = (self.req, &self.facts, self.cfg);
        let ranked = ranking
            .order
            .iter()
            .map(|o| Ranked {
                pod: cands[o.candidate].pod.to_string(),
                matched_blocks: cands[o.candidate].candidate.matched,
                score: Some(round3(o.score.cost)),
            })
            .collect();
        let serving = &chosen.serving;
        let tier_hint = serving.candidate.tiers.or_else(|| {
            let ix = facts.index.as_ref()?;
            let m = facts.confirmed.iter().find(|m| m.pod == serving.pod)?;
            Some(ix.tier_hint(m.slot, &req.chain, m.depth))
        });
        let explain =
            (cfg.explain || (req.dry_run && req.explain)).then(|| explain(cands, ranking));
        RouteResponse {
            pod: serving.pod.to_string(),
            decision,
            ranked,
            tier_hint,
            prefill_pod: chosen.prefill.as_ref().map(|p| p.pod.to_string()),
            policy_version: cfg.version,
            explain,
        }
    }
}

/// Tier detail for the deepest few candidates only (it is kept off the lookup path).
fn tier_hints(facts: &Facts, req: &RouteRequest, cands: &mut [PodCandidate]) {
    let Some(ix) = &facts.index else { return };
    let mut by_depth: Vec<usize> = (0..cands.len())
        .filter(|&i| cands[i].candidate.matched > 0)
        .collect();
    by_depth.sort_by_key(|&i| std::cmp::Reverse(cands[i].candidate.matched));
    for &i in by_depth.iter().take(TIER_TOP) {
        if let Some(m) = facts.confirmed.iter().find(|m| m.pod == cands[i].pod) {
            cands[i].candidate.tiers = Some(ix.tier_hint(m.slot, &req.chain, m.depth));
        }
    }
}

/// Every candidate's cost, term by term (the answer's `explain`).
fn explain(cands: &[PodCandidate], ranking: &Ranking) -> serde_json::Value {
    json!(ranking
        .order
        .iter()
        .map(|o| {
            let (c, s) = (&cands[o.candidate].candidate, &o.score);
            json!({
                "pod": &*cands[o.candidate].pod, "matched": c.matched, "predicted": c.predicted,
                "in_flight": c.in_flight, "prefilling": c.prefilling, "stale": c.stale, "hits": round3(s.hits), "uncached": round3(s.uncached),
                "queued_prefill_blocks": round3(s.queued_prefill), "decode_blocks": s.decode,
                "inflight": c.load.inflight, "recent_blocks": round3(c.load.recent_blocks),
                "within_balance": o.within_balance, "cost": round3(s.cost),
            })
        })
        .collect::<Vec<_>>())
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_shared::protocol::{CompletionReport, LoadOp, PodRegistration, PolicyConfig};

    /// A sidecar with the default policy and four registered pods of model "m"; the
    /// second value keeps its channels open.
    fn four_pods() -> (std::sync::Arc<Sidecar>, crate::state::Channels) {
        let (sc, ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
        for p in 0..4 {
            let reg: PodRegistration =
                serde_json::from_value(serde_json::json!({"model": "m"})).expect("reg");
            sc.register(&format!("10.0.0.{p}:8000"), reg)
                .expect("register");
        }
        (sc, ch)
    }

    /// Another replica's add on 10.0.0.2 binding nothing; tests set what it binds.
    fn peer_add(id: &str) -> LoadDelta {
        LoadDelta {
            blocks: 4,
            ..LoadDelta::new("peer", id, "10.0.0.2:8000", "m", LoadOp::Add)
        }
    }

    /// A completion report for a route answer.
    fn done_with(sc: &Sidecar, answer: &RouteResponse, status: u16) {
        report(
            sc,
            &CompletionReport {
                decision: answer.decision.clone().unwrap_or_default(),
                pod: answer.pod.clone(),
                status,
                ..Default::default()
            },
        );
    }

    fn done(sc: &Sidecar, answer: &RouteResponse) {
        done_with(sc, answer, 200)
    }

    fn tokens_req(chain: Vec<u64>, request_id: &str) -> RouteRequest {
        RouteRequest {
            request_id: Some(request_id.into()),
            ..RouteRequest::tokens("m", 16, chain)
        }
    }

    /// Three turns of one conversation (under `session`, or none) on a pod whose events
    /// the index follows: the second finds all of the first's prompt there; the pod then
    /// evicts all but its first 16 blocks, and the third, continuing the second (checked
    /// 256 tokens, 16 blocks, before its end: 64 blocks), finds 16 of 64. The pod's
    /// pressure is that one observation's. Returns the first turn's answer.
    fn returning_turns_after_an_eviction(sc: &Sidecar, session: Option<&str>) -> RouteResponse {
        use crate::ingest::{ingest, Recovery};
        use kvroute_shared::protocol::{Event, EventBatch, Tier};
        let locks = Recovery::default();
        let turn = |chain: Vec<u64>| RouteRequest {
            session: session.map(str::to_owned),
            ..tokens_req(chain, "r")
        };
        let first: Vec<u64> = (1000..1064).collect();
        let a = route(sc, &turn(first.clone())).expect("first");
        done(sc, &a);
        let mut seq = 0;
        let mut events = |events: Vec<Event>| {
            let b = EventBatch::new(&a.pod, "m", "e", seq, events);
            seq += 1;
            ingest(sc, &locks, &b).expect("ingest");
        };
        events(vec![Event::Stored {
            tier: Tier::Gpu,
            parent: None,
            blocks: first,
            tokens: None,
        }]);
        let b = route(sc, &turn((1000..1080).collect())).expect("second");
        done(sc, &b);
        assert_eq!(b.pod, a.pod);
        assert_eq!(sc.returns.pressure_of(&a.pod), Some(0.0));
        events(vec![
            Event::Stored {
                tier: Tier::Gpu,
                parent: Some(1063),
                blocks: (1064..1080).collect(),
                tokens: None,
            },
            Event::Removed {
                tier: Tier::Gpu,
                blocks: (1016..1080).collect(),
            },
        ]);
        let c = route(sc, &turn((1000..1090).collect())).expect("third");
        done(sc, &c);
        let p = sc.returns.pressure_of(&a.pod).unwrap_or(0.0);
        assert!((p - 0.1 * 48.0 / 64.0).abs() < 1e-9, "{p}");
        a
    }

    /// A conversation whose client sends no session id is followed by its prompt: each
    /// turn binds the pod it went to under its chain's block at a grid place near the
    /// end (`Kind::Prompt`, one entry per conversation), the next turn finds it by
    /// probing its own chain, and tells `returns` what that pod evicted of it, as a
    /// session's turn does. It is credited nothing where no index holds its prompt.
    #[test]
    fn a_conversation_without_a_session_id_is_followed_by_its_prompt() {
        let (sc, _ch) = four_pods();
        returning_turns_after_an_eviction(&sc, None);
        assert_eq!(
            sc.bindings.len(Kind::Prompt),
            1,
            "one entry per conversation"
        );
        assert_eq!(sc.bindings.len(Kind::Session), 0, "no session table entry");
        // Another conversation is another entry; a prompt that continues none (the
        // first 16 blocks differ) starts its own.
        let d = route(&sc, &tokens_req((7000..7064).collect(), "r")).expect("other");
        done(&sc, &d);
        assert_eq!(sc.bindings.len(Kind::Prompt), 2);
        // No index holds any of its prompt and its pod is seen evicting returning
        // prompts: a session would be credited there, a conversation followed by its
        // prompt is not.
        let home: Arc<str> = Arc::from(d.pod.as_str());
        for _ in 0..30 {
            sc.returns.observe(&home, 100, 0);
        }
        let later = Instant::now() + std::time::Duration::from_secs(1);
        sc.predicted.expire(std::time::Duration::ZERO, later);
        let dry = RouteRequest {
            dry_run: true,
            explain: true,
            ..tokens_req((7000..7080).collect(), "r")
        };
        let r = route(&sc, &dry).expect("dry run");
        let hits = r
            .explain
            .as_ref()
            .and_then(|e| e.as_array())
            .and_then(|e| e.iter().find(|c| c["pod"] == d.pod.as_str()))
            .and_then(|c| c["hits"].as_f64());
        assert_eq!(hits, Some(0.0));
    }

    /// A conversation whose turns reach several replicas is followed by each of them: a
    /// turn's add carries its prompt's tip (and, without a session, the tip it moved
    /// from, which receivers forget), so the replica routing the next turn knows the pod
    /// and tells `returns` what that pod evicted, as the one that routed the last turn
    /// would have. Without the tip a replica's pressure stayed at nothing, and a session
    /// kept home by its credit elsewhere lapsed there.
    #[test]
    fn another_replica_follows_a_conversation_and_sees_what_its_pod_evicted() {
        use crate::ingest::{ingest, Recovery};
        use kvroute_shared::protocol::{Event, EventBatch, Tier};
        for session in [None, Some("s")] {
            let (a, mut ach) = four_pods();
            let (b, _bch) = four_pods();
            a.enable_replica_sync(true);
            let mut relay = || {
                while let Ok(d) = ach.outbox.try_recv() {
                    b.apply_remote(&d);
                }
            };
            let turn = |chain: Vec<u64>| RouteRequest {
                session: session.map(str::to_owned),
                ..tokens_req(chain, "r")
            };
            let first = route(&a, &turn((1000..1064).collect())).expect("first");
            done(&a, &first);
            relay();
            let second = route(&a, &turn((1000..1080).collect())).expect("second");
            done(&a, &second);
            relay();
            let (kind, other) = match session {
                None => (Kind::Prompt, Kind::Session),
                Some(_) => (Kind::Session, Kind::Prompt),
            };
            assert_eq!(
                b.bindings.len(kind),
                1,
                "{session:?}: one entry, moved along"
            );
            assert_eq!(b.bindings.len(other), 0, "{session:?}");
            // The other replica follows the pod's events: all of the second prompt but
            // its first 16 blocks is evicted by the time the third turn comes to it.
            let pod: Arc<str> = Arc::from(second.pod.as_str());
            let batch = |seq, events| EventBatch::new(&second.pod, "m", "e", seq, events);
            let locks = Recovery::default();
            let stored = Event::Stored {
                tier: Tier::Gpu,
                parent: None,
                blocks: (1000..1080).collect(),
                tokens: None,
            };
            let removed = Event::Removed {
                tier: Tier::Gpu,
                blocks: (1016..1080).collect(),
            };
            ingest(&b, &locks, &batch(0, vec![stored])).expect("stored");
            ingest(&b, &locks, &batch(1, vec![removed])).expect("removed");
            let third = turn((1000..1090).collect());
            let facts = lookup(&b, &third, Instant::now());
            let bound = match session {
                None => facts.prompt.map(|(_, b)| b),
                Some(_) => facts.session.and_then(|(_, b)| b),
            };
            let bound = bound.expect("the other replica's turn is known here");
            assert_eq!(bound.pod, pod, "{session:?}");
            assert_eq!(bound.tip, Some((64, 1063)), "{session:?}");
            let c = route(&b, &third).expect("third");
            done(&b, &c);
            // 16 of the 64 blocks sent there before the tip are held.
            let p = b.returns.pressure_of(&pod).unwrap_or(0.0);
            assert!((p - 0.1 * 48.0 / 64.0).abs() < 1e-9, "{session:?}: {p}");
        }
        // A tip that is no place in a chain binds nothing.
        let (c, _cch) = four_pods();
        for n in [0, u64::from(u32::MAX) + 1, u64::MAX] {
            c.apply_remote(&LoadDelta {
                bound_tokens: 64,
                tip: Some([n, 7]),
                tip_was: Some(8),
                ..peer_add(&format!("peer-{n}"))
            });
        }
        assert_eq!(c.bindings.len(Kind::Prompt), 0);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Whatever another replica sends in a load delta's bindings (sessions, tips and
        /// the tips they moved from, responses, on pods known or not), applying it never
        /// panics, every binding table stays within its bound, and routing goes on.
        #[test]
        fn any_replica_bindings_stay_bounded(
            deltas in proptest::collection::vec(
                (
                    proptest::prelude::any::<bool>(),
                    proptest::option::of(0u64..4),
                    proptest::option::of((proptest::prelude::any::<u64>(), 0u64..8)),
                    proptest::option::of(0u64..8),
                    0u8..6,
                ),
                0..64,
            ),
        ) {
            let cfg = PolicyConfig { max_bindings: 4, ..PolicyConfig::default() };
            let (sc, _ch) = Sidecar::new(cfg).expect("sidecar");
            for p in 0..4 {
                let reg: PodRegistration =
                    serde_json::from_value(serde_json::json!({"model": "m"})).expect("reg");
                sc.register(&format!("10.0.0.{p}:8000"), reg).expect("register");
            }
            for (i, (add, session, tip, was, pod)) in deltas.into_iter().enumerate() {
                sc.apply_remote(&LoadDelta {
                    pod: format!("10.0.0.{pod}:8000"),
                    op: if add { LoadOp::Add } else { LoadOp::Release },
                    session,
                    response: session,
                    bound_tokens: 64,
                    tip: tip.map(|(n, h)| [n, h]),
                    tip_was: was,
                    ..peer_add(&format!("peer-{i}"))
                });
            }
            for kind in Kind::ALL {
                proptest::prop_assert!(sc.bindings.len(kind) <= 4);
            }
            let a = route(&sc, &tokens_req((0..40).collect(), "r")).expect("routes");
            done(&sc, &a);
        }
    }

    /// A session's turn routed by tokens tells how much of its last prompt the pod it
    /// went to still holds: a pod that evicted most of it gains eviction pressure; a
    /// prompt that starts afresh under the same session (a sub-agent) tells nothing.
    #[test]
    fn returning_turns_measure_what_their_pod_evicted() {
        let (sc, _ch) = four_pods();
        let turn = |chain: Vec<u64>| RouteRequest {
            session: Some("s".into()),
            ..tokens_req(chain, "r")
        };
        let a = returning_turns_after_an_eviction(&sc, Some("s"));
        // A sub-agent under the same session id, with a prompt of its own: no change
        // to whichever pod the session is bound to.
        let pressures = || -> Vec<f64> {
            (0..4)
                .map(|i| {
                    sc.returns
                        .pressure_of(&format!("10.0.0.{i}:8000"))
                        .unwrap_or(0.0)
                })
                .collect()
        };
        let before = pressures();
        let d = route(&sc, &turn((5000..5064).collect())).expect("sub-agent");
        done(&sc, &d);
        let e = route(&sc, &turn((1000..1095).collect())).expect("back");
        done(&sc, &e);
        assert_eq!(before, pressures());
        // A session on a pod whose engine has sent no events: its index knows nothing
        // of what the pod holds, so a returning turn there says nothing either.
        let quiet = |chain: Vec<u64>| RouteRequest {
            session: Some("q".into()),
            ..tokens_req(chain, "q")
        };
        let (x, base) = (1..20u64)
            .map(|k| {
                let x = route(&sc, &quiet((k * 7000..k * 7000 + 64).collect())).expect("quiet");
                done(&sc, &x);
                (x, k * 7000)
            })
            .find(|(x, _)| x.pod != a.pod)
            .expect("a first turn on a pod without events");
        let y = route(&sc, &quiet((base..base + 80).collect())).expect("quiet again");
        done(&sc, &y);
        assert_eq!(sc.returns.pressure_of(&x.pod), None);
    }

    /// A session bound to a pod whose events the index follows, which keeps what
    /// returning turns come back for and holds none of this session's prompt: the prompt
    /// aged out while the session was away, the binding credits nothing, and the session
    /// chooses its home again by load. The same pod seen evicting returning prompts keeps
    /// the session's credit (and so do pods whose events the index does not follow:
    /// `bindings_keep_conversations_on_their_pods`).
    #[test]
    fn a_binding_lapses_where_its_pod_keeps_returning_prompts() {
        use crate::ingest::{ingest, Recovery};
        use kvroute_shared::protocol::{Event, EventBatch, Tier};
        let (sc, _ch) = four_pods();
        let locks = Recovery::default();
        let turn = |chain: Vec<u64>, dry_run: bool| RouteRequest {
            session: Some("s".into()),
            dry_run,
            explain: dry_run,
            ..tokens_req(chain, "r")
        };
        let first: Vec<u64> = (1000..1064).collect();
        let a = route(&sc, &turn(first.clone(), false)).expect("first");
        done(&sc, &a);
        let next: Vec<u64> = (1000..1080).collect();
        let hits_on_home = || -> f64 {
            let r = route(&sc, &turn(next.clone(), true)).expect("dry run");
            r.explain
                .as_ref()
                .and_then(|e| e.as_array())
                .and_then(|e| e.iter().find(|c| c["pod"] == a.pod.as_str()))
                .and_then(|c| c["hits"].as_f64())
                .expect("the home pod's breakdown")
        };
        // Its engine stores the prompt, then evicts all of it; no returning turn found
        // its prompt gone there before: the binding lapses.
        for (seq, ev) in [
            Event::Stored {
                tier: Tier::Gpu,
                parent: None,
                blocks: first.clone(),
                tokens: None,
            },
            Event::Removed {
                tier: Tier::Gpu,
                blocks: first.clone(),
            },
        ]
        .into_iter()
        .enumerate()
        {
            let b = EventBatch::new(&a.pod, "m", "e", seq as u64, vec![ev]);
            ingest(&sc, &locks, &b).expect("ingest");
        }
        // ... and the router's own guess that the pod holds it has expired
        // (`predicted_ttl_s`): no index knows anything of the prompt.
        let later = Instant::now() + std::time::Duration::from_secs(1);
        sc.predicted.expire(std::time::Duration::ZERO, later);
        assert_eq!(hits_on_home(), 0.0);
        // The pod is seen evicting returning prompts: the binding holds again.
        let home: Arc<str> = Arc::from(a.pod.as_str());
        for _ in 0..30 {
            sc.returns.observe(&home, 100, 0);
        }
        let credit = PolicyConfig::default().session_weight * 64.0;
        assert_eq!(hits_on_home(), credit);
    }

    /// Sessions and continued responses stay with their pods, weighed as hits: a
    /// session's next turn (whose chain the index knows nothing of) goes where its last
    /// turn went; a Responses turn naming `previous_response_id` goes to the pod that
    /// stored it, and rebinds when that pod is gone; a binding never beats the bounded
    /// load; another replica learns both from the deltas.
    #[test]
    fn bindings_keep_conversations_on_their_pods() {
        let (sc, _ch) = four_pods();
        let turn = |chain: u64, session: Option<&str>, prev: Option<&str>| RouteRequest {
            session: session.map(str::to_owned),
            previous_response: prev.map(str::to_owned),
            ..tokens_req((chain * 1000..chain * 1000 + 64).collect(), "r")
        };
        let mut stayed = 0;
        for s in 0..20u64 {
            let name = format!("session-{s}");
            let first = route(&sc, &turn(2 * s + 1, Some(&name), None)).expect("first");
            done(&sc, &first);
            let next = route(&sc, &turn(2 * s + 2, Some(&name), None)).expect("next");
            done(&sc, &next);
            stayed += usize::from(next.pod == first.pod);
        }
        assert_eq!(stayed, 20, "every second turn on its session's pod");
        // Without sessions the same chains scatter by their own hashes.
        let scattered: std::collections::BTreeSet<String> = (0..20u64)
            .map(|s| {
                let a = route(&sc, &turn(500 + s, None, None)).expect("route");
                done(&sc, &a);
                a.pod
            })
            .collect();
        assert!(scattered.len() > 1);

        // A Responses chain: the report names the response, the next turn continues it.
        let first = route(&sc, &turn(900, None, None)).expect("first");
        report(
            &sc,
            &CompletionReport {
                decision: first.decision.clone().unwrap_or_default(),
                pod: first.pod.clone(),
                status: 200,
                prompt_tokens: Some(64 * 16),
                completion_tokens: Some(100),
                response_id: Some("resp_a".into()),
                ..Default::default()
            },
        );
        for i in 0..8u64 {
            let a = route(&sc, &turn(901 + i, None, Some("resp_a"))).expect("continued");
            assert_eq!(a.pod, first.pod, "turn {i}: where the response is stored");
            done(&sc, &a);
        }
        assert_eq!(sc.bindings.len(Kind::Response), 1);
        // The bounded load still holds: a pod already far over the mean is passed over.
        let held: Vec<RouteResponse> = (0..40u64)
            .map(|i| route(&sc, &turn(950 + i, None, Some("resp_a"))).expect("held"))
            .collect();
        assert!(
            held.iter().any(|a| a.pod != first.pod),
            "the binding does not override the bounded load"
        );
        for a in &held {
            done(&sc, a);
        }
        // The pod goes: the chain rebinds at once, with no error.
        sc.remove_pod(&first.pod, "test");
        let a = route(&sc, &turn(999, None, Some("resp_a"))).expect("rebinds");
        assert_ne!(a.pod, first.pod);
        done(&sc, &a);

        // Another replica hears the session's binding from the decision's delta.
        let (other, _och) = four_pods();
        let d = LoadDelta {
            session: Some(affinity::key("m", "roaming")),
            bound_tokens: 64 * 16,
            ..peer_add("peer-1")
        };
        other.apply_remote(&d);
        let a = route(&other, &turn(7777, Some("roaming"), None)).expect("route");
        assert_eq!(a.pod, "10.0.0.2:8000");
        done(&other, &a);

        // A replica hears its own deltas too (it subscribes to every replica's subject):
        // an echo of an older turn's decision must not rebind the session to that turn's
        // pod, nor drop what the binding knows of the turn's prompt.
        let now = route(&other, &turn(7778, Some("roaming"), None)).expect("next");
        done(&other, &now);
        let key = affinity::key("m", "roaming");
        let ttl = std::time::Duration::from_secs(3600);
        let before = other.bindings.get(Kind::Session, key, Instant::now(), ttl);
        let echo = LoadDelta {
            replica: other.replica().to_string(),
            id: format!("{}-1", other.replica()),
            pod: "10.0.0.3:8000".into(),
            ..d.clone()
        };
        other.apply_remote(&echo);
        assert_eq!(
            other.bindings.get(Kind::Session, key, Instant::now(), ttl),
            before
        );
        assert!(before.is_some_and(|b| b.tip.is_some()));
    }

    /// A route answered after its caller's deadline (a slow first turn, a busy sidecar)
    /// used to be committed anyway: load on a pod the request never went to (the filter
    /// had failed open), held until `load_timeout_s`. Now nothing is committed.
    #[test]
    fn a_decision_past_its_deadline_commits_nothing() {
        let (sc, _ch) = four_pods();
        let req = tokens_req((0..8).collect(), "late");
        let gone = SystemTime::now() - std::time::Duration::from_millis(1);
        let e = route_until(&sc, &req, Some(gone)).expect_err("too late");
        assert_eq!((e.reason(), e.status()), ("deadline", 504));
        assert_eq!(sc.ledger().outstanding(), 0, "no phantom load");
        assert_eq!(sc.metrics.route_errors.get("deadline"), 1);
        // In time: committed as ever.
        let soon = SystemTime::now() + std::time::Duration::from_secs(5);
        let a = route_until(&sc, &req, Some(soon)).expect("in time");
        assert!(a.decision.is_some());
        assert_eq!(sc.ledger().outstanding(), 1);
    }

    #[test]
    fn cold_prompts_find_homes_by_recent_work_after_their_load_is_gone() {
        let (sc, _ch) = four_pods();
        // Each prompt is done (reported) before the next arrives, so in-flight load and
        // queued prefill say nothing; only the work each pod drew lately tells them apart.
        let mut homes = std::collections::HashSet::new();
        for i in 0..4u64 {
            let req = tokens_req(
                (0..8).map(|b| 1000 * (i + 1) + b).collect(),
                &format!("c{i}"),
            );
            let d = route(&sc, &req).expect("route");
            done(&sc, &d);
            homes.insert(d.pod);
        }
        assert_eq!(homes.len(), 4, "{homes:?}");
    }

    #[test]
    fn prefix_load_follows_decisions_and_is_released() {
        let (sc, _ch) = four_pods();
        // Text mode: every decision is also a prediction, so the second request is routed
        // by the first one's prefix.
        let req = |i: u32| RouteRequest {
            model: "m".into(),
            adapter: String::new(),
            mode: Mode::Text,
            block_size: 256,
            chain: (1..=8).chain([100 + i as u64]).collect(),
            prompt_tokens: 9 * 64,
            request_id: Some(format!("r{i}")),
            session: None,
            previous_response: None,
            role: None,
            dry_run: false,
            explain: false,
            prompt_body: None,
            admission: Default::default(),
        };
        let first = route(&sc, &req(0)).expect("route");
        assert_eq!(
            sc.ledger().prefixes_in_flight(),
            0,
            "a cold prompt has no prefix"
        );
        // Done before the others arrive: its pod holds the prefix and no load, so the next
        // request follows it there (text load counts in the tokens a block stands for).
        done(&sc, &first);
        let mut answers = vec![];
        for i in 1..=3 {
            answers.push(route(&sc, &req(i)).expect("route"));
        }
        let held: u32 = sc.ledger().prefix_inflight(8).values().sum();
        assert_eq!(held, 3);
        assert!(sc
            .ledger()
            .prefix_inflight(8)
            .contains_key(first.pod.as_str()));
        for a in &answers {
            done(&sc, a);
        }
        assert_eq!(
            sc.ledger().prefixes_in_flight(),
            0,
            "reports release every count"
        );
        assert_eq!(sc.ledger().outstanding(), 0);
        // Another replica's decisions count too, and go with their release.
        let delta = |op, id: &str| LoadDelta {
            prefill_tokens: 64,
            blocks: 9,
            prefix: Some(8),
            ..LoadDelta::new("other", id, "10.0.0.1:8000", "m", op)
        };
        let n = |sc: &Sidecar| sc.ledger().prefix_inflight(8).get("10.0.0.1:8000").copied();
        sc.apply_remote(&delta(LoadOp::Add, "x1"));
        sc.apply_remote(&delta(LoadOp::Add, "x2"));
        sc.apply_remote(&delta(LoadOp::Add, "x2"));
        assert_eq!(n(&sc), Some(2), "a repeated add changes nothing");
        sc.apply_remote(&delta(LoadOp::Release, "x1"));
        sc.apply_remote(&delta(LoadOp::Release, "x1"));
        assert_eq!(n(&sc), Some(1), "a duplicate release changes nothing");
        sc.apply_remote(&delta(LoadOp::Release, "x2"));
        assert_eq!(sc.ledger().prefixes_in_flight(), 0);
        assert_eq!(sc.ledger().remote_count("10.0.0.1:8000"), 0);
    }

    /// A client's request id never names a ledger entry: twenty concurrent requests
    /// with the same `x-request-id` are twenty decisions, each released by its own
    /// report, and the pods end with nothing in flight.
    #[test]
    fn the_same_request_id_on_concurrent_requests_releases_every_decision() {
        let (sc, _ch) = four_pods();
        let answers: Vec<RouteResponse> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..20u64)
                .map(|i| {
                    let sc = &sc;
                    s.spawn(move || {
                        route(
                            sc,
                            &tokens_req((0..4).map(|b| 7000 + 10 * i + b).collect(), "same"),
                        )
                        .expect("route")
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        let ids: std::collections::HashSet<_> =
            answers.iter().map(|a| a.decision.clone()).collect();
        assert_eq!(ids.len(), 20, "every decision has its own id");
        assert_eq!(sc.ledger().outstanding(), 20);
        for a in &answers {
            done(&sc, a);
            done(&sc, a); // a repeated report releases nothing twice
        }
        assert_eq!(sc.ledger().outstanding(), 0);
        let now = Instant::now();
        let cfg = sc.config();
        for p in 0..4 {
            let v = sc
                .ledger()
                .view(&format!("10.0.0.{p}:8000"), None, now, &cfg);
            assert_eq!((v.inflight, v.decode_blocks), (0, 0), "pod {p}: {v:?}");
        }
        // A report that names no decision, or another replica's, releases nothing.
        let a = route(&sc, &tokens_req(vec![1, 2, 3], "same")).expect("route");
        for decision in ["", "same", "0000000000000000-1"] {
            report(
                &sc,
                &CompletionReport {
                    decision: decision.into(),
                    pod: a.pod.clone(),
                    status: 200,
                    ..Default::default()
                },
            );
        }
        assert_eq!(sc.ledger().outstanding(), 1);
        // The twenty repeated reports and the two that name no decision of ours.
        assert_eq!(sc.metrics.report_decisions.get("unknown"), 22);
        assert_eq!(sc.metrics.report_decisions.get("none"), 1);
    }

    /// A client that gives up before any answer (the filter reports status 0) is not a
    /// pod failure; server errors in a row still open the breaker.
    /// With admission on, a model whose pods all have open breakers answers 503
    /// `no_ready_pod` with when the first closes; without admission, or when the pods
    /// are out for another reason, it stays `no_pod` (the filter fails open on it).
    #[test]
    fn failing_pods_make_no_ready_pod_only_under_admission() {
        let (sc, _ch) = four_pods();
        let cfg = sc.config();
        let gate = crate::admission::Headroom {
            max_backlog_s: 1e9,
            max_waiting: 0,
            max_inflight: 0,
            cache_loss: 1.0,
            reserve_inflight: 0,
        };
        let req = tokens_req(vec![21, 22, 23], "r");
        let gated =
            |sc: &Sidecar| route_gated_with(sc, &req, Instant::now(), &mut PolicySelector, &gate);
        for p in 0..4 {
            let pod = format!("10.0.0.{p}:8000");
            for _ in 0..cfg.breaker_failures {
                let a = gated(&sc).expect("a pod is ready");
                done_with(
                    &sc,
                    &RouteResponse {
                        pod: pod.clone(),
                        ..a
                    },
                    500,
                );
            }
        }
        match gated(&sc) {
            Err(e @ RouteError::NoReadyPod { .. }) => {
                let retry = e.retry_after_s().expect("retry");
                assert!(
                    (1..=cfg.breaker_cooldown_s as u32).contains(&retry),
                    "{retry}"
                );
                assert_eq!((e.status(), e.reason()), (503, "no_ready_pod"));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(route(&sc, &req), Err(RouteError::NoPod { .. })));
        // Another model's pods (none) or an adapter nobody serves are not "failing".
        let other = RouteRequest::tokens("other", 16, vec![1]);
        assert!(matches!(
            route_gated_with(&sc, &other, Instant::now(), &mut PolicySelector, &gate),
            Err(RouteError::NoPod { .. })
        ));
        // The breakers close after their cooldown: ready again.
        let later = Instant::now() + std::time::Duration::from_secs(cfg.breaker_cooldown_s + 1);
        assert!(route_gated_with(&sc, &req, later, &mut PolicySelector, &gate).is_ok());
    }

    #[test]
    fn client_aborts_do_not_open_the_breaker() {
        let (sc, _ch) = four_pods();
        let cfg = sc.config();
        let req = tokens_req(vec![11, 12, 13], "r");
        let pod = route(&sc, &req).expect("route").pod;
        for _ in 0..(cfg.breaker_failures * 3) {
            let a = route(
                &sc,
                &RouteRequest {
                    dry_run: false,
                    explain: false,
                    prompt_body: None,
                    ..req.clone()
                },
            )
            .expect("route");
            done_with(
                &sc,
                &RouteResponse {
                    pod: pod.clone(),
                    ..a
                },
                0,
            );
        }
        let open = |sc: &Sidecar| {
            sc.registry()
                .get(pod.as_str())
                .is_some_and(|p| p.breaker_open(Instant::now()))
        };
        assert!(!open(&sc), "aborts opened the breaker");
        for _ in 0..cfg.breaker_failures {
            let a = route(&sc, &req).expect("route");
            done_with(
                &sc,
                &RouteResponse {
                    pod: pod.clone(),
                    ..a
                },
                502,
            );
        }
        assert!(open(&sc), "server errors must open it");
        assert_eq!(
            sc.ledger().outstanding(),
            1,
            "every reported decision was released"
        );
    }

    /// An engine that holds every text prompt routed to it, tokenizing at
    /// `bytes_per_token`: a report's `cached_tokens` is its longest held prefix, in whole
    /// 16-token blocks, short of the last token (as vLLM recomputes it).
    struct TextEngine {
        bytes_per_token: f64,
        held: std::collections::HashMap<String, Vec<Vec<u64>>>,
    }

    impl TextEngine {
        fn serve(&mut self, sc: &Sidecar, chain: &[u64], bytes: u64, evicted: bool) {
            let req = RouteRequest {
                mode: Mode::Text,
                block_size: 256,
                prompt_tokens: bytes.div_ceil(4) as u32,
                ..tokens_req(chain.to_vec(), "text")
            };
            let a = route(sc, &req).expect("route");
            let held = self.held.entry(a.pod.clone()).or_default();
            if evicted {
                held.clear();
            }
            let hit = held
                .iter()
                .map(|h| kvroute_shared::common_prefix_blocks(h, chain))
                .max()
                .unwrap_or(0);
            held.push(chain.to_vec());
            let prompt = (bytes as f64 / self.bytes_per_token) as u32;
            let hit_tokens = (hit as f64 * 256.0 / self.bytes_per_token) as u32;
            let cached = hit_tokens.min(prompt.saturating_sub(1)) / 16 * 16;
            report(
                sc,
                &CompletionReport {
                    decision: a.decision.clone().unwrap_or_default(),
                    pod: a.pod,
                    status: 200,
                    prompt_tokens: Some(prompt),
                    cached_tokens: Some(cached),
                    ..Default::default()
                },
            );
        }
    }

    /// Text chains have no index to read what a pod evicted, but a session's turn sent
    /// back to its pod has the engine's report: its cached tokens are what the pod kept
    /// of the last prompt sent there, and feed `returns` as a token chain's index does.
    /// A prompt that starts afresh under the same session tells nothing.
    #[test]
    fn a_text_session_back_on_its_pod_tells_from_its_report_what_the_pod_kept() {
        let (sc, _ch) = four_pods();
        let text = |chain: Vec<u64>| RouteRequest {
            mode: Mode::Text,
            block_size: 256,
            prompt_tokens: (chain.len() * 64) as u32,
            session: Some("s".into()),
            ..tokens_req(chain, "text")
        };
        let served = |a: &RouteResponse, prompt: u32, cached: u32| {
            report(
                &sc,
                &CompletionReport {
                    decision: a.decision.clone().unwrap_or_default(),
                    pod: a.pod.clone(),
                    status: 200,
                    prompt_tokens: Some(prompt),
                    cached_tokens: Some(cached),
                    ..Default::default()
                },
            )
        };
        let first = route(&sc, &text((1..=20).collect())).expect("first");
        served(&first, 20 * 64, 0);
        assert_eq!(sc.returns.pressure_of(&first.pod), None, "a first turn");
        let second = route(&sc, &text((1..=40).collect())).expect("second");
        assert_eq!(second.pod, first.pod);
        // Of the first prompt's 19 blocks before its tip (one block, 256 bytes, from its
        // end), the engine kept 5: 320 of 2,560 tokens at 64 a block.
        served(&second, 40 * 64, 320);
        let p = sc.returns.pressure_of(&first.pod).unwrap_or(0.0);
        assert!((p - 0.1 * 14.0 / 19.0).abs() < 1e-9, "{p}");
        // A sub-agent under the same session, with a prompt of its own.
        let fresh = route(&sc, &text((500..540).collect())).expect("fresh");
        served(&fresh, 40 * 64, 0);
        assert_eq!(sc.returns.pressure_of(&first.pod), Some(p));
    }

    /// A prompt's second request, routed onto its guess while the first one is still
    /// being prefilled, may find nothing cached: that is the engine's queue, counted
    /// apart, and cuts no capacity (it still weighs in the pod's eviction pressure: a
    /// copy sent there would not have been served from cache either). Once the first
    /// request is reported the guess is settled, and the same shortfall is an eviction.
    #[test]
    fn shortfalls_on_guesses_still_prefilling_are_not_evictions() {
        let (sc, _ch) = four_pods();
        // Load does not pull the second request away from the prompt's home here.
        let cfg = PolicyConfig {
            load_weight: 0.0,
            ..PolicyConfig::default()
        };
        sc.set_config(cfg, None).expect("config");
        let text = |blocks: u64| RouteRequest {
            mode: Mode::Text,
            block_size: 256,
            prompt_tokens: (blocks * 64) as u32,
            ..tokens_req((1..=blocks).collect(), "text")
        };
        let cold = |a: &RouteResponse| CompletionReport {
            decision: a.decision.clone().unwrap_or_default(),
            pod: a.pod.clone(),
            status: 200,
            cached_tokens: Some(0),
            ..Default::default()
        };
        let first = route(&sc, &text(20)).expect("route");
        let second = route(&sc, &text(22)).expect("route");
        assert_eq!(second.pod, first.pod, "the guess drew the second request");
        let cap = sc.predicted.capacity_of(&first.pod);
        report(&sc, &cold(&second));
        assert_eq!(sc.metrics.predicted_in_flight.get(), 1);
        assert_eq!(sc.metrics.mispredictions.get(), 0);
        assert_eq!(sc.predicted.capacity_of(&first.pod), cap, "no capacity cut");
        let pressure = sc.predicted.pressure_of(&first.pod);
        assert!(pressure > Some(0.0));
        report(&sc, &cold(&first));
        // Both reported: the guesses are settled, and a miss on them is an eviction.
        let third = route(&sc, &text(24)).expect("route");
        assert_eq!(third.pod, first.pod);
        report(&sc, &cold(&third));
        assert_eq!(sc.metrics.mispredictions.get(), 1);
        assert_eq!(sc.metrics.predicted_in_flight.get(), 1);
        assert!(
            sc.predicted.capacity_of(&first.pod) < cap,
            "an eviction cuts"
        );
        assert!(sc.predicted.pressure_of(&first.pod) > pressure);
    }

    /// Text chains are bytes; engines cache tokens. At any bytes-per-token ratio, a
    /// prompt the engine really holds is not a misprediction (at four bytes a token
    /// assumed, every fully cached English prompt was one, and each cut the pod's
    /// predicted capacity by 30%) — and a pod that really evicts is still caught.
    #[test]
    fn text_hits_are_judged_in_the_engines_tokens_and_real_evictions_still_count() {
        for bytes_per_token in [4.7, 3.2, 1.4] {
            let (sc, _ch) = four_pods();
            let mut engine = TextEngine {
                bytes_per_token,
                held: Default::default(),
            };
            // Eight conversations, six turns each, each turn two blocks longer.
            for turn in 0..6u64 {
                for conv in 0..8u64 {
                    let blocks = 20 + 2 * turn;
                    let chain: Vec<u64> = (0..blocks).map(|b| 1000 * (conv + 1) + b).collect();
                    engine.serve(&sc, &chain, blocks * 256 + 100, false);
                }
            }
            assert_eq!(
                sc.metrics.mispredictions.get(),
                0,
                "{bytes_per_token} bytes a token: held prompts counted as mispredicted"
            );
            let e = sc.text_tokens.estimate("m", None, None);
            assert!(
                e.learned && (e.tokens_per_byte * bytes_per_token - 1.0).abs() < 0.05,
                "{e:?}"
            );
            let pod = "10.0.0.0:8000";
            let cap = sc.predicted.capacity_of(pod);
            // The engines lose everything: the next turns are real mispredictions.
            for conv in 0..8u64 {
                let chain: Vec<u64> = (0..40).map(|b| 1000 * (conv + 1) + b).collect();
                engine.serve(&sc, &chain, 40 * 256, true);
            }
            assert!(
                sc.metrics.mispredictions.get() >= 6,
                "evictions went unseen"
            );
            assert!(
                sc.predicted.capacity_of(pod) < cap,
                "{bytes_per_token}: capacity {cap:?} did not shrink"
            );
        }
    }
}
