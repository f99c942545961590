//! The HTTP API (docs/protocol.md): the filter's `/v1/route` and `/v1/report`, event
//! ingestion, pods, config, lookups for operators, metrics and health.
//!
//! The same router serves the TCP listener and the filter's Unix socket. On TCP, when an
//! admin token is configured, every request that changes state needs it as a bearer
//! token; the Unix socket is authorized by its file permissions instead (the filter
//! cannot be given a secret more safely than a socket only Envoy can open).
//!
//! The TCP listener is also reachable from operators' browsers, so it refuses what only a
//! web page would send ([`BrowserGuard`]): a foreign `Origin`, a `Host` that is neither an
//! IP literal, `localhost` nor a configured name (DNS rebinding), and state-changing
//! requests without a JSON (or the filter's binary) content type — the types a page can
//! send without a CORS preflight, which this API never answers.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use kvroute_shared::protocol::{
    EventBatch, PodRegistration, PolicyConfig, ReportBatch, RouteQueued, RouteRequest,
    RouteResponse, WaitRequest,
};
use serde_json::json;

use crate::admission::{Admitted, Shed, Verdict};
use crate::ingest::{self, Recovery};
use crate::route::{self, RouteError};
use crate::state::{ConfigError, Sidecar};

#[derive(Clone)]
pub struct Api {
    pub sc: Arc<Sidecar>,
    pub recovery: Arc<Recovery>,
    /// Required bearer token for state-changing requests (TCP listener only).
    pub admin_token: Option<Arc<str>>,
    /// The browser checks (TCP listener only; see [`BrowserGuard`]).
    pub browser: Option<BrowserGuard>,
    /// Route calls with large bodies decoding and routing at once (see [`LargeRoutes`]).
    pub large_routes: LargeRoutes,
}

/// Route calls whose body is over [`LARGE_ROUTE_BYTES`] (a chat sent for the sidecar to
/// tokenize) are decoded and routed on the blocking pool, a bounded number at a time:
/// decoding megabytes on the async workers would hold up every small route behind them,
/// and an unbounded number of them on the blocking pool would take every core. A call
/// that waits past its deadline is answered `deadline` without any work.
#[derive(Clone, Debug)]
pub struct LargeRoutes(Arc<tokio::sync::Semaphore>);

/// Route bodies larger than this take a [`LargeRoutes`] permit.
pub const LARGE_ROUTE_BYTES: usize = 64 << 10;

impl LargeRoutes {
    /// `n` at once (`--large-routes`); `None`: one core fewer than the node has, at least
    /// one, so small routes on the async workers always keep a core.
    pub fn new(n: Option<usize>) -> LargeRoutes {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let n = n.unwrap_or(cores.saturating_sub(1)).max(1);
        LargeRoutes(Arc::new(tokio::sync::Semaphore::new(n)))
    }
}

/// What the TCP listener accepts from a client that may be a web page.
#[derive(Clone, Debug, Default)]
pub struct BrowserGuard {
    /// Host names accepted besides IP literals and `localhost` (lowercase, no port).
    hosts: Arc<[String]>,
}

/// Why the guard refused a request (stable labels: metric and answer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    ForeignHost,
    ForeignOrigin,
    ContentType,
}

impl Refusal {
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::ForeignHost => "foreign_host",
            Refusal::ForeignOrigin => "foreign_origin",
            Refusal::ContentType => "content_type",
        }
    }
}

impl BrowserGuard {
    pub fn new(hosts: &[String]) -> BrowserGuard {
        let hosts: Vec<String> = hosts
            .iter()
            .map(|h| h.trim().to_ascii_lowercase())
            .filter(|h| !h.is_empty())
            .collect();
        BrowserGuard {
            hosts: hosts.into(),
        }
    }

    /// A host (without its port) this listener answers to: an IP literal cannot be
    /// rebound by DNS, `localhost` resolves locally, and names are the operator's.
    fn host_ok(&self, host: &str) -> bool {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        bare.parse::<std::net::IpAddr>().is_ok()
            || host.eq_ignore_ascii_case("localhost")
            || self.hosts.iter().any(|h| h.eq_ignore_ascii_case(host))
    }

