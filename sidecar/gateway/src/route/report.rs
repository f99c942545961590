//! Completion reports: the circuit breaker hears the status, the ledger releases the
//! decision the report names (once), predicted residency learns from the engine's
//! `cached_tokens`, decisions made from engine events are checked against it
//! (`agreement`), and a Responses id is bound to the pod that stored it (`affinity`).

use std::time::Instant;

use kvroute_shared::protocol::CompletionReport;
use kvroute_shared::Mode;

use crate::affinity::{self, Bound, Kind};
use crate::agreement::Outcome;
use crate::ledger::Release;
use crate::predicted::Shortfall;
use crate::state::Sidecar;

/// A completion report from the filter.
pub fn report(sc: &Sidecar, r: &CompletionReport) {
    report_at(sc, r, Instant::now())
}

pub fn report_at(sc: &Sidecar, r: &CompletionReport, now: Instant) {
    sc.metrics.reports.inc();
    let cfg = sc.config();
    // Circuit breaker: consecutive server errors open it; a client abort (no status)
    // says nothing about the pod.
    sc.registry().record_status(
        &r.pod,
        r.status,
        cfg.breaker_failures,
        std::time::Duration::from_secs(cfg.breaker_cooldown_s),
        now,
    );
    let released = match sc.ledger().parse_id(&r.decision) {
        Some(id) => sc.ledger().release(id, now, &cfg),
        None => None,
    };
    let outcome = match (&released, r.decision.is_empty()) {
        (Some(_), _) => "released",
        (None, true) => "none",
        (None, false) => "unknown",
    };
    sc.metrics.report_decisions.inc(outcome, 1);
    let Some((d, mut deltas)) = released else {
        return;
    };
    sc.settle(&d);
    sc.metrics.load_released.inc(Release::Report.label(), 1);
    // Load left a pod: a request waiting for room may fit now.
    sc.waiting.wake();
    // A Responses id the engine gave: the next turn naming it belongs where it was
    // stored, credited with this turn's prompt and output (its history then).
    if let Some(id) = r.response_id.as_deref().filter(|_| r.status / 100 == 2) {
        let key = affinity::key(&d.placement.model, id);
        let tokens = r.prompt_tokens.map_or(
            d.placement.prefill_tokens + d.placement.expected_cached,
            u64::from,
        ) + r.completion_tokens.map_or(0, u64::from);
        if let Some(delta) = deltas.first_mut() {
            delta.response = Some(key);
            delta.bound_tokens = tokens;
        }
        sc.bindings.bind(
            Kind::Response,
            key,
            Bound {
                pod: d.placement.pod.clone(),
                tokens,
                tip: None,
            },
            now,
            cfg.max_bindings as usize,
        );
    }
    sc.publish(deltas);
    let (p, cache_pod) = (&d.placement, d.cache_pod());
    let from_cache_pod = **cache_pod == *r.pod;
    if let (Some(bytes), Some(tokens), true) = (p.text_bytes, r.prompt_tokens, from_cache_pod) {
        sc.text_tokens
            .record(&p.model, &r.pod, p.last_block, bytes, tokens as u64);
    }
    let Some(c) = r.cached_tokens.map(u64::from) else {
        return;
    };
    sc.metrics.cached_tokens.inc("reported", c);
    sc.metrics.cached_tokens.inc("predicted", p.expected_cached);
    if !p.predicted && from_cache_pod {
        let bs = cfg.block_size(&p.model, Mode::Tokens) as u64;
        let o = Outcome::of(p.expected_cached, c, bs);
        let toks = sc.tokenizers();
        let template = toks.get(&p.model).and_then(|t| t.template_id());
        sc.agreement.record(&p.model, template, o, now);
        sc.metrics
            .agreement(&p.model, template.map(|t| &**t), o.label());
    }
    if p.predicted && from_cache_pod {
        // The engine held fewer of the settled guesses than the router believed, by more
        // than a block and the estimate's error: the pod evicts sooner than assumed. A
        // shortfall only in guesses still being prefilled when this request was routed
        // is the engine's queue, not its cache.
        let short = if c + p.slack_tokens < p.settled_cached {
            sc.metrics.mispredictions.inc();
            Shortfall::Evicted
        } else if c + p.slack_tokens < p.expected_cached {
            sc.metrics.predicted_in_flight.inc();
            Shortfall::InFlight
        } else {
            Shortfall::None
        };
        // The engine's own tokens per chain block, from this very prompt (a partial
        // last block makes it a little high, so `held` errs low).
        let held = r
            .prompt_tokens
            .filter(|&t| t > 0)
            .map(|t| c.saturating_mul(p.chain_blocks) / u64::from(t));
        sc.predicted.feedback(
            &r.pod,
            short,
            held,
            p.chain_blocks,
            cfg.predicted_capacity_blocks,
        );
        // A session's turn back on its pod: of its last prompt, the pod kept what the
        // engine found cached.
        if let (Some(n), Some(held)) = (p.returning, held) {
            sc.returns.observe(cache_pod, n, held.min(n));
        }
    }
}
