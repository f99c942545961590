//! The sidecar's shared state: the confirmed index, predicted residency, the pod
//! registry, the load ledger, the policy in force and metrics. Request handlers, the
//! NATS consumer and the background cleaner all hold an `Arc<Sidecar>`.
//!
//! Data flows one way: events → [`crate::ingest`] → index and registry; route requests
//! → [`crate::route`] (index lookup → policy → decision → ledger); reports → ledger
//! release and prediction feedback. Work that must not run on a request's path (phase 2
//! of pod removal, dump fetches, publishing load deltas) is queued to background tasks.
//!
//! Lock order, wherever two are held: `pods`, then the ledger; `tombstones` and the
//! index locks are never held with either (docs/architecture.md).

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use kvroute_shared::protocol::{LoadDelta, PodRegistration, PolicyConfig};
use parking_lot::{Mutex, RwLock};
use tokio::sync::mpsc;

use crate::index::{Indexes, ModelIndex, Retired};
use crate::ledger::{Ledger, Release};
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

pub struct Channels {
    pub cleanup: mpsc::UnboundedReceiver<CleanupJob>,
    pub resync: mpsc::Receiver<ResyncJob>,
    /// Load deltas for the other replicas; whoever takes it must call
    /// [`Sidecar::enable_replica_sync`] (the NATS publisher, or the simulator).
    pub outbox: mpsc::Receiver<LoadDelta>,
}

/// Resyncs waiting for their dump fetch (one per pod at most, so this bounds the queue
/// by the pods that fell behind at once; beyond it they are dropped and counted, and the
/// pod's next gap asks again).
pub const RESYNC_QUEUE: usize = 1024;

/// Load deltas waiting to be published. Bounded: while NATS is slow or down the newest
/// are dropped and counted, so neither memory nor a route call waits on it (the other
/// replicas expire what they miss after `load_timeout_s`).
pub const OUTBOX_CAPACITY: usize = 4096;

pub struct Sidecar {
    pub(crate) indexes: Indexes,
    pub(crate) predicted: Predicted,
    pub(crate) pods: Mutex<Pods>,
    config: RwLock<Arc<PolicyConfig>>,
    ledger: Ledger,
    /// Pods removed by an operator or by their own shutdown event, with the epoch they had:
    /// their events are refused until a new epoch (engine restart) or a new registration,
    /// so a deleted pod does not come back with its next load report.
    pub(crate) tombstones: Mutex<HashMap<String, Option<String>>>,
    pub metrics: Metrics,
    cleanup_tx: mpsc::UnboundedSender<CleanupJob>,
    resync_tx: mpsc::Sender<ResyncJob>,
    /// Pods with a resync queued or running: at most one job per pod.
    resyncing: Mutex<std::collections::HashSet<Arc<str>>>,
    pub(crate) nats_configured: AtomicBool,
    pub started: Instant,
    outbox: mpsc::Sender<LoadDelta>,
    /// The last decisions, for the status page (written by `route::route` only).
    pub recent: crate::recent::Recent,
    /// Per model: do engines' cached_tokens agree with the index (written by reports).
    pub agreement: crate::agreement::Agreement,
    /// Tokenizers by model (set at start; read by routes that carry a prompt body).
    tokenizers: RwLock<Arc<crate::tokenize::Tokenizers>>,
}

/// Why a pod registration was refused. `reason()` is the stable label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegisterError {
    EmptyModel,
    BadPodId(String),
    /// The model already has the most pods one index holds.
    ModelFull(String),
}

impl RegisterError {
    pub fn reason(&self) -> &'static str {
        match self {
            RegisterError::EmptyModel | RegisterError::BadPodId(_) => "bad_registration",
            RegisterError::ModelFull(_) => "model_full",
        }
    }

    /// 409 when the registration is fine but the model has no room, else 400.
    pub fn status(&self) -> u16 {
        match self {
            RegisterError::ModelFull(_) => 409,
            _ => 400,
        }
    }
}

impl std::fmt::Display for RegisterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegisterError::EmptyModel => f.write_str("model must not be empty"),
            RegisterError::BadPodId(id) => write!(f, "pod id {id:?} must be IP:port"),
            RegisterError::ModelFull(m) => f.write_str(m),
        }
    }
}

