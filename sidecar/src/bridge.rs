//! `kvroute-sidecar bridge`: runs next to one vLLM or SGLang engine (a container in the
//! engine's pod), subscribes to its ZMQ KV event stream, translates the events into
//! kvroute event batches ([`crate::translate`]) and publishes them ([`crate::sink`]).
//!
//! It sits with the engine, not with the gateway, because the translation needs every
//! event since the engine started (a block is named through its parent): a bridge that
//! lives as long as its engine sees them all, translates once for every gateway replica,
//! and can serve the engine's cache as a dump (`GET /dump`) when a sidecar resyncs.
//!
//! Three tasks, data flowing one way: ZMQ receive → translate (under a short lock
//! shared with `/dump`) → an ordered channel → publish. A bad frame or payload is
//! counted and skipped; the stream goes on.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use parking_lot::Mutex;
use zeromq::{Socket, SocketRecv};

use crate::sink::EventSink;
use crate::translate::Translator;
use crate::vllm;

#[derive(clap::Args, Debug, Clone)]
pub struct BridgeArgs {
    /// The engine's ZMQ PUB endpoint (vLLM: the `endpoint` of `--kv-events-config`,
    /// e.g. `tcp://*:5557` there, `tcp://127.0.0.1:5557` here).
    #[arg(
        long,
        env = "KVROUTE_BRIDGE_ZMQ",
        default_value = "tcp://127.0.0.1:5557"
    )]
    pub zmq: String,
    /// ZMQ topic to subscribe to (vLLM's `topic`, empty by default).
    #[arg(long, env = "KVROUTE_BRIDGE_TOPIC", default_value = "")]
    pub topic: String,
    /// The pod as the gateway reaches it (`ip:port` of the engine's HTTP server).
    #[arg(long, env = "KVROUTE_BRIDGE_POD")]
    pub pod: String,
    /// The model name clients send (the kvroute namespace; LoRA adapters ride on it).
    #[arg(long, env = "KVROUTE_BRIDGE_MODEL")]
    pub model: String,
    /// The engine's KV block size in tokens; must equal the filter's block size for
    /// this model (vLLM `--block-size`, 16 by default).
    #[arg(long, env = "KVROUTE_BRIDGE_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,
    /// Publish on NATS (every sidecar replica subscribes).
    #[arg(long, env = "KVROUTE_NATS_URL")]
    pub nats: Option<String>,
    /// POST to these sidecars' `/v1/events` (comma-separated base URLs).
    #[arg(
        long = "sidecar",
        env = "KVROUTE_BRIDGE_SIDECARS",
        value_delimiter = ','
    )]
    pub sidecars: Vec<String>,
    /// Serves `GET /dump` (register it as the pod's `dump_url`), `/metrics`, `/healthz`.
    #[arg(long, env = "KVROUTE_BRIDGE_LISTEN", default_value = "0.0.0.0:9400")]
    pub listen: SocketAddr,
}

impl BridgeArgs {
    pub fn validate(&self) -> anyhow::Result<()> {
        if !crate::state::valid_pod_id(&self.pod) {
            anyhow::bail!("--pod {:?} must be host:port", self.pod);
        }
        if self.model.is_empty() {
            anyhow::bail!("--model must not be empty");
        }
        if self.block_size == 0 {
            anyhow::bail!("--block-size must be at least 1");
        }
        if self.nats.is_none() && self.sidecars.is_empty() {
            anyhow::bail!("nowhere to send events: give --nats and/or --sidecar");
        }
        Ok(())
    }
}

#[derive(Default)]
struct Counters {
    messages: AtomicU64,
    bad_frames: AtomicU64,
    bad_payloads: AtomicU64,
    send_failures: AtomicU64,
}

struct Bridge {
    tr: Mutex<Translator>,
    n: Counters,
}

