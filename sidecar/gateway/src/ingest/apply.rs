//! Applying a batch's events to the index and predicted residency: the one loop that
//! live ingestion, dump snapshots and the replay of batches over a dump all use, so a
//! rule about an event kind is kept once.

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
    for ev in &b.events {
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
                });
            }
            (Event::Shutdown | Event::Load { .. }, Source::Replay) => {}
        }
    }
    out.handle = handle;
    Ok(out)
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
    let (h, old) = index
        .reset(pod)
        .map_err(|e| IngestError::Full(e.to_string()))?;
    if let Some(r) = old {
        sc.queue_cleanup(index.clone(), r);
    }
    if let Some((ix, r)) = sc.predicted.forget(model, pod) {
        sc.queue_cleanup(ix, r);
    }
    tracing::debug!(pod, why, "pod blocks dropped");
    Ok(h)
}
