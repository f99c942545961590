//! Route requests and completion reports: index lookup → policy → decision → load
//! projection, and the release of that load when the request ends.

use std::sync::atomic::Ordering;
use std::time::Instant;

use kvroute_shared::protocol::{
    CompletionReport, LoadOp, Ranked, Role, RouteRequest, RouteResponse,
};
use kvroute_shared::Mode;
use serde_json::json;

use crate::policy::{self, Ask, Candidate, PodFacts};
use crate::state::{Decision, Sidecar};

/// Why a route request got no pod.
#[derive(Debug, Clone, PartialEq)]
pub enum RouteError {
    /// 400: the request itself is wrong.
    Bad(String),
    /// 503: nothing can serve it.
    NoPod(String),
}

impl RouteError {
    pub fn reason(&self) -> &'static str {
        match self {
            RouteError::Bad(m) if m.contains("block_size") => "block_size_mismatch",
            RouteError::Bad(_) => "bad_request",
            RouteError::NoPod(_) => "no_pod",
        }
    }
}

const MAX_CHAIN: usize = 1 << 20;
/// Candidates whose tier detail is looked up for scoring (the deepest few).
const TIER_TOP: usize = 2;

pub fn route(sc: &Sidecar, req: &RouteRequest) -> Result<RouteResponse, RouteError> {
    let t0 = Instant::now();
    let r = route_inner(sc, req);
    sc.metrics.route_seconds.observe(t0.elapsed().as_secs_f64());
    if let Err(e) = &r {
        sc.metrics.route_errors.inc(e.reason(), 1);
    }
    r
}

