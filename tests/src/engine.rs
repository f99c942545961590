//! `kvroute-engine-sim`: a simulated vLLM-like engine pod. Everything in front of it is
//! real, so it behaves like an engine where routing can tell: OpenAI endpoints, a real
//! BPE tokenizer (o200k), a paged prefix cache keyed by the kvroute token chain, prefill
//! time proportional to uncached tokens, a FIFO queue and a batch limit, KV events with
//! (epoch, seq), reported `cached_tokens`, and fault knobs.
//!
//! Cost model (shared with the routing simulator through [`CostModel`]):
//! - prefill is serialized per pod (compute-bound): `uncached_tokens / prefill_tps`;
//! - each decode step takes `decode_ms × (1 + 0.1 × running)` (a larger batch is slower);
//! - at most `max_batch` requests run; the rest wait in FIFO order.
//!
//! All durations are multiplied by `time_scale` so demos run fast.
//!
//! Chat template (documented, simple): for each message
//! `<|im_start|>{role}\n{content}<|im_end|>\n`, then `<|im_start|>assistant\n` — or, with
//! `--model-dir`, the model's own tokenizer and chat template, as vLLM applies them.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use kvroute_shared::protocol::{Event, EventBatch, Tier};
use kvroute_shared::{Mode, Namespace};
use parking_lot::Mutex;
use serde_json::{json, Value};

use crate::bench::Rng;
use crate::cache::BlockCache;
use crate::engine_api::{stream_end, stream_start, stream_token, Api, Counts, Reply};
use crate::vllm_pub::VllmPublisher;
use kvroute_bridge::sink::EventSink;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "kvroute-engine-sim",
    about = "A simulated vLLM-like engine pod"
)]
pub struct EngineArgs {
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Served model name.
    #[arg(long, default_value = "m")]
    pub model: String,
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    #[arg(long, default_value_t = 4096)]
    pub capacity_blocks: usize,
    /// Prefill throughput, tokens per second (simulated time).
    #[arg(long, default_value_t = 8000.0)]
    pub prefill_tps: f64,
    /// Decode step time at batch 1, milliseconds (simulated).
    #[arg(long, default_value_t = 20.0)]
    pub decode_ms: f64,
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// Real seconds per simulated second.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Publish KV events to this NATS server.
    #[arg(long)]
    pub nats: Option<String>,
    /// POST KV events to this sidecar base URL (http://host:port).
    #[arg(long)]
    pub sidecar: Option<String>,
    /// Publish KV events as vLLM does instead: msgpack over a ZMQ PUB socket bound here
    /// (e.g. tcp://127.0.0.1:5557), engine-salted hashes; `kvroute-bridge`
    /// translates them.
    #[arg(long)]
    pub zmq_events: Option<String>,
    /// Publish no KV events at all (predicted-mode engines).
    #[arg(long)]
    pub no_events: bool,
    #[arg(long, default_value_t = 500)]
    pub load_interval_ms: u64,
    /// Fault knobs: fractions of event batches dropped / duplicated / delayed.
    #[arg(long, default_value_t = 0.0)]
    pub drop_events: f64,
    #[arg(long, default_value_t = 0.0)]
    pub dup_events: f64,
    #[arg(long, default_value_t = 0.0)]
    pub delay_events: f64,
    #[arg(long, default_value_t = 200)]
    pub delay_ms: u64,
    /// Fraction of requests answered with HTTP 500.
    #[arg(long, default_value_t = 0.0)]
    pub error_fraction: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Data-parallel ranks behind this one port, each with its own cache, queue and KV
    /// event stream (pod `ip:port@rank`). A request runs on the rank its
    /// `x-data-parallel-rank` header names (vLLM's), else on the least busy one.
    /// kvroute's own events only (not `--zmq-events`).
    #[arg(long, default_value_t = 1)]
    pub dp_ranks: usize,
    /// A Hugging Face model directory: chat and text prompts are tokenized with its
    /// tokenizer and chat template as vLLM does (the same code the sidecar's
    /// `--tokenizer` runs, checked against transformers), instead of o200k + ChatML.
    #[arg(long)]
    pub model_dir: Option<std::path::PathBuf>,
}

