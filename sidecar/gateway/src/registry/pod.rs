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
                v.inflight = v.inflight.max(e.running.saturating_add(e.waiting));
                v.queued = e.waiting;
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

    pub fn role(&self) -> Role {
        self.reg.role
    }
}
