//! What the filter decides, as plain functions over bytes and strings, so that every
//! branch is unit-tested natively; the proxy-wasm glue only moves data in and out.
//!
//! One request's life: [`wants_body`] on headers → [`prepare`] on the whole body (chain
//! and route-request bytes) → [`interpret`] on the callout's answer → at the end
//! [`report`]. Every path that is not a clean steer is a [`Skip`] with a stable reason,
//! and a skip always means "continue unsteered" (fail open).

use kvroute_shared::canon::{self, Endpoint};
use kvroute_shared::protocol::{
    Admission, CompletionReport, PromptApi, PromptBody, RouteQueued, RouteRequest, RouteResponse,
    WaitRequest, MAX_ADMISSION_ID,
};

use crate::config::{FilterConfig, ModelSettings};
use crate::usage::Usage;

/// Why a request was not steered. `as_str` is the metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    BodyTooLarge,
    BadJson,
    NoPrompt,
    EmptyPrompt,
    TextNotRouted,
    DispatchFailed,
    Timeout,
    SidecarError,
    NoPod,
    BadAnswer,
    TooManyMessages,
}

impl Skip {
    pub const ALL: [Skip; 11] = [
        Skip::BodyTooLarge,
        Skip::BadJson,
        Skip::NoPrompt,
        Skip::EmptyPrompt,
        Skip::TextNotRouted,
        Skip::DispatchFailed,
        Skip::Timeout,
        Skip::SidecarError,
        Skip::NoPod,
        Skip::BadAnswer,
        Skip::TooManyMessages,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Skip::BodyTooLarge => "body_too_large",
            Skip::BadJson => "bad_json",
            Skip::NoPrompt => "no_prompt",
            Skip::EmptyPrompt => "empty_prompt",
            Skip::TextNotRouted => "text_not_routed",
            Skip::DispatchFailed => "dispatch_failed",
            Skip::Timeout => "timeout",
            Skip::SidecarError => "sidecar_error",
            Skip::NoPod => "no_pod",
            Skip::BadAnswer => "bad_answer",
            Skip::TooManyMessages => "too_many_messages",
        }
    }
}

/// Should the filter hold the headers and read the body of this request?
pub fn wants_body(cfg: &FilterConfig, method: Option<&str>, path: Option<&str>) -> bool {
    method == Some("POST") && path.is_some_and(|p| cfg.routes_path(p))
}

/// A request ready for the callout.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    pub model: String,
    pub blocks: usize,
    pub prompt_tokens: u32,
    pub route_body: Vec<u8>,
    /// The body is the compact binary form (long chains), not JSON.
    pub binary: bool,
    /// A Responses request (its response's id is worth learning).
    pub responses: bool,
}

/// What the route takes from the request's headers.
#[derive(Debug, Clone, Copy, Default)]
pub struct FromHeaders<'a> {
    pub request_id: Option<&'a str>,
    pub session: Option<&'a str>,
    /// The value of the configured `tenant_header` (set by the gateway, never the client).
    pub tenant: Option<&'a str>,
    /// The configured priority, objective and fairness headers' values, and the API
    /// key (`authorization`, else `x-api-key`), for the admission class.
    pub priority: Option<&'a str>,
    pub objective: Option<&'a str>,
    pub fairness: Option<&'a str>,
    pub api_key: Option<&'a str>,
}

impl FromHeaders<'_> {
    /// The request's admission class. The tenant is the gateway's authenticated tenant
    /// if configured, else the fairness header, else the API key's hash (the key itself
    /// never leaves Envoy), else none.
    pub fn admission(&self, cfg: &FilterConfig) -> Admission {
        fn nonempty(v: Option<&str>) -> Option<&str> {
            v.map(str::trim).filter(|v| !v.is_empty())
        }
        let tenant = if cfg.tenant_header.is_empty() {
            None
        } else {
            nonempty(self.tenant)
        };
        let tenant = tenant
            .or(nonempty(self.fairness))
            .map(|t| cut(t, MAX_ADMISSION_ID).to_owned())
            .or_else(|| {
                nonempty(self.api_key)
                    .map(|k| format!("key-{:016x}", xxhash_rust::xxh3::xxh3_64(k.as_bytes())))
            });
        Admission {
            priority: nonempty(self.priority).and_then(|p| p.parse().ok()),
            objective: nonempty(self.objective).map(|o| cut(o, MAX_ADMISSION_ID).to_owned()),
            tenant,
        }
    }
}

