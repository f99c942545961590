//! The sidecar's shared state: the confirmed index, predicted residency, the pod
//! registry, the policy in force, outstanding decisions and metrics. Request handlers,
//! the NATS consumer and the background cleaner all hold an `Arc<Sidecar>`.
//!
//! Data flows one way: events → [`crate::ingest`] → index and registry; route requests
//! → [`crate::route`] (index lookup → policy → decision → load projection); reports →
//! load release and prediction feedback. Work that must not run on a request's path
//! (phase 2 of pod removal, dump fetches) is queued to background tasks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kvroute_shared::protocol::{PodRegistration, PolicyConfig};
use parking_lot::{Mutex, RwLock};
use tokio::sync::mpsc;

use crate::index::{Indexes, ModelIndex, Retired};
use crate::metrics::{Gauges, Metrics};
use crate::pods::{Pod, Pods};
use crate::predicted::Predicted;

/// Phase 2 of a pod removal, for the cleaner.
pub struct CleanupJob {
    pub index: Arc<ModelIndex>,
    pub retired: Retired,
}

/// Fetch a pod's full dump after a sequence gap.
#[derive(Debug, Clone)]
pub struct ResyncJob {
    pub pod: Arc<str>,
    pub model: String,
    pub url: String,
}

/// A route decision whose load is still projected.
#[derive(Debug, Clone)]
pub struct Decision {
    pub pod: Arc<str>,
    pub model: String,
    pub prefill_tokens: u64,
    pub blocks: u64,
    pub at: Instant,
    /// Tokens the router expected the engine to find cached.
    pub expected_cached: u64,
    /// Residency of this pod was a guess (predicted mode).
    pub predicted: bool,
    pub chain_blocks: u64,
    /// The decision's id (the request id, or one the sidecar made up).
    pub id: String,
    /// Counted in the pod's in-flight requests (false for a prefill pod's share).
    pub inflight: bool,
    /// The cached prefix the request was routed by (its last block), for the per-prefix
    /// load bound.
    pub prefix: Option<u64>,
}

pub struct Channels {
    pub cleanup: mpsc::UnboundedReceiver<CleanupJob>,
    pub resync: mpsc::UnboundedReceiver<ResyncJob>,
}

pub struct Sidecar {
    pub indexes: Indexes,
    pub predicted: Predicted,
    pub pods: Mutex<Pods>,
    config: RwLock<Arc<PolicyConfig>>,
    pub decisions: Mutex<HashMap<String, Decision>>,
    /// In-flight decisions per routing prefix and pod (see `policy::pick`); an entry
    /// lives only while some decision routed by that prefix is outstanding.
    pub prefix_load: Mutex<HashMap<u64, HashMap<Arc<str>, u32>>>,
    /// Pods removed by an operator or by their own shutdown event, with the epoch they had:
    /// their events are refused until a new epoch (engine restart) or a new registration,
    /// so a deleted pod does not come back with its next load report.
    pub tombstones: Mutex<HashMap<String, Option<String>>>,
    pub metrics: Metrics,
    cleanup_tx: mpsc::UnboundedSender<CleanupJob>,
    pub resync_tx: mpsc::UnboundedSender<ResyncJob>,
    pub nats_configured: AtomicBool,
    next_id: AtomicU64,
    pub started: Instant,
    /// Where this replica's decisions go to be broadcast (set while NATS runs).
    pub load_tx: Mutex<Option<mpsc::UnboundedSender<kvroute_shared::protocol::LoadDelta>>>,
    /// This replica's id (for load broadcasts between replicas).
    pub replica: String,
}

/// Why a config update was refused.
#[derive(Debug)]
pub enum ConfigError {
    Invalid(Vec<String>),
    VersionConflict { current: u64, given: u64 },
}

