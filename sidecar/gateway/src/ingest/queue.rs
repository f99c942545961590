//! Batches from NATS, applied so that no pod can hold up another: a FIFO queue per pod,
//! pods taken round-robin by a pool of workers, one batch per turn, each pod by one
//! worker at a time (its batches stay in order). A pod whose batches are slow to apply
//! (a million blocks, a flood of resets) occupies at most one worker and waits for its
//! own turn; every other pod's batch waits for at most one batch of each pod ahead of it.
//!
//! Bounded in count and bytes, per pod and in all; a batch that does not fit is dropped
//! and counted (`queue_full`): its pod sees a sequence gap and is recovered, as for a
//! batch lost on the wire. The consume loop only decodes and enqueues, so it never waits
//! on the index.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use kvroute_service::Shutdown;
use kvroute_shared::protocol::EventBatch;
use parking_lot::{Condvar, Mutex};

use super::Recovery;
use crate::state::Sidecar;

/// Batches one pod may have waiting.
pub const POD_BATCHES: usize = 256;
/// Bytes (as received) one pod may have waiting.
pub const POD_BYTES: usize = 8 << 20;
/// Bytes waiting in all.
pub const TOTAL_BYTES: usize = 64 << 20;

#[derive(Default)]
pub struct IngestQueue {
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    pods: HashMap<Arc<str>, PodQueue>,
    /// Pods with batches waiting and no worker on them, in turn order.
    ready: VecDeque<Arc<str>>,
    bytes: usize,
    stopping: bool,
}

#[derive(Default)]
struct PodQueue {
    batches: VecDeque<(EventBatch, usize, Instant)>,
    bytes: usize,
    /// In `ready` or held by a worker.
    scheduled: bool,
}

/// Why a batch was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueFull {
    Pod,
    Total,
}

impl IngestQueue {
    /// Queue `b` (`bytes` as received) behind its pod's other batches.
    pub fn submit(&self, b: EventBatch, bytes: usize) -> Result<(), QueueFull> {
        let mut g = self.state.lock();
        if g.bytes + bytes > TOTAL_BYTES {
            return Err(QueueFull::Total);
        }
        let key: Arc<str> = match g.pods.get_key_value(b.pod.as_str()) {
            Some((k, _)) => k.clone(),
            None => Arc::from(b.pod.as_str()),
        };
        let q = g.pods.entry(key.clone()).or_default();
        if q.batches.len() >= POD_BATCHES || q.bytes + bytes > POD_BYTES {
            if q.batches.is_empty() && !q.scheduled {
                g.pods.remove(&key);
            }
            return Err(QueueFull::Pod);
        }
        q.batches.push_back((b, bytes, Instant::now()));
        q.bytes += bytes;
        let schedule = !std::mem::replace(&mut q.scheduled, true);
        g.bytes += bytes;
        if schedule {
            g.ready.push_back(key);
            drop(g);
            self.wake.notify_one();
        }
        Ok(())
    }

    /// The next pod's next batch, waiting for one; `None` once stopping.
    fn take(&self) -> Option<(Arc<str>, EventBatch, Instant)> {
        let mut g = self.state.lock();
        loop {
            if g.stopping {
                return None;
            }
            if let Some(pod) = g.ready.pop_front() {
                let Some(q) = g.pods.get_mut(&pod) else {
                    continue;
                };
                let Some((b, bytes, at)) = q.batches.pop_front() else {
                    q.scheduled = false;
                    continue;
                };
                q.bytes -= bytes;
                g.bytes -= bytes;
                return Some((pod, b, at));
            }
            self.wake.wait(&mut g);
        }
    }

    /// The worker is done with `pod`'s batch: its turn goes to the back of the line, or
    /// it leaves the queue when it has nothing waiting.
    fn done(&self, pod: Arc<str>) {
        let mut g = self.state.lock();
        match g.pods.get_mut(&pod) {
            Some(q) if !q.batches.is_empty() => {
                g.ready.push_back(pod);
                drop(g);
                self.wake.notify_one();
            }
            Some(_) => {
                g.pods.remove(&pod);
            }
            None => {}
        }
    }

    fn stop(&self) {
        self.state.lock().stopping = true;
        self.wake.notify_all();
    }

    /// Batches waiting (tests, metrics).
    pub fn waiting(&self) -> usize {
        self.state
            .lock()
            .pods
            .values()
            .map(|q| q.batches.len())
            .sum()
    }
}

/// Apply queued batches with `workers` threads until shutdown (what is still queued
/// then is dropped: the next sidecar start resyncs from dumps).
pub async fn run_workers(
    sc: Arc<Sidecar>,
    rec: Arc<Recovery>,
    queue: Arc<IngestQueue>,
    workers: usize,
    mut shutdown: Shutdown,
) {
    let mut pool = tokio::task::JoinSet::new();
    for _ in 0..workers.max(1) {
        let (sc, rec, queue) = (sc.clone(), rec.clone(), queue.clone());
        pool.spawn_blocking(move || {
            while let Some((pod, b, queued_at)) = queue.take() {
                sc.metrics
                    .event_queue_seconds
                    .observe(queued_at.elapsed().as_secs_f64());
                if let Err(e) = super::ingest(&sc, &rec, &b) {
                    tracing::debug!("nats: batch refused: {e}");
                }
                queue.done(pod);
            }
        });
    }
    shutdown.wait().await;
    queue.stop();
    while pool.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_shared::protocol::Event;

    fn b(pod: &str, seq: u64) -> EventBatch {
        EventBatch::new(pod, "m", "e", seq, vec![Event::Cleared])
    }

    #[test]
    fn pods_take_turns_and_each_keeps_its_order() {
        let q = IngestQueue::default();
        for s in 0..3 {
            q.submit(b("10.0.0.1:1", s), 10).expect("a");
        }
        q.submit(b("10.0.0.2:1", 0), 10).expect("b");
        let mut order = Vec::new();
        while q.waiting() > 0 {
            let (pod, batch, _) = q.take().expect("batch");
            order.push((pod.to_string(), batch.seq));
            q.done(pod);
        }
        assert_eq!(
            order,
            [
                ("10.0.0.1:1".to_string(), 0),
                ("10.0.0.2:1".to_string(), 0),
                ("10.0.0.1:1".to_string(), 1),
                ("10.0.0.1:1".to_string(), 2)
            ]
        );
        assert!(
            q.state.lock().pods.is_empty(),
            "drained pods leave no entry"
        );
    }

    #[test]
    fn bounded_per_pod_and_in_all() {
        let q = IngestQueue::default();
        for s in 0..POD_BATCHES as u64 {
            q.submit(b("10.0.0.1:1", s), 1).expect("fits");
        }
        assert_eq!(q.submit(b("10.0.0.1:1", 999), 1), Err(QueueFull::Pod));
        assert_eq!(
            q.submit(b("10.0.0.3:1", 0), POD_BYTES + 1),
            Err(QueueFull::Pod)
        );
        q.submit(b("10.0.0.2:1", 0), 1)
            .expect("another pod still fits");
        for i in 0..TOTAL_BYTES / POD_BYTES {
            let _ = q.submit(b(&format!("10.1.0.{i}:1"), 0), POD_BYTES);
        }
        assert_eq!(
            q.submit(b("10.0.0.9:1", 0), POD_BYTES),
            Err(QueueFull::Total)
        );
    }
}