/// Session keys and response ids longer than this are cut (the sidecar hashes them; a
/// client's megabyte header must not travel in every route call).
pub const MAX_KEY_BYTES: usize = 256;

/// `s` cut to at most `max` bytes, at a character boundary.
fn cut(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Parse and chain a whole request body.
pub fn prepare(
    cfg: &FilterConfig,
    path: &str,
    body: &[u8],
    h: FromHeaders<'_>,
) -> Result<Prepared, Skip> {
    let req = parse(cfg, path, body)?;
    route_request(cfg, req, body, h)
}

/// The body as a request, or why it is not routed. Split from [`route_request`] only so
/// the glue can time the two halves (parsing dominates long token-id prompts).
pub fn parse<'a>(
    cfg: &FilterConfig,
    path: &str,
    body: &'a [u8],
) -> Result<canon::Request<'a>, Skip> {
    if body.len() > cfg.max_body_bytes {
        return Err(Skip::BodyTooLarge);
    }
    let endpoint = Endpoint::from_path(path).ok_or(Skip::NoPrompt)?;
    canon::parse(endpoint, body).map_err(|e| match e {
        canon::CanonError::Json(_) => Skip::BadJson,
        canon::CanonError::Missing(_) => Skip::NoPrompt,
        canon::CanonError::Empty => Skip::EmptyPrompt,
        canon::CanonError::TooManyMessages => Skip::TooManyMessages,
    })
}

/// Chain a parsed request and encode the sidecar's route body.
pub fn route_request(
    cfg: &FilterConfig,
    req: canon::Request<'_>,
    body: &[u8],
    h: FromHeaders<'_>,
) -> Result<Prepared, Skip> {
    let (route, responses) = build_route(cfg, req, body, h, |_, s| *s)?;
    let blocks = route.chain.len();
    let binary = blocks > cfg.binary_above_blocks;
    let route_body = if binary {
        route.encode_binary()
    } else {
        serde_json::to_vec(&route).map_err(|_| Skip::BadAnswer)?
    };
    Ok(Prepared {
        model: route.model,
        blocks,
        prompt_tokens: route.prompt_tokens,
        route_body,
        binary,
        responses,
    })
}

