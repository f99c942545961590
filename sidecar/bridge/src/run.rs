//! `kvroute-bridge`: runs next to one vLLM or SGLang engine (a container in the
//! engine's pod), subscribes to its ZMQ KV event stream, translates the events into
//! kvroute event batches ([`crate::translate`]) and publishes them ([`crate::sink`]).
//!
//! It sits with the engine, not with the gateway, because the translation needs every
//! event since the engine started (a block is named through its parent): a bridge that
//! lives as long as its engine sees them all, translates once for every gateway replica,
//! and can serve the engine's cache as a dump (`GET /dump`) when a sidecar resyncs.
//!
//! Data flows one way: ZMQ receive (and the engine-load poll) → translate (under a short
//! lock shared with `/dump`) → a bounded, ordered queue → publish. A bad frame or payload
//! is counted and skipped; the stream goes on.
//!
//! Shutdown (the future given to [`run`]) stops the receiver and the poller first, then
//! lets the publisher send what is queued (for at most `DRAIN`), then stops the HTTP
//! server; `run` returns when every task has ended.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{ConnectInfo, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use bytes::Bytes;
use futures::StreamExt;
use kvroute_service::http_server::{self, ConnEvent, ConnLimits};
use kvroute_service::{NatsAuth, Shutdown};
use parking_lot::Mutex;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::metrics::{Counters, METRICS_CONTENT_TYPE};
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
    /// The engine's replay endpoint (vLLM's `replay_endpoint`): a sequence gap is filled
    /// from it before falling back to a new epoch.
    #[arg(long, env = "KVROUTE_BRIDGE_REPLAY")]
    pub replay: Option<String>,
    /// ZMQ topic to subscribe to (vLLM's `topic`, empty by default).
    #[arg(long, env = "KVROUTE_BRIDGE_TOPIC", default_value = "")]
    pub topic: String,
    /// The pod as the gateway reaches it (`ip:port` of the engine's HTTP server).
    #[arg(long, env = "KVROUTE_BRIDGE_POD")]
    pub pod: String,
    /// The engine's data-parallel rank this bridge follows (vLLM publishes each rank's
    /// events on its own ZMQ port: the endpoint's port + rank). Its blocks then belong to
    /// the pod `ip:port@rank`, routed to by the rank header; batches of other ranks are
    /// refused and counted.
    #[arg(long, env = "KVROUTE_BRIDGE_DP_RANK")]
    pub dp_rank: Option<u16>,
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
    /// The sidecars' admin token, sent as a bearer token with `--sidecar` posts.
    #[arg(long, env = "KVROUTE_BRIDGE_SIDECAR_TOKEN", hide_env_values = true)]
    pub sidecar_token: Option<String>,
    #[command(flatten)]
    pub nats_auth: NatsAuth,
    /// Serves `GET /dump`, `/metrics`, `/healthz`.
    #[arg(long, env = "KVROUTE_BRIDGE_LISTEN", default_value = "0.0.0.0:9400")]
    pub listen: SocketAddr,
    /// The dump's URL as sidecars reach it, sent in every batch so that a sidecar which
    /// restarts (or loses a batch) resyncs the pod from it. Default: the pod's host and
    /// the --listen port; empty: do not advertise.
    #[arg(long, env = "KVROUTE_BRIDGE_DUMP_URL")]
    pub dump_url: Option<String>,
    /// Bearer token `GET /dump` requires (the sidecars' `--dump-token`). Without one,
    /// `/dump` answers loopback clients only: the dump lists every cached block's chain
    /// hash, which tells whoever can ask whether a prompt was seen.
    #[arg(long, env = "KVROUTE_BRIDGE_DUMP_TOKEN", hide_env_values = true)]
    pub dump_token: Option<String>,
    /// The engine's Prometheus metrics, polled for its own load (requests running and
    /// waiting, KV usage), published as `load` events. Default `http://<pod>/metrics`;
    /// empty: do not poll.
    #[arg(long, env = "KVROUTE_BRIDGE_ENGINE_METRICS")]
    pub engine_metrics: Option<String>,
    #[arg(long, env = "KVROUTE_BRIDGE_LOAD_INTERVAL_MS", default_value_t = 500)]
    pub load_interval_ms: u64,
}

