//! Applying a batch's events to the index and predicted residency: the one loop that
//! live ingestion, dump snapshots and the replay of batches over a dump all use, so a
//! rule about an event kind is kept once. A batch's work is bounded by its own events:
//! its `cleared` events collapse into one reset, a reset of a pod holding nothing is
//! free, and none scrubs the index inline (`ModelIndex::reset`).

use std::sync::Arc;
use std::time::Instant;

use kvroute_shared::protocol::{Event, EventBatch};

use super::error::IngestError;
use crate::index::{ModelIndex, PodHandle};
use crate::registry::EngineLoad;
use crate::state::Sidecar;

/// Where the events come from, which decides what each kind means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Source {
    /// A live batch: every kind counts; `shutdown` removes the pod and ends the batch.
    Live,
    /// A dump: the pod's cache as a snapshot, so only its stored blocks count.
    Snapshot,
    /// A batch recorded during a resync, applied again over its dump: block changes
    /// only (its load report and any shutdown were acted on when it arrived).
    Replay,
}

/// What applying a batch's events did.
#[derive(Debug)]
pub(super) struct Applied {
    /// The pod's handle after the events (a `cleared` moves it to a fresh slot).
    pub handle: PodHandle,
    pub blocks_changed: u64,
    /// The last engine load report in the batch.
    pub load: Option<EngineLoad>,
    /// The batch said the engine shut down; the pod was removed.
    pub removed_pod: bool,
}

pub(super) fn apply_events(
    sc: &Sidecar,
    index: &Arc<ModelIndex>,
    mut handle: PodHandle,
    b: &EventBatch,
    source: Source,
    now: Instant,
) -> Result<Applied, IngestError> {
    let mut out = Applied {
        handle,
        blocks_changed: 0,
        load: None,
        removed_pod: false,
    };
    // Whatever a batch stores or removes before its last `cleared` is gone with it: one
    // reset per batch, however many it carries.
    let last_clear = b.events.iter().rposition(|e| matches!(e, Event::Cleared));
    for (i, ev) in b.events.iter().enumerate() {
        let moot = last_clear.is_some_and(|l| i < l)
            && matches!(
                ev,
                Event::Stored { .. } | Event::Removed { .. } | Event::Cleared
            );
        if moot {
            continue;
        }
        match (ev, source) {
            (Event::Stored { tier, blocks, .. }, _) => {
                if let Ok(a) = index.store(handle, *tier, blocks) {
                    out.blocks_changed += a.changed;
                }
            }
            (_, Source::Snapshot) => {}
            (Event::Removed { tier, blocks }, _) => {
                if let Ok(a) = index.remove(handle, *tier, blocks) {
                    out.blocks_changed += a.changed;
                }
            }
            (Event::Cleared, _) => handle = reset_pod(sc, index, &b.pod, &b.model, "cleared")?,
            (Event::Shutdown, Source::Live) => {
                sc.remove_pod_at(&b.pod, "shutdown", now);
                out.removed_pod = true;
                break;
            }
            (
                Event::Load {
                    running,
                    waiting,
                    kv_usage,
                    ..
                },
                Source::Live,
            ) => {
                out.load = Some(EngineLoad {
                    running: *running,
                    waiting: *waiting,
                    kv_usage: *kv_usage,
                    at: now,
                    finished_before: sc.ledger().finished(&b.pod),
                });
            }
            (Event::Shutdown | Event::Load { .. }, Source::Replay) => {}
        }
    }
    out.handle = handle;
    Ok(out)
}

/// A fresh (or, if it held nothing, the same) slot for the pod, its old one queued for
/// the cleaner. With no slot free the pod is left out of the index until one frees
/// (`Full`), never scrubbed inline.
pub(super) fn reset_slot(
    sc: &Sidecar,
    index: &Arc<ModelIndex>,
    pod: &str,
) -> Result<PodHandle, IngestError> {
    match index.reset(pod) {
        Ok((h, old)) => {
            if let Some(r) = old {
                sc.queue_cleanup(index.clone(), r);
            }
            Ok(h)
        }
        Err(u) => {
            if let Some(r) = u.retired {
                sc.queue_cleanup(index.clone(), r);
            }
            Err(IngestError::Full(format!(
                "pod {pod} reset with no free slot in its model's index: left out of lookups until one frees"
            )))
        }
    }
}

/// Drop all of a pod's blocks at once: it moves to a fresh slot, the old one is cleaned
/// in the background; its predicted residency goes too.
pub(super) fn reset_pod(
    sc: &Sidecar,
    index: &Arc<ModelIndex>,
    pod: &str,
    model: &str,
    why: &str,
) -> Result<PodHandle, IngestError> {
    let h = reset_slot(sc, index, pod)?;
    if let Some((ix, r)) = sc.predicted.forget(model, pod) {
        sc.queue_cleanup(ix, r);
    }
    sc.returns.forget(pod);
    tracing::debug!(pod, why, "pod blocks dropped");
    Ok(h)
}
