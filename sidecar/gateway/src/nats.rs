//! Event ingestion from NATS. Every sidecar replica subscribes to the same subject, so
//! all replicas build the same index. The connection is retried forever with backoff
//! (also when NATS is down at start); its state is a metric and part of `/readyz`.
//! A malformed message is counted and dropped; it never stalls the subscription. Batches
//! are decoded and checked against their subject here, then applied by the ingest
//! workers from a queue per pod (`ingest/queue.rs`), so one pod's batches cannot hold up
//! another's, nor this loop.
//!
//! This replica's load deltas leave through their own task ([`publish_outbox`]), each
//! publish bounded by a timeout, so a NATS outage can delay only that task: event
//! ingestion, the other replicas' deltas and shutdown never wait on a publish. Its
//! admission queues' states leave through another ([`share_queues`]), so tenants take
//! turns across replicas (`admission::fleet`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvroute_service::{NatsAuth, Shutdown};
use kvroute_shared::protocol::{EventBatch, LoadDelta, QueueState, QUEUE_SUBJECT};
use tokio::sync::mpsc;

use crate::ingest::{self, IngestQueue, Recovery};
use crate::state::Sidecar;

#[derive(Clone, Debug, Default)]
pub struct NatsOpts {
    pub url: String,
    pub subject: String,
    pub auth: NatsAuth,
}

pub async fn connect(sc: &Arc<Sidecar>, o: &NatsOpts) -> anyhow::Result<async_nats::Client> {
    let sc_ev = sc.clone();
    let opts = async_nats::ConnectOptions::new()
        .name("kvroute-sidecar")
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(Duration::from_secs(2))
        .reconnect_delay_callback(|attempt| {
            Duration::from_millis((100u64 << attempt.min(5)).min(3000))
        })
        .event_callback(move |ev| {
            let sc = sc_ev.clone();
            async move {
                let up = match ev {
                    async_nats::Event::Connected => Some(1),
                    async_nats::Event::Disconnected | async_nats::Event::Closed => Some(0),
                    _ => None,
                };
                if let Some(v) = up {
                    sc.metrics.nats_connected.set(v as i64);
                    tracing::info!("nats: {ev}");
                }
            }
        });
    let opts = o.auth.apply(opts).await?;
    Ok(opts.connect(o.url.as_str()).await?)
}

/// How long one load delta may wait for the NATS client before it is dropped.
const PUBLISH_TIMEOUT: Duration = Duration::from_millis(500);

pub async fn run(
    sc: Arc<Sidecar>,
    rec: Arc<Recovery>,
    o: NatsOpts,
    outbox: mpsc::Receiver<LoadDelta>,
    shutdown: Shutdown,
) {
    sc.nats_configured.store(true, Ordering::Relaxed);
    let client = match connect(&sc, &o).await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("nats: cannot configure the connection: {e}");
            return;
        }
    };
    sc.enable_replica_sync(true);
    let queue = Arc::new(IngestQueue::default());
    // At least two, so one pod's slow batch always leaves a worker for the others.
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().max(2));
    tokio::join!(
        consume(&sc, &queue, &client, &o, shutdown.clone()),
        publish_outbox(&sc, &client, outbox, shutdown.clone()),
        share_queues(&sc, &client, shutdown.clone()),
        ingest::run_workers(sc.clone(), rec, queue.clone(), workers, shutdown),
    );
    sc.enable_replica_sync(false);
}

/// Publish this replica's load deltas until shutdown; a publish that NATS does not take
/// within `PUBLISH_TIMEOUT` is dropped and counted.
pub async fn publish_outbox(
    sc: &Sidecar,
    client: &async_nats::Client,
    mut outbox: mpsc::Receiver<LoadDelta>,
    mut shutdown: Shutdown,
) {
    loop {
        let delta = tokio::select! {
            _ = shutdown.wait() => break,
            d = outbox.recv() => match d { Some(d) => d, None => break },
        };
        let Ok(bytes) = serde_json::to_vec(&delta) else {
            continue;
        };
        let Some(outcome) = publish(client, delta.subject(), bytes, &mut shutdown).await else {
            break;
        };
        sc.metrics.replica_deltas.inc(outcome, 1);
    }
}

/// One publish, given at most `PUBLISH_TIMEOUT`: "published" or "publish_failed"; `None`
/// when shutdown came first.
async fn publish(
    client: &async_nats::Client,
    subject: String,
    bytes: Vec<u8>,
    shutdown: &mut Shutdown,
) -> Option<&'static str> {
    let publish = client.publish(subject, bytes.into());
    tokio::select! {
        _ = shutdown.wait() => None,
        r = tokio::time::timeout(PUBLISH_TIMEOUT, publish) => Some(match r {
            Ok(Ok(())) => "published",
            _ => "publish_failed",
        }),
    }
}