/// The timing model, shared with the routing simulator.
#[derive(Clone, Copy, Debug)]
pub struct CostModel {
    pub prefill_tps: f64,
    pub decode_ms: f64,
    pub max_batch: usize,
}

impl CostModel {
    /// Seconds to prefill `uncached` tokens.
    pub fn prefill_s(&self, uncached: u64) -> f64 {
        uncached as f64 / self.prefill_tps.max(1.0)
    }

    /// Seconds of one decode step with `running` requests in the batch.
    pub fn decode_step_s(&self, running: usize) -> f64 {
        self.decode_ms / 1e3 * (1.0 + 0.1 * running as f64)
    }
}

struct Engine {
    args: EngineArgs,
    pod: String,
    tokenizer: tiktoken_rs::CoreBPE,
    /// `--model-dir`: the model's own tokenizer and template.
    model_tok: Option<Arc<kvroute_sidecar::ModelTokenizer>>,
    /// Where this rank's dump is served (its rank in the query when there are several).
    dump_url: String,
    cache: Mutex<BlockCache>,
    epoch: Mutex<String>,
    seq: AtomicU64,
    /// FIFO admission to the batch.
    batch: Arc<tokio::sync::Semaphore>,
    /// Prefill is serialized (compute-bound).
    prefill_lane: tokio::sync::Mutex<()>,
    running: AtomicU64,
    waiting: AtomicU64,
    rng: Mutex<Rng>,
    events: tokio::sync::mpsc::UnboundedSender<EventBatch>,
    /// vLLM-style events (`--zmq-events`), in place of kvroute's.
    vllm: Option<Mutex<VllmPublisher>>,
    served: AtomicU64,
    /// Responses this engine stored (a later turn may continue only its own).
    responses: Mutex<crate::engine_api::ResponseStore>,
}

impl Engine {
    fn cost(&self) -> CostModel {
        CostModel {
            prefill_tps: self.args.prefill_tps,
            decode_ms: self.args.decode_ms,
            max_batch: self.args.max_batch,
        }
    }

    fn scaled(&self, sim_s: f64) -> Duration {
        Duration::from_secs_f64((sim_s * self.args.time_scale).max(0.0))
    }

    fn publish(&self, events: Vec<Event>) {
        if self.args.no_events || events.is_empty() {
            return;
        }
        let b = EventBatch {
            v: 1,
            pod: self.pod.clone(),
            model: self.args.model.clone(),
            epoch: self.epoch.lock().clone(),
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            ts: Some(unix_now()),
            // Named in every batch, so a sidecar that never saw a registration (or lost
            // it in a restart) can still resync this pod.
            dump_url: Some(self.dump_url.clone()),
            events,
        };
        let _ = self.events.send(b);
    }

