//! The pod registry: what the sidecar knows about each engine pod besides its cached
//! blocks — registration, event-stream position (epoch, seq), staleness, liveness, the
//! projected load and the circuit breaker.
//!
//! One map behind one mutex: every access is a short read-modify-write of a few fields
//! (a route updates one pod's load; an event batch updates one pod's position), so a
//! finer scheme would buy nothing measurable and cost clarity.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kvroute_shared::protocol::{PodRegistration, PolicyConfig, Role};

use crate::policy::{LoadView, PrefillHorizon, RecentWork};

/// The engine's own last load report.
#[derive(Clone, Copy, Debug)]
pub struct EngineLoad {
    pub running: u32,
    pub waiting: u32,
    pub kv_usage: f64,
    pub at: Instant,
}

/// Load the router has projected onto a pod and not yet released.
#[derive(Clone, Copy, Debug, Default)]
pub struct Projected {
    /// When the prefills routed here should be done (see [`PrefillHorizon`]).
    pub horizon: PrefillHorizon,
    pub decode_blocks: u64,
    pub inflight: u32,
    /// Prompt blocks routed here lately, by this replica and the others.
    pub recent: RecentWork,
}

/// Seconds on a process-wide monotonic clock, the time base of [`PrefillHorizon`].
pub fn clock(now: Instant) -> f64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    now.checked_duration_since(start)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[derive(Clone, Debug)]
pub struct Pod {
    pub id: Arc<str>,
    pub reg: PodRegistration,
    /// Registered by `PUT /v1/pods` or `--pods` (not just seen in events).
    pub registered: bool,
    pub epoch: Option<String>,
    pub last_seq: Option<u64>,
    /// A sequence gap was seen and not yet repaired: hits are discounted.
    pub stale: bool,
    /// Has ever sent KV events (otherwise its residency is predicted).
    pub events_seen: bool,
    pub last_seen: Instant,
    pub projected: Projected,
    /// Decisions of other sidecar replicas on this pod: id → (received, prefill tokens,
    /// blocks, routing prefix).
    pub remote: std::collections::HashMap<String, (Instant, u64, u64, Option<u64>)>,
    pub engine: Option<EngineLoad>,
    pub failures: u32,
    pub breaker_until: Option<Instant>,
    /// Rendezvous key (hash of the id).
    pub key: u64,
}

/// An engine report is trusted for this long.
const ENGINE_LOAD_FRESH_S: f64 = 5.0;

impl Pod {
    pub fn new(id: &str, reg: PodRegistration, registered: bool, now: Instant) -> Pod {
        Pod {
            id: Arc::from(id),
            reg,
            registered,
            epoch: None,
            last_seq: None,
            stale: false,
            events_seen: false,
            last_seen: now,
            projected: Projected::default(),
            remote: Default::default(),
            engine: None,
            failures: 0,
            breaker_until: None,
            key: xxhash_rust::xxh3::xxh3_64(id.as_bytes()),
        }
    }

    /// The load the policy sees: the router's projection, raised to the engine's own
    /// count when that is fresh and larger (other gateways route to this pod too).
    pub fn load_view(&self, now: Instant, cfg: &PolicyConfig) -> LoadView {
        let mut v = LoadView {
            pending_prefill_tokens: self
                .projected
                .horizon
                .pending(clock(now), cfg.prefill_tokens_per_s),
            decode_blocks: self.projected.decode_blocks
                + self.remote.values().map(|r| r.2).sum::<u64>(),
            inflight: self.projected.inflight + self.remote.len() as u32,
            queued: 0,
            prefix_inflight: 0,
            recent_blocks: self.projected.recent.value(clock(now), cfg.home_window_s),
        };
        if let Some(e) = self.engine {
            if now.duration_since(e.at).as_secs_f64() < ENGINE_LOAD_FRESH_S {
                v.inflight = v.inflight.max(e.running + e.waiting);
                v.queued = e.waiting;
            }
        }
        v
    }

    pub fn breaker_open(&self, now: Instant) -> bool {
        self.breaker_until.is_some_and(|t| now < t)
    }

    pub fn role(&self) -> Role {
        self.reg.role
    }
}

pub type Pods = HashMap<Arc<str>, Pod>;