    pub fn check(&self, method: &Method, h: &HeaderMap) -> Result<(), Refusal> {
        let host = h.get("host").and_then(|v| v.to_str().ok());
        if let Some(host) = host {
            if !self.host_ok(strip_port(host)) {
                return Err(Refusal::ForeignHost);
            }
        }
        // Browsers send Origin on every cross-origin request and on same-origin POSTs;
        // the status page is served from this listener, so its Origin names this Host.
        if let Some(origin) = h.get("origin") {
            let same = origin
                .to_str()
                .ok()
                .and_then(|o| {
                    o.strip_prefix("http://")
                        .or_else(|| o.strip_prefix("https://"))
                })
                .zip(host)
                .is_some_and(|(o, host)| o.eq_ignore_ascii_case(host));
            if !same {
                return Err(Refusal::ForeignOrigin);
            }
        }
        if matches!(*method, Method::POST | Method::PUT) {
            let ct = h
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .map(|v| {
                    v.split(';')
                        .next()
                        .unwrap_or("")
                        .trim()
                        .to_ascii_lowercase()
                });
            let ok = ct.as_deref().is_some_and(|ct| {
                ct == "application/json"
                    || ct == kvroute_shared::protocol::ROUTE_BINARY_CONTENT_TYPE
            });
            if !ok {
                return Err(Refusal::ContentType);
            }
        }
        Ok(())
    }
}

/// `host[:port]` or `[v6][:port]` without the port.
fn strip_port(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split_once(']').map_or(host, |(ip, _)| ip);
    }
    match host.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    }
}

/// Event batches and dumps can be large; route requests carry at most ~1M hashes.
const BODY_LIMIT: usize = 32 << 20;

pub fn router(api: Api) -> Router {
    Router::new()
        .route("/v1/route", post(route_h))
        .route("/v1/route/wait", post(wait_h))
        .route("/v1/route/cancel", post(cancel_h))
        .route("/v1/report", post(report_h))
        .route("/v1/events", post(events_h))
        .route("/v1/pods", get(pods_h))
        .route(
            "/v1/pods/{id}",
            put(put_pod_h).delete(delete_pod_h).get(get_pod_h),
        )
        .route("/v1/pods/{id}/blocks", get(pod_blocks_h))
        .route("/v1/config", get(get_config_h).put(put_config_h))
        .route("/v1/lookup", get(lookup_get_h).post(lookup_post_h))
        .route("/v1/status", get(status_h))
        .route("/v1/tokenize", post(tokenize_h))
        .route("/v1/decisions", get(decisions_h))
        .route("/metrics", get(metrics_h))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_h))
        .merge(crate::ui::router())
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(axum::middleware::from_fn_with_state(api.clone(), auth))
        .with_state(api)
}

async fn auth(
    State(api): State<Api>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(guard) = &api.browser {
        if let Err(r) = guard.check(req.method(), req.headers()) {
            api.sc.metrics.api_refused.inc(r.reason(), 1);
            let (status, msg) = match r {
                Refusal::ContentType => (
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "state-changing requests must be Content-Type: application/json",
                ),
                _ => (
                    StatusCode::FORBIDDEN,
                    "requests from another origin or host name are refused (see --allowed-host)",
                ),
            };
            return err(status, r.reason(), msg);
        }
    }
    if let Some(token) = &api.admin_token {
        let changes_state = matches!(*req.method(), Method::POST | Method::PUT | Method::DELETE);
        // A lookup tells whether a prompt is cached: what users asked, so it is guarded
        // like the admin API whichever the method.
        let path = req.uri().path();
        // Registrations name dump URLs and pods' addresses: an operator's business too.
        let reveals_prompts = matches!(path, "/v1/lookup" | "/v1/status" | "/v1/decisions")
            || path.starts_with("/v1/pods");
        if (changes_state || reveals_prompts) && !bearer_ok(req.headers(), token) {
            api.sc.metrics.api_refused.inc("unauthorized", 1);
            return err(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "this endpoint needs Authorization: Bearer <admin token>",
            );
        }
    }
    next.run(req).await
}

fn bearer_ok(h: &HeaderMap, token: &str) -> bool {
    let v = h.get("authorization").and_then(|v| v.to_str().ok());
    kvroute_service::bearer_matches(v, token)
}

fn err(status: StatusCode, reason: &str, msg: impl std::fmt::Display) -> Response {
    (
        status,
        Json(json!({"error": msg.to_string(), "reason": reason})),
    )
        .into_response()
}

