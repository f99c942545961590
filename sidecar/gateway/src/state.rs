//! The sidecar's shared state: the confirmed index, predicted residency, the pod
//! registry, the load ledger, the policy in force and metrics. Request handlers, the
//! NATS consumer and the background tasks all hold an `Arc<Sidecar>`. Each piece has
//! its own owner (the registry, the ledger, the indexes); `Sidecar` only coordinates the
//! operations that span several: registering and removing a pod, applying another
//! replica's load.
//!
//! Data flows one way: events → [`crate::ingest`] → registry and index; route requests
//! → [`crate::route`] (index lookup → policy → decision → ledger); reports → ledger
//! release and prediction feedback. Work that must not run on a request's path (phase 2
//! of pod removal, publishing load deltas) is queued to background tasks.
//!
//! Lock order, wherever two are held: the registry, then the ledger; the index locks
//! are never held with either (docs/architecture.md).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use kvroute_shared::protocol::{LoadDelta, LoadOp, PodRegistration, PolicyConfig};
use parking_lot::RwLock;
use tokio::sync::mpsc;

use crate::index::{Indexes, ModelIndex, Retired};
use crate::ledger::{Ledger, Release};
use crate::metrics::{Gauges, Metrics};
use crate::predicted::Predicted;
use crate::registry::{RegisterError, Registry, MAX_MODELS};

/// Phase 2 of a pod removal, for the cleaner.
pub struct CleanupJob {
    pub index: Arc<ModelIndex>,
    pub retired: Retired,
}

pub struct Channels {
    pub cleanup: mpsc::UnboundedReceiver<CleanupJob>,
    /// Load deltas for the other replicas; whoever takes it must call
    /// [`Sidecar::enable_replica_sync`] (the NATS publisher, or the simulator).
    pub outbox: mpsc::Receiver<LoadDelta>,
}

/// Load deltas waiting to be published. Bounded: while NATS is slow or down the newest
/// are dropped and counted, so neither memory nor a route call waits on it (the other
/// replicas expire what they miss after `load_timeout_s`).
pub const OUTBOX_CAPACITY: usize = 4096;