    /// Tokens of a request body (completions: token ids or text; chat and Messages: the
    /// template; Responses: its text, after the stored conversation it continues).
    fn tokenize(&self, path: &str, v: &Value) -> Result<Vec<u32>, String> {
        let api = Api::of(path);
        let chat = api == Api::Chat;
        if matches!(api, Api::Messages | Api::Responses) {
            // With the model's directory, as vLLM does: Messages and Responses bodies made
            // the chat request vLLM renders (a continued response below: its history is
            // this engine's own record).
            let continued = v["previous_response_id"].is_string();
            if let (Some(t), false) = (&self.model_tok, continued) {
                let api = match api {
                    Api::Messages => kvroute_shared::protocol::PromptApi::Messages,
                    _ => kvroute_shared::protocol::PromptApi::Responses,
                };
                return t.tokenize_for(api, v).map_err(|e| e.to_string());
            }
            let text = crate::engine_api::agent_text(api, v)?;
            let mut toks = match &self.model_tok {
                Some(t) => t.encode(&text, false).map_err(|e| e.to_string())?,
                None => self.tokenizer.encode_ordinary(&text),
            };
            if let Some(prev) = v["previous_response_id"].as_str() {
                let store = self.responses.lock();
                let history = store
                    .get(prev)
                    .ok_or_else(|| format!("{NOT_STORED}{prev}"))?;
                toks.splice(0..0, history.iter().copied());
            }
            return Ok(toks);
        }
        if let Some(t) = &self.model_tok {
            let text_prompt = v["prompt"].is_string()
                || v["prompt"]
                    .as_array()
                    .is_some_and(|a| a.first().is_some_and(Value::is_string));
            if chat || text_prompt {
                return t.tokenize_request(chat, v).map_err(|e| e.to_string());
            }
        }
        if chat {
            let msgs = v["messages"]
                .as_array()
                .ok_or("`messages` must be a list")?;
            let mut text = String::new();
            for m in msgs {
                let role = m["role"].as_str().unwrap_or("user");
                let content = match &m["content"] {
                    Value::String(s) => s.clone(),
                    Value::Array(parts) => parts
                        .iter()
                        .filter_map(|p| p["text"].as_str())
                        .collect::<Vec<_>>()
                        .join(""),
                    _ => String::new(),
                };
                text.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
            }
            text.push_str("<|im_start|>assistant\n");
            return Ok(self.tokenizer.encode_ordinary(&text));
        }
        match &v["prompt"] {
            Value::String(s) => Ok(self.tokenizer.encode_ordinary(s)),
            Value::Array(a) if a.first().is_some_and(|x| x.is_number()) => a
                .iter()
                .map(|x| {
                    x.as_u64()
                        .and_then(|t| u32::try_from(t).ok())
                        .ok_or_else(|| "token ids must be u32".to_string())
                })
                .collect(),
            Value::Array(a) => match a.first() {
                Some(Value::String(s)) => Ok(self.tokenizer.encode_ordinary(s)),
                Some(Value::Array(t)) => t
                    .iter()
                    .map(|x| {
                        x.as_u64()
                            .map(|t| t as u32)
                            .ok_or_else(|| "token ids must be u32".to_string())
                    })
                    .collect(),
                _ => Err("empty prompt".into()),
            },
            _ => Err("`prompt` is required".into()),
        }
    }
}

/// The start of the error a Responses request gets for a response this engine does not
/// hold (vLLM answers 404: its store is per server).
const NOT_STORED: &str = "Response not found: ";

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn new_epoch(rng: &mut Rng) -> String {
    format!("{:016x}", rng.next_u64())
}

pub async fn run(args: EngineArgs) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let addr = listener.local_addr()?;
    let ranks = args.dp_ranks.max(1);
    anyhow::ensure!(
        ranks == 1 || args.zmq_events.is_none(),
        "--dp-ranks with --zmq-events is not simulated (vLLM binds a ZMQ port per rank)"
    );
    anyhow::ensure!(
        ranks <= usize::from(kvroute_shared::protocol::MAX_DP_RANK) + 1,
        "--dp-ranks {ranks} is too many"
    );
    let model_tok = match &args.model_dir {
        Some(d) => Some(Arc::new(kvroute_sidecar::ModelTokenizer::load(
            d,
            64 << 20,
        )?)),
        None => None,
    };
    let mut engines = Vec::new();
    for r in 0..ranks {
        let (pod, dump_url) = if ranks > 1 {
            (
                format!("{addr}@{r}"),
                format!("http://{addr}/kvroute/dump?rank={r}"),
            )
        } else {
            (addr.to_string(), format!("http://{addr}/kvroute/dump"))
        };
        let seed = args.seed ^ addr.port() as u64 ^ (unix_now() * 1e6) as u64 ^ (r as u64) << 40;
        engines.push(start_rank(args.clone(), pod, dump_url, model_tok.clone(), Rng(seed)).await?);
    }
    let app = if ranks == 1 {
        rank_app(engines[0].clone())
    } else {
        ranked_app(engines)
    };
    eprintln!("kvroute-engine-sim: listening on {addr}");
    // Small streamed writes (headers, then one chunk per token) must not wait for
    // delayed ACKs: Nagle off, as real engines' servers do.
    let listener = axum::serve::ListenerExt::tap_io(listener, |s| {
        let _ = s.set_nodelay(true);
    });
    axum::serve(listener, app).await?;
    Ok(())
}

