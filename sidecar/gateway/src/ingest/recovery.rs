//! Recovery after missed batches, as one unit: the per-pod streams (the lock that
//! orders a pod's batches, and the replay buffer a pending resync keeps), the resync
//! queue (one job per pod), the dump fetch with its limits, and applying a dump.
//!
//! A pod that fell behind (a sequence gap) gets its blocks from a dump — the
//! engine-side publisher's snapshot at its own seq — completed with the batches applied
//! since the gap; without a usable dump its blocks are dropped and rebuilt from live
//! events. The cleaner does not fetch: [`fetch_dumps`] is its own task.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_service::Shutdown;
use kvroute_shared::protocol::{Event, EventBatch};
use parking_lot::Mutex;
use tokio::sync::mpsc;

use super::apply::{apply_events, reset_pod, reset_slot, Source};
use super::error::IngestError;
use crate::index::{ModelIndex, PodHandle};
use crate::registry::{Advance, Gap, MAX_PODS};
use crate::state::Sidecar;

/// Resyncs waiting for their dump fetch (one per pod at most, so this bounds the queue
/// by the pods that fell behind at once; beyond it they are dropped and counted, and the
/// pod's next gap asks again).
pub const RESYNC_QUEUE: usize = 1024;
/// Bytes of block lists one pending resync keeps for its replay (only stored, removed
/// and cleared events, without token ids); past this the resync ends without replay
/// (and the pod stays stale until its next gap is repaired).
pub const MAX_REPLAY_BYTES: usize = 8 << 20;
/// Bytes of block lists every pending resync keeps together: a pod whose dump never
/// answers cannot grow the sidecar past this, however many pods do it at once.
pub const MAX_REPLAY_TOTAL_BYTES: usize = 64 << 20;
/// The largest dump body the sidecar reads (a pod's whole cache as JSON: ~20 bytes a
/// block, so ~3M blocks).
pub const MAX_DUMP_BYTES: usize = 64 << 20;
/// How long one dump fetch may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// Fetch a pod's full dump after a sequence gap.
#[derive(Debug, Clone)]
pub struct ResyncJob {
    pub pod: Arc<str>,
    pub model: String,
    pub url: String,
}

/// Per-pod streams and the resync queue. Shared by every ingestion path (HTTP, NATS,
/// the dump fetcher); one per sidecar.
pub struct Recovery {
    streams: Mutex<HashMap<Arc<str>, Arc<Mutex<Stream>>>>,
    queue: mpsc::Sender<ResyncJob>,
    /// Pods with a resync queued or running: at most one job per pod.
    busy: Mutex<HashSet<Arc<str>>>,
    /// Bytes every stream's replay holds (bounded by [`MAX_REPLAY_TOTAL_BYTES`]).
    replay_bytes: Arc<AtomicUsize>,
}

/// What the lock of one pod's stream guards besides the order of its batches.
#[derive(Default)]
pub struct Stream {
    /// While a resync is pending: every batch applied since the gap, so that the dump
    /// (a snapshot at its own seq) can be completed with the batches that came after it
    /// instead of erasing them. `None` when no resync is pending.
    replay: Option<Replay>,
}

/// The block events of the batches applied since a gap, and the bytes they hold, given
/// back to the total when the replay ends (however its stream goes).
struct Replay {
    batches: Vec<EventBatch>,
    bytes: usize,
    total: Arc<AtomicUsize>,
}

impl Drop for Replay {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl Stream {
    /// End the pending replay (if any); its batches.
    fn end_replay(&mut self) -> Vec<EventBatch> {
        self.replay
            .take()
            .map(|mut r| std::mem::take(&mut r.batches))
            .unwrap_or_default()
    }

    /// Keep `b`'s block events for the pending replay; false if that would pass the
    /// per-pod or the total bound.
    fn record(&mut self, rec: &Recovery, b: &EventBatch) -> bool {
        let Some(r) = &mut self.replay else {
            return true;
        };
        let events: Vec<Event> = b
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Stored {
                    tier,
                    parent,
                    blocks,
                    ..
                } => Some(Event::Stored {
                    tier: *tier,
                    parent: *parent,
                    blocks: blocks.clone(),
                    tokens: None,
                }),
                Event::Removed { .. } | Event::Cleared => Some(e.clone()),
                Event::Shutdown | Event::Load { .. } => None,
            })
            .collect();
        let bytes = std::mem::size_of::<EventBatch>()
            + b.pod.len()
            + b.model.len()
            + b.epoch.len()
            + events
                .iter()
                .map(|e| {
                    std::mem::size_of::<Event>()
                        + match e {
                            Event::Stored { blocks, .. } | Event::Removed { blocks, .. } => {
                                blocks.len() * 8
                            }
                            _ => 0,
                        }
                })
                .sum::<usize>();
        let total = rec.replay_bytes.fetch_add(bytes, Ordering::AcqRel) + bytes;
        if r.bytes + bytes > MAX_REPLAY_BYTES || total > MAX_REPLAY_TOTAL_BYTES {
            rec.replay_bytes.fetch_sub(bytes, Ordering::AcqRel);
            return false;
        }
        r.bytes += bytes;
        r.batches.push(EventBatch {
            v: b.v,
            pod: b.pod.clone(),
            model: b.model.clone(),
            epoch: b.epoch.clone(),
            seq: b.seq,
            ts: None,
            dump_url: None,
            events,
        });
        true
    }
}

