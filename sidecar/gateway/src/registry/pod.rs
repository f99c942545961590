//! One pod as the registry knows it: registration, event-stream position (epoch, seq,
//! stale), liveness, the engine's own load report and the circuit breaker. Everyone may
//! read a `Pod` (the registry hands out references under its lock, or clones); only the
//! registry changes one, through the `pub(super)` methods here.

use std::sync::Arc;
use std::time::Instant;

use kvroute_shared::protocol::{PodRegistration, Role};

use crate::policy::LoadView;

/// The engine's own last load report.
#[derive(Clone, Copy, Debug)]
pub struct EngineLoad {
    pub running: u32,
    pub waiting: u32,
    pub kv_usage: f64,
    pub at: Instant,
    /// The ledger's released count for the pod when the report arrived: requests
    /// released after it had finished in the engine too, and no longer count.
    pub finished_before: u64,
}

#[derive(Clone, Debug)]
pub struct Pod {
    pub id: Arc<str>,
    pub reg: PodRegistration,
    /// Registered by `PUT /v1/pods` or `--pods` (not just seen in events).
    pub registered: bool,
    pub epoch: Option<String>,
    pub last_seq: Option<u64>,
    /// Holes and recent digests below `last_seq` (the duplicate rule; `seq.rs`).
    pub(super) window: super::seq::SeqWindow,
    /// A sequence gap was seen and not yet repaired: hits are discounted.
    pub stale: bool,
    /// Has ever sent KV events (otherwise its residency is predicted).
    pub events_seen: bool,
    pub last_seen: Instant,
    pub engine: Option<EngineLoad>,
    pub failures: u32,
    pub breaker_until: Option<Instant>,
    /// Rendezvous key (hash of the id).
    pub key: u64,
}

/// An engine report is trusted for this long.
const ENGINE_LOAD_FRESH_S: f64 = 5.0;

impl Pod {
    pub(super) fn new(id: &str, reg: PodRegistration, registered: bool, now: Instant) -> Pod {
        Pod {
            id: Arc::from(id),
            reg,
            registered,
            epoch: None,
            last_seq: None,
            window: Default::default(),
            stale: false,
            events_seen: false,
            last_seen: now,
            engine: None,
            failures: 0,
            breaker_until: None,
            key: xxhash_rust::xxh3::xxh3_64(id.as_bytes()),
        }
    }

    /// The load the policy sees: the ledger's projection, raised to the engine's own
    /// count when that is fresh and larger (other gateways route to this pod too).
    pub fn load_view(&self, projected: LoadView, now: Instant) -> LoadView {
        let mut v = projected;
        if let Some(e) = self.engine {
            if now.saturating_duration_since(e.at).as_secs_f64() < ENGINE_LOAD_FRESH_S {
                // The report is a snapshot: what finished since then has left the engine
                // (an admission gate that kept counting it would hold the pod full until
                // the next report).
                let done = u32::try_from(projected.finished.saturating_sub(e.finished_before))
                    .unwrap_or(u32::MAX);
                let engine = e.running.saturating_add(e.waiting).saturating_sub(done);
                v.inflight = v.inflight.max(engine);
                v.queued = e.waiting.saturating_sub(done);
            }
        }
        v
    }

    /// A completion report's status: a server error opens the breaker after
    /// `failures_to_open` in a row; anything the pod answered closes the count. A request
    /// the client gave up on before any answer (status 0) says nothing about the pod.
    pub(super) fn record_status(
        &mut self,
        status: u16,
        failures_to_open: u32,
        cooldown: std::time::Duration,
        now: Instant,
    ) {
        match status {
            0 => {}
            500.. => {
                self.failures += 1;
                if self.failures >= failures_to_open.max(1) {
                    self.breaker_until = Some(now + cooldown);
                    self.failures = 0;
                }
            }
            _ => self.failures = 0,
        }
    }

    pub fn breaker_open(&self, now: Instant) -> bool {
        self.breaker_until.is_some_and(|t| now < t)
    }

    /// How long the open breaker stays open (`None` when it is closed).
    pub fn breaker_left(&self, now: Instant) -> Option<std::time::Duration> {
        self.breaker_until
            .filter(|&t| now < t)
            .map(|t| t.duration_since(now))
    }

    pub fn role(&self) -> Role {
        self.reg.role
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An engine's report counts what it ran then; requests released since have left
    /// it, so a pod that just finished its batch is not held full until the next report.
    #[test]
    fn releases_since_the_engine_report_are_not_counted_again() {
        let now = Instant::now();
        let reg: PodRegistration =
            serde_json::from_value(serde_json::json!({"model": "m"})).expect("reg");
        let mut p = Pod::new("10.0.0.1:8000", reg, true, now);
        p.engine = Some(EngineLoad {
            running: 2,
            waiting: 1,
            kv_usage: 0.5,
            at: now,
            finished_before: 10,
        });
        let view = |finished: u64, inflight: u32| {
            p.load_view(
                LoadView {
                    inflight,
                    finished,
                    ..LoadView::default()
                },
                now,
            )
        };
        assert_eq!((view(10, 0).inflight, view(10, 0).queued), (3, 1));
        assert_eq!((view(12, 0).inflight, view(12, 0).queued), (1, 0));
        assert_eq!(view(20, 0).inflight, 0, "never below zero");
        assert_eq!(
            view(12, 2).inflight,
            2,
            "the router's own count still holds"
        );
    }
}
