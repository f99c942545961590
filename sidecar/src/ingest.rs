//! Engine events → index and registry. The one path for NATS, `POST /v1/events` and
//! dumps, so every source gets the same checks.
//!
//! Per pod the sidecar tracks `(epoch, seq)`: a new epoch is an engine restart (its old
//! blocks go at once, via a fresh index slot); `seq ≤ last` is a duplicate or replay
//! (ignored, so applying a batch twice or from two consumers ends as once); a gap marks
//! the pod stale and triggers a resync (its dump URL if registered or advertised in the
//! batches, otherwise its blocks are dropped and rebuilt from live events). Batches of one pod are applied under that
//! pod's ingest lock, so two consumers cannot interleave them out of order.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kvroute_shared::protocol::{Event, EventBatch, PodRegistration};
use parking_lot::Mutex;

use crate::index::{ModelIndex, PodHandle};
use crate::pods::{EngineLoad, Pod};
use crate::state::{ResyncJob, Sidecar};

/// Why a well-formed batch was refused (decode errors are refused before this).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IngestError {
    Unregistered(String),
    Removed(String),
    ModelMismatch {
        pod: String,
        registered: String,
        got: String,
    },
    Full(String),
}

impl IngestError {
    pub fn reason(&self) -> &'static str {
        match self {
            IngestError::Unregistered(_) => "unregistered_pod",
            IngestError::Removed(_) => "removed_pod",
            IngestError::ModelMismatch { .. } => "model_mismatch",
            IngestError::Full(_) => "model_full",
        }
    }
}

impl std::fmt::Display for IngestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IngestError::Unregistered(p) => {
                write!(f, "pod {p} is not registered (require_registration is on)")
            }
            IngestError::ModelMismatch {
                pod,
                registered,
                got,
            } => {
                write!(
                    f,
                    "pod {pod} is registered for model {registered:?}, batch says {got:?}"
                )
            }
            IngestError::Full(m) => f.write_str(m),
            IngestError::Removed(p) => write!(
                f,
                "pod {p} was removed; its events are refused until it restarts (new epoch) or is registered again"
            ),
        }
    }
}

/// What a batch did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Ingested {
    pub duplicate: bool,
    pub restarted: bool,
    pub gap: bool,
    pub blocks_changed: u64,
    pub removed_pod: bool,
}

/// Per-pod ingest locks (kept apart from the registry so the registry lock stays short).
#[derive(Default)]
pub struct IngestLocks(Mutex<HashMap<Arc<str>, Arc<Mutex<()>>>>);

impl IngestLocks {
    fn get(&self, pod: &str) -> Arc<Mutex<()>> {
        let mut m = self.0.lock();
        if let Some(l) = m.get(pod) {
            return l.clone();
        }
        let l = Arc::new(Mutex::new(()));
        m.insert(Arc::from(pod), l.clone());
        l
    }
}

pub fn ingest(
    sc: &Sidecar,
    locks: &IngestLocks,
    batch: &EventBatch,
) -> Result<Ingested, IngestError> {
    ingest_at(sc, locks, batch, Instant::now())
}

/// [`ingest`] at `now` (the simulator's virtual clock).
pub fn ingest_at(
    sc: &Sidecar,
    locks: &IngestLocks,
    batch: &EventBatch,
    now: Instant,
) -> Result<Ingested, IngestError> {
    let r = ingest_inner(sc, locks, batch, now);
    match &r {
        Ok(i) if i.duplicate => {
            sc.metrics.duplicates.inc();
        }
        Ok(i) => {
            sc.metrics.events_applied.inc();
            sc.metrics.event_blocks.inc_by(i.blocks_changed);
            if let Some(ts) = batch.ts {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs_f64())
                    .unwrap_or(ts);
                sc.metrics.set_event_lag(&batch.pod, (now - ts).max(0.0));
            }
        }
        Err(e) => sc.metrics.events_rejected.inc(e.reason(), 1),
    }
    r
}

