//! The proxy-wasm glue: moves bytes between Envoy and [`crate::logic`], nothing more.
//!
//! It calls `proxy_wasm::hostcalls` directly instead of the SDK's trait helpers, because
//! those unwrap host errors (a header set after the router picked a host, a non-UTF-8
//! header value) and a panic here would hang a paused request. Every host call's error
//! is turned into "continue unsteered".
//!
//! One file on purpose (~500 lines): a request's host calls read top to bottom here, in
//! the order Envoy makes them (headers → body → callout answer → response → log), and
//! the state machine between them is easiest to check for a path that could hang a
//! request when it is all in view.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};

use crate::config::FilterConfig;
use crate::logic::{self, Skip};
use crate::usage::{Head, Tail};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { shared: None }) });
}}

/// Metric ids, defined once per VM (Envoy exposes them as `wasmcustom.kvroute_*`).
#[derive(Default)]
struct Metrics {
    routed: Option<u32>,
    skipped: Vec<(Skip, Option<u32>)>,
    callout_us: Option<u32>,
    prepare_us: Option<u32>,
    body_bytes: Option<u32>,
    reports: Option<u32>,
    /// Requests the sidecar queued, and requests it refused (answered 429 here).
    queued: Option<u32>,
    refused: Option<u32>,
    /// Requests answered 503 here: every pod of the model was failing.
    unavailable: Option<u32>,
}

impl Metrics {
    fn define() -> Metrics {
        let counter = |n: &str| hostcalls::define_metric(MetricType::Counter, n).ok();
        Metrics {
            routed: counter("kvroute_routed"),
            skipped: Skip::ALL
                .iter()
                .map(|s| (*s, counter(&format!("kvroute_fail_open_{}", s.as_str()))))
                .collect(),
            callout_us: hostcalls::define_metric(MetricType::Histogram, "kvroute_callout_us").ok(),
            prepare_us: hostcalls::define_metric(MetricType::Histogram, "kvroute_prepare_us").ok(),
            body_bytes: counter("kvroute_body_bytes"),
            reports: counter("kvroute_reports"),
            queued: counter("kvroute_queued"),
            refused: counter("kvroute_refused"),
            unavailable: counter("kvroute_unavailable"),
        }
    }

    fn inc(id: Option<u32>, by: i64) {
        if let Some(id) = id {
            let _ = hostcalls::increment_metric(id, by);
        }
    }

    fn skip(&self, reason: Skip) {
        let id = self
            .skipped
            .iter()
            .find(|(s, _)| *s == reason)
            .and_then(|(_, id)| *id);
        Self::inc(id, 1);
    }
}

struct Shared {
    cfg: FilterConfig,
    metrics: Metrics,
    /// Reports waiting for the next batch callout. A RefCell suffices: a VM runs one
    /// callback at a time on its own worker thread.
    reports: RefCell<logic::ReportQueue>,
}

impl Shared {
    /// Sends a batch of reports, fire and forget (the answer goes to the root context,
    /// which ignores it; a lost batch only delays load release until its TTL).
    fn send_reports(&self, batch: Option<(Vec<u8>, usize)>) {
        let Some((body, n)) = batch else {
            return;
        };
        let headers = vec![
            (":method", "POST"),
            (":path", self.cfg.report_path.as_str()),
            (":authority", self.cfg.sidecar_authority.as_str()),
            ("content-type", "application/json"),
        ];
        let timeout = Duration::from_millis(self.cfg.timeout_ms.max(1000));
        if hostcalls::dispatch_http_call(
            &self.cfg.sidecar_cluster,
            headers,
            Some(&body),
            vec![],
            timeout,
        )
        .is_ok()
        {
            Metrics::inc(self.metrics.reports, n as i64);
        }
    }
}

impl Shared {
    /// Tell the sidecar a queued request's client is gone, fire and forget (if it is
    /// lost, the request is dispatched or expires and its decision times out).
    fn cancel_wait(&self, model: &str, ticket: u64) {
        let headers = vec![
            (":method", "POST"),
            (":path", self.cfg.cancel_path.as_str()),
            (":authority", self.cfg.sidecar_authority.as_str()),
            ("content-type", "application/json"),
        ];
        let body = logic::wait_body(model, ticket);
        let timeout = Duration::from_millis(self.cfg.timeout_ms.max(1000));
        let _ = hostcalls::dispatch_http_call(
            &self.cfg.sidecar_cluster,
            headers,
            Some(&body),
            vec![],
            timeout,
        );
    }
}