/// One engine (a data-parallel rank of the process, or the whole of it) and its event
/// and load tasks.
async fn start_rank(
    args: EngineArgs,
    pod: String,
    dump_url: String,
    model_tok: Option<Arc<kvroute_sidecar::ModelTokenizer>>,
    mut rng: Rng,
) -> anyhow::Result<Arc<Engine>> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let tokenizer = tiktoken_rs::o200k_base().map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
    let vllm = match &args.zmq_events {
        Some(ep) => Some(Mutex::new(
            VllmPublisher::bind(ep, args.block_size, rng.next_u64()).await?,
        )),
        None => None,
    };
    let eng = Arc::new(Engine {
        pod,
        dump_url,
        tokenizer,
        model_tok,
        cache: Mutex::new(BlockCache::new(args.capacity_blocks)),
        epoch: Mutex::new(new_epoch(&mut rng)),
        seq: AtomicU64::new(0),
        batch: Arc::new(tokio::sync::Semaphore::new(args.max_batch.max(1))),
        prefill_lane: tokio::sync::Mutex::new(()),
        running: AtomicU64::new(0),
        waiting: AtomicU64::new(0),
        rng: Mutex::new(rng),
        events: tx,
        vllm,
        served: AtomicU64::new(0),
        responses: Mutex::new(crate::engine_api::ResponseStore::new(4096)),
        args,
    });
    tokio::spawn(event_sender(eng.clone(), rx));
    tokio::spawn(load_reporter(eng.clone()));
    Ok(eng)
}

/// One rank's endpoints.
fn rank_app(eng: Arc<Engine>) -> Router {
    Router::new()
        .route("/v1/completions", post(complete))
        .route("/v1/chat/completions", post(complete))
        .route("/v1/messages", post(complete))
        .route("/v1/responses", post(complete))
        .route("/v1/completions/render", post(render))
        .route("/v1/chat/completions/render", post(render))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .route("/kvroute/dump", get(dump))
        .route("/admin/restart", post(restart))
        .route("/admin/stats", get(stats))
        .route("/metrics", get(metrics))
        .layer(axum::extract::DefaultBodyLimit::max(64 << 20))
        .with_state(eng)
}

/// Several ranks behind one port: each request goes to the rank its
/// `x-data-parallel-rank` header (or `?rank=`) names, else to the least busy rank, as
/// vLLM's own data-parallel balancing does; a rank out of range is refused (400).
fn ranked_app(engines: Vec<Arc<Engine>>) -> Router {
    use tower::ServiceExt as _;
    let apps: Arc<Vec<Router>> = Arc::new(engines.iter().cloned().map(rank_app).collect());
    let engines = Arc::new(engines);
    Router::new().fallback(move |req: axum::extract::Request| {
        let (apps, engines) = (apps.clone(), engines.clone());
        async move {
            let named = req
                .headers()
                .get("x-data-parallel-rank")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
                .or_else(|| {
                    req.uri()
                        .query()
                        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("rank=")))
                        .map(str::to_owned)
                });
            let k = match named {
                Some(s) => match s.trim().parse::<usize>() {
                    Ok(k) if k < apps.len() => k,
                    _ => return error(StatusCode::BAD_REQUEST, "no such data-parallel rank"),
                },
                None => (0..engines.len())
                    .min_by_key(|&k| {
                        let e = &engines[k];
                        (
                            e.waiting.load(Ordering::Relaxed) * 4
                                + e.running.load(Ordering::Relaxed),
                            k,
                        )
                    })
                    .unwrap_or(0),
            };
            match apps[k].clone().oneshot(req).await {
                Ok(r) => r,
                Err(never) => match never {},
            }
        }
    })
}