/// A parsed request as the sidecar's route request, and whether it is a Responses
/// request. `settings` may replace the configured model settings (the sidecar's picker
/// takes block sizes from its own policy); the filter keeps them as configured. The one
/// place where both front doors turn a request into a route, so they chain alike.
pub fn build_route(
    cfg: &FilterConfig,
    mut req: canon::Request<'_>,
    body: &[u8],
    h: FromHeaders<'_>,
    settings: impl FnOnce(&str, &ModelSettings) -> ModelSettings,
) -> Result<(RouteRequest, bool), Skip> {
    if !cfg.tenant_header.is_empty() {
        // The trusted tenant, not the client, names the namespace.
        req.cache_salt = std::borrow::Cow::Owned(h.tenant.unwrap_or_default().to_owned());
    }
    let (base, _) = cfg.adapters.resolve(&req.model);
    let settings = settings(base, cfg.model(base));
    let mode = req.prompt.mode();
    let block_size = match mode {
        kvroute_shared::Mode::Tokens => settings.block_size,
        kvroute_shared::Mode::Text if settings.route_text || settings.sidecar_tokenizes => {
            settings.text_block_bytes
        }
        kvroute_shared::Mode::Text => return Err(Skip::TextNotRouted),
    };
    // The sidecar tokenizes this model's text: hand it what the template reads (the
    // text chain still goes along, for when it cannot).
    let prompt_body = if settings.sidecar_tokenizes && mode == kvroute_shared::Mode::Text {
        let api = match req.prompt {
            canon::Prompt::Chat { .. } => PromptApi::Chat,
            canon::Prompt::Messages { .. } => PromptApi::Messages,
            canon::Prompt::Responses { .. } => PromptApi::Responses,
            _ => PromptApi::Completions,
        };
        Some(PromptBody::extract(api, &req.cache_salt, body).map_err(|_| Skip::BadJson)?)
    } else {
        None
    };
    let chained = req.chain(&cfg.adapters, block_size);
    let prompt_tokens = u32::try_from(req.prompt.approx_tokens()).unwrap_or(u32::MAX);
    let route = RouteRequest {
        model: chained.base_model,
        adapter: chained.adapter,
        mode,
        block_size,
        chain: chained.chain,
        prompt_tokens,
        request_id: h.request_id.map(str::to_owned),
        session: h
            .session
            .or(req.session.as_deref())
            .map(|s| cut(s, MAX_KEY_BYTES).to_owned()),
        previous_response: req
            .previous_response
            .as_deref()
            .map(|s| cut(s, MAX_KEY_BYTES).to_owned()),
        role: None,
        dry_run: false,
        explain: false,
        prompt_body,
        admission: h.admission(cfg),
    };
    let responses = matches!(req.prompt, canon::Prompt::Responses { .. });
    Ok((route, responses))
}

/// A usable answer from the sidecar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Steer {
    /// The pod id the sidecar chose (reports name it): `ip:port`, or `ip:port@rank`.
    pub pod: String,
    /// What the data plane steers to: the pod id's `ip:port`.
    pub address: String,
    /// The engine's data-parallel rank to run on, for a pod that is one rank.
    pub rank: Option<u16>,
    pub prefill_pod: Option<String>,
    pub matched_blocks: u32,
    /// The sidecar's decision id, echoed in the completion report.
    pub decision: String,
}

pub use kvroute_shared::protocol::valid_endpoint;
use kvroute_shared::protocol::{parse_pod, split_rank, valid_steer};

/// Judge the callout's answer (`status` from the `:status` pseudo-header).
pub fn interpret(status: Option<&str>, body: Option<&[u8]>) -> Result<Steer, Skip> {
    match status {
        Some("200") => {}
        // Envoy answers a timed-out callout with a synthetic 504.
        Some("504") => return Err(Skip::Timeout),
        Some("503") => return Err(Skip::NoPod),
        _ => return Err(Skip::SidecarError),
    }
    let body = body.ok_or(Skip::BadAnswer)?;
    let resp: RouteResponse = serde_json::from_slice(body).map_err(|_| Skip::BadAnswer)?;
    if !valid_steer(&resp.pod) {
        return Err(Skip::BadAnswer);
    }
    let address = split_rank(&resp.pod).0.to_owned();
    let rank = parse_pod(&resp.pod).and_then(|(_, r)| r);
    let prefill_pod = resp.prefill_pod.filter(|p| valid_endpoint(p));
    let matched_blocks = resp
        .ranked
        .iter()
        .find(|r| r.pod == resp.pod)
        .map_or(0, |r| r.matched_blocks);
    Ok(Steer {
        pod: resp.pod,
        address,
        rank,
        prefill_pod,
        matched_blocks,
        decision: resp.decision.unwrap_or_default(),
    })
}

/// What a route call (or a wait call) answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Steer the request here.
    Steer(Steer),
    /// The sidecar holds the request in its admission queue: claim its decision with a
    /// wait call (`/v1/route/wait`), for up to `wait_ms`.
    Queued { ticket: u64, wait_ms: u64 },
    /// The sidecar will not route the request and says the client should be told so:
    /// `429` with `Retry-After` while the model is saturated (sending it on would only
    /// queue it in an engine), `503` while every pod of the model is failing.
    Refused(Refused),
}

