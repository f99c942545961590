//! Completion reports: the circuit breaker hears the status, the ledger releases the
//! decision the report names (once), predicted residency learns from the engine's
//! `cached_tokens`, and decisions made from engine events are checked against it
//! (`agreement`).

use std::time::Instant;

use kvroute_shared::protocol::CompletionReport;
use kvroute_shared::Mode;

use crate::agreement::Outcome;
use crate::ledger::Release;
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
    let Some((d, deltas)) = released else { return };
    sc.metrics.load_released.inc(Release::Report.label(), 1);
    sc.publish(deltas);
    if let Some(c) = r.cached_tokens {
        sc.metrics.cached_tokens.inc("reported", c as u64);
        sc.metrics
            .cached_tokens
            .inc("predicted", d.placement.expected_cached);
        if !d.placement.predicted && &**d.cache_pod() == r.pod.as_str() {
            let bs = cfg.block_size(&d.placement.model, Mode::Tokens) as u64;
            let o = Outcome::of(d.placement.expected_cached, c as u64, bs);
            sc.agreement.record(&d.placement.model, o, now);
            sc.metrics.agreement(&d.placement.model, o.label());
        }
        if d.placement.predicted && &**d.cache_pod() == r.pod.as_str() {
            let bs = cfg.block_size(&d.placement.model, Mode::Tokens) as u64;
            let mispredicted = (c as u64) + bs < d.placement.expected_cached;
            if mispredicted {
                sc.metrics.mispredictions.inc();
            }
            sc.predicted.feedback(
                &r.pod,
                mispredicted,
                d.placement.chain_blocks,
                cfg.predicted_capacity_blocks,
            );
        }
    }
}