/// Publishes batches with the fault knobs applied (drop, duplicate, delay).
async fn event_sender(eng: Arc<Engine>, mut rx: tokio::sync::mpsc::UnboundedReceiver<EventBatch>) {
    let sidecars = eng.args.sidecar.iter().cloned().collect();
    let auth = kvroute_bridge::NatsAuth::default();
    let sink = match EventSink::connect(eng.args.nats.as_deref(), &auth, sidecars, None).await {
        Ok(s) => Arc::new(s),
        Err(e) => {
            eprintln!("kvroute-engine-sim: event sink: {e}");
            return;
        }
    };
    while let Some(b) = rx.recv().await {
        let (drop, dup, delay) = {
            let mut r = eng.rng.lock();
            (
                r.f64() < eng.args.drop_events,
                r.f64() < eng.args.dup_events,
                r.f64() < eng.args.delay_events,
            )
        };
        if drop {
            continue;
        }
        let copies = if dup { 2 } else { 1 };
        let send = {
            let sink = sink.clone();
            async move {
                for _ in 0..copies {
                    sink.send(&b).await;
                }
            }
        };
        if delay {
            let d = Duration::from_millis(eng.args.delay_ms);
            tokio::spawn(async move {
                tokio::time::sleep(d).await;
                send.await;
            });
        } else {
            send.await;
        }
    }
}

async fn load_reporter(eng: Arc<Engine>) {
    let mut t = tokio::time::interval(Duration::from_millis(eng.args.load_interval_ms.max(50)));
    loop {
        t.tick().await;
        let usage = {
            let c = eng.cache.lock();
            c.len() as f64 / c.capacity() as f64
        };
        eng.publish(vec![Event::Load {
            running: eng.running.load(Ordering::Relaxed) as u32,
            waiting: eng.waiting.load(Ordering::Relaxed) as u32,
            kv_usage: usage.clamp(0.0, 1.0),
            capacity_blocks: Some(eng.args.capacity_blocks as u64),
        }]);
    }
}

/// vLLM's own load gauges, in its Prometheus names (what `kvroute-bridge` polls).
async fn metrics(State(eng): State<Arc<Engine>>) -> String {
    let usage = {
        let c = eng.cache.lock();
        c.len() as f64 / c.capacity().max(1) as f64
    };
    let m = &eng.args.model;
    format!(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"{m}\"}} {}\n\
         # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"{m}\"}} {}\n\
         # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{model_name=\"{m}\"}} {usage}\n",
        eng.running.load(Ordering::Relaxed),
        eng.waiting.load(Ordering::Relaxed),
    )
}

/// vLLM's render API: the token ids the engine would run for a request, without running
/// it (`GenerateRequest`; a list of them for completions). vLLM's router (`kv_aware`)
/// asks a worker for them to look the prompt up in the blocks its events announced.
async fn render(State(eng): State<Arc<Engine>>, uri: axum::http::Uri, body: Bytes) -> Response {
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("invalid JSON: {e}")),
    };
    let path = uri.path().trim_end_matches("/render");
    match eng.tokenize(path, &v) {
        Ok(t) if !t.is_empty() => {
            let g = json!({"request_id": format!("render-{}", eng.rng.lock().next_u64()),
                           "token_ids": t, "model": eng.args.model,
                           "sampling_params": {"max_tokens": v["max_tokens"].as_u64().unwrap_or(16)}});
            Json(if Api::of(path) == Api::Chat {
                g
            } else {
                json!([g])
            })
            .into_response()
        }
        Ok(_) => error(StatusCode::BAD_REQUEST, "empty prompt"),
        Err(e) => error(StatusCode::BAD_REQUEST, &e),
    }
}

fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({"error": {"message": message}}))).into_response()
}

