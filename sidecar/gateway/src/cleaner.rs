//! Background upkeep, off every request's path: phase 2 of pod removals, liveness,
//! expiry of projected load and predicted residency. (Dump fetches for resyncs are
//! recovery's own task, [`crate::ingest::fetch_dumps`].)
//!
//! Shaped like mini-redis's purge task: one loop, its shutdown passed in and checked in
//! every `select!`; `serve` awaits it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_service::Shutdown;
use tokio::sync::mpsc;

use crate::state::{CleanupJob, Sidecar};

const TICK: Duration = Duration::from_millis(500);

pub async fn run(
    sc: Arc<Sidecar>,
    mut jobs: mpsc::UnboundedReceiver<CleanupJob>,
    mut shutdown: Shutdown,
) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.wait() => break,
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

/// One pass of the periodic upkeep.
pub fn sweep(sc: &Sidecar, now: Instant) {
    let cfg = sc.config();
    // Liveness: pods that have spoken (sent any batch) and then went silent.
    let liveness = Duration::from_secs(cfg.liveness_timeout_s);
    for id in sc.registry().silent(now, liveness) {
        tracing::info!(pod = %id, "no events for {}s: removing", cfg.liveness_timeout_s);
        sc.remove_pod_at(&id, "liveness", now);
    }
    // Projected load whose report never came (ours or another replica's).
    sc.expire_load(now);
    sc.predicted
        .expire(Duration::from_secs(cfg.predicted_ttl_s), now);
    sc.bindings.expire(
        now,
        Duration::from_secs(cfg.binding_ttl_s),
        cfg.max_bindings as usize,
    );
    // Indexes whose share of the budget shrank (a model was added) come down to it.
    sc.trim_indexes();
    crate::release_free_memory();
}