fn ingest_inner(
    sc: &Sidecar,
    locks: &IngestLocks,
    b: &EventBatch,
    now: Instant,
) -> Result<Ingested, IngestError> {
    let cfg = sc.config();
    let lock = locks.get(&b.pod);
    let _serial = lock.lock();
    let mut out = Ingested::default();
    {
        let mut t = sc.tombstones.lock();
        if let Some(epoch) = t.get(b.pod.as_str()) {
            if epoch.is_none() || epoch.as_deref() == Some(b.epoch.as_str()) {
                return Err(IngestError::Removed(b.pod.clone()));
            }
            t.remove(b.pod.as_str());
        }
    }
    let index = sc.index(&b.model);

    // Position in the pod's stream, under the registry lock (short).
    let resync_url;
    let mut drop_blocks = false;
    {
        let mut pods = sc.pods.lock();
        let pod = match pods.get_mut(b.pod.as_str()) {
            Some(p) => p,
            None if cfg.require_registration => {
                return Err(IngestError::Unregistered(b.pod.clone()))
            }
            None => {
                let reg = PodRegistration {
                    model: b.model.clone(),
                    ..Default::default()
                };
                pods.entry(Arc::from(b.pod.as_str()))
                    .or_insert_with(|| Pod::new(&b.pod, reg, false, now))
            }
        };
        if pod.reg.model != b.model {
            return Err(IngestError::ModelMismatch {
                pod: b.pod.clone(),
                registered: pod.reg.model.clone(),
                got: b.model.clone(),
            });
        }
        pod.last_seen = now;
        // An engine-side publisher may say where its dump is; an explicit registration's
        // word wins.
        if !pod.registered && b.dump_url.is_some() && pod.reg.dump_url != b.dump_url {
            pod.reg.dump_url = b.dump_url.clone();
        }
        if pod.epoch.as_deref() != Some(b.epoch.as_str()) {
            if pod.epoch.is_some() {
                out.restarted = true;
            }
            pod.epoch = Some(b.epoch.clone());
            pod.last_seq = None;
            pod.stale = false;
        }
        match pod.last_seq {
            Some(last) if b.seq <= last => {
                out.duplicate = true;
                return Ok(out);
            }
            Some(last) if b.seq > last + 1 => out.gap = true,
            // First batch we see of this epoch, not its first: we missed the start (our
            // own restart, or the engine's early batches). Resync when a dump is known.
            None if b.seq > 0
                && !out.restarted
                && (pod.events_seen || pod.reg.dump_url.is_some()) =>
            {
                out.gap = true
            }
            _ => {}
        }
        pod.last_seq = Some(b.seq);
        if b.events.iter().any(|e| {
            matches!(
                e,
                Event::Stored { .. } | Event::Removed { .. } | Event::Cleared
            )
        }) {
            pod.events_seen = true;
        }
        resync_url = if out.gap {
            pod.reg.dump_url.clone()
        } else {
            None
        };
        if out.gap {
            sc.metrics.seq_gaps.inc();
            match resync_url {
                Some(_) => pod.stale = true,
                None => drop_blocks = true,
            }
        }
    }

    let mut handle = index.join(&b.pod).map_err(|e| {
        sc.metrics.pods_refused.inc();
        IngestError::Full(e.to_string())
    })?;
    if out.restarted {
        sc.metrics.epochs.inc();
        handle = reset_pod(sc, &index, b, "new epoch")?;
    }
    if drop_blocks {
        sc.metrics.resyncs.inc("drop", 1);
        handle = reset_pod(sc, &index, b, "sequence gap, no dump url")?;
    }
    if let Some(url) = resync_url {
        let _ = sc.resync_tx.send(ResyncJob {
            pod: Arc::from(b.pod.as_str()),
            model: b.model.clone(),
            url,
        });
    }

    let mut load = None;
    for ev in &b.events {
        match ev {
            Event::Stored { tier, blocks, .. } => {
                if let Ok(a) = index.store(handle, *tier, blocks) {
                    out.blocks_changed += a.changed;
                }
            }
            Event::Removed { tier, blocks } => {
                if let Ok(a) = index.remove(handle, *tier, blocks) {
                    out.blocks_changed += a.changed;
                }
            }
            Event::Cleared => handle = reset_pod(sc, &index, b, "cleared")?,
            Event::Shutdown => {
                sc.remove_pod_at(&b.pod, "shutdown", now);
                out.removed_pod = true;
                return Ok(out);
            }
            Event::Load {
                running,
                waiting,
                kv_usage,
                ..
            } => {
                load = Some(EngineLoad {
                    running: *running,
                    waiting: *waiting,
                    kv_usage: *kv_usage,
                    at: now,
                });
            }
        }
    }
    if let Some(l) = load {
        if let Some(p) = sc.pods.lock().get_mut(b.pod.as_str()) {
            p.engine = Some(l);
        }
    }
    Ok(out)
}

/// Drop all of a pod's blocks at once: it moves to a fresh slot, the old one is cleaned
/// in the background.
fn reset_pod(
    sc: &Sidecar,
    index: &Arc<ModelIndex>,
    b: &EventBatch,
    why: &str,
) -> Result<PodHandle, IngestError> {
    let (h, old) = index
        .reset(&b.pod)
        .map_err(|e| IngestError::Full(e.to_string()))?;
    if let Some(r) = old {
        sc.queue_cleanup(index.clone(), r);
    }
    if let Some((ix, r)) = sc.predicted.forget(&b.model, &b.pod) {
        sc.queue_cleanup(ix, r);
    }
    tracing::debug!(pod = %b.pod, why, "pod blocks dropped");
    Ok(h)
}

/// Replace a pod's blocks with a full dump (after a gap), then clear its stale mark.
pub fn apply_dump(
    sc: &Sidecar,
    locks: &IngestLocks,
    pod: &str,
    dump: &EventBatch,
) -> Result<u64, IngestError> {
    let lock = locks.get(pod);
    let _serial = lock.lock();
    let index = sc.index(&dump.model);
    let (h, old) = index
        .reset(pod)
        .map_err(|e| IngestError::Full(e.to_string()))?;
    if let Some(r) = old {
        sc.queue_cleanup(index.clone(), r);
    }
    let mut n = 0;
    for ev in &dump.events {
        if let Event::Stored { tier, blocks, .. } = ev {
            if let Ok(a) = index.store(h, *tier, blocks) {
                n += a.changed;
            }
        }
    }
    if let Some(p) = sc.pods.lock().get_mut(pod) {
        p.stale = false;
        // The dump is the state as of its own (epoch, seq).
        if p.epoch.as_deref() == Some(dump.epoch.as_str()) {
            p.last_seq = Some(p.last_seq.map_or(dump.seq, |s| s.max(dump.seq)));
        }
    }
    sc.metrics.resyncs.inc("dump", 1);
    Ok(n)
}

/// Drop a pod's blocks (a gap with no usable dump) and clear its stale mark.
pub fn drop_blocks(sc: &Sidecar, locks: &IngestLocks, pod: &str, model: &str) {
    let lock = locks.get(pod);
    let _serial = lock.lock();
    if let Some(ix) = sc.indexes.get(model) {
        if ix.handle(pod).is_some() {
            if let Ok((_, Some(old))) = ix.reset(pod) {
                sc.queue_cleanup(ix.clone(), old);
            }
        }
    }
    if let Some(p) = sc.pods.lock().get_mut(pod) {
        p.stale = false;
    }
}