// A refusal is a ready response; boxing it would only add an allocation per error.
#[allow(clippy::result_large_err)]
fn parse<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> Result<T, Response> {
    serde_json::from_slice(body).map_err(|e| {
        err(
            StatusCode::BAD_REQUEST,
            "bad_json",
            format!("malformed {what}: {e}"),
        )
    })
}

async fn route_h(State(api): State<Api>, headers: HeaderMap, body: Bytes) -> Response {
    let deadline = headers
        .get(kvroute_shared::protocol::ROUTE_DEADLINE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|ms| std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms));
    let binary = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with(kvroute_shared::protocol::ROUTE_BINARY_CONTENT_TYPE));
    if body.len() > LARGE_ROUTE_BYTES {
        return large_route(&api, binary, body, deadline).await;
    }
    let req = match decode_route(&api.sc, binary, &body) {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    if req.prompt_body.is_some() {
        // Rendering and tokenizing take milliseconds: off the async workers.
        let sc = api.sc.clone();
        match tokio::task::spawn_blocking(move || route_answer(&sc, req, deadline)).await {
            Ok(r) => r,
            Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, "internal", e),
        }
    } else {
        route_answer(&api.sc, req, deadline)
    }
}

/// A route call's answer: routed at once, or, with admission on and the model
/// saturated, queued (`202` and a ticket) or refused (`429`).
fn route_answer(
    sc: &Sidecar,
    req: RouteRequest,
    deadline: Option<std::time::SystemTime>,
) -> Response {
    let cfg = sc.config();
    if !cfg.admission.enabled || req.dry_run {
        return answer(route::route_until(sc, &req, deadline));
    }
    let req = route::tokenized(sc, req);
    match sc
        .waiting
        .admit(sc, req, deadline, std::time::Instant::now())
    {
        Ok(Admitted::Routed(r)) => answer(Ok(r)),
        Ok(Admitted::Queued { ticket, wait }) => (
            StatusCode::ACCEPTED,
            Json(RouteQueued {
                ticket,
                wait_ms: u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            }),
        )
            .into_response(),
        Ok(Admitted::Refused(why)) => refused(&cfg, why),
        Err(e) => answer(Err(e)),
    }
}

/// `429` for a request admission will not route, with when to try again.
fn refused(cfg: &PolicyConfig, why: Shed) -> Response {
    retry_later(
        StatusCode::TOO_MANY_REQUESTS,
        why.label(),
        format!(
            "the model is saturated and the request was not queued or left the queue ({})",
            why.label()
        ),
        cfg.admission.retry_after_s,
    )
}

/// An answer the filter relays to the client: the stable `reason`, and when to try
/// again in the body and in `Retry-After`.
fn retry_later(status: StatusCode, reason: &str, msg: String, retry: u32) -> Response {
    let body = json!({"error": msg, "reason": reason, "retry_after_s": retry});
    (status, [("retry-after", retry.to_string())], Json(body)).into_response()
}

/// `POST /v1/route/cancel` (same body as the wait call): the client of a queued
/// request went away; `204` whether or not anything was still held.
async fn cancel_h(State(api): State<Api>, body: Bytes) -> Response {
    let w: WaitRequest = match parse(&body, "cancel request") {
        Ok(w) => w,
        Err(resp) => return resp,
    };
    api.sc.waiting.cancel(&api.sc, &w.model, w.ticket);
    StatusCode::NO_CONTENT.into_response()
}

/// `POST /v1/route/wait`: the decision of a request the route call queued, when it
/// leaves the queue. The call ending early (its client went away) takes it out.
async fn wait_h(State(api): State<Api>, body: Bytes) -> Response {
    let w: WaitRequest = match parse(&body, "wait request") {
        Ok(w) => w,
        Err(resp) => return resp,
    };
    let cfg = api.sc.config();
    match api.sc.waiting.wait(&api.sc, &w.model, w.ticket).await {
        Verdict::Routed(r) => answer(Ok(r)),
        Verdict::Refused(why) => refused(&cfg, why),
        Verdict::Failed(e) => answer(Err(e)),
        Verdict::Stopping => err(
            StatusCode::SERVICE_UNAVAILABLE,
            "stopping",
            "the sidecar is stopping; send the request on unsteered",
        ),
    }
}