impl Default for Recovery {
    /// Recovery with nobody fetching dumps (the simulator, tests): a gap with a dump URL
    /// is counted (`no_fetcher`) and the pod stays stale until its next gap.
    fn default() -> Self {
        Recovery::new().0
    }
}

impl Recovery {
    /// Recovery and the queue of resyncs for [`fetch_dumps`].
    pub fn new() -> (Recovery, mpsc::Receiver<ResyncJob>) {
        let (queue, jobs) = mpsc::channel(RESYNC_QUEUE);
        let r = Recovery {
            streams: Mutex::default(),
            queue,
            busy: Mutex::default(),
            replay_bytes: Arc::default(),
        };
        (r, jobs)
    }

    /// The pod's stream; lock it to apply one of its batches.
    pub fn stream(&self, pod: &str) -> Arc<Mutex<Stream>> {
        let mut m = self.streams.lock();
        if let Some(l) = m.get(pod) {
            return l.clone();
        }
        // Streams of pods that left are not needed once nobody holds them; admission
        // keeps the live ones under MAX_PODS.
        if m.len() >= MAX_PODS {
            m.retain(|_, l| Arc::strong_count(l) > 1);
        }
        let l = Arc::new(Mutex::new(Stream::default()));
        m.insert(Arc::from(pod), l.clone());
        l
    }

    /// Ask for `job.pod`'s dump, unless a fetch for it is already queued or running.
    pub fn queue_resync(&self, sc: &Sidecar, job: ResyncJob) {
        let mut busy = self.busy.lock();
        if busy.contains(&job.pod) {
            sc.metrics.resyncs.inc("already_queued", 1);
            return;
        }
        let pod = job.pod.clone();
        match self.queue.try_send(job) {
            Ok(()) => {
                busy.insert(pod);
            }
            Err(mpsc::error::TrySendError::Full(_)) => sc.metrics.resyncs.inc("queue_full", 1),
            Err(mpsc::error::TrySendError::Closed(_)) => sc.metrics.resyncs.inc("no_fetcher", 1),
        }
    }

    /// Streams tracked (tests: nothing is allocated for a refused batch).
    #[cfg(test)]
    pub(crate) fn streams(&self) -> usize {
        self.streams.lock().len()
    }

    /// Bytes the pending resyncs' replays hold.
    pub fn replay_bytes(&self) -> usize {
        self.replay_bytes.load(Ordering::Acquire)
    }

    /// The resync of `pod` is over (applied, failed or dropped).
    pub fn resync_done(&self, pod: &str) {
        self.busy.lock().remove(pod);
    }
}

/// Plan recovery for a batch that advanced its pod's stream (under the pod's stream
/// lock): a restart or a gap without a dump drops the pod's blocks; a gap with a dump
/// queues a resync and starts recording batches for its replay; while one is pending,
/// this batch is recorded. Returns the handle the batch's events go to.
pub(super) fn plan(
    sc: &Sidecar,
    rec: &Recovery,
    stream: &mut Stream,
    index: &Arc<ModelIndex>,
    b: &EventBatch,
    adv: &Advance,
    mut handle: PodHandle,
) -> Result<PodHandle, IngestError> {
    if adv.restarted {
        sc.metrics.epochs.inc();
        handle = reset_pod(sc, index, &b.pod, &b.model, "new epoch")?;
    }
    if adv.gap == Some(Gap::Drop) {
        sc.metrics.resyncs.inc("drop", 1);
        handle = reset_pod(sc, index, &b.pod, &b.model, "sequence gap, no dump url")?;
    }
    if adv.restarted || adv.gap == Some(Gap::Drop) {
        stream.end_replay();
    }
    if let Some(Gap::Resync(url)) = &adv.gap {
        stream.replay.get_or_insert_with(|| Replay {
            batches: Vec::new(),
            bytes: 0,
            total: rec.replay_bytes.clone(),
        });
        rec.queue_resync(
            sc,
            ResyncJob {
                pod: Arc::from(b.pod.as_str()),
                model: b.model.clone(),
                url: url.clone(),
            },
        );
    }
    if !stream.record(rec, b) {
        sc.metrics.resyncs.inc("replay_overflow", 1);
        stream.end_replay();
    }
    Ok(handle)
}

