//! Stand-ins for the filter's tests: a sidecar that records what the filter asked and
//! answers as told, and upstream pods that say who they are and report usage.
//!
//! They are deliberately dumb so that a filter test checks the filter alone; the real
//! sidecar and the engine simulator have their own end-to-end tests.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use kvroute_shared::protocol::{
    CompletionReport, Ranked, ReportBatch, RouteRequest, RouteResponse,
};
use parking_lot::Mutex;

/// How the stub sidecar answers `/v1/route`.
#[derive(Clone, Debug)]
pub enum Answer {
    Pod(String),
    Status(u16),
    Garbage,
}

#[derive(Default)]
pub struct SidecarLog {
    pub routes: Vec<RouteRequest>,
    pub reports: Vec<CompletionReport>,
}

struct SidecarState {
    answer: Mutex<Answer>,
    delay: Mutex<Duration>,
    log: Arc<Mutex<SidecarLog>>,
}

pub struct StubSidecar {
    pub addr: SocketAddr,
    state: Arc<SidecarState>,
    pub log: Arc<Mutex<SidecarLog>>,
}

impl StubSidecar {
    pub async fn start(answer: Answer) -> anyhow::Result<StubSidecar> {
        let log = Arc::new(Mutex::new(SidecarLog::default()));
        let state = Arc::new(SidecarState {
            answer: Mutex::new(answer),
            delay: Mutex::new(Duration::ZERO),
            log: log.clone(),
        });
        let app = Router::new()
            .route("/v1/route", post(route))
            .route("/v1/report", post(report))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move { axum::serve(listener, app).await });
        Ok(StubSidecar { addr, state, log })
    }

    pub fn set_answer(&self, a: Answer) {
        *self.state.answer.lock() = a;
    }

    pub fn set_delay(&self, d: Duration) {
        *self.state.delay.lock() = d;
    }
}

async fn route(State(st): State<Arc<SidecarState>>, body: Bytes) -> Response {
    let delay = *st.delay.lock();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let req: RouteRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let n = req.chain.len() as u32;
    st.log.lock().routes.push(req);
    let answer = st.answer.lock().clone();
    match answer {
        Answer::Pod(pod) => {
            let resp = RouteResponse {
                ranked: vec![Ranked {
                    pod: pod.clone(),
                    matched_blocks: n,
                    score: None,
                }],
                pod,
                decision: Some(format!("stub-{n}")),
                tier_hint: None,
                prefill_pod: None,
                policy_version: 1,
                explain: None,
            };
            axum::Json(resp).into_response()
        }
        Answer::Status(s) => StatusCode::from_u16(s)
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
            .into_response(),
        Answer::Garbage => "{not json".into_response(),
    }
}

async fn report(State(st): State<Arc<SidecarState>>, body: Bytes) -> StatusCode {
    match ReportBatch::decode(&body) {
        Ok(b) if b.rejected.is_empty() => {
            st.log.lock().reports.extend(b.reports);
            StatusCode::NO_CONTENT
        }
        _ => StatusCode::BAD_REQUEST,
    }
}

/// An upstream pod that names itself in `x-pod` and reports fixed usage.
pub struct StubPod {
    pub addr: SocketAddr,
    pub name: String,
}

#[derive(Clone)]
struct PodState {
    name: String,
}

impl StubPod {
    pub async fn start(name: &str) -> anyhow::Result<StubPod> {
        let st = PodState {
            name: name.to_string(),
        };
        let app = Router::new()
            .route("/v1/completions", post(complete))
            .route("/v1/chat/completions", post(complete))
            .route("/v1/messages", post(complete))
            .route("/v1/responses", post(complete))
            .route("/v1/models", axum::routing::get(models))
            .with_state(st);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let listener = axum::serve::ListenerExt::tap_io(listener, |s| {
            let _ = s.set_nodelay(true);
        });
        tokio::spawn(async move { axum::serve(listener, app).await });
        Ok(StubPod {
            addr,
            name: name.to_string(),
        })
    }
}

async fn models(State(st): State<PodState>) -> Response {
    ([("x-pod", st.name)], "{\"object\":\"list\",\"data\":[]}").into_response()
}

/// Non-streaming: a JSON body with usage (cached_tokens 7). Streaming: five SSE chunks
/// 100 ms apart, the last carrying usage, so a test can see chunks arrive before the end.
async fn complete(State(st): State<PodState>, headers: HeaderMap, body: Bytes) -> Response {
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    let steered = headers
        .get("x-gateway-destination-endpoint")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("")
        .to_string();
    // The data-parallel rank the router told the engine to run the request on.
    let rank = headers
        .get("x-data-parallel-rank")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("")
        .to_string();
    let usage = serde_json::json!({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                                   "prompt_tokens_details": {"cached_tokens": 7}});
    if v["stream"].as_bool() == Some(true) {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(8);
        tokio::spawn(async move {
            for i in 0..5 {
                let chunk =
                    format!("data: {{\"choices\":[{{\"text\":\"t{i}\"}}],\"usage\":null}}\n\n");
                if tx.send(Ok(Bytes::from(chunk))).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let last = format!(
                "data: {}\n\ndata: [DONE]\n\n",
                serde_json::json!({"choices": [], "usage": usage})
            );
            let _ = tx.send(Ok(Bytes::from(last))).await;
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        return Response::builder()
            .header("content-type", "text/event-stream")
            .header("x-pod", st.name)
            .header("x-seen-steer", steered)
            .header("x-seen-rank", rank)
            .body(Body::from_stream(stream))
            .unwrap_or_default();
    }
    let resp = serde_json::json!({"id": "cmpl", "object": "text_completion",
                                  "choices": [{"text": "ok", "index": 0}], "usage": usage});
    (
        [
            ("x-pod", st.name),
            ("x-seen-steer", steered),
            ("x-seen-rank", rank),
        ],
        axum::Json(resp),
    )
        .into_response()
}