impl Sidecar {
    pub fn new(cfg: PolicyConfig) -> Result<(Arc<Sidecar>, Channels), Vec<String>> {
        cfg.validate()?;
        let (cleanup_tx, cleanup) = mpsc::unbounded_channel();
        let (resync_tx, resync) = mpsc::unbounded_channel();
        let mut cfg = cfg;
        cfg.version = cfg.version.max(1);
        let metrics = Metrics::default();
        metrics.config_version.store(cfg.version, Ordering::Relaxed);
        let replica = format!(
            "{:016x}",
            xxhash_rust::xxh3::xxh3_64(
                format!("{:?}{}", Instant::now(), std::process::id()).as_bytes()
            )
        );
        let sc = Sidecar {
            indexes: Indexes::default(),
            predicted: Predicted::default(),
            pods: Mutex::new(Pods::new()),
            config: RwLock::new(Arc::new(cfg)),
            decisions: Mutex::new(HashMap::new()),
            prefix_load: Mutex::new(HashMap::new()),
            tombstones: Mutex::new(HashMap::new()),
            metrics,
            cleanup_tx,
            resync_tx,
            nats_configured: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            started: Instant::now(),
            load_tx: Mutex::new(None),
            replica,
        };
        Ok((Arc::new(sc), Channels { cleanup, resync }))
    }

    pub fn config(&self) -> Arc<PolicyConfig> {
        self.config.read().clone()
    }

    /// Replace the whole policy atomically. A config that carries a version must carry
    /// the current one; the new one gets the next version.
    pub fn set_config(
        &self,
        mut new: PolicyConfig,
        given_version: Option<u64>,
    ) -> Result<Arc<PolicyConfig>, ConfigError> {
        if let Err(errs) = new.validate() {
            self.metrics.config_rejected.fetch_add(1, Ordering::Relaxed);
            return Err(ConfigError::Invalid(errs));
        }
        let mut cur = self.config.write();
        if let Some(v) = given_version.filter(|v| *v != 0) {
            if v != cur.version {
                self.metrics.config_rejected.fetch_add(1, Ordering::Relaxed);
                return Err(ConfigError::VersionConflict {
                    current: cur.version,
                    given: v,
                });
            }
        }
        new.version = cur.version + 1;
        for (model, ix) in self.indexes.all() {
            ix.set_max_blocks(new.model(&model).max_blocks);
        }
        *cur = Arc::new(new);
        self.metrics
            .config_version
            .store(cur.version, Ordering::Relaxed);
        Ok(cur.clone())
    }

    pub fn index(&self, model: &str) -> Arc<ModelIndex> {
        let cap = self.config().model(model).max_blocks;
        self.indexes.get_or_create(model, cap)
    }

    pub fn queue_cleanup(&self, index: Arc<ModelIndex>, retired: Retired) {
        if let Err(e) = self.cleanup_tx.send(CleanupJob { index, retired }) {
            // No cleaner (tests, shutdown): clean inline rather than leak the slot.
            let job = e.0;
            job.index.cleanup(job.retired);
        }
    }