pub async fn run(a: BridgeArgs) -> anyhow::Result<()> {
    a.validate()?;
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    let epoch_base = format!("bridge-{started}-{}", std::process::id());
    let br = Arc::new(Bridge {
        tr: Mutex::new(Translator::new(&a.pod, &a.model, a.block_size, &epoch_base)),
        n: Counters::default(),
    });
    let sink = EventSink::connect(a.nats.as_deref(), a.sidecars.clone()).await?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(publish(br.clone(), sink, rx));
    tokio::spawn(receive(br.clone(), a.zmq.clone(), a.topic.clone(), tx));
    let app = Router::new()
        .route("/dump", get(dump))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(br);
    let listener = tokio::net::TcpListener::bind(a.listen).await?;
    tracing::info!(
        zmq = %a.zmq, pod = %a.pod, model = %a.model, listen = %listener.local_addr()?,
        "bridge running"
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(crate::serve::wait_for_signal())
        .await?;
    Ok(())
}

async fn receive(
    br: Arc<Bridge>,
    endpoint: String,
    topic: String,
    tx: tokio::sync::mpsc::UnboundedSender<kvroute_shared::protocol::EventBatch>,
) {
    let mut sock = zeromq::SubSocket::new();
    if let Err(e) = sock.subscribe(&topic).await {
        tracing::error!("zmq subscribe: {e}");
        return;
    }
    // Waits for the engine to come up, then reconnects by itself.
    if let Err(e) = sock.connect(&endpoint).await {
        tracing::error!("zmq connect {endpoint}: {e}");
        return;
    }
    tracing::info!(%endpoint, "subscribed to engine KV events");
    loop {
        let msg = match sock.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!("zmq receive: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        br.n.messages.fetch_add(1, Ordering::Relaxed);
        // (topic, sequence as 8 bytes big-endian, msgpack payload)
        let frames = msg.into_vec();
        let (Some(seq), Some(payload)) = (frames.get(1), frames.get(2)) else {
            br.n.bad_frames.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_ref()).map(u64::from_be_bytes) else {
            br.n.bad_frames.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let batch = match vllm::decode(payload) {
            Ok(b) => b,
            Err(e) => {
                br.n.bad_payloads.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(seq, "engine event batch refused: {e}");
                continue;
            }
        };
        let out = br.tr.lock().on_batch(seq, &batch);
        if let Some(b) = out {
            if tx.send(b).is_err() {
                return;
            }
        }
    }
}

async fn publish(
    br: Arc<Bridge>,
    sink: EventSink,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<kvroute_shared::protocol::EventBatch>,
) {
    while let Some(b) = rx.recv().await {
        let failed = sink.send(&b).await;
        br.n.send_failures
            .fetch_add(failed as u64, Ordering::Relaxed);
    }
}

async fn dump(State(br): State<Arc<Bridge>>) -> impl IntoResponse {
    Json(br.tr.lock().dump())
}

async fn metrics(State(br): State<Arc<Bridge>>) -> impl IntoResponse {
    let (s, known) = {
        let t = br.tr.lock();
        (t.stats.clone(), t.known_blocks())
    };
    let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let mut out = String::new();
    let mut line = |name: &str, help: &str, kind: &str, v: u64| {
        out += &format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n");
    };
    line(
        "kvroute_bridge_messages_total",
        "ZMQ messages received.",
        "counter",
        n(&br.n.messages),
    );
    line(
        "kvroute_bridge_bad_frames_total",
        "Messages without (topic, seq, payload) frames.",
        "counter",
        n(&br.n.bad_frames),
    );
    line(
        "kvroute_bridge_bad_payloads_total",
        "Payloads that are not an engine event batch.",
        "counter",
        n(&br.n.bad_payloads),
    );
    line(
        "kvroute_bridge_send_failures_total",
        "Batches a destination refused or did not get.",
        "counter",
        n(&br.n.send_failures),
    );
    line(
        "kvroute_bridge_batches_out_total",
        "kvroute event batches published.",
        "counter",
        s.batches_out,
    );
    line(
        "kvroute_bridge_duplicates_total",
        "Engine batches seen twice.",
        "counter",
        s.duplicates,
    );
    line(
        "kvroute_bridge_gaps_total",
        "Engine sequence gaps (each starts a new epoch).",
        "counter",
        s.gaps,
    );
    line(
        "kvroute_bridge_restarts_total",
        "Engine restarts seen.",
        "counter",
        s.restarts,
    );
    line(
        "kvroute_bridge_blocks_stored_total",
        "Blocks translated as stored.",
        "counter",
        s.blocks_stored,
    );
    line(
        "kvroute_bridge_blocks_removed_total",
        "Blocks translated as removed.",
        "counter",
        s.blocks_removed,
    );
    line(
        "kvroute_bridge_known_blocks",
        "Engine blocks with a kvroute name.",
        "gauge",
        known as u64,
    );
    out += "# HELP kvroute_bridge_blocks_skipped_total Blocks not translated, by reason.\n# TYPE kvroute_bridge_blocks_skipped_total counter\n";
    for (why, v) in &s.skipped {
        out += &format!("kvroute_bridge_blocks_skipped_total{{reason=\"{why}\"}} {v}\n");
    }
    ([("content-type", "text/plain; version=0.0.4")], out)
}
