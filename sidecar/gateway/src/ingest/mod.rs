//! Engine events → registry and index: the one path for NATS, `POST /v1/events` and
//! dumps, so every source gets the same checks. A batch runs named steps, one way, as a
//! route does: [`admit`](Registry::admit) → index → the pod's stream lock → `advance`
//! (the registry's stream position: epoch, seq, gap) → `join` (the pod's index slot) →
//! [`recovery::plan`] (restart, gap, resync, replay buffer) → [`apply::apply_events`]
//! (index and predicted residency) → engine load.
//!
//! Per pod the registry tracks `(epoch, seq)`: a new epoch is an engine restart (its old
//! blocks go at once, via a fresh index slot); `seq ≤ last` is a duplicate or replay
//! (ignored, so applying a batch twice or from two consumers ends as once); a gap marks
//! the pod stale and triggers a resync (its dump URL if registered or advertised in the
//! batches, otherwise its blocks are dropped and rebuilt from live events). Batches of one
//! pod are applied under that pod's stream lock, so two consumers cannot interleave them
//! out of order.

mod apply;
mod error;
mod queue;
mod recovery;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Instant;

use kvroute_shared::protocol::EventBatch;

use crate::index::{ModelIndex, PodHandle};
use crate::registry::Advance;
use crate::state::Sidecar;

pub use error::IngestError;
pub use queue::{run_workers, IngestQueue, QueueFull};
pub use recovery::{fetch_dumps, Recovery, ResyncJob};

/// What a batch did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Ingested {
    pub duplicate: bool,
    pub restarted: bool,
    pub gap: bool,
    pub blocks_changed: u64,
    pub removed_pod: bool,
}

pub fn ingest(sc: &Sidecar, rec: &Recovery, batch: &EventBatch) -> Result<Ingested, IngestError> {
    ingest_at(sc, rec, batch, Instant::now())
}

/// [`ingest`] at `now` (the simulator's virtual clock).
pub fn ingest_at(
    sc: &Sidecar,
    rec: &Recovery,
    batch: &EventBatch,
    now: Instant,
) -> Result<Ingested, IngestError> {
    let r = steps(sc, rec, batch, now);
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

fn steps(
    sc: &Sidecar,
    rec: &Recovery,
    b: &EventBatch,
    now: Instant,
) -> Result<Ingested, IngestError> {
    let cfg = sc.config();
    // Admission, before anything is allocated for this pod or model.
    sc.registry()
        .admit(&b.pod, &b.model, cfg.require_registration)?;
    let index = sc
        .index(&b.model)
        .ok_or_else(|| IngestError::TooManyModels(b.model.clone()))?;
    let lock = rec.stream(&b.pod);
    let mut stream = lock.lock();
    let adv = advance(sc, b, cfg.require_registration, now)?;
    if adv.duplicate {
        return Ok(Ingested {
            duplicate: true,
            ..Default::default()
        });
    }
    let handle = join(sc, &index, b)?;
    let handle = recovery::plan(sc, rec, &mut stream, &index, b, &adv, handle)?;
    if adv.late {
        // Older than what the index reflects: the recovery just planned replaces it.
        sc.metrics.events_rejected.inc("late", 1);
        return Ok(Ingested {
            gap: true,
            ..Default::default()
        });
    }
    let applied = apply::apply_events(sc, &index, handle, b, apply::Source::Live, now)?;
    if let Some(load) = applied.load {
        sc.registry().record_engine_load(&b.pod, load);
    }
    Ok(Ingested {
        duplicate: false,
        restarted: adv.restarted,
        gap: adv.gap.is_some(),
        blocks_changed: applied.blocks_changed,
        removed_pod: applied.removed_pod,
    })
}

/// The batch's place in its pod's stream (the registry's rules), counted.
fn advance(
    sc: &Sidecar,
    b: &EventBatch,
    require_registration: bool,
    now: Instant,
) -> Result<Advance, IngestError> {
    let adv = sc.registry().advance(b, require_registration, now)?;
    if adv.dump_url_refused {
        sc.metrics.events_rejected.inc("dump_url_elsewhere", 1);
    }
    if adv.gap.is_some() {
        sc.metrics.seq_gaps.inc();
    }
    if adv.conflict {
        sc.metrics.events_rejected.inc("seq_conflict", 1);
    }
    Ok(adv)
}

/// The pod's slot in its model's index, taken after its stream advanced.
fn join(sc: &Sidecar, index: &Arc<ModelIndex>, b: &EventBatch) -> Result<PodHandle, IngestError> {
    let handle = index.join(&b.pod).map_err(|e| {
        sc.metrics.pods_refused.inc();
        // A pod learned from this very batch leaves no registry entry behind.
        sc.registry().forget_learned(&b.pod);
        IngestError::Full(e.to_string())
    })?;
    // A DELETE between the stream's advance and this join has removed the pod: the slot
    // just taken must not outlive it.
    if !sc.registry().contains(&b.pod) {
        if let Some(r) = index.retire(&b.pod) {
            sc.queue_cleanup(index.clone(), r);
        }
        return Err(crate::registry::StreamError::Removed(b.pod.clone()).into());
    }
    Ok(handle)
}