impl BridgeArgs {
    pub fn validate(&self) -> anyhow::Result<()> {
        if !matches!(
            kvroute_shared::protocol::parse_pod(&self.pod),
            Some((_, None))
        ) {
            anyhow::bail!(
                "--pod {:?} must be IP:port (a rank goes in --dp-rank)",
                self.pod
            );
        }
        if let Some(r) = self
            .dp_rank
            .filter(|r| *r > kvroute_shared::protocol::MAX_DP_RANK)
        {
            anyhow::bail!(
                "--dp-rank {r} is over {}",
                kvroute_shared::protocol::MAX_DP_RANK
            );
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
        if let Some(u) = self.advertised_dump_url() {
            if !(u.starts_with("http://") || u.starts_with("https://")) {
                anyhow::bail!("--dump-url {u:?} must be an http(s) URL");
            }
        }
        Ok(())
    }

    /// The pod id this bridge's blocks belong to: `ip:port`, or `ip:port@rank`.
    pub fn pod_id(&self) -> String {
        match self.dp_rank {
            Some(r) => format!("{}@{r}", self.pod),
            None => self.pod.clone(),
        }
    }

    pub fn engine_metrics_url(&self) -> Option<String> {
        match &self.engine_metrics {
            Some(u) if u.is_empty() => None,
            Some(u) => Some(u.clone()),
            None => Some(format!("http://{}/metrics", self.pod)),
        }
    }

    pub fn advertised_dump_url(&self) -> Option<String> {
        match &self.dump_url {
            Some(u) if u.is_empty() => None,
            Some(u) => Some(u.clone()),
            None => {
                let host = self.pod.rsplit_once(':').map_or(self.pod.as_str(), |h| h.0);
                Some(format!("http://{host}:{}/dump", self.listen.port()))
            }
        }
    }
}

struct Bridge {
    tr: Mutex<Translator>,
    n: Counters,
    dump_token: Option<String>,
    /// `--dp-rank`: batches naming another rank are not this pod's.
    dp_rank: Option<u16>,
}

pub async fn run(
    a: BridgeArgs,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    a.validate()?;
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    let epoch_base = format!("bridge-{started}-{}", std::process::id());
    let br = Arc::new(Bridge {
        tr: Mutex::new(
            Translator::new(&a.pod_id(), &a.model, a.block_size, &epoch_base)
                .with_dump_url(a.advertised_dump_url()),
        ),
        n: Counters::default(),
        dump_token: a.dump_token.clone().filter(|t| !t.is_empty()),
        dp_rank: a.dp_rank,
    });
    if br.dump_token.is_none() && !a.listen.ip().is_loopback() {
        tracing::warn!("no --dump-token: GET /dump answers loopback clients only");
    }
    let sink = EventSink::connect(
        a.nats.as_deref(),
        &a.nats_auth,
        a.sidecars.clone(),
        a.sidecar_token.clone(),
    )
    .await?;
    let listener = tokio::net::TcpListener::bind(a.listen).await?;
    let (stop_tx, stop) = Shutdown::new();
    let (tx, rx) = tokio::sync::mpsc::channel(QUEUE);
    let mut producers = tokio::task::JoinSet::new();
    if let Some(url) = a.engine_metrics_url() {
        let every = Duration::from_millis(a.load_interval_ms.max(50));
        producers.spawn(poll_load(br.clone(), url, every, tx.clone(), stop.clone()));
    }
    producers.spawn(receive(br.clone(), a.clone(), tx, stop.clone()));
    let publisher = tokio::spawn(publish(br.clone(), sink, rx, stop.clone()));
    let counted = br.n.connections.clone();
    let app = Router::new()
        .route("/dump", get(dump))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(br);
    tracing::info!(
        zmq = %a.zmq, pod = %a.pod, model = %a.model, listen = %listener.local_addr()?,
        "bridge running"
    );
    // Its clients are a few sidecars fetching dumps and a metrics scraper.
    let limits = ConnLimits {
        max_connections: 64,
        header_timeout: Duration::from_secs(30),
        body_timeout: Duration::from_secs(60),
    };
    let count = move |e: ConnEvent| {
        counted
            .get_or_create(&vec![("outcome", e.label().to_string())])
            .inc();
    };
    let server = tokio::spawn(http_server::serve(
        listener,
        app,
        limits,
        count,
        stop.clone(),
    ));
    shutdown.await;
    tracing::info!("bridge: shutting down");
    stop_tx.stop();
    // The producers end and drop their senders; the publisher drains what is queued.
    while producers.join_next().await.is_some() {}
    let _ = publisher.await;
    let _ = server.await;
    Ok(())
}

/// How long a shutting-down bridge keeps sending the batches still queued.
const DRAIN: Duration = Duration::from_secs(5);

/// Batches waiting for the destinations. Bounded: with NATS or the sidecars away for
/// long, the newest batches are dropped (counted) rather than memory growing; the
/// sidecars then see a sequence gap and resync the pod from the dump.
const QUEUE: usize = 8192;

type Out = tokio::sync::mpsc::Sender<kvroute_shared::protocol::EventBatch>;

/// Queue a batch; false when the publisher is gone.
fn queue(br: &Bridge, tx: &Out, b: kvroute_shared::protocol::EventBatch) -> bool {
    match tx.try_send(b) {
        Ok(()) => true,
        Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {
            br.n.queue_drops.inc();
            true
        }
        Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => false,
    }
}

async fn receive(br: Arc<Bridge>, a: BridgeArgs, tx: Out, mut stop: Shutdown) {
    let mut sock = zeromq::SubSocket::new();
    // Connection events: next to the engine, a reconnection means it restarted.
    let mut monitor = sock.monitor();
    if let Err(e) = sock.subscribe(&a.topic).await {
        tracing::error!("zmq subscribe: {e}");
        return;
    }
    // Waits for the engine to come up, then reconnects by itself.
    let connected = tokio::select! {
        _ = stop.wait() => return,
        c = sock.connect(&a.zmq) => c,
    };
    if let Err(e) = connected {
        tracing::error!("zmq connect {}: {e}", a.zmq);
        return;
    }
    tracing::info!(endpoint = %a.zmq, "subscribed to engine KV events");
    loop {
        // Connection events first: a batch of a restarted engine must not be read as
        // one of the old engine's.
        let msg = tokio::select! {
            biased;
            _ = stop.wait() => return,
            Some(ev) = monitor.next() => {
                if let zeromq::SocketEvent::Connected(..) = ev {
                    let out = br.tr.lock().reconnected();
                    if let Some(b) = out {
                        tracing::info!("engine stream reconnected: new epoch {}", b.epoch);
                        if !queue(&br, &tx, b) {
                            return;
                        }
                    }
                }
                continue;
            }
            m = sock.recv() => m,
        };
        let msg = match msg {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!("zmq receive: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        br.n.messages.inc();
        // (topic, sequence as 8 bytes big-endian, msgpack payload)
        let frames = msg.into_vec();
        let Some((seq, payload)) = seq_and_payload(frames.get(1), frames.get(2)) else {
            br.n.bad_frames.inc();
            continue;
        };
        let last = br.tr.lock().last_engine_seq();
        if let (Some(ep), Some(last)) = (&a.replay, last) {
            if seq > last.saturating_add(1) {
                fill_gap(&br, ep, last.saturating_add(1), seq, &tx).await;
            }
        }
        if !apply(&br, seq, payload, &tx) {
            return;
        }
    }
}

fn seq_and_payload<'a>(
    seq: Option<&Bytes>,
    payload: Option<&'a Bytes>,
) -> Option<(u64, &'a Bytes)> {
    let seq = <[u8; 8]>::try_from(seq?.as_ref()).ok()?;
    Some((u64::from_be_bytes(seq), payload?))
}

/// Decode, translate and queue one engine batch; false when the publisher is gone.
fn apply(br: &Bridge, seq: u64, payload: &[u8], tx: &Out) -> bool {
    let batch = match vllm::decode(payload) {
        Ok(b) => b,
        Err(e) => {
            br.n.bad_payloads.inc();
            tracing::warn!(seq, "engine event batch refused: {e}");
            return true;
        }
    };
    if let (Some(want), Some(got)) = (br.dp_rank, batch.dp_rank) {
        if got != i64::from(want) {
            br.n.other_rank.inc();
            tracing::warn!(
                seq,
                got,
                want,
                "a batch of another data-parallel rank refused"
            );
            return true;
        }
    }
    let out = br.tr.lock().on_batch(seq, &batch);
    out.is_none_or(|b| queue(br, tx, b))
}

/// Ask the engine to replay batches `from..until`; apply them if it still has them all
/// (otherwise the next batch finds the gap, and a new epoch starts).
async fn fill_gap(br: &Bridge, endpoint: &str, from: u64, until: u64, tx: &Out) {
    match replay(endpoint, from, until).await {
        Some(missed) => {
            for (seq, payload) in &missed {
                apply(br, *seq, payload, tx);
            }
            br.n.replayed.inc_by(missed.len() as u64);
        }
        None => {
            br.n.replay_failures.inc();
        }
    }
}

/// vLLM's replay protocol: send the first sequence wanted (8 bytes big-endian) to its
/// ROUTER socket; it answers (seq, payload) for each batch it still buffers, then
/// seq = −1. `None` unless every batch in `from..until` came back.
async fn replay(endpoint: &str, from: u64, until: u64) -> Option<Vec<(u64, Bytes)>> {
    let ask = async {
        let mut s = zeromq::DealerSocket::new();
        s.connect(endpoint).await.ok()?;
        let mut m = ZmqMessage::from(Vec::<u8>::new());
        m.push_back(from.to_be_bytes().to_vec().into());
        s.send(m).await.ok()?;
        let mut out = Vec::new();
        loop {
            let frames = s.recv().await.ok()?.into_vec();
            let (seq, payload) = seq_and_payload(frames.get(1), frames.get(2))?;
            if seq == u64::MAX {
                break;
            }
            if (from..until).contains(&seq) {
                out.push((seq, payload.clone()));
            }
        }
        let complete = out.len() as u64 == until - from
            && out.iter().zip(from..).all(|((s, _), want)| *s == want);
        complete.then_some(out)
    };
    tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .ok()
        .flatten()
}

/// The engine's own load, from its metrics endpoint, as `load` events: the router's
/// projection then follows what the engine really runs and queues.
async fn poll_load(br: Arc<Bridge>, url: String, every: Duration, tx: Out, mut stop: Shutdown) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap_or_default();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.wait() => return,
            _ = tick.tick() => {}
        }
        br.n.load_polls.inc();
        let text = match http.get(&url).send().await {
            Ok(r) if r.status().is_success() => r.text().await.ok(),
            _ => None,
        };
        // A rank's bridge reads its own rank's series.
        let load = text
            .as_deref()
            .and_then(|t| vllm::engine_load_of(t, br.dp_rank));
        let Some((running, waiting, usage)) = load else {
            br.n.load_poll_failures.inc();
            continue;
        };
        let b = br.tr.lock().load(running, waiting, usage);
        if !queue(&br, &tx, b) {
            return;
        }
    }
}