/// A route call over [`LARGE_ROUTE_BYTES`]: decoded and answered on the blocking pool once
/// a [`LargeRoutes`] permit is free, or `deadline` (504) if none is free in time.
async fn large_route(
    api: &Api,
    binary: bool,
    body: Bytes,
    deadline: Option<std::time::SystemTime>,
) -> Response {
    let acquire = api.large_routes.0.clone().acquire_owned();
    let permit = match deadline {
        Some(d) => {
            let left = d
                .duration_since(std::time::SystemTime::now())
                .unwrap_or_default();
            tokio::time::timeout(left, acquire).await.ok()
        }
        None => Some(acquire.await),
    };
    let Some(Ok(permit)) = permit else {
        let e = RouteError::DeadlinePassed;
        api.sc.metrics.route_errors.inc(e.reason(), 1);
        return err(status_of(e.status()), e.reason(), e);
    };
    let sc = api.sc.clone();
    let work = move || {
        let _permit = permit;
        match decode_route(&sc, binary, &body) {
            Ok(req) => route_answer(&sc, req, deadline),
            Err(resp) => resp,
        }
    };
    match tokio::task::spawn_blocking(work).await {
        Ok(r) => r,
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, "internal", e),
    }
}

/// A route call's body, JSON or binary; a refusal (counted `bad_json`) otherwise.
#[allow(clippy::result_large_err)] // as `parse`
fn decode_route(sc: &Sidecar, binary: bool, body: &[u8]) -> Result<RouteRequest, Response> {
    let parsed = if binary {
        RouteRequest::decode_binary(body).map_err(|e| err(StatusCode::BAD_REQUEST, "bad_body", e))
    } else {
        parse(body, "route request")
    };
    parsed.inspect_err(|_| sc.metrics.route_errors.inc("bad_json", 1))
}

fn answer(r: Result<RouteResponse, RouteError>) -> Response {
    match r {
        Ok(resp) => Json(resp).into_response(),
        Err(e) => match e.retry_after_s() {
            Some(retry) => retry_later(status_of(e.status()), e.reason(), e.to_string(), retry),
            None => err(status_of(e.status()), e.reason(), e),
        },
    }
}

fn status_of(code: u16) -> StatusCode {
    StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

async fn report_h(State(api): State<Api>, body: Bytes) -> Response {
    let rejected = |n: usize| api.sc.metrics.reports_rejected.inc_by(n as u64);
    match ReportBatch::decode(&body) {
        Ok(batch) => {
            for r in &batch.reports {
                route::report(&api.sc, r);
            }
            if batch.rejected.is_empty() {
                return StatusCode::NO_CONTENT.into_response();
            }
            rejected(batch.rejected.len());
            err(
                StatusCode::BAD_REQUEST,
                "bad_report",
                format!(
                    "{} of {} reports rejected (the others were applied): {}",
                    batch.rejected.len(),
                    batch.rejected.len() + batch.reports.len(),
                    batch.rejected.join("; ")
                ),
            )
        }
        Err(e) => {
            rejected(1);
            err(StatusCode::BAD_REQUEST, "bad_json", e)
        }
    }
}

async fn events_h(State(api): State<Api>, body: Bytes) -> Response {
    let batch = match EventBatch::decode(&body) {
        Ok(b) => b,
        Err(e) => {
            api.sc.metrics.events_rejected.inc(e.reason(), 1);
            return err(StatusCode::BAD_REQUEST, e.reason(), e);
        }
    };
    let (sc, rec) = (api.sc.clone(), api.recovery.clone());
    let r = tokio::task::spawn_blocking(move || ingest::ingest(&sc, &rec, &batch)).await;
    match r {
        Ok(Ok(i)) => Json(json!({
            "applied": !i.duplicate, "duplicate": i.duplicate, "restarted": i.restarted,
            "gap": i.gap, "blocks_changed": i.blocks_changed, "removed_pod": i.removed_pod,
        }))
        .into_response(),
        Ok(Err(e)) => err(StatusCode::UNPROCESSABLE_ENTITY, e.reason(), e),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, "internal", e),
    }
}

fn pod_json(sc: &Sidecar, p: &crate::registry::Pod, now: std::time::Instant) -> serde_json::Value {
    crate::status::pod(sc, p, now)
}

#[derive(serde::Deserialize)]
struct TokenizeBody {
    model: String,
    /// The API path the body is for (`/v1/chat/completions`, `/v1/messages`, …).
    path: String,
    body: serde_json::Value,
}