/// A request the sidecar's admission refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// What the client is answered: 429 (saturated) or 503 (no ready pod).
    pub status: u16,
    /// The sidecar's stable reason (`queue_full`, `expired`, `displaced`, `shed`,
    /// `no_ready_pod`, ...).
    pub reason: String,
    pub retry_after_s: u32,
}

/// The sidecar's reason for a `503` the client is answered with; any other `503`
/// (`no_pod`: the sidecar knows no live pod, and may be the one that is blind) fails open.
pub const NO_READY_POD: &str = "no_ready_pod";

/// Judge a route or wait call's answer. Only an explicit, well-formed `202` or `429`
/// from the sidecar queues or refuses a request; anything else that is not a steer
/// fails open.
pub fn answer(status: Option<&str>, body: Option<&[u8]>) -> Result<Answer, Skip> {
    match status {
        Some("202") => {
            let q: RouteQueued = body
                .and_then(|b| serde_json::from_slice(b).ok())
                .ok_or(Skip::BadAnswer)?;
            Ok(Answer::Queued {
                ticket: q.ticket,
                wait_ms: q.wait_ms,
            })
        }
        Some(code @ ("429" | "503")) => {
            #[derive(serde::Deserialize)]
            struct Body {
                reason: String,
                #[serde(default)]
                retry_after_s: u32,
            }
            let b: Option<Body> = body.and_then(|b| serde_json::from_slice(b).ok());
            match (code, b) {
                ("429", Some(b)) => Ok(Answer::Refused(Refused {
                    status: 429,
                    reason: cut(&b.reason, 64).to_owned(),
                    retry_after_s: b.retry_after_s.min(3600),
                })),
                ("503", Some(b)) if b.reason == NO_READY_POD => Ok(Answer::Refused(Refused {
                    status: 503,
                    reason: NO_READY_POD.to_owned(),
                    retry_after_s: b.retry_after_s.clamp(1, 3600),
                })),
                ("503", _) => Err(Skip::NoPod),
                _ => Err(Skip::BadAnswer),
            }
        }
        _ => interpret(status, body).map(Answer::Steer),
    }
}

/// The wait call's body.
pub fn wait_body(model: &str, ticket: u64) -> Vec<u8> {
    serde_json::to_vec(&WaitRequest {
        model: model.to_owned(),
        ticket,
    })
    .unwrap_or_default()
}

/// The error body a refused client gets, shaped as the API it called documents its
/// rate-limit errors (Anthropic's for `/v1/messages`, OpenAI's otherwise), so SDKs
/// surface it and retry after `Retry-After`.
pub fn refusal_body(path: &str, r: &Refused) -> Vec<u8> {
    let unavailable = r.status == 503;
    let message = if unavailable {
        format!(
            "every pod serving the model is failing ({}); retry after {} s",
            r.reason, r.retry_after_s
        )
    } else {
        format!(
            "the model's pods are saturated ({}); retry after {} s",
            r.reason, r.retry_after_s
        )
    };
    let v = if Endpoint::from_path(path.split('?').next().unwrap_or(path))
        == Some(Endpoint::Messages)
    {
        let kind = if unavailable {
            "overloaded_error"
        } else {
            "rate_limit_error"
        };
        serde_json::json!({
            "type": "error",
            "error": {"type": kind, "message": message},
        })
    } else {
        let kind = if unavailable {
            "service_unavailable"
        } else {
            "rate_limit_exceeded"
        };
        serde_json::json!({
            "error": {
                "message": message,
                "type": kind,
                "param": null,
                "code": r.reason,
            }
        })
    };
    serde_json::to_vec(&v).unwrap_or_default()
}

/// A completion report as `/v1/report` takes it (JSON).
pub fn encode_report(r: &CompletionReport) -> Vec<u8> {
    serde_json::to_vec(r).unwrap_or_default()
}