struct Root {
    shared: Option<Rc<Shared>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let raw = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten();
        match FilterConfig::parse(raw.as_deref()) {
            Ok(cfg) => {
                if cfg.report && cfg.report_batch > 1 {
                    let _ = hostcalls::set_tick_period(Duration::from_millis(cfg.report_flush_ms));
                }
                self.shared = Some(Rc::new(Shared {
                    reports: RefCell::new(logic::ReportQueue::new(cfg.report_batch)),
                    cfg,
                    metrics: Metrics::define(),
                }));
                true
            }
            Err(errs) => {
                for e in errs {
                    let _ = hostcalls::log(
                        LogLevel::Error,
                        &format!("kvroute: invalid plugin configuration: {e}"),
                    );
                }
                false
            }
        }
    }

    fn on_tick(&mut self) {
        if let Some(sh) = &self.shared {
            let batch = sh.reports.try_borrow_mut().ok().and_then(|mut q| q.take());
            sh.send_reports(batch);
        }
    }

    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        // Without a valid config Envoy has refused the plugin; a pass-through context keeps
        // the function total anyway.
        Some(Box::new(Http {
            shared: self.shared.clone(),
            state: State::PassThrough,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

enum State {
    /// Not ours: every callback continues.
    PassThrough,
    /// Holding headers while Envoy buffers the body.
    Buffering {
        path: String,
        request_id: Option<String>,
        session: Option<String>,
        /// The configured tenant header's value.
        tenant: Option<String>,
        /// The admission headers' values.
        class: ClassHeaders,
    },
    /// Waiting for the sidecar's answer: to the route call, or (`waiting`) to the wait
    /// call of a request the sidecar queued.
    Calling {
        token: u32,
        sent: Option<SystemTime>,
        model: String,
        request_id: String,
        timings: Timings,
        /// A Responses request: its response's id is learned for later turns.
        responses: bool,
        /// The request's path (a refusal's body is shaped as its API's errors).
        path: String,
        /// The sidecar's ticket while this is the wait call of a request it queued.
        ticket: Option<u64>,
    },
    /// The request went on (steered or not); watch the response for `usage`.
    Forwarded {
        model: String,
        request_id: String,
        steered: Option<logic::Steer>,
        status: u16,
        tail: Tail,
        /// Responses requests only: the body's first bytes, where its id is.
        head: Option<Head>,
        start: Option<SystemTime>,
        timings: Timings,
    },
}

/// The request headers its admission class is read from (see [`logic::FromHeaders`]).
#[derive(Default)]
struct ClassHeaders {
    priority: Option<String>,
    objective: Option<String>,
    fairness: Option<String>,
    api_key: Option<String>,
}

impl ClassHeaders {
    fn read(cfg: &FilterConfig) -> ClassHeaders {
        let named = |h: &str| {
            if h.is_empty() {
                None
            } else {
                header(MapType::HttpRequestHeaders, h)
            }
        };
        ClassHeaders {
            priority: named(&cfg.priority_header),
            objective: named(&cfg.objective_header),
            fairness: named(&cfg.fairness_header),
            api_key: header(MapType::HttpRequestHeaders, "authorization")
                .or_else(|| header(MapType::HttpRequestHeaders, "x-api-key")),
        }
    }
}

/// Where the filter's time went for one request (debug headers; `prepare_us` is also a
/// metric).
#[derive(Clone, Copy, Debug, Default)]
struct Timings {
    /// Parsing the body (the bulk of it for long token-id prompts).
    parse_us: u64,
    /// Parsing, chaining and encoding the route body, in all.
    prepare_us: u64,
    /// Callout round trip as the filter saw it (0 without a callout).
    callout_us: u64,
}

struct Http {
    shared: Option<Rc<Shared>>,
    state: State,
}

fn header(map: MapType, name: &str) -> Option<String> {
    hostcalls::get_map_value_bytes(map, name)
        .ok()
        .flatten()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
}

fn now() -> Option<SystemTime> {
    hostcalls::get_current_time().ok()
}

fn micros_since(t0: Option<SystemTime>) -> u64 {
    match (t0, now()) {
        (Some(a), Some(b)) => b
            .duration_since(a)
            .map(|d| d.as_micros().min(u64::MAX as u128) as u64)
            .unwrap_or(0),
        _ => 0,
    }
}

impl Http {
    fn forward(
        &mut self,
        sh: &Shared,
        model: String,
        request_id: String,
        steered: Option<logic::Steer>,
        timings: Timings,
        responses: bool,
    ) {
        let start = now();
        let tail = Tail::new(sh.cfg.usage_window_bytes);
        self.state = State::Forwarded {
            model,
            request_id,
            steered,
            status: 0,
            tail,
            head: responses.then(Head::default),
            start,
            timings,
        };
    }
}

impl Context for Http {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let Some(sh) = self.shared.clone() else {
            return;
        };
        let State::Calling {
            token,
            sent,
            model,
            request_id,
            mut timings,
            responses,
            path,
            ticket: waiting,
        } = std::mem::replace(&mut self.state, State::PassThrough)
        else {
            return;
        };
        if token != token_id {
            return;
        }
        timings.callout_us += micros_since(sent);
        if let Some(id) = sh.metrics.callout_us {
            let _ = hostcalls::record_metric(id, micros_since(sent));
        }
        let status = header(MapType::HttpCallResponseHeaders, ":status");
        let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten();
        let steered = match logic::answer(status.as_deref(), body.as_deref()) {
            // A wait call is answered with a decision or a refusal, never another ticket.
            Ok(logic::Answer::Queued { .. }) if waiting.is_some() => {
                sh.metrics.skip(Skip::BadAnswer);
                None
            }
            Ok(logic::Answer::Queued { ticket, wait_ms }) => {
                Metrics::inc(sh.metrics.queued, 1);
                // The sidecar answers before the request's TTL; a little more covers the
                // trip, and past it a hung sidecar fails the request open.
                let wait =
                    Duration::from_millis(wait_ms.saturating_add(1000).min(sh.cfg.max_wait_ms));
                let headers = vec![
                    (":method", "POST"),
                    (":path", sh.cfg.wait_path.as_str()),
                    (":authority", sh.cfg.sidecar_authority.as_str()),
                    ("content-type", "application/json"),
                ];
                let body = logic::wait_body(&model, ticket);
                match hostcalls::dispatch_http_call(
                    &sh.cfg.sidecar_cluster,
                    headers,
                    Some(&body),
                    vec![],
                    wait,
                ) {
                    Ok(token) => {
                        self.state = State::Calling {
                            token,
                            sent: now(),
                            model,
                            request_id,
                            timings,
                            responses,
                            path,
                            ticket: Some(ticket),
                        };
                        return;
                    }
                    Err(_) => {
                        sh.metrics.skip(Skip::DispatchFailed);
                        None
                    }
                }
            }
            Ok(logic::Answer::Refused(r)) => {
                let counted = if r.status == 503 {
                    sh.metrics.unavailable
                } else {
                    sh.metrics.refused
                };
                Metrics::inc(counted, 1);
                let retry = r.retry_after_s.to_string();
                let body = logic::refusal_body(&path, &r);
                let sent = hostcalls::send_http_response(
                    u32::from(r.status),
                    vec![
                        ("retry-after", retry.as_str()),
                        ("content-type", "application/json"),
                        ("x-kvroute-refused", r.reason.as_str()),
                    ],
                    Some(&body),
                );
                if sent.is_ok() {
                    return;
                }
                sh.metrics.skip(Skip::DispatchFailed);
                None
            }
            Ok(logic::Answer::Steer(steer)) => {
                let set = hostcalls::set_map_value(
                    MapType::HttpRequestHeaders,
                    &sh.cfg.steer_header,
                    Some(&steer.address),
                )
                .and_then(|()| {
                    // One data-parallel rank of the engine: the engine is told which.
                    let rank = steer.rank.map(|r| r.to_string());
                    hostcalls::set_map_value(
                        MapType::HttpRequestHeaders,
                        &sh.cfg.rank_header,
                        rank.as_deref(),
                    )
                });
                let set_prefill = match &steer.prefill_pod {
                    Some(p) => hostcalls::set_map_value(
                        MapType::HttpRequestHeaders,
                        &sh.cfg.prefill_header,
                        Some(p),
                    ),
                    None => Ok(()),
                };
                if set.is_ok() && set_prefill.is_ok() {
                    Metrics::inc(sh.metrics.routed, 1);
                    Some(steer)
                } else {
                    sh.metrics.skip(Skip::DispatchFailed);
                    None
                }
            }
            Err(reason) => {
                sh.metrics.skip(reason);
                // A wait call that failed or timed out: the request goes on unsteered, so
                // the sidecar must not dispatch it later.
                if let Some(t) = waiting {
                    sh.cancel_wait(&model, t);
                }
                None
            }
        };
        self.forward(&sh, model, request_id, steered, timings, responses);
        let _ = hostcalls::resume_http_request();
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        let Some(sh) = self.shared.clone() else {
            return Action::Continue;
        };
        // Clients never choose the pod: drop their copies of the steering headers on
        // every request, routed or not (otherwise a client could reach any host).
        // Removing a header makes Envoy drop its route cache, so only remove what is there.
        for h in [&sh.cfg.steer_header, &sh.cfg.prefill_header] {
            if !matches!(
                hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, h),
                Ok(None)
            ) {
                let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, h, None);
            }
        }
        let method = header(MapType::HttpRequestHeaders, ":method");
        let path = header(MapType::HttpRequestHeaders, ":path");
        if end_of_stream || !logic::wants_body(&sh.cfg, method.as_deref(), path.as_deref()) {
            return Action::Continue;
        }
        let session = sh
            .cfg
            .session_header_names()
            .find_map(|h| header(MapType::HttpRequestHeaders, h).filter(|v| !v.is_empty()));
        let tenant = if sh.cfg.tenant_header.is_empty() {
            None
        } else {
            header(MapType::HttpRequestHeaders, &sh.cfg.tenant_header)
        };
        self.state = State::Buffering {
            path: path.unwrap_or_default(),
            request_id: header(MapType::HttpRequestHeaders, "x-request-id"),
            session,
            tenant,
            class: ClassHeaders::read(&sh.cfg),
        };
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(sh) = self.shared.clone() else {
            return Action::Continue;
        };
        let State::Buffering {
            path,
            request_id,
            session,
            tenant,
            class,
        } = &self.state
        else {
            return Action::Continue;
        };
        if body_size > sh.cfg.max_body_bytes {
            sh.metrics.skip(Skip::BodyTooLarge);
            self.state = State::PassThrough;
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        Metrics::inc(sh.metrics.body_bytes, body_size as i64);
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        let rid = request_id.clone().unwrap_or_default();
        let t0 = now();
        let mut timings = Timings::default();
        let prepared = logic::parse(&sh.cfg, path, &body).and_then(|req| {
            timings.parse_us = micros_since(t0);
            let h = logic::FromHeaders {
                request_id: request_id.as_deref(),
                session: session.as_deref(),
                tenant: tenant.as_deref(),
                priority: class.priority.as_deref(),
                objective: class.objective.as_deref(),
                fairness: class.fairness.as_deref(),
                api_key: class.api_key.as_deref(),
            };
            logic::route_request(&sh.cfg, req, &body, h)
        });
        let prepared = match prepared {
            Ok(p) => p,
            Err(reason) => {
                sh.metrics.skip(reason);
                self.state = State::PassThrough;
                return Action::Continue;
            }
        };
        drop(body);
        timings.prepare_us = micros_since(t0);
        if let Some(id) = sh.metrics.prepare_us {
            let _ = hostcalls::record_metric(id, timings.prepare_us);
        }
        let content_type = if prepared.binary {
            kvroute_shared::protocol::ROUTE_BINARY_CONTENT_TYPE
        } else {
            "application/json"
        };
        let timeout = Duration::from_millis(sh.cfg.timeout_ms);
        // The sidecar commits no decision it cannot answer before this callout times out
        // (we would have failed open and never report it).
        let deadline = now()
            .and_then(|t| (t + timeout).duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_millis().to_string());
        let mut headers = vec![
            (":method", "POST"),
            (":path", sh.cfg.route_path.as_str()),
            (":authority", sh.cfg.sidecar_authority.as_str()),
            ("content-type", content_type),
        ];
        if let Some(d) = &deadline {
            headers.push((kvroute_shared::protocol::ROUTE_DEADLINE_HEADER, d.as_str()));
        }
        match hostcalls::dispatch_http_call(
            &sh.cfg.sidecar_cluster,
            headers,
            Some(&prepared.route_body),
            vec![],
            timeout,
        ) {
            Ok(token) => {
                self.state = State::Calling {
                    token,
                    sent: now(),
                    model: prepared.model,
                    request_id: rid,
                    timings,
                    responses: prepared.responses,
                    path: path.clone(),
                    ticket: None,
                };
                Action::Pause
            }
            Err(_) => {
                sh.metrics.skip(Skip::DispatchFailed);
                self.forward(&sh, prepared.model, rid, None, timings, prepared.responses);
                Action::Continue
            }
        }
    }

    fn on_http_response_headers(&mut self, _n: usize, _eos: bool) -> Action {
        let Some(sh) = self.shared.clone() else {
            return Action::Continue;
        };
        if let State::Forwarded {
            status,
            steered,
            timings,
            ..
        } = &mut self.state
        {
            *status = header(MapType::HttpResponseHeaders, ":status")
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            if sh.cfg.debug_headers {
                for (name, us) in [
                    ("x-kvroute-parse-us", timings.parse_us),
                    ("x-kvroute-prepare-us", timings.prepare_us),
                    ("x-kvroute-callout-us", timings.callout_us),
                ] {
                    let v = us.to_string();
                    let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(&v));
                }
                if let Some(s) = steered {
                    let _ = hostcalls::set_map_value(
                        MapType::HttpResponseHeaders,
                        "x-kvroute-pod",
                        Some(&s.pod),
                    );
                    let m = s.matched_blocks.to_string();
                    let _ = hostcalls::set_map_value(
                        MapType::HttpResponseHeaders,
                        "x-kvroute-matched-blocks",
                        Some(&m),
                    );
                }
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _eos: bool) -> Action {
        // Never buffer the response: each chunk goes on at once; only its tail is kept.
        if let State::Forwarded { tail, head, .. } = &mut self.state {
            if let Ok(Some(chunk)) =
                hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size)
            {
                tail.push(&chunk);
                if let Some(h) = head {
                    h.push(&chunk);
                }
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        let Some(sh) = self.shared.clone() else {
            return;
        };
        // The client left while its request waited in the sidecar's queue: take it out
        // (Envoy does not end the wait call for us), or release a decision made for it.
        if let State::Calling {
            model,
            ticket: Some(ticket),
            ..
        } = &self.state
        {
            sh.cancel_wait(model, *ticket);
            return;
        }
        if !sh.cfg.report {
            return;
        }
        let State::Forwarded {
            model,
            request_id,
            steered,
            status,
            tail,
            head,
            start,
            ..
        } = &self.state
        else {
            return;
        };
        // The pod that actually served: Envoy's upstream address, else the one we chose.
        let upstream = hostcalls::get_property(vec!["upstream", "address"])
            .ok()
            .flatten()
            .map(|b| String::from_utf8_lossy(&b).into_owned());
        // A rank served where it was sent is that rank's pod.
        let pod = match (upstream, steered.as_ref()) {
            (Some(u), Some(s)) if u == s.address => s.pod.clone(),
            (Some(u), _) => u,
            (None, Some(s)) => s.pod.clone(),
            (None, None) => return,
        };
        let duration_ms = match (start, now()) {
            (Some(a), Some(b)) => b
                .duration_since(*a)
                .map(|d| d.as_secs_f64() * 1e3)
                .unwrap_or(0.0),
            _ => 0.0,
        };
        let decision = steered.as_ref().map_or("", |s| s.decision.as_str());
        let body = logic::encode_report(&logic::completion_report(
            decision,
            request_id,
            model,
            &pod,
            *status,
            tail.usage(),
            duration_ms,
            head.as_ref().and_then(Head::response_id),
        ));
        // A Responses id binds the next turn, which the client may send at once: that
        // report leaves now, with whatever is queued, instead of on the flush tick.
        let urgent = head.is_some();
        let batch = sh.reports.try_borrow_mut().ok().and_then(|mut q| {
            let full = q.push(&body);
            if urgent && full.is_none() {
                q.take()
            } else {
                full
            }
        });
        sh.send_reports(batch);
    }
}