fn route_inner(sc: &Sidecar, req: &RouteRequest) -> Result<RouteResponse, RouteError> {
    let cfg = sc.config();
    if req.model.is_empty() {
        return Err(RouteError::Bad("model must not be empty".into()));
    }
    if req.chain.len() > MAX_CHAIN {
        return Err(RouteError::Bad(format!(
            "chain of {} blocks exceeds {MAX_CHAIN}",
            req.chain.len()
        )));
    }
    let want_bs = cfg.block_size(&req.model, req.mode);
    if req.block_size != want_bs {
        return Err(RouteError::Bad(format!(
            "block_size {} does not match the {} block size {want_bs} configured for model {:?}: gateway and engines must agree",
            req.block_size,
            req.mode.as_str(),
            req.model
        )));
    }
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
    let now = Instant::now();
    let bs = req.block_size.max(1);
    let token_blocks = req.prompt_tokens.div_ceil(if req.mode == Mode::Tokens {
        bs
    } else {
        (bs / 4).max(1)
    });
    let prompt_blocks = (req.chain.len() as u32).max(token_blocks);
    let deepest = confirmed
        .iter()
        .map(|m| m.depth)
        .chain(predicted.iter().map(|m| m.depth))
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
    // The prefix this request is routed by: the deepest one any pod holds.
    let prefix_key = (deepest as usize)
        .checked_sub(1)
        .and_then(|d| req.chain.get(d))
        .copied();
    let prefix_load = prefix_key
        .and_then(|k| sc.prefix_load.lock().get(&k).cloned())
        .unwrap_or_default();
    let ask = Ask {
        prompt_blocks,
        block_size: bs,
        tie_key,
        seed: tie_key ^ now.elapsed().as_nanos() as u64,
        load_only: false,
    };

    let mut pods = sc.pods.lock();
    // Candidates of the model that pass the Filter stage.
    let mut ids = Vec::new();
    let mut roles = (false, false);
    for (id, p) in pods.iter() {
        if p.reg.model != req.model {
            continue;
        }
        roles.0 |= p.reg.role == Role::Prefill;
        roles.1 |= p.reg.role == Role::Decode;
        ids.push(id.clone());
    }
    let disaggregated = req.role.is_none() && roles.0 && roles.1;
    let build =
        |want: Option<Role>, pods: &crate::pods::Pods| -> Vec<(Candidate, std::sync::Arc<str>)> {
            let mut v = Vec::new();
            for id in &ids {
                let Some(p) = pods.get(id) else { continue };
                let facts = PodFacts {
                    role: p.reg.role,
                    adapters: &p.reg.adapters,
                    breaker_open: p.breaker_open(now),
                };
                if !policy::admissible(&facts, &req.adapter, want) {
                    continue;
                }
                // Alive in the index (a pod in phase 1 of removal is already out).
                let m = confirmed.iter().find(|m| m.pod == *id);
                let slot_alive = index.as_ref().and_then(|ix| ix.handle(id)).is_some();
                if index.is_some() && !slot_alive {
                    continue;
                }
                v.push((
                    Candidate {
                        id: v.len(),
                        key: p.key,
                        matched: m.map_or(0, |m| m.depth),
                        predicted: predicted
                            .iter()
                            .find(|x| x.pod == *id)
                            .map_or(0, |x| x.depth),
                        tiers: None,
                        stale: p.stale,
                        load: crate::policy::LoadView {
                            prefix_inflight: prefix_load.get(id).copied().unwrap_or(0),
                            ..p.load_view(now, &cfg)
                        },
                    },
                    id.clone(),
                ));
            }
            v
        };
    let (main_role, prefill) = if disaggregated {
        (Some(Role::Decode), true)
    } else {
        (req.role, false)
    };
    let mut cands = build(main_role, &pods);
    if cands.is_empty() {
        return Err(RouteError::NoPod(format!(
            "no live pod serves model {:?}{}",
            req.model,
            adapter_note(&req.adapter)
        )));
    }
    // Tier detail for the deepest few only (it is kept off the lookup path).
    if let Some(ix) = &index {
        let mut by_depth: Vec<usize> = (0..cands.len())
            .filter(|&i| cands[i].0.matched > 0)
            .collect();
        by_depth.sort_by_key(|&i| std::cmp::Reverse(cands[i].0.matched));
        for &i in by_depth.iter().take(TIER_TOP) {
            if let Some(m) = confirmed.iter().find(|m| m.pod == cands[i].1) {
                cands[i].0.tiers = Some(ix.tier_hint(m.slot, &req.chain, m.depth));
            }
        }
    }
    let main_ask = Ask {
        load_only: prefill,
        ..ask
    };
    let only: Vec<Candidate> = cands.iter().map(|c| c.0.clone()).collect();
    let ranking = policy::pick(&cfg, &main_ask, &only)
        .ok_or_else(|| RouteError::NoPod("no candidate".into()))?;
    let (wi, wscore, _) = ranking.order[ranking.pick];
    let winner = cands[wi].1.clone();
    let winner_c = cands[wi].0.clone();

    // Disaggregated: the prefill pod by cache and prefill load.
    let mut prefill_pod = None;
    let mut prefill_c = None;
    if prefill {
        let pc = build(Some(Role::Prefill), &pods);
        let only: Vec<Candidate> = pc.iter().map(|c| c.0.clone()).collect();
        if let Some(r) = policy::pick(&cfg, &ask, &only) {
            let (pi, _, _) = r.order[r.pick];
            prefill_pod = Some(pc[pi].1.clone());
            prefill_c = Some(pc[pi].0.clone());
        }
    }

    // Project the load at once, before the engine can report it.
    let cache_pod = prefill_c.as_ref().unwrap_or(&winner_c);
    let cache_pod_id = prefill_pod.clone().unwrap_or_else(|| winner.clone());
    let hit_blocks = cache_pod.matched.max(cache_pod.predicted) as u64;
    let tokens_per_block = if req.mode == Mode::Tokens {
        bs as u64
    } else {
        (bs as u64 / 4).max(1)
    };
    let expected_cached = (hit_blocks * tokens_per_block).min(req.prompt_tokens as u64);
    let prefill_tokens = (req.prompt_tokens as u64).saturating_sub(expected_cached);
    let blocks = prompt_blocks as u64;
    let predicted_mode =
        req.mode == Mode::Text || pods.get(&cache_pod_id).is_some_and(|p| !p.events_seen);
    if !req.dry_run {
        // The prompt's home is where it is prefilled and cached (the prefill pod of a
        // disaggregated model); the decode pod holds the running request.
        if let Some(p) = pods.get_mut(&cache_pod_id) {
            p.projected.horizon.add(
                crate::pods::clock(now),
                prefill_tokens,
                cfg.prefill_tokens_per_s,
            );
            p.projected
                .recent
                .add(crate::pods::clock(now), blocks, cfg.home_window_s);
        }
        if let Some(p) = pods.get_mut(&winner) {
            p.projected.decode_blocks += blocks;
            p.projected.inflight += 1;
        }
    }
    drop(pods);

    let ranked: Vec<Ranked> = ranking
        .order
        .iter()
        .map(|(i, s, _)| Ranked {
            pod: cands[*i].1.to_string(),
            matched_blocks: cands[*i].0.matched,
            score: Some(round3(s.cost)),
        })
        .collect();
    let tier_hint = winner_c.tiers.or_else(|| {
        let ix = index.as_ref()?;
        let m = confirmed.iter().find(|m| m.pod == winner)?;
        Some(ix.tier_hint(m.slot, &req.chain, m.depth))
    });
    let explain = cfg.explain.then(|| {
        json!(ranking.order.iter().map(|(i, s, ok)| json!({
            "pod": &*cands[*i].1, "matched": cands[*i].0.matched, "predicted": cands[*i].0.predicted,
            "stale": cands[*i].0.stale, "hits": round3(s.hits), "uncached": round3(s.uncached),
            "queued_prefill_blocks": round3(s.queued_prefill), "decode_blocks": s.decode,
            "inflight": cands[*i].0.load.inflight, "recent_blocks": round3(cands[*i].0.load.recent_blocks),
            "within_balance": ok, "cost": round3(s.cost),
        })).collect::<Vec<_>>())
    });

    if !req.dry_run {
        sc.metrics.decisions.inc(&winner, 1);
        sc.metrics
            .matched_blocks
            .observe(winner_c.matched.max(cache_pod.matched) as f64);
        let id = req
            .request_id
            .clone()
            .filter(|r| !r.is_empty())
            .unwrap_or_else(|| sc.next_request_id());
        let d = Decision {
            pod: winner.clone(),
            model: req.model.clone(),
            prefill_tokens: if prefill_pod.as_ref().is_some_and(|pp| pp != &winner) {
                0
            } else {
                prefill_tokens
            },
            blocks,
            at: Instant::now(),
            expected_cached,
            predicted: predicted_mode,
            chain_blocks: req.chain.len() as u64,
            id: id.clone(),
            inflight: true,
            prefix: prefix_key,
        };
        if let Some(k) = prefix_key {
            sc.prefix_add(k, &winner);
        }
        sc.broadcast(&d, LoadOp::Add);
        sc.decisions.lock().insert(id.clone(), d);
        if predicted_mode {
            sc.predicted.insert(
                &req.model,
                &cache_pod_id,
                &req.chain,
                cfg.predicted_capacity_blocks,
                Instant::now(),
            );
        }
        // The prefill pod's pending prefill is released with the decision too.
        if let Some(pp) = &prefill_pod {
            if pp != &winner {
                let pid = format!("{id}#prefill");
                let d = Decision {
                    pod: pp.clone(),
                    model: req.model.clone(),
                    prefill_tokens,
                    blocks: 0,
                    at: Instant::now(),
                    expected_cached,
                    predicted: predicted_mode,
                    chain_blocks: 0,
                    id: pid.clone(),
                    inflight: false,
                    prefix: None,
                };
                sc.broadcast(&d, LoadOp::Add);
                sc.decisions.lock().insert(pid, d);
            }
        }
    }
    let _ = wscore;
    Ok(RouteResponse {
        pod: winner.to_string(),
        ranked,
        tier_hint,
        prefill_pod: prefill_pod.map(|p| p.to_string()),
        policy_version: cfg.version,
        explain,
    })
}