/// The completion report sent from `on_log` (and handed over in process by the sidecar's
/// picker). `decision` is the id the sidecar gave the route (empty when the request was
/// not steered); `status` 0 means the client went away before any response.
#[allow(clippy::too_many_arguments)]
pub fn completion_report(
    decision: &str,
    request_id: &str,
    model: &str,
    pod: &str,
    status: u16,
    usage: Option<Usage>,
    duration_ms: f64,
    response_id: Option<String>,
) -> CompletionReport {
    CompletionReport {
        decision: decision.to_owned(),
        request_id: request_id.to_owned(),
        pod: pod.to_owned(),
        model: model.to_owned(),
        status,
        prompt_tokens: usage.and_then(|u| u.prompt()),
        cached_tokens: usage.and_then(|u| u.cached_tokens()),
        completion_tokens: usage.and_then(|u| u.completion()),
        duration_ms,
        response_id,
    }
}

/// Completion reports waiting to leave in one callout, encoded as the JSON array the
/// sidecar's `/v1/report` takes. It lives in the root context of each VM (one per Envoy
/// worker) and is bounded by `max` reports: a full batch is handed back at once, a partial
/// one on the flush tick.
#[derive(Debug)]
pub struct ReportQueue {
    body: Vec<u8>,
    count: usize,
    max: usize,
}

impl ReportQueue {
    pub fn new(max: usize) -> ReportQueue {
        ReportQueue {
            body: Vec::new(),
            count: 0,
            max: max.max(1),
        }
    }

    /// Queues one encoded report; returns `(batch body, reports in it)` once `max` are in.
    pub fn push(&mut self, report: &[u8]) -> Option<(Vec<u8>, usize)> {
        if report.is_empty() {
            return None;
        }
        self.body.push(if self.count == 0 { b'[' } else { b',' });
        self.body.extend_from_slice(report);
        self.count += 1;
        if self.count >= self.max {
            self.take()
        } else {
            None
        }
    }

