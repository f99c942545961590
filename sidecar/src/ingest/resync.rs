//! Resyncs: a pod that fell behind (a sequence gap) gets its blocks from a dump — the
//! engine-side publisher's snapshot at its own seq — completed with the batches applied
//! since the gap; without a usable dump its blocks are dropped and rebuilt from live
//! events. Dump URLs named by batches are held to the pod's own address.

use kvroute_shared::protocol::{Event, EventBatch};

use super::{reset_pod, IngestError, IngestLocks};
use crate::state::Sidecar;

/// An http(s) URL whose host is the pod's own IP: the only dump location a batch may
/// name (a registration may name any).
pub fn dump_url_on_pod(url: &str, pod: &str) -> bool {
    let (Ok(u), Ok(addr)) = (
        reqwest::Url::parse(url),
        pod.parse::<std::net::SocketAddr>(),
    ) else {
        return false;
    };
    let host_is_pod = u
        .host_str()
        .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
        .and_then(|h| h.parse::<std::net::IpAddr>().ok())
        .is_some_and(|ip| ip == addr.ip());
    matches!(u.scheme(), "http" | "https") && host_is_pod && u.username().is_empty()
}

/// Replace a pod's blocks with a full dump (after a gap), then clear its stale mark.
pub fn apply_dump(
    sc: &Sidecar,
    locks: &IngestLocks,
    pod: &str,
    dump: &EventBatch,
) -> Result<u64, IngestError> {
    let lock = locks.get(pod);
    let mut stream = lock.lock();
    let replay = stream.replay.take();
    // A pod removed (or moved to another model) while its dump was on the way stays
    // removed: the dump must not give it a slot again.
    if sc
        .pods
        .lock()
        .get(pod)
        .is_none_or(|p| p.reg.model != dump.model)
    {
        return Err(IngestError::Removed(pod.to_string()));
    }
    let index = sc
        .index(&dump.model)
        .ok_or_else(|| IngestError::TooManyModels(dump.model.clone()))?;
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
    // The dump is the state as of its own (epoch, seq): the batches applied since the
    // gap that came after it are applied again on top, in order, so nothing they stored
    // or removed is lost to the reset.
    let mut h = h;
    let mut replayed = 0;
    for b in replay.iter().flatten() {
        if b.epoch != dump.epoch || b.seq <= dump.seq {
            continue;
        }
        for ev in &b.events {
            match ev {
                Event::Stored { tier, blocks, .. } => {
                    if let Ok(a) = index.store(h, *tier, blocks) {
                        n += a.changed;
                    }
                }
                Event::Removed { tier, blocks } => {
                    let _ = index.remove(h, *tier, blocks);
                }
                Event::Cleared => h = reset_pod(sc, &index, b, "cleared (replayed)")?,
                Event::Shutdown | Event::Load { .. } => {}
            }
        }
        replayed += 1;
    }
    if let Some(p) = sc.pods.lock().get_mut(pod) {
        p.stale = false;
        if p.epoch.as_deref() == Some(dump.epoch.as_str()) {
            p.last_seq = Some(p.last_seq.map_or(dump.seq, |s| s.max(dump.seq)));
        }
    }
    sc.metrics.resyncs.inc("dump", 1);
    if replayed > 0 {
        sc.metrics.resyncs.inc("replayed_batches", replayed);
    }
    Ok(n)
}

/// Drop a pod's blocks (a gap with no usable dump) and clear its stale mark.
pub fn drop_blocks(sc: &Sidecar, locks: &IngestLocks, pod: &str, model: &str) {
    let lock = locks.get(pod);
    let mut stream = lock.lock();
    stream.replay = None;
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