/// Why a config update was refused.
#[derive(Debug)]
pub enum ConfigError {
    Invalid(Vec<String>),
    VersionConflict { current: u64, given: u64 },
}

impl Sidecar {
    pub fn new(cfg: PolicyConfig) -> Result<(Arc<Sidecar>, Channels), Vec<String>> {
        Self::with_replica(cfg, None)
    }

    /// A sidecar whose replica id (its load deltas' subject, its decisions' prefix) is
    /// `replica`, or a random one. A fixed id lets NATS permissions confine each replica
    /// to publishing its own deltas.
    pub fn with_replica(
        cfg: PolicyConfig,
        replica: Option<String>,
    ) -> Result<(Arc<Sidecar>, Channels), Vec<String>> {
        if let Some(r) = &replica {
            if !valid_replica_id(r) {
                return Err(vec![format!(
                    "replica id {r:?} must be 1-64 characters of [A-Za-z0-9_-]"
                )]);
            }
        }
        cfg.validate()?;
        let (cleanup_tx, cleanup) = mpsc::unbounded_channel();
        let (resync_tx, resync) = mpsc::channel(RESYNC_QUEUE);
        let (outbox, outbox_rx) = mpsc::channel(OUTBOX_CAPACITY);
        let mut cfg = cfg;
        cfg.version = cfg.version.max(1);
        let metrics = Metrics::default();
        metrics.config_version.set(cfg.version as i64);
        let replica = replica.unwrap_or_else(|| {
            format!(
                "{:016x}",
                xxhash_rust::xxh3::xxh3_64(
                    format!("{:?}{}", Instant::now(), std::process::id()).as_bytes()
                )
            )
        });
        let sc = Sidecar {
            indexes: Indexes::default(),
            predicted: Predicted::default(),
            pods: Mutex::new(Pods::new()),
            config: RwLock::new(Arc::new(cfg)),
            ledger: Ledger::new(replica),
            tombstones: Mutex::new(HashMap::new()),
            metrics,
            cleanup_tx,
            resync_tx,
            resyncing: Mutex::new(Default::default()),
            nats_configured: AtomicBool::new(false),
            started: Instant::now(),
            outbox,
            recent: Default::default(),
            agreement: Default::default(),
            tokenizers: Default::default(),
        };
        Ok((
            Arc::new(sc),
            Channels {
                cleanup,
                resync,
                outbox: outbox_rx,
            },
        ))
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
            self.metrics.config_rejected.inc();
            return Err(ConfigError::Invalid(errs));
        }
        let mut cur = self.config.write();
        if let Some(v) = given_version.filter(|v| *v != 0) {
            if v != cur.version {
                self.metrics.config_rejected.inc();
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
        self.metrics.config_version.set(cur.version as i64);
        Ok(cur.clone())
    }

    /// The model's index, created on first use; `None` when the sidecar indexes
    /// [`crate::ingest::MAX_MODELS`] other models already.
    pub fn index(&self, model: &str) -> Option<Arc<ModelIndex>> {
        let cap = self.config().model(model).max_blocks;
        self.indexes
            .get_or_create_capped(model, cap, crate::ingest::MAX_MODELS)
    }

    pub fn queue_cleanup(&self, index: Arc<ModelIndex>, retired: Retired) {
        if let Err(e) = self.cleanup_tx.send(CleanupJob { index, retired }) {
            // No cleaner (tests, shutdown): clean inline rather than leak the slot.
            let job = e.0;
            job.index.cleanup(job.retired);
        }
    }

    /// Ask for `job.pod`'s dump, unless a fetch for it is already queued or running.
    pub(crate) fn queue_resync(&self, job: ResyncJob) {
        let mut busy = self.resyncing.lock();
        if busy.contains(&job.pod) {
            self.metrics.resyncs.inc("already_queued", 1);
            return;
        }
        let pod = job.pod.clone();
        match self.resync_tx.try_send(job) {
            Ok(()) => {
                busy.insert(pod);
            }
            Err(_) => self.metrics.resyncs.inc("queue_full", 1),
        }
    }

    /// The resync of `pod` is over (applied, failed or dropped).
    pub(crate) fn resync_done(&self, pod: &str) {
        self.resyncing.lock().remove(pod);
    }

    /// The load ledger (read-only views and tests; routes and reports change it).
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// This replica's id (names its decisions and load deltas).
    pub fn replica(&self) -> &str {
        self.ledger.replica()
    }

    /// Register or update a pod (`PUT /v1/pods/{id}`).
    pub fn register(&self, id: &str, reg: PodRegistration) -> Result<(), RegisterError> {
        if reg.model.is_empty() {
            return Err(RegisterError::EmptyModel);
        }
        if !valid_pod_id(id) {
            return Err(RegisterError::BadPodId(id.to_string()));
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
        let joined = match self.index(&reg.model) {
            Some(ix) => ix.join(id).map(|_| ()).map_err(|e| e.to_string()),
            None => Err(format!(
                "the sidecar indexes {} models already",
                crate::ingest::MAX_MODELS
            )),
        };
        joined.map_err(|e| {
            self.metrics.pods_refused.inc();
            self.pods.lock().remove(id);
            RegisterError::ModelFull(e)
        })?;
        Ok(())
    }

    /// Two-phase removal: the pod is out of every later decision when this returns.
    pub fn remove_pod(&self, id: &str, reason: &str) -> bool {
        self.remove_pod_at(id, reason, Instant::now())
    }

    pub fn remove_pod_at(&self, id: &str, reason: &str, now: Instant) -> bool {
        let cfg = self.config();
        let (pod, deltas) = {
            let mut pods = self.pods.lock();
            let Some(pod) = pods.remove(id) else {
                return false;
            };
            // Under the registry lock: no route can commit to the pod after this.
            (pod, self.ledger.forget_pod(id, now, &cfg))
        };
        self.publish(deltas);
        if reason != "liveness" {
            let mut t = self.tombstones.lock();
            // Bounded: under churn beyond this, the oldest guard against a stale engine's
            // return is the one given up (any one, in fact: none is worth unbounded memory).
            if t.len() >= crate::ingest::MAX_PODS {
                if let Some(k) = t.keys().next().cloned() {
                    t.remove(&k);
                }
            }
            t.insert(id.to_string(), pod.epoch.clone());
        }
        self.drop_from_index(&pod.reg.model, id);
        self.metrics.forget_pod(id);
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

    /// The outbox is published from now on (by the NATS task or a simulator).
    /// (The ledger builds deltas only while this is on.)
    pub fn enable_replica_sync(&self, on: bool) {
        self.ledger.set_announce(on);
    }

    /// Queue load deltas for the other replicas; never waits.
    pub(crate) fn publish(&self, deltas: Vec<LoadDelta>) {
        for d in deltas {
            let outcome = match self.outbox.try_send(d) {
                Ok(()) => "queued",
                Err(_) => "dropped_full",
            };
            self.metrics.replica_deltas.inc(outcome, 1);
        }
    }

    /// Apply another replica's load change (for a pod this replica knows).
    pub fn apply_remote(&self, l: &LoadDelta) {
        self.apply_remote_at(l, Instant::now())
    }

    pub fn apply_remote_at(&self, l: &LoadDelta, now: Instant) {
        let cfg = self.config();
        let pods = self.pods.lock();
        let applied = match pods.get_key_value(l.pod.as_str()) {
            Some((id, _)) => self.ledger.apply_remote(id, l, now, &cfg),
            None => false,
        };
        drop(pods);
        self.metrics
            .replica_deltas
            .inc(if applied { "applied" } else { "ignored" }, 1);
    }

    /// Release projected load whose report never came (ours, or another replica's).
    pub fn expire_load(&self, now: Instant) {
        let cfg = self.config();
        let timeout = std::time::Duration::from_secs(cfg.load_timeout_s);
        let (gone, deltas) = self.ledger.expire(now, timeout, &cfg);
        self.metrics
            .load_released
            .inc(Release::Timeout.label(), gone.len() as u64);
        self.publish(deltas);
    }

    pub fn set_tokenizers(&self, t: crate::tokenize::Tokenizers) {
        *self.tokenizers.write() = Arc::new(t);
    }

    pub fn tokenizers(&self) -> Arc<crate::tokenize::Tokenizers> {
        self.tokenizers.read().clone()
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
        g.inflight = self.ledger.outstanding() as u64;
        g
    }
}

pub use kvroute_shared::protocol::valid_pod_addr as valid_pod_id;

/// A replica id is one NATS subject token.
pub fn valid_replica_id(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}