    pub fn next_request_id(&self) -> String {
        format!("kvr-{}", self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Register or update a pod (`PUT /v1/pods/{id}`).
    pub fn register(&self, id: &str, reg: PodRegistration) -> Result<(), String> {
        if reg.model.is_empty() {
            return Err("model must not be empty".into());
        }
        if !valid_pod_id(id) {
            return Err(format!("pod id {id:?} must be host:port"));
        }
        let now = Instant::now();
        self.tombstones.lock().remove(id);
        let moved = {
            let mut pods = self.pods.lock();
            match pods.get_mut(id) {
                Some(p) => {
                    let old_model = std::mem::replace(&mut p.reg, reg.clone()).model;
                    p.registered = true;
                    (old_model != reg.model).then_some(old_model)
                }
                None => {
                    pods.insert(Arc::from(id), Pod::new(id, reg.clone(), true, now));
                    None
                }
            }
        };
        if let Some(old) = moved {
            self.drop_from_index(&old, id);
        }
        // Join the index now so that the 257th pod is refused at registration.
        self.index(&reg.model).join(id).map_err(|e| {
            self.metrics.pods_refused.fetch_add(1, Ordering::Relaxed);
            self.pods.lock().remove(id);
            e.to_string()
        })?;
        Ok(())
    }

    /// Two-phase removal: the pod is out of every later decision when this returns.
    pub fn remove_pod(&self, id: &str, reason: &str) -> bool {
        let Some(pod) = self.pods.lock().remove(id) else {
            return false;
        };
        if reason != "liveness" {
            self.tombstones
                .lock()
                .insert(id.to_string(), pod.epoch.clone());
        }
        self.drop_from_index(&pod.reg.model, id);
        self.decisions.lock().retain(|_, d| &*d.pod != id);
        self.prefix_load.lock().retain(|_, per_pod| {
            per_pod.remove(id);
            !per_pod.is_empty()
        });
        self.metrics.pods_removed.inc(reason, 1);
        true
    }

    fn drop_from_index(&self, model: &str, id: &str) {
        if let Some(ix) = self.indexes.get(model) {
            if let Some(r) = ix.retire(id) {
                self.queue_cleanup(ix, r);
            }
        }
        if let Some((ix, r)) = self.predicted.forget(model, id) {
            self.queue_cleanup(ix, r);
        }
    }

    /// Broadcast a projected-load change to the other replicas (no-op without NATS).
    pub fn broadcast(&self, d: &Decision, op: kvroute_shared::protocol::LoadOp) {
        if let Some(tx) = self.load_tx.lock().as_ref() {
            let _ = tx.send(kvroute_shared::protocol::LoadDelta {
                replica: self.replica.clone(),
                id: d.id.clone(),
                pod: d.pod.to_string(),
                model: d.model.clone(),
                op,
                prefill_tokens: d.prefill_tokens,
                blocks: d.blocks,
                prefix: d.prefix.filter(|_| d.inflight),
            });
        }
    }

    /// Count one more in-flight request routed by prefix `k` on `pod`.
    pub fn prefix_add(&self, k: u64, pod: &Arc<str>) {
        *self
            .prefix_load
            .lock()
            .entry(k)
            .or_default()
            .entry(pod.clone())
            .or_insert(0) += 1;
    }

    /// Undo [`Sidecar::prefix_add`]; entries go when their count reaches zero.
    pub fn prefix_release(&self, k: u64, pod: &str) {
        let mut pl = self.prefix_load.lock();
        if let Some(per_pod) = pl.get_mut(&k) {
            if let Some(n) = per_pod.get_mut(pod) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    per_pod.remove(pod);
                }
            }
            if per_pod.is_empty() {
                pl.remove(&k);
            }
        }
    }

    /// Apply another replica's load change.
    pub fn apply_remote(&self, l: &kvroute_shared::protocol::LoadDelta) {
        if l.replica == self.replica {
            return;
        }
        let now = Instant::now();
        let cfg = self.config();
        let tps = cfg.prefill_tokens_per_s;
        let mut pods = self.pods.lock();
        let Some(p) = pods.get_mut(l.pod.as_str()) else {
            return;
        };
        let key = format!("{}/{}", l.replica, l.id);
        match l.op {
            kvroute_shared::protocol::LoadOp::Add => {
                p.projected
                    .horizon
                    .add(crate::pods::clock(now), l.prefill_tokens, tps);
                if let Some(k) = l.prefix {
                    self.prefix_add(k, &p.id);
                }
                p.projected
                    .recent
                    .add(crate::pods::clock(now), l.blocks, cfg.home_window_s);
                p.remote
                    .insert(key, (now, l.prefill_tokens, l.blocks, l.prefix));
            }
            kvroute_shared::protocol::LoadOp::Release => {
                if let Some((_, tokens, _, prefix)) = p.remote.remove(&key) {
                    p.projected
                        .horizon
                        .release(crate::pods::clock(now), tokens, tps);
                    if let Some(k) = prefix {
                        self.prefix_release(k, &p.id);
                    }
                }
            }
        }
    }

    pub fn gauges(&self) -> Gauges {
        let mut g = Gauges::default();
        let now = Instant::now();
        for p in self.pods.lock().values() {
            if p.stale {
                g.pods_stale += 1;
            }
            if !p.breaker_open(now) {
                g.pods_live += 1;
            }
        }
        for (m, ix) in self.indexes.all() {
            let s = ix.stats();
            g.pods_draining += s.draining_pods as u64;
            g.index.push((m, s.entries, s.heap_bytes));
        }
        g.predicted_entries = self.predicted.entries();
        g.inflight = self.decisions.lock().len() as u64;
        g
    }
}

pub use kvroute_shared::protocol::valid_endpoint as valid_pod_id;
