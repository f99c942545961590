//! Background upkeep, off every request's path: phase 2 of pod removals, liveness,
//! expiry of projected load and predicted residency, and dump fetches for resyncs.
//!
//! Shaped like mini-redis's purge task: one loop, an explicit shutdown signal (a watch
//! channel) checked in every `select!`, and a [`DropGuard`] so that whatever way the
//! server exits, the task is told to stop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_shared::protocol::EventBatch;
use tokio::sync::{mpsc, watch};

use crate::ingest::{self, IngestLocks};
use crate::state::{CleanupJob, ResyncJob, Sidecar};

/// Tells background tasks to stop when dropped.
pub struct DropGuard(pub watch::Sender<bool>);

impl Drop for DropGuard {
    fn drop(&mut self) {
        let _ = self.0.send(true);
    }
}

const TICK: Duration = Duration::from_millis(500);

pub async fn run(
    sc: Arc<Sidecar>,
    mut jobs: mpsc::UnboundedReceiver<CleanupJob>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            Some(job) = jobs.recv() => {
                // The walk takes milliseconds for a large pod: keep it off the runtime.
                let r = tokio::task::spawn_blocking(move || job.index.cleanup(job.retired)).await;
                if let Err(e) = r {
                    tracing::error!("pod cleanup task failed: {e}");
                }
            }
            _ = tick.tick() => sweep(&sc, Instant::now()),
        }
    }
}

/// One pass of the periodic upkeep (public for tests).
pub fn sweep(sc: &Sidecar, now: Instant) {
    let cfg = sc.config();
    // Liveness: pods that have spoken (sent any batch) and then went silent.
    let liveness = Duration::from_secs(cfg.liveness_timeout_s);
    let dead: Vec<String> = sc
        .pods
        .lock()
        .values()
        .filter(|p| p.epoch.is_some() && now.duration_since(p.last_seen) > liveness)
        .map(|p| p.id.to_string())
        .collect();
    for id in dead {
        tracing::info!(pod = %id, "no events for {}s: removing", cfg.liveness_timeout_s);
        sc.remove_pod_at(&id, "liveness", now);
    }
    // Projected load whose report never came (ours or another replica's).
    sc.expire_load(now);
    sc.predicted
        .expire(Duration::from_secs(cfg.predicted_ttl_s), now);
}

/// The largest dump body the sidecar reads (a pod's whole cache as JSON: ~20 bytes a
/// block, so ~3M blocks).
pub const MAX_DUMP_BYTES: usize = 64 << 20;

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

/// Fetch dumps for pods that fell behind, one at a time.
pub async fn resyncs(
    sc: Arc<Sidecar>,
    locks: Arc<IngestLocks>,
    mut jobs: mpsc::Receiver<ResyncJob>,
    mut shutdown: watch::Receiver<bool>,
) {
    // No redirects: the URL was checked, where it would send us was not.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap_or_default();
    loop {
        let job = tokio::select! {
            _ = shutdown.changed() => break,
            j = jobs.recv() => match j { Some(j) => j, None => break },
        };
        let fetched = async {
            let resp = client
                .get(&job.url)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            if !resp.status().is_success() {
                return Err(format!("status {}", resp.status()));
            }
            let body = read_capped(resp, MAX_DUMP_BYTES).await?;
            EventBatch::decode(&body).map_err(|e| e.to_string())
        }
        .await;
        let (sc2, locks2, pod, model) = (
            sc.clone(),
            locks.clone(),
            job.pod.clone(),
            job.model.clone(),
        );
        let outcome = tokio::task::spawn_blocking(move || match fetched {
            Ok(dump) if dump.pod == *pod && dump.model == model => {
                ingest::apply_dump(&sc2, &locks2, &pod, &dump).map_err(|e| e.to_string())
            }
            Ok(dump) => Err(format!("dump names pod {} model {}", dump.pod, dump.model)),
            Err(e) => Err(e),
        })
        .await;
        let result = outcome.unwrap_or_else(|e| Err(e.to_string()));
        sc.resync_done(&job.pod);
        match result {
            Ok(n) => tracing::info!(pod = %job.pod, blocks = n, "resynced from dump"),
            Err(e) => {
                tracing::warn!(pod = %job.pod, "dump fetch failed ({e}); dropping its blocks to rebuild from live events");
                sc.metrics.resyncs.inc("drop_after_failed_dump", 1);
                ingest::drop_blocks(&sc, &locks, &job.pod, &job.model);
            }
        }
    }
}