/// Replace a pod's blocks with a full dump (after a gap), replay the batches that came
/// after the dump's snapshot, then clear its stale mark. Returns the blocks changed.
pub fn apply_dump(
    sc: &Sidecar,
    rec: &Recovery,
    pod: &str,
    dump: &EventBatch,
) -> Result<u64, IngestError> {
    let lock = rec.stream(pod);
    let mut stream = lock.lock();
    let replay = stream.end_replay();
    // A pod removed (or moved to another model) while its dump was on the way stays
    // removed: the dump must not give it a slot again.
    if sc.registry().model_of(pod).as_deref() != Some(dump.model.as_str()) {
        return Err(crate::registry::StreamError::Removed(pod.to_string()).into());
    }
    let index = sc
        .index(&dump.model)
        .ok_or_else(|| IngestError::TooManyModels(dump.model.clone()))?;
    let h = reset_slot(sc, &index, pod)?;
    let now = Instant::now();
    let snap = apply_events(sc, &index, h, dump, Source::Snapshot, now)?;
    let (mut h, mut n) = (snap.handle, snap.blocks_changed);
    // The dump is the state as of its own (epoch, seq): the batches applied since the
    // gap that came after it are applied again on top, in order, so nothing they stored
    // or removed is lost to the reset.
    let mut replayed = 0;
    for b in &replay {
        if b.epoch != dump.epoch || b.seq <= dump.seq {
            continue;
        }
        let a = apply_events(sc, &index, h, b, Source::Replay, now)?;
        (h, n) = (a.handle, n + a.blocks_changed);
        replayed += 1;
    }
    sc.registry().resynced(pod, &dump.epoch, dump.seq);
    sc.metrics.resyncs.inc("dump", 1);
    if replayed > 0 {
        sc.metrics.resyncs.inc("replayed_batches", replayed);
    }
    Ok(n)
}

/// Drop a pod's blocks (a gap with no usable dump) and clear its stale mark.
pub fn drop_blocks(sc: &Sidecar, rec: &Recovery, pod: &str, model: &str) {
    let lock = rec.stream(pod);
    let mut stream = lock.lock();
    stream.end_replay();
    if let Some(ix) = sc.indexes.get(model) {
        if ix.handle(pod).is_some() {
            // With no slot free the pod stays out of the index until one frees: dropped
            // all the same.
            let _ = reset_slot(sc, &ix, pod);
        }
    }
    sc.registry().rebuilt(pod);
}

/// The body of `resp`, refused once it passes `cap` bytes.
async fn read_capped(mut resp: reqwest::Response, cap: usize) -> Result<Vec<u8>, String> {
    if resp.content_length().is_some_and(|n| n > cap as u64) {
        return Err(format!("dump larger than {cap} bytes"));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > cap {
            return Err(format!("dump larger than {cap} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

async fn fetch(
    client: &reqwest::Client,
    url: &str,
    token: Option<&str>,
) -> Result<EventBatch, String> {
    let mut req = client.get(url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("status {}", resp.status()));
    }
    let body = read_capped(resp, MAX_DUMP_BYTES).await?;
    EventBatch::decode(&body).map_err(|e| e.to_string())
}

/// Fetch dumps for pods that fell behind, one at a time, until shutdown: apply each
/// (off the async workers), or drop the pod's blocks when the fetch fails. `token` is
/// presented as a bearer token (the bridges' `--dump-token`).
pub async fn fetch_dumps(
    sc: Arc<Sidecar>,
    rec: Arc<Recovery>,
    mut jobs: mpsc::Receiver<ResyncJob>,
    token: Option<String>,
    mut shutdown: Shutdown,
) {
    // No redirects: the URL was checked, where it would send us was not.
    let client = reqwest::Client::builder()
        .timeout(FETCH_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap_or_default();
    loop {
        let job = tokio::select! {
            _ = shutdown.wait() => break,
            j = jobs.recv() => match j { Some(j) => j, None => break },
        };
        let fetched = fetch(&client, &job.url, token.as_deref()).await;
        let (sc2, rec2, pod, model) = (sc.clone(), rec.clone(), job.pod.clone(), job.model.clone());
        let outcome = tokio::task::spawn_blocking(move || match fetched {
            Ok(dump) if dump.pod == *pod && dump.model == model => {
                apply_dump(&sc2, &rec2, &pod, &dump).map_err(|e| e.to_string())
            }
            Ok(dump) => Err(format!("dump names pod {} model {}", dump.pod, dump.model)),
            Err(e) => Err(e),
        })
        .await;
        let result = outcome.unwrap_or_else(|e| Err(e.to_string()));
        rec.resync_done(&job.pod);
        match result {
            Ok(n) => tracing::info!(pod = %job.pod, blocks = n, "resynced from dump"),
            Err(e) => {
                tracing::warn!(pod = %job.pod, "dump fetch failed ({e}); dropping its blocks to rebuild from live events");
                sc.metrics.resyncs.inc("drop_after_failed_dump", 1);
                drop_blocks(&sc, &rec, &job.pod, &job.model);
            }
        }
    }
}