/// A request body as the model's tokenizer sees it (`--tokenizer`): the status page's
/// inspector chains these ids in the browser, and operators compare them with the
/// engine's. Guarded like every POST.
async fn tokenize_h(State(api): State<Api>, body: Bytes) -> Response {
    // The same budget as routes; a body too large for it is refused before it is parsed.
    if body.len() > api.sc.tokenize_budget.max_fields() {
        return not_tokenized(&api.sc, crate::tokenize::Refused::TooLarge);
    }
    let b: TokenizeBody = match parse(&body, "tokenize request") {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let Some(endpoint) = kvroute_shared::canon::Endpoint::from_path(&b.path) else {
        return err(
            StatusCode::BAD_REQUEST,
            "bad_path",
            format!("{:?} is not a routed API path", b.path),
        );
    };
    let prompt_api = kvroute_shared::protocol::PromptApi::from(endpoint);
    let toks = api.sc.tokenizers();
    let Some(t) = toks.get(&b.model).cloned() else {
        return err(
            StatusCode::NOT_FOUND,
            "no_tokenizer",
            format!("no tokenizer is loaded for model {:?}", b.model),
        );
    };
    let (sc, len) = (api.sc.clone(), body.len());
    let model = b.model.clone();
    let r = tokio::task::spawn_blocking(move || {
        // Held while tokenizing; refused if the routes took the budget meanwhile.
        let permit = sc.tokenize_budget.take(len);
        permit.map(|_p| t.tokenize_for(prompt_api, &b.body))
    })
    .await;
    match r {
        Ok(Ok(Ok(ids))) => Json(json!({"model": model, "tokens": ids})).into_response(),
        Ok(Ok(Err(e))) => err(StatusCode::UNPROCESSABLE_ENTITY, e.reason(), e),
        Ok(Err(r)) => not_tokenized(&api.sc, r),
        Err(e) => err(StatusCode::INTERNAL_SERVER_ERROR, "internal", e),
    }
}

/// `/v1/tokenize` refused by the budget: 413 or 503, counted as routes' refusals are.
fn not_tokenized(sc: &Sidecar, r: crate::tokenize::Refused) -> Response {
    sc.metrics.precise.inc(r.reason(), 1);
    let status = match r {
        crate::tokenize::Refused::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        crate::tokenize::Refused::Busy => StatusCode::SERVICE_UNAVAILABLE,
    };
    err(status, r.reason(), format!("not tokenized: {}", r.reason()))
}

/// Everything the status page shows (guarded like lookups: it reveals cache state).
async fn status_h(State(api): State<Api>) -> Response {
    Json(crate::status::snapshot(&api.sc)).into_response()
}

#[derive(serde::Deserialize)]
struct DecisionsQuery {
    #[serde(default)]
    limit: Option<usize>,
}

/// The last decisions, newest first (guarded like lookups).
async fn decisions_h(State(api): State<Api>, Query(q): Query<DecisionsQuery>) -> Response {
    let n = q.limit.unwrap_or(50).min(crate::recent::RECENT);
    Json(json!({"decisions": api.sc.recent.latest(n)})).into_response()
}

async fn pods_h(State(api): State<Api>) -> Response {
    let now = std::time::Instant::now();
    let v: Vec<_> = api
        .sc
        .registry()
        .all()
        .iter()
        .map(|p| pod_json(&api.sc, p, now))
        .collect();
    Json(json!({"pods": v})).into_response()
}

async fn get_pod_h(State(api): State<Api>, Path(id): Path<String>) -> Response {
    let p = api.sc.registry().get(&id);
    match p {
        Some(p) => Json(pod_json(&api.sc, &p, std::time::Instant::now())).into_response(),
        None => err(StatusCode::NOT_FOUND, "unknown_pod", format!("no pod {id}")),
    }
}

/// Every block the index holds for a pod (operators and tests: compare with the engine's
/// own cache). Guarded like lookups.
async fn pod_blocks_h(State(api): State<Api>, Path(id): Path<String>) -> Response {
    let model = api.sc.registry().model_of(&id);
    let Some(model) = model else {
        return err(StatusCode::NOT_FOUND, "unknown_pod", format!("no pod {id}"));
    };
    let blocks = api
        .sc
        .indexes
        .get(&model)
        .and_then(|ix| ix.handle(&id).map(|h| ix.blocks_of(h)))
        .unwrap_or_default();
    Json(json!({"pod": id, "model": model, "blocks": blocks})).into_response()
}

async fn put_pod_h(State(api): State<Api>, Path(id): Path<String>, body: Bytes) -> Response {
    let reg: PodRegistration = match parse(&body, "pod registration") {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    match api.sc.register(&id, reg) {
        Ok(()) => get_pod_h(State(api), Path(id)).await,
        Err(e) => err(status_of(e.status()), e.reason(), e),
    }
}

async fn delete_pod_h(State(api): State<Api>, Path(id): Path<String>) -> Response {
    if api.sc.remove_pod(&id, "api") {
        StatusCode::NO_CONTENT.into_response()
    } else {
        err(StatusCode::NOT_FOUND, "unknown_pod", format!("no pod {id}"))
    }
}

async fn get_config_h(State(api): State<Api>) -> Response {
    Json((*api.sc.config()).clone()).into_response()
}

async fn put_config_h(State(api): State<Api>, body: Bytes) -> Response {
    let cfg: PolicyConfig = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => {
            api.sc.metrics.config_rejected.inc();
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": "invalid config", "problems": [e.to_string()]})),
            )
                .into_response();
        }
    };
    let given = Some(cfg.version);
    match api.sc.set_config(cfg, given) {
        Ok(c) => Json((*c).clone()).into_response(),
        Err(ConfigError::Invalid(problems)) => {
            (StatusCode::BAD_REQUEST, Json(json!({"error": "invalid config", "problems": problems}))).into_response()
        }
        Err(ConfigError::VersionConflict { current, given }) => err(
            StatusCode::CONFLICT,
            "version_conflict",
            format!("config version {given} is not the current one ({current}): GET it again and reapply your change"),
        ),
    }
}