fn adapter_note(a: &str) -> String {
    if a.is_empty() {
        String::new()
    } else {
        format!(" with adapter {a:?}")
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Release the load a decision projected (report or timeout).
pub fn release(sc: &Sidecar, d: &Decision, how: &str) {
    let tps = sc.config().prefill_tokens_per_s;
    let mut pods = sc.pods.lock();
    if let Some(p) = pods.get_mut(&d.pod) {
        p.projected
            .horizon
            .release(crate::pods::clock(Instant::now()), d.prefill_tokens, tps);
        p.projected.decode_blocks = p.projected.decode_blocks.saturating_sub(d.blocks);
        if d.inflight {
            p.projected.inflight = p.projected.inflight.saturating_sub(1);
        }
    }
    drop(pods);
    if let (Some(k), true) = (d.prefix, d.inflight) {
        sc.prefix_release(k, &d.pod);
    }
    sc.broadcast(d, LoadOp::Release);
    sc.metrics.load_released.inc(how, 1);
}

/// A completion report from the filter.
pub fn report(sc: &Sidecar, r: &CompletionReport) {
    sc.metrics.reports.fetch_add(1, Ordering::Relaxed);
    let cfg = sc.config();
    let now = Instant::now();
    let d = sc.decisions.lock().remove(&r.request_id);
    if let Some(pd) = sc
        .decisions
        .lock()
        .remove(&format!("{}#prefill", r.request_id))
    {
        release(sc, &pd, "report");
    }
    // Circuit breaker: consecutive server errors (5xx, or no status) open it.
    {
        let mut pods = sc.pods.lock();
        if let Some(p) = pods.get_mut(r.pod.as_str()) {
            if r.status >= 500 || r.status == 0 {
                p.failures += 1;
                if p.failures >= cfg.breaker_failures.max(1) {
                    p.breaker_until =
                        Some(now + std::time::Duration::from_secs(cfg.breaker_cooldown_s));
                    p.failures = 0;
                }
            } else {
                p.failures = 0;
            }
        }
    }
    let Some(d) = d else { return };
    release(sc, &d, "report");
    if let Some(c) = r.cached_tokens {
        sc.metrics.cached_tokens.inc("reported", c as u64);
        sc.metrics.cached_tokens.inc("predicted", d.expected_cached);
        if d.predicted && &*d.pod == r.pod.as_str() {
            let bs = cfg.block_size(&d.model, kvroute_shared::Mode::Tokens) as u64;
            let mispredicted = (c as u64) + bs < d.expected_cached;
            if mispredicted {
                sc.metrics.mispredictions.fetch_add(1, Ordering::Relaxed);
            }
            sc.predicted.feedback(
                &r.pod,
                mispredicted,
                d.chain_blocks,
                cfg.predicted_capacity_blocks,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_shared::protocol::{PodRegistration, PolicyConfig};

    /// A sidecar with the default policy and four registered pods of model "m"; the
    /// second value keeps its channels open.
    fn four_pods() -> (std::sync::Arc<Sidecar>, impl Sized) {
        let (sc, ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
        for p in 0..4 {
            let reg: PodRegistration =
                serde_json::from_value(serde_json::json!({"model": "m"})).expect("reg");
            sc.register(&format!("10.0.0.{p}:8000"), reg)
                .expect("register");
        }
        (sc, ch)
    }

    /// A successful completion report.
    fn done(sc: &Sidecar, request_id: &str, pod: &str) {
        report(
            sc,
            &CompletionReport {
                request_id: request_id.into(),
                pod: pod.into(),
                status: 200,
                ..Default::default()
            },
        );
    }

    #[test]
    fn cold_prompts_find_homes_by_recent_work_after_their_load_is_gone() {
        let (sc, _ch) = four_pods();
        // Each prompt is done (reported) before the next arrives, so in-flight load and
        // queued prefill say nothing; only the work each pod drew lately tells them apart.
        let mut homes = std::collections::HashSet::new();
        for i in 0..4u64 {
            let req = RouteRequest {
                model: "m".into(),
                adapter: String::new(),
                mode: Mode::Tokens,
                block_size: 16,
                chain: (0..8).map(|b| 1000 * (i + 1) + b).collect(),
                prompt_tokens: 8 * 16,
                request_id: Some(format!("c{i}")),
                session: None,
                role: None,
                dry_run: false,
            };
            let d = route(&sc, &req).expect("route");
            done(&sc, &format!("c{i}"), &d.pod);
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
            role: None,
            dry_run: false,
        };
        let first = route(&sc, &req(0)).expect("route");
        assert!(
            sc.prefix_load.lock().is_empty(),
            "a cold prompt has no prefix"
        );
        for i in 1..=3 {
            route(&sc, &req(i)).expect("route");
        }
        let held: u32 = sc
            .prefix_load
            .lock()
            .values()
            .flat_map(|m| m.values())
            .sum();
        assert_eq!(held, 3);
        assert!(sc
            .prefix_load
            .lock()
            .values()
            .any(|m| m.contains_key(first.pod.as_str())));
        for i in 0..=3 {
            done(&sc, &format!("r{i}"), &first.pod);
        }
        assert!(
            sc.prefix_load.lock().is_empty(),
            "reports release every count"
        );
        // Another replica's decisions count too, and go with their release.
        let delta = |op, id: &str| kvroute_shared::protocol::LoadDelta {
            replica: "other".into(),
            id: id.into(),
            pod: "10.0.0.1:8000".into(),
            model: "m".into(),
            op,
            prefill_tokens: 64,
            blocks: 9,
            prefix: Some(8),
        };
        let n = |sc: &Sidecar| {
            sc.prefix_load
                .lock()
                .get(&8)
                .and_then(|m| m.get("10.0.0.1:8000").copied())
        };
        sc.apply_remote(&delta(LoadOp::Add, "x1"));
        sc.apply_remote(&delta(LoadOp::Add, "x2"));
        assert_eq!(n(&sc), Some(2));
        sc.apply_remote(&delta(LoadOp::Release, "x1"));
        sc.apply_remote(&delta(LoadOp::Release, "x1"));
        assert_eq!(n(&sc), Some(1), "a duplicate release changes nothing");
        sc.apply_remote(&delta(LoadOp::Release, "x2"));
        assert!(sc.prefix_load.lock().is_empty());
    }
}