pub struct Sidecar {
    pub(crate) indexes: Indexes,
    pub(crate) predicted: Predicted,
    /// Eviction pressure on token chains, from sessions' returning turns.
    pub(crate) returns: crate::returns::Returns,
    registry: Registry,
    config: RwLock<Arc<PolicyConfig>>,
    ledger: Ledger,
    pub metrics: Metrics,
    cleanup_tx: mpsc::UnboundedSender<CleanupJob>,
    pub(crate) nats_configured: AtomicBool,
    pub started: Instant,
    outbox: mpsc::Sender<LoadDelta>,
    /// The last decisions, for the status page (written by `route::route` only).
    pub recent: crate::recent::Recent,
    /// Per model: do engines' cached_tokens agree with the index (written by reports).
    pub agreement: crate::agreement::Agreement,
    /// Tokens per byte of text chains, per model and pod (written by reports).
    pub text_tokens: crate::text_tokens::TextTokens,
    /// Tokenizers by model (set at start; read by routes that carry a prompt body).
    tokenizers: RwLock<Arc<crate::tokenize::Tokenizers>>,
    /// Client text tokenizing now, in bytes, against its cap (every tokenizing path).
    pub tokenize_budget: crate::tokenize::Budget,
    /// Sessions and Responses ids bound to pods (written by route commits, reports and
    /// other replicas' deltas; read by routes).
    pub(crate) bindings: crate::affinity::Bindings,
    /// Requests waiting for room while their model is saturated (written by route
    /// calls, wait calls and the dispatcher; `admission::waiting`).
    pub waiting: crate::admission::Waiting,
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
            returns: Default::default(),
            registry: Registry::default(),
            config: RwLock::new(Arc::new(cfg)),
            ledger: Ledger::new(replica),
            metrics,
            cleanup_tx,
            nats_configured: AtomicBool::new(false),
            started: Instant::now(),
            outbox,
            recent: Default::default(),
            agreement: Default::default(),
            text_tokens: Default::default(),
            bindings: Default::default(),
            tokenizers: Default::default(),
            tokenize_budget: Default::default(),
            waiting: Default::default(),
        };
        Ok((
            Arc::new(sc),
            Channels {
                cleanup,
                outbox: outbox_rx,
            },
        ))
    }

    pub fn config(&self) -> Arc<PolicyConfig> {
        self.config.read().clone()
    }

    /// Whether the sidecar routes from everything it was told to follow: `Err` names
    /// what is missing (it still routes, from HTTP ingestion and prediction). `/readyz`
    /// and the picker's gRPC readiness both answer this.
    pub fn ready(&self) -> Result<(), &'static str> {
        let nats_wanted = self
            .nats_configured
            .load(std::sync::atomic::Ordering::Relaxed);
        if nats_wanted && self.metrics.nats_connected.get() != 1 {
            return Err("nats disconnected");
        }
        Ok(())
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
    /// [`MAX_MODELS`] other models already.
    pub fn index(&self, model: &str) -> Option<Arc<ModelIndex>> {
        let cap = self.config().model(model).max_blocks;
        self.indexes.get_or_create_capped(model, cap, MAX_MODELS)
    }

    /// The bytes every index together may hold (`--max-index-mb`): three quarters for
    /// the confirmed indexes (engines' events), a quarter for predicted residency.
    pub fn set_index_budget(&self, bytes: u64) {
        let entries = bytes / crate::index::BUDGET_BYTES_PER_ENTRY;
        self.indexes.set_budget(entries / 4 * 3);
        self.predicted.indexes.set_budget(entries / 4);
    }

    /// The budget set by [`Sidecar::set_index_budget`], in bytes (None: unbounded).
    pub fn index_budget(&self) -> Option<u64> {
        let e = self
            .indexes
            .budget()
            .checked_add(self.predicted.indexes.budget())?;
        e.checked_mul(crate::index::BUDGET_BYTES_PER_ENTRY)
    }

    /// Evict every index down to its cap (a new model took its share of the budget).
    pub fn trim_indexes(&self) -> u64 {
        self.indexes.trim() + self.predicted.indexes.trim()
    }

    /// The pod registry (its methods keep its rules; nothing else holds its lock).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    pub fn queue_cleanup(&self, index: Arc<ModelIndex>, retired: Retired) {
        if let Err(e) = self.cleanup_tx.send(CleanupJob { index, retired }) {
            // No cleaner (tests, shutdown): clean inline rather than leak the slot.
            let job = e.0;
            job.index.cleanup(job.retired);
        }
    }

    /// The load ledger (read-only views and tests; routes and reports change it).
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// This replica's id (names its decisions and load deltas).
    pub fn replica(&self) -> &str {
        self.ledger.replica()
    }

    /// Register or update a pod (`PUT /v1/pods/{id}`), and give it its index slot now,
    /// so that the 257th pod of a model is refused at registration.
    pub fn register(&self, id: &str, reg: PodRegistration) -> Result<(), RegisterError> {
        let model = reg.model.clone();
        if let Some(old) = self.registry.register(id, reg, Instant::now())? {
            self.drop_from_index(&old, id);
        }
        let joined = match self.index(&model) {
            Some(ix) => ix.join(id).map(|_| ()).map_err(|e| e.to_string()),
            None => Err(format!("the sidecar indexes {MAX_MODELS} models already")),
        };
        joined.map_err(|e| {
            self.metrics.pods_refused.inc();
            self.registry.refuse(id);
            RegisterError::ModelFull(e)
        })
    }

    /// Two-phase removal: the pod is out of every later decision when this returns.
    pub fn remove_pod(&self, id: &str, reason: &str) -> bool {
        self.remove_pod_at(id, reason, Instant::now())
    }

    /// A pod removed by an operator or by its own shutdown event keeps a tombstone (its
    /// epoch's events are refused, so it does not come back with its next load report);
    /// one removed for silence may come back with its next batch.
    pub fn remove_pod_at(&self, id: &str, reason: &str, now: Instant) -> bool {
        let cfg = self.config();
        // Under the registry lock: no route can commit to the pod after this.
        let removed = self.registry.remove(id, reason != "liveness", |_| {
            self.ledger.forget_pod(id, now, &cfg)
        });
        let Some((pod, deltas)) = removed else {
            return false;
        };
        self.publish(deltas);
        self.drop_from_index(&pod.reg.model, id);
        self.text_tokens.forget_pod(id);
        self.returns.forget(id);
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
        // Every replica subscribes to all replicas' subjects, its own included: its own
        // deltas come back, and an echo of an older turn would rebind that turn's
        // session to the pod it had then (and the ledger already has its own load).
        if l.replica == self.replica() {
            self.metrics.replica_deltas.inc("own", 1);
            return;
        }
        let cfg = self.config();
        // Under a registry view: a pod removed meanwhile gets no load after its removal.
        let pods = self.registry.view();
        let applied = match pods.id(&l.pod) {
            Some(id) => {
                // The other replica's bindings: its session went there, its
                // conversation without one, or its response is stored there.
                use crate::affinity::{self, Kind};
                // A tip is a place in a chain (blocks up to and including it) or nothing.
                let tip = l.tip.and_then(|[n, h]| Some((u32::try_from(n).ok()?, h)));
                let tip = tip.filter(|(n, _)| *n > 0);
                let max = cfg.max_bindings as usize;
                let bind = |kind, key: u64, tip| {
                    let bound = affinity::Bound {
                        pod: id.clone(),
                        tokens: l.bound_tokens,
                        tip,
                    };
                    self.bindings.bind(kind, key, bound, now, max);
                };
                match (l.op, l.session, tip) {
                    (LoadOp::Add, Some(key), _) => bind(Kind::Session, key, tip),
                    (LoadOp::Add, None, Some((_, last))) => {
                        let m = affinity::model_key(&l.model);
                        if let Some(was) = l.tip_was.filter(|w| *w != last) {
                            self.bindings
                                .unbind(Kind::Prompt, affinity::tip_key(m, was));
                        }
                        bind(Kind::Prompt, affinity::tip_key(m, last), tip);
                    }
                    (LoadOp::Add, None, None) => {}
                    (LoadOp::Release, ..) => {
                        if let Some(key) = l.response {
                            bind(Kind::Response, key, None);
                        }
                    }
                }
                self.ledger.apply_remote(id, l, now, &cfg)
            }
            None => false,
        };
        drop(pods);
        self.metrics
            .replica_deltas
            .inc(if applied { "applied" } else { "ignored" }, 1);
    }

    /// A decision of ours left the ledger (reported, abandoned or timed out): its
    /// predicted guesses are settled, so a request that finds them missing from now on
    /// has seen an eviction, not a prefill still running.
    pub(crate) fn settle(&self, d: &crate::ledger::Decision) {
        self.predicted.settle(d.cache_pod(), d.id);
    }

    /// Release projected load whose report never came (ours, or another replica's).
    pub fn expire_load(&self, now: Instant) {
        let cfg = self.config();
        let timeout = std::time::Duration::from_secs(cfg.load_timeout_s);
        let (gone, deltas) = self.ledger.expire(now, timeout, &cfg);
        for d in &gone {
            self.settle(d);
        }
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
        (g.pods_stale, g.pods_live) = self.registry.counts(Instant::now());
        for (m, ix) in self.indexes.all() {
            let s = ix.stats();
            g.pods_draining += s.draining_pods as u64;
            g.index.push((m, s.entries, s.heap_bytes));
        }
        g.predicted_entries = self.predicted.entries();
        g.tokenizers = self
            .tokenizers()
            .models()
            .map(|(m, t)| (m.clone(), t.cache_stats(), t.chunk_stats()))
            .collect();
        g.inflight = self.ledger.outstanding() as u64;
        g.queued = self
            .waiting
            .depths()
            .into_iter()
            .map(|(m, p, t, n)| (m, p, t.to_string(), n))
            .collect();
        g
    }
}

/// A replica id is one NATS subject token.
pub fn valid_replica_id(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}