/// How often the admission queues' states are checked for a change to share.
const SHARE_EVERY: Duration = Duration::from_millis(20);

/// Send this replica's admission queue states to the other replicas until shutdown:
/// each when it changes, and again now and then while it has tenants to speak of
/// (`Waiting::states_to_share`).
pub async fn share_queues(sc: &Sidecar, client: &async_nats::Client, mut shutdown: Shutdown) {
    loop {
        tokio::select! {
            _ = shutdown.wait() => break,
            _ = tokio::time::sleep(SHARE_EVERY) => {}
        }
        for state in sc.waiting.states_to_share(sc, std::time::Instant::now()) {
            let Ok(bytes) = serde_json::to_vec(&state) else {
                continue;
            };
            let Some(outcome) = publish(client, state.subject(), bytes, &mut shutdown).await else {
                return;
            };
            sc.metrics.replica_queues.inc(outcome, 1);
        }
    }
}

async fn consume(
    sc: &Arc<Sidecar>,
    queue: &IngestQueue,
    client: &async_nats::Client,
    o: &NatsOpts,
    mut shutdown: Shutdown,
) {
    let mut sub = loop {
        match client.subscribe(o.subject.clone()).await {
            Ok(s) => break s,
            Err(e) => {
                tracing::warn!("nats: subscribe failed ({e}); retrying");
                tokio::select! {
                    _ = shutdown.wait() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        }
    };
    tracing::info!("nats: subscribed to {}", o.subject);
    // Replicas share their decisions so that several gateways do not pile onto one pod.
    let mut loads = client.subscribe(format!("{LOAD_SUBJECT}.>")).await.ok();
    // And their admission queues, so that tenants take turns across the replicas.
    let mut queues = client.subscribe(format!("{QUEUE_SUBJECT}.>")).await.ok();
    loop {
        tokio::select! {
            _ = shutdown.wait() => break,
            Some(msg) = async { match queues.as_mut() { Some(q) => q.next().await, None => std::future::pending().await } } => {
                let outcome = match serde_json::from_slice::<QueueState>(&msg.payload) {
                    Ok(state) if msg.subject.as_str() == state.subject() => {
                        sc.waiting.apply_peer(sc, &state, std::time::Instant::now())
                    }
                    Ok(_) => "subject_mismatch",
                    Err(e) => {
                        tracing::debug!("nats: malformed queue state: {e}");
                        "malformed"
                    }
                };
                sc.metrics.replica_queues.inc(outcome, 1);
            }
            Some(msg) = async { match loads.as_mut() { Some(l) => l.next().await, None => std::future::pending().await } } => {
                match serde_json::from_slice::<LoadDelta>(&msg.payload) {
                    // A replica speaks only for itself, on its own subject.
                    Ok(delta) if msg.subject.as_str() == delta.subject() => sc.apply_remote(&delta),
                    Ok(_) => sc.metrics.replica_deltas.inc("subject_mismatch", 1),
                    Err(e) => {
                        sc.metrics.replica_deltas.inc("malformed", 1);
                        tracing::debug!("nats: malformed load delta: {e}");
                    }
                }
            }
            msg = sub.next() => {
                let Some(msg) = msg else { break };
                sc.metrics.nats_messages.inc();
                match EventBatch::decode(&msg.payload) {
                    // The subject names the pod; NATS permissions confine each bridge to
                    // its own, so a batch may speak only for the pod its subject names.
                    Ok(batch) if msg.subject.as_str() != batch.subject() => {
                        sc.metrics.events_rejected.inc("subject_mismatch", 1);
                        tracing::debug!("nats: batch for pod {} on subject {}", batch.pod, msg.subject);
                    }
                    // Applied by the workers, in the pod's turn (ingest/queue.rs).
                    Ok(batch) => {
                        let pod = batch.pod.clone();
                        if queue.submit(batch, msg.payload.len()).is_err() {
                            // Routed around, not silently kept: the next batch is a gap.
                            sc.metrics.events_rejected.inc("queue_full", 1);
                            sc.registry().mark_stale(&pod);
                        }
                    }
                    Err(e) => {
                        sc.metrics.events_rejected.inc(e.reason(), 1);
                        tracing::debug!("nats: malformed batch on {}: {e}", msg.subject);
                    }
                }
            }
        }
    }
    let _ = tokio::time::timeout(PUBLISH_TIMEOUT, sub.unsubscribe()).await;
}

pub use kvroute_shared::protocol::LOAD_SUBJECT;