#[derive(serde::Deserialize)]
struct LookupQuery {
    model: String,
    /// Comma-separated decimal hashes.
    chain: String,
}

#[derive(serde::Deserialize)]
struct LookupBody {
    model: String,
    chain: Vec<u64>,
}

async fn lookup_get_h(State(api): State<Api>, Query(q): Query<LookupQuery>) -> Response {
    let chain: Result<Vec<u64>, _> = q
        .chain
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.trim().parse::<u64>())
        .collect();
    match chain {
        Ok(c) => lookup(&api.sc, &q.model, &c),
        Err(e) => err(
            StatusCode::BAD_REQUEST,
            "bad_chain",
            format!("chain must be comma-separated u64: {e}"),
        ),
    }
}

async fn lookup_post_h(State(api): State<Api>, body: Bytes) -> Response {
    match parse::<LookupBody>(&body, "lookup") {
        Ok(b) => lookup(&api.sc, &b.model, &b.chain),
        Err(resp) => resp,
    }
}

/// What the index knows about a chain: confirmed and predicted depth per pod, and where
/// the deepest confirmed pod holds its blocks. No decision is made.
fn lookup(sc: &Sidecar, model: &str, chain: &[u64]) -> Response {
    let confirmed = sc.indexes.get(model).map(|ix| {
        ix.lookup(chain)
            .into_iter()
            .map(|m| json!({"pod": &*m.pod, "matched_blocks": m.depth, "tiers": ix.tier_hint(m.slot, chain, m.depth)}))
            .collect::<Vec<_>>()
    });
    let predicted = sc.predicted.indexes.get(model).map(|ix| {
        ix.lookup(chain)
            .into_iter()
            .map(|m| json!({"pod": &*m.pod, "matched_blocks": m.depth}))
            .collect::<Vec<_>>()
    });
    Json(
        json!({"model": model, "blocks": chain.len(), "confirmed": confirmed.unwrap_or_default(),
                "predicted": predicted.unwrap_or_default()}),
    )
    .into_response()
}

async fn metrics_h(State(api): State<Api>) -> Response {
    let body = api.sc.metrics.render(&api.sc.gauges());
    ([("content-type", crate::metrics::CONTENT_TYPE)], body).into_response()
}

/// Only `/healthz` and `/readyz`, for a listener that kubelet probes on the pod's
/// address while the API stays on loopback.
pub fn health_router(api: Api) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_h))
        .with_state(api)
}

async fn ready_h(State(api): State<Api>) -> Response {
    if let Err(why) = api.sc.ready() {
        // Still serving (from HTTP ingestion and predicted mode), but say so.
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"ready": false, "degraded": why})),
        )
            .into_response();
    }
    Json(json!({"ready": true})).into_response()
}