async fn models(State(eng): State<Arc<Engine>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": eng.args.model, "object": "model"}]}))
}

async fn stats(State(eng): State<Arc<Engine>>) -> Json<Value> {
    Json(
        json!({"pod": eng.pod, "served": eng.served.load(Ordering::Relaxed), "cached_blocks": eng.cache.lock().len(),
                "epoch": eng.epoch.lock().clone(), "seq": eng.seq.load(Ordering::Relaxed)}),
    )
}

/// The whole cache as one batch of `stored` events (for resyncs).
async fn dump(State(eng): State<Arc<Engine>>) -> Response {
    let blocks = eng.cache.lock().blocks();
    let b = EventBatch {
        v: 1,
        pod: eng.pod.clone(),
        model: eng.args.model.clone(),
        epoch: eng.epoch.lock().clone(),
        seq: eng.seq.load(Ordering::Relaxed).saturating_sub(1),
        ts: Some(unix_now()),
        dump_url: None,
        events: vec![Event::Stored {
            tier: Tier::Gpu,
            parent: None,
            blocks,
            tokens: None,
        }],
    };
    ([("content-type", "application/json")], b.encode()).into_response()
}

/// Simulated engine restart: empty cache, new epoch, seq from 0.
async fn restart(State(eng): State<Arc<Engine>>) -> Json<Value> {
    eng.cache.lock().clear();
    if let Some(v) = &eng.vllm {
        let salt = eng.rng.lock().next_u64();
        v.lock().restarted(salt);
    }
    let e = new_epoch(&mut eng.rng.lock());
    *eng.epoch.lock() = e.clone();
    eng.seq.store(0, Ordering::Relaxed);
    eng.publish(vec![Event::Cleared]);
    Json(json!({"epoch": e}))
}