/// Send queued batches in order until the producers are gone and the queue is empty;
/// once shutdown starts, for at most [`DRAIN`] more.
async fn publish(
    br: Arc<Bridge>,
    sink: EventSink,
    mut rx: tokio::sync::mpsc::Receiver<kvroute_shared::protocol::EventBatch>,
    mut stop: Shutdown,
) {
    let send_all = async {
        while let Some(b) = rx.recv().await {
            let failed = sink.send(&b).await;
            br.n.send_failures.inc_by(failed as u64);
        }
    };
    tokio::pin!(send_all);
    tokio::select! {
        _ = &mut send_all => return,
        _ = stop.wait() => {}
    }
    if tokio::time::timeout(DRAIN, send_all).await.is_err() {
        tracing::warn!("bridge: batches still queued after {DRAIN:?}; dropped");
    }
}

async fn dump(
    State(br): State<Arc<Bridge>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: axum::http::HeaderMap,
) -> Response {
    let allowed = match &br.dump_token {
        Some(t) => kvroute_service::bearer_matches(
            headers.get("authorization").and_then(|v| v.to_str().ok()),
            t,
        ),
        None => peer.ip().is_loopback(),
    };
    if !allowed {
        br.n.dumps_refused.inc();
        return (
            axum::http::StatusCode::UNAUTHORIZED,
            "GET /dump needs Authorization: Bearer <dump token>\n",
        )
            .into_response();
    }
    Json(br.tr.lock().dump()).into_response()
}

async fn metrics(State(br): State<Arc<Bridge>>) -> impl IntoResponse {
    let (s, known) = {
        let t = br.tr.lock();
        (t.stats.clone(), t.known_blocks())
    };
    (
        [("content-type", METRICS_CONTENT_TYPE)],
        br.n.render(&s, known),
    )
}
