//! Engine events → index and registry. The one path for NATS, `POST /v1/events` and
//! dumps, so every source gets the same checks.
//!
//! Per pod the sidecar tracks `(epoch, seq)`: a new epoch is an engine restart (its old
//! blocks go at once, via a fresh index slot); `seq ≤ last` is a duplicate or replay
//! (ignored, so applying a batch twice or from two consumers ends as once); a gap marks
//! the pod stale and triggers a resync (its dump URL if registered or advertised in the
//! batches, otherwise its blocks are dropped and rebuilt from live events). Batches of one pod are applied under that
//! pod's ingest lock, so two consumers cannot interleave them out of order.

mod error;
mod resync;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kvroute_shared::protocol::{Event, EventBatch, PodRegistration};
use parking_lot::Mutex;

use crate::index::{ModelIndex, PodHandle};
use crate::pods::{EngineLoad, Pod};
use crate::state::{ResyncJob, Sidecar};

pub use error::IngestError;
pub use resync::{apply_dump, drop_blocks, dump_url_on_pod};

/// Pods the registry tracks at most (registered, and learned from events).
pub const MAX_PODS: usize = 4096;
/// Models the sidecar indexes at most (each index costs ~150 KB empty).
pub const MAX_MODELS: usize = 64;
/// How far a batch may run ahead of the last sequence number of its epoch.
pub const MAX_SEQ_JUMP: u64 = 1 << 16;

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
/// Per-pod ingest state, behind the pod's ingest lock (kept apart from the registry so
/// the registry lock stays short): batches of one pod are applied one at a time.
#[derive(Default)]
pub struct IngestLocks(Mutex<HashMap<Arc<str>, Arc<Mutex<Stream>>>>);

/// What the lock of one pod's stream guards besides the order of its batches.
#[derive(Default)]
pub(super) struct Stream {
    /// While a resync is pending: every batch applied since the gap, so that the dump
    /// (a snapshot at its own seq) can be completed with the batches that came after it
    /// instead of erasing them. `None` when no resync is pending.
    pub(super) replay: Option<Vec<EventBatch>>,
}

/// Batches kept for one pending resync; past this the resync ends without replay (and
/// the pod stays stale until its next gap is repaired).
pub const MAX_REPLAY: usize = 4096;

impl IngestLocks {
    pub(super) fn get(&self, pod: &str) -> Arc<Mutex<Stream>> {
        let mut m = self.0.lock();
        if let Some(l) = m.get(pod) {
            return l.clone();
        }
        // Locks of pods that left are not needed once nobody holds them; admission keeps
        // the live ones under MAX_PODS.
        if m.len() >= MAX_PODS {
            m.retain(|_, l| Arc::strong_count(l) > 1);
        }
        let l = Arc::new(Mutex::new(Stream::default()));
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
    // Admission, before anything is allocated for this pod or model.
    if !crate::state::valid_pod_id(&b.pod) {
        return Err(IngestError::BadPod(b.pod.clone()));
    }
    {
        let pods = sc.pods.lock();
        if !pods.contains_key(b.pod.as_str()) {
            if cfg.require_registration {
                return Err(IngestError::Unregistered(b.pod.clone()));
            }
            if pods.len() >= MAX_PODS {
                return Err(IngestError::TooManyPods(b.pod.clone()));
            }
        }
    }
    let Some(index) = sc.index(&b.model) else {
        return Err(IngestError::TooManyModels(b.model.clone()));
    };
    let lock = locks.get(&b.pod);
    let mut stream = lock.lock();
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
        // word wins. Only a URL on the pod's own address is taken: the sidecar fetches it,
        // and an event must not be able to aim the sidecar's HTTP client elsewhere.
        if !pod.registered && b.dump_url.is_some() && pod.reg.dump_url != b.dump_url {
            match b.dump_url.as_deref().filter(|u| dump_url_on_pod(u, &b.pod)) {
                Some(u) => pod.reg.dump_url = Some(u.to_string()),
                None => sc.metrics.events_rejected.inc("dump_url_elsewhere", 1),
            }
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
            Some(last) if b.seq - last > MAX_SEQ_JUMP => {
                return Err(IngestError::SeqJump {
                    pod: b.pod.clone(),
                    last,
                    got: b.seq,
                })
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

    let mut handle = match index.join(&b.pod) {
        Ok(h) => h,
        Err(e) => {
            sc.metrics.pods_refused.inc();
            // A pod learned from this very batch leaves no registry entry behind.
            let mut pods = sc.pods.lock();
            if pods.get(b.pod.as_str()).is_some_and(|p| !p.registered) {
                pods.remove(b.pod.as_str());
            }
            return Err(IngestError::Full(e.to_string()));
        }
    };
    // A DELETE between the registry update above and this join has removed the pod: the
    // slot just taken must not outlive it.
    if !sc.pods.lock().contains_key(b.pod.as_str()) {
        if let Some(r) = index.retire(&b.pod) {
            sc.queue_cleanup(index.clone(), r);
        }
        return Err(IngestError::Removed(b.pod.clone()));
    }
    if out.restarted {
        sc.metrics.epochs.inc();
        handle = reset_pod(sc, &index, b, "new epoch")?;
    }
    if drop_blocks {
        sc.metrics.resyncs.inc("drop", 1);
        handle = reset_pod(sc, &index, b, "sequence gap, no dump url")?;
    }
    if out.restarted || drop_blocks {
        stream.replay = None;
    }
    if let Some(url) = resync_url {
        if stream.replay.is_none() {
            stream.replay = Some(Vec::new());
        }
        sc.queue_resync(ResyncJob {
            pod: Arc::from(b.pod.as_str()),
            model: b.model.clone(),
            url,
        });
    }
    // Recorded for the pending resync, to be replayed over its dump.
    if let Some(r) = &mut stream.replay {
        if r.len() < MAX_REPLAY {
            r.push(b.clone());
        } else {
            sc.metrics.resyncs.inc("replay_overflow", 1);
            stream.replay = None;
        }
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
pub(super) fn reset_pod(
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