async fn complete(State(eng): State<Arc<Engine>>, uri: axum::http::Uri, body: Bytes) -> Response {
    let t_arrive = Instant::now();
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": {"message": format!("invalid JSON: {e}")}})),
            )
                .into_response()
        }
    };
    if eng.rng.lock().f64() < eng.args.error_fraction {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"error": {"message": "injected failure"}})),
        )
            .into_response();
    }
    let tokens = match eng.tokenize(uri.path(), &v) {
        Ok(t) if !t.is_empty() => t,
        Ok(_) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": {"message": "empty prompt"}})),
            )
                .into_response()
        }
        Err(e) => {
            let status = if e.starts_with(NOT_STORED) {
                StatusCode::NOT_FOUND
            } else {
                StatusCode::BAD_REQUEST
            };
            return (status, Json(json!({"error": {"message": e}}))).into_response();
        }
    };
    let max_tokens = v["max_tokens"].as_u64().unwrap_or(16).clamp(1, 4096);
    let stream = v["stream"].as_bool().unwrap_or(false);
    let include_usage = v["stream_options"]["include_usage"]
        .as_bool()
        .unwrap_or(false);
    let salt = v["cache_salt"].as_str().unwrap_or("").to_string();
    let api = Api::of(uri.path());

    // Queue for a batch slot (FIFO), then prefill (serialized), then decode.
    eng.waiting.fetch_add(1, Ordering::Relaxed);
    let permit = eng.batch.clone().acquire_owned().await;
    eng.waiting.fetch_sub(1, Ordering::Relaxed);
    eng.running.fetch_add(1, Ordering::Relaxed);
    let ns = Namespace {
        mode: Mode::Tokens,
        block_size: eng.args.block_size,
        model: &eng.args.model,
        adapter: "",
        cache_salt: &salt,
    };
    let chain = ns.chain_tokens(&tokens);
    let (cached_blocks, stored, removed) = {
        let lane = eng.prefill_lane.lock().await;
        let adm = eng.cache.lock().admit(&chain);
        let cached_tokens =
            (adm.hit_blocks as u64 * eng.args.block_size as u64).min(tokens.len() as u64);
        let uncached = tokens.len() as u64 - cached_tokens;
        tokio::time::sleep(eng.scaled(eng.cost().prefill_s(uncached))).await;
        drop(lane);
        (adm.hit_blocks, adm.stored, adm.removed)
    };
    if let Some(v) = &eng.vllm {
        v.lock().admitted(&chain, &tokens, &salt, &stored, &removed);
    }
    let mut evs = Vec::new();
    if !removed.is_empty() && eng.vllm.is_none() {
        evs.push(Event::Removed {
            tier: Tier::Gpu,
            blocks: removed,
        });
    }
    if !stored.is_empty() && eng.vllm.is_none() {
        evs.push(Event::Stored {
            tier: Tier::Gpu,
            parent: None,
            blocks: stored,
            tokens: None,
        });
    }
    eng.publish(evs);
    let cached_tokens =
        (cached_blocks as u64 * eng.args.block_size as u64).min(tokens.len() as u64);
    let ttft_ms = t_arrive.elapsed().as_secs_f64() * 1e3;
    let counts = Counts {
        prompt: tokens.len() as u64,
        cached: cached_tokens,
        output: max_tokens,
    };
    let text: String = (0..max_tokens).map(|i| format!("t{i} ")).collect();
    let id = if api == Api::Responses {
        let mut store = eng.responses.lock();
        let id = store.new_id(&eng.pod);
        if v["store"].as_bool() != Some(false) {
            // The conversation so far, for a later turn naming this response.
            let mut all = tokens.clone();
            match &eng.model_tok {
                Some(t) => all.extend(t.encode(&text, false).unwrap_or_default()),
                None => all.extend(eng.tokenizer.encode_ordinary(&text)),
            }
            store.put(id.clone(), all);
        }
        id
    } else {
        format!(
            "msg_{}_{}",
            eng.served.load(Ordering::Relaxed),
            tokens.len()
        )
    };
    let model = eng.args.model.clone();
    let previous = v["previous_response_id"].as_str().map(str::to_owned);
    let eng2 = eng.clone();
    let finish = move || {
        eng2.running.fetch_sub(1, Ordering::Relaxed);
        eng2.served.fetch_add(1, Ordering::Relaxed);
    };
    let pod = eng.pod.clone();
    if stream {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
        let eng3 = eng.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let reply = Reply {
                id: &id,
                model: &model,
                previous: previous.as_deref(),
            };
            let mut ok = tx
                .send(Ok(Bytes::from(stream_start(api, &reply, counts))))
                .await
                .is_ok();
            for i in 0..max_tokens {
                if !ok {
                    break;
                }
                let chunk = stream_token(api, &reply, i, &format!("t{i} "));
                ok = tx.send(Ok(Bytes::from(chunk))).await.is_ok();
                let running = eng3.running.load(Ordering::Relaxed) as usize;
                tokio::time::sleep(eng3.scaled(eng3.cost().decode_step_s(running))).await;
            }
            let end = stream_end(api, &reply, &text, counts, include_usage);
            let _ = tx.send(Ok(Bytes::from(end))).await;
            finish();
        });
        return Response::builder()
            .header("content-type", "text/event-stream")
            .header("x-pod", pod)
            .header("x-engine-ttft-ms", format!("{ttft_ms:.3}"))
            .body(Body::from_stream(
                tokio_stream::wrappers::ReceiverStream::new(rx),
            ))
            .unwrap_or_default();
    }
    for _ in 0..max_tokens {
        let running = eng.running.load(Ordering::Relaxed) as usize;
        tokio::time::sleep(eng.scaled(eng.cost().decode_step_s(running))).await;
    }
    drop(permit);
    finish();
    let reply = Reply {
        id: &id,
        model: &model,
        previous: previous.as_deref(),
    };
    let resp = crate::engine_api::body(api, &reply, &text, counts);
    (
        [
            ("x-pod", pod),
            ("x-engine-ttft-ms", format!("{ttft_ms:.3}")),
        ],
        Json(resp),
    )
        .into_response()
}