    /// The pending batch, if any.
    pub fn take(&mut self) -> Option<(Vec<u8>, usize)> {
        if self.count == 0 {
            return None;
        }
        self.body.push(b']');
        let n = std::mem::replace(&mut self.count, 0);
        Some((std::mem::take(&mut self.body), n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> FilterConfig {
        let mut c = FilterConfig::default();
        c.default_model.block_size = 4;
        c
    }

    #[test]
    fn only_posts_to_routed_paths() {
        let c = cfg();
        assert!(wants_body(&c, Some("POST"), Some("/v1/completions")));
        assert!(!wants_body(&c, Some("GET"), Some("/v1/completions")));
        assert!(!wants_body(&c, Some("POST"), Some("/v1/embeddings")));
        assert!(!wants_body(&c, None, None));
    }

    #[test]
    fn prepared_route_carries_the_reference_chain() {
        let body = br#"{"model":"m","prompt":[0,1,2,3,4,5,6,7,8,9],"user":"u1"}"#;
        let p = prepare(
            &cfg(),
            "/v1/completions",
            body,
            FromHeaders {
                request_id: Some("r1"),
                ..Default::default()
            },
        )
        .expect("prepared");
        let r: RouteRequest = serde_json::from_slice(&p.route_body).expect("route json");
        assert_eq!(r.chain, [12505186680924831797, 7943115681171077851]);
        assert_eq!((r.block_size, r.prompt_tokens, p.blocks), (4, 10, 2));
        assert_eq!(r.request_id.as_deref(), Some("r1"));
        assert_eq!(r.session.as_deref(), Some("u1"));
    }

    #[test]
    fn long_chains_use_the_binary_body() {
        let mut c = cfg();
        c.binary_above_blocks = 1;
        let body = br#"{"model":"m","prompt":[0,1,2,3,4,5,6,7,8,9]}"#;
        let p = prepare(&c, "/v1/completions", body, FromHeaders::default()).expect("prepared");
        assert!(p.binary);
        let r = RouteRequest::decode_binary(&p.route_body).expect("binary");
        assert_eq!(r.chain, [12505186680924831797, 7943115681171077851]);
    }

    #[test]
    fn skips_have_reasons() {
        let c = cfg();
        assert_eq!(
            prepare(&c, "/v1/completions", b"{oops", FromHeaders::default()),
            Err(Skip::BadJson)
        );
        assert_eq!(
            prepare(&c, "/v1/completions", b"{}", FromHeaders::default()),
            Err(Skip::NoPrompt)
        );
        assert_eq!(
            prepare(
                &c,
                "/v1/completions",
                br#"{"prompt":""}"#,
                FromHeaders::default()
            ),
            Err(Skip::EmptyPrompt)
        );
        let mut small = cfg();
        small.max_body_bytes = 8;
        assert_eq!(
            prepare(
                &small,
                "/v1/completions",
                br#"{"prompt":"long"}"#,
                FromHeaders::default()
            ),
            Err(Skip::BodyTooLarge)
        );
        let mut tokens_only = cfg();
        tokens_only.default_model.route_text = false;
        assert_eq!(
            prepare(
                &tokens_only,
                "/v1/completions",
                br#"{"prompt":"x"}"#,
                FromHeaders::default()
            ),
            Err(Skip::TextNotRouted)
        );
        let labels: std::collections::HashSet<_> = Skip::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(labels.len(), Skip::ALL.len());
    }

    #[test]
    fn answers_are_judged() {
        let ok = br#"{"pod":"127.0.0.1:8001","decision":"ab-7","ranked":[{"pod":"127.0.0.1:8001","matched_blocks":3}],"policy_version":1}"#;
        assert_eq!(
            interpret(Some("200"), Some(ok)),
            Ok(Steer {
                pod: "127.0.0.1:8001".into(),
                address: "127.0.0.1:8001".into(),
                rank: None,
                prefill_pod: None,
                matched_blocks: 3,
                decision: "ab-7".into(),
            })
        );
        assert_eq!(interpret(Some("504"), None), Err(Skip::Timeout));
        assert_eq!(interpret(Some("503"), Some(b"{}")), Err(Skip::NoPod));
        assert_eq!(interpret(Some("500"), Some(ok)), Err(Skip::SidecarError));
        assert_eq!(interpret(None, Some(ok)), Err(Skip::SidecarError));
        assert_eq!(interpret(Some("200"), None), Err(Skip::BadAnswer));
        assert_eq!(interpret(Some("200"), Some(b"[]")), Err(Skip::BadAnswer));
        let inject = br#"{"pod":"1.2.3.4:80\r\nx-evil: 1","ranked":[]}"#;
        assert_eq!(interpret(Some("200"), Some(inject)), Err(Skip::BadAnswer));
        // One data-parallel rank: steered to its address, the rank told apart.
        let ranked = br#"{"pod":"10.0.0.1:8000@3","decision":"d","ranked":[],"policy_version":1}"#;
        let s = interpret(Some("200"), Some(ranked)).expect("a rank is a pod");
        assert_eq!(
            (s.address.as_str(), s.rank, s.pod.as_str()),
            ("10.0.0.1:8000", Some(3), "10.0.0.1:8000@3")
        );
        for bad in [
            "10.0.0.1:8000@",
            "10.0.0.1:8000@03",
            "10.0.0.1:8000@99999",
            "10.0.0.1:8000@x\r\n",
        ] {
            let b = format!(r#"{{"pod":"{bad}","ranked":[]}}"#);
            assert_eq!(
                interpret(Some("200"), Some(b.as_bytes())),
                Err(Skip::BadAnswer),
                "{bad}"
            );
        }
    }

    #[test]
    fn endpoint_shapes() {
        for good in ["127.0.0.1:8000", "[::1]:8000", "pod-a.ns.svc:80"] {
            assert!(valid_endpoint(good), "{good}");
        }
        for bad in ["", "127.0.0.1", ":80", "a:b", "a b:80", "a:123456", "x\n:1"] {
            assert!(!valid_endpoint(bad), "{bad}");
        }
    }

    #[test]
    fn report_body_carries_usage() {
        let u = Usage {
            prompt_tokens: Some(10),
            completion_tokens: Some(2),
            prompt_tokens_details: Some(crate::usage::Details {
                cached_tokens: Some(8),
            }),
            ..Usage::default()
        };
        let r: CompletionReport = serde_json::from_slice(&encode_report(&completion_report(
            "ab-7",
            "r",
            "m",
            "p:1",
            200,
            Some(u),
            1.5,
            Some("resp_1".into()),
        )))
        .expect("json");
        assert_eq!(r.response_id.as_deref(), Some("resp_1"));
        assert_eq!(
            (
                r.cached_tokens,
                r.status,
                r.pod.as_str(),
                r.decision.as_str()
            ),
            (Some(8), 200, "p:1", "ab-7")
        );
    }

    #[test]
    fn report_queue_batches_into_a_json_array_the_sidecar_decodes() {
        let mut q = ReportQueue::new(3);
        assert!(q.take().is_none(), "nothing pending, nothing sent");
        let one = encode_report(&completion_report(
            "d1", "r1", "m", "p:1", 200, None, 1.0, None,
        ));
        assert!(q.push(&one).is_none());
        assert!(q.push(&[]).is_none(), "an empty encoding is not queued");
        assert!(q
            .push(&encode_report(&completion_report(
                "d2", "r2", "m", "p:2", 500, None, 2.0, None
            )))
            .is_none());
        let (body, n) = q
            .push(&encode_report(&completion_report(
                "d3", "r3", "m", "p:1", 200, None, 3.0, None,
            )))
            .expect("full");
        assert_eq!(n, 3);
        let b = kvroute_shared::protocol::ReportBatch::decode(&body).expect("decodes");
        let ids: Vec<&str> = b.reports.iter().map(|r| r.request_id.as_str()).collect();
        assert_eq!(ids, ["r1", "r2", "r3"]);
        assert!(b.rejected.is_empty());
        assert!(q.take().is_none(), "a sent batch is not sent twice");
        assert!(q.push(&one).is_none());
        let (body, n) = q.take().expect("partial batch on the tick");
        assert_eq!(n, 1);
        assert_eq!(
            kvroute_shared::protocol::ReportBatch::decode(&body)
                .expect("decodes")
                .reports
                .len(),
            1
        );
    }

    /// With a tenant header configured, the namespace follows the trusted tenant: two
    /// tenants sending the same prompt (and the same client-chosen salt) never share a
    /// chain, and a client cannot join another tenant's namespace with `cache_salt`.
    #[test]
    fn the_tenant_header_names_the_namespace_and_the_clients_salt_does_not() {
        let mut c = cfg();
        c.tenant_header = "x-tenant".into();
        let body = |salt: &str| {
            format!(
                r#"{{"model":"m","prompt":"{}","cache_salt":"{salt}"}}"#,
                "hello world ".repeat(40)
            )
        };
        let chain = |tenant: Option<&str>, salt: &str| {
            let h = FromHeaders {
                tenant,
                ..Default::default()
            };
            let p = prepare(&c, "/v1/completions", body(salt).as_bytes(), h).expect("prepared");
            let r: RouteRequest = serde_json::from_slice(&p.route_body).expect("json");
            r.chain
        };
        assert_ne!(
            chain(Some("a"), "x"),
            chain(Some("b"), "x"),
            "tenants are apart"
        );
        assert_eq!(
            chain(Some("a"), "x"),
            chain(Some("a"), "y"),
            "the client's salt is ignored"
        );
        assert_eq!(chain(Some("b"), "anything"), chain(Some("b"), "b"));
        let mut bad = cfg();
        bad.tenant_header = "X Tenant".into();
        assert!(bad.validate().is_err());
    }

    /// Only a well-formed 202 queues and a well-formed 429 refuses; anything else the
    /// filter did not expect fails open.
    #[test]
    fn queued_and_refused_answers_and_nothing_else() {
        assert_eq!(
            answer(Some("202"), Some(br#"{"ticket":7,"wait_ms":900}"#)),
            Ok(Answer::Queued {
                ticket: 7,
                wait_ms: 900
            })
        );
        assert_eq!(answer(Some("202"), Some(b"{}")), Err(Skip::BadAnswer));
        assert_eq!(
            answer(
                Some("429"),
                Some(br#"{"error":"x","reason":"expired","retry_after_s":2}"#)
            ),
            Ok(Answer::Refused(Refused {
                status: 429,
                reason: "expired".into(),
                retry_after_s: 2
            }))
        );
        assert_eq!(answer(Some("429"), Some(b"not json")), Err(Skip::BadAnswer));
        assert_eq!(answer(Some("500"), None), Err(Skip::SidecarError));
        // A 503 is answered to the client only when the sidecar says no pod is ready
        // (their breakers are open); its Retry-After is kept sane.
        assert_eq!(
            answer(
                Some("503"),
                Some(br#"{"error":"x","reason":"no_ready_pod","retry_after_s":0}"#)
            ),
            Ok(Answer::Refused(Refused {
                status: 503,
                reason: "no_ready_pod".into(),
                retry_after_s: 1
            }))
        );
        for body in [
            &br#"{"error":"x","reason":"no_pod"}"#[..],
            br#"{"reason":"no_ready_pod","retry_after_s":-1}"#,
            b"not json",
        ] {
            assert_eq!(answer(Some("503"), Some(body)), Err(Skip::NoPod));
        }
        assert_eq!(answer(Some("503"), None), Err(Skip::NoPod));
        let down = Refused {
            status: 503,
            reason: "no_ready_pod".into(),
            retry_after_s: 4,
        };
        let anthropic: serde_json::Value =
            serde_json::from_slice(&refusal_body("/v1/messages", &down)).expect("json");
        assert_eq!(anthropic["error"]["type"], "overloaded_error");
        let openai: serde_json::Value =
            serde_json::from_slice(&refusal_body("/v1/responses", &down)).expect("json");
        assert_eq!(openai["error"]["type"], "service_unavailable");
        let r = Refused {
            status: 429,
            reason: "queue_full".into(),
            retry_after_s: 1,
        };
        let anthropic: serde_json::Value =
            serde_json::from_slice(&refusal_body("/v1/messages?beta=true", &r)).expect("json");
        assert_eq!(anthropic["type"], "error");
        assert_eq!(anthropic["error"]["type"], "rate_limit_error");
        let openai: serde_json::Value =
            serde_json::from_slice(&refusal_body("/v1/chat/completions", &r)).expect("json");
        assert_eq!(openai["error"]["code"], "queue_full");
    }

    /// The tenant is the trusted header if configured, else the fairness id, else the
    /// API key's hash (never the key); a priority that is not a number is ignored.
    #[test]
    fn the_admission_class_comes_from_the_configured_headers() {
        let mut c = cfg();
        let h = FromHeaders {
            tenant: Some("auth-tenant"),
            fairness: Some("gie-tenant"),
            api_key: Some("Bearer sk-secret"),
            priority: Some("7"),
            objective: Some("interactive"),
            ..Default::default()
        };
        let a = h.admission(&c);
        assert_eq!(
            a.tenant.as_deref(),
            Some("gie-tenant"),
            "no tenant_header set"
        );
        assert_eq!(
            (a.priority, a.objective.as_deref()),
            (Some(7), Some("interactive"))
        );
        c.tenant_header = "x-tenant".into();
        assert_eq!(h.admission(&c).tenant.as_deref(), Some("auth-tenant"));
        let keyed = FromHeaders {
            api_key: Some("Bearer sk-secret"),
            priority: Some("high"),
            ..Default::default()
        }
        .admission(&cfg());
        let t = keyed.tenant.expect("a tenant from the key");
        assert!(t.starts_with("key-") && !t.contains("secret"), "{t}");
        assert_eq!(keyed.priority, None);
        assert!(FromHeaders::default().admission(&cfg()).is_empty());
    }
}
