//! One HTTP request's conversation with Envoy's ext_proc filter, as a state machine over
//! messages: no I/O, no clock of its own, so every branch is unit-tested. The server
//! feeds it each [`ProcessingRequest`] and sends what it answers; when the request body is
//! whole it asks for a route ([`Step::Route`]) and is handed the decision back.
//!
//! How the body arrives decides when the steering headers can still be set:
//! - **buffered**: Envoy holds the headers until the whole body has been answered, so the
//!   headers are let through at once and the body's answer carries the steer;
//! - **full-duplex streamed** (GIE's mode) and **streamed with
//!   `send_body_without_waiting_for_header_response`**: the headers' answer is held until
//!   the body is whole, then sent with the steer, followed by the body (echoed back in
//!   full-duplex, acknowledged chunk by chunk in streamed mode);
//! - **streamed** otherwise, and **none**: the body comes only after the headers are
//!   answered, too late to steer: the request goes on unsteered, counted.
//!
//! Anything else fails open: the request continues unsteered, every message is still
//! answered (a message left unanswered would hang the request until Envoy's timeout).

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request as Msg, HeaderMutation, HttpBody, HttpHeaders, ProcessingRequest,
    ProcessingResponse,
};
use kvroute_filter::config::{FilterConfig, ModelSettings};
use kvroute_filter::logic::{self, FromHeaders, Skip};
use kvroute_filter::usage::{Head, Tail};
use kvroute_shared::protocol::{
    parse_pod, split_rank, valid_endpoint, valid_steer, CompletionReport, RouteRequest,
    RouteResponse,
};

use super::wire::{self, Dir};
use crate::route::RouteError;

/// Endpoints after the chosen one in the destination list (the data plane's retries go
/// down it in order).
pub const FALLBACKS: usize = 2;
/// Bytes of a held body handed back to Envoy per message (full-duplex mode).
pub const ECHO_CHUNK: usize = 1 << 20;

/// How the data plane sends a body, as its first message says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyMode {
    None,
    Buffered,
    /// `early`: chunks come without waiting for the headers' answer.
    Streamed {
        early: bool,
    },
    FullDuplex,
}

impl BodyMode {
    pub fn from_wire(mode: i32, early: bool) -> BodyMode {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::Buffered | BodySendMode::BufferedPartial) => BodyMode::Buffered,
            Ok(BodySendMode::Streamed) => BodyMode::Streamed { early },
            Ok(BodySendMode::FullDuplexStreamed) => BodyMode::FullDuplex,
            // None, and modes this build does not know (gRPC framing): nothing to read.
            _ => BodyMode::None,
        }
    }
}

/// What became of a request. `as_str` is the `kvroute_picker_requests_total` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Routed,
    /// Not a POST to a routed path.
    NotRouted,
    /// The request has no body.
    NoBody,
    /// The body mode lets no body be read before the headers go on.
    ModeUnsupported,
    Skip(Skip),
    NoPod,
    /// Every pod of the model is failing (breakers open): answered 503 + Retry-After.
    NoReadyPod,
    /// The subset hint left no eligible pod: answered 503.
    OutsideSubset,
    Deadline,
    /// The sidecar refused the route (a block-size mismatch, a bad request).
    Refused,
    /// Messages out of the protocol's order.
    BadStream,
    /// Admission refused it while the model was saturated: answered 429.
    Saturated,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Routed => "routed",
            Outcome::NotRouted => "not_routed",
            Outcome::NoBody => "no_body",
            Outcome::ModeUnsupported => "mode_unsupported",
            Outcome::Skip(s) => s.as_str(),
            Outcome::NoPod => "no_pod",
            Outcome::NoReadyPod => "no_ready_pod",
            Outcome::OutsideSubset => "outside_subset",
            Outcome::Deadline => "deadline",
            Outcome::Refused => "refused",
            Outcome::BadStream => "bad_stream",
            Outcome::Saturated => "saturated",
        }
    }
}

/// What the server does with a message's answer.
pub enum Step {
    Reply(Vec<ProcessingResponse>),
    /// Route this, then hand the result to [`Exchange::routed`].
    Route(Box<RouteJob>),
}

pub struct RouteJob {
    pub req: RouteRequest,
    pub subset: Option<Vec<String>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Waiting for the request headers.
    Start,
    /// Reading the body to route it.
    Collecting,
    /// The body is whole; the route is being decided.
    Routing,
    /// Steered or not, the request goes on: every further message is let through.
    Passing,
}

/// The decision the report will release.
struct Decision {
    id: String,
    pod: String,
    model: String,
    at: Instant,
}

/// Model settings as the sidecar's policy has them (block sizes); the configuration's
/// `route_text` and `sidecar_tokenizes` stay.
pub type Settings = Arc<dyn Fn(&str, &ModelSettings) -> ModelSettings + Send + Sync>;

pub struct Exchange {
    cfg: Arc<FilterConfig>,
    settings: Settings,
    req_mode: BodyMode,
    resp_mode: BodyMode,
    state: State,
    request_id: Option<String>,
    session: Option<String>,
    tenant: Option<String>,
    /// The admission headers' values: priority, objective, fairness id, API key.
    class: [Option<String>; 4],
    path: String,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    /// Streamed chunks whose answer waits for the headers'.
    held: usize,
    /// Trailers arrived while the body was being read: their answer follows the body's.
    trailers_owed: bool,
    /// Set once, taken by the server for the metric.
    outcome: Option<Outcome>,
    settled: bool,
    decision: Option<Decision>,
    status: u16,
    served: Option<String>,
    tail: Tail,
    head: Option<Head>,
}

impl Exchange {
    pub fn new(cfg: Arc<FilterConfig>, settings: Settings) -> Exchange {
        let tail = Tail::new(cfg.usage_window_bytes);
        Exchange {
            cfg,
            settings,
            req_mode: BodyMode::Buffered,
            resp_mode: BodyMode::None,
            state: State::Start,
            request_id: None,
            session: None,
            tenant: None,
            class: Default::default(),
            path: String::new(),
            subset: None,
            body: Vec::new(),
            held: 0,
            trailers_owed: false,
            outcome: None,
            settled: false,
            decision: None,
            status: 0,
            served: None,
            tail,
            head: None,
        }
    }

    /// The request's outcome, once it is known (given out once).
    pub fn take_outcome(&mut self) -> Option<Outcome> {
        self.outcome.take()
    }

    /// The request's outcome: the first one named counts, once.
    fn settle(&mut self, o: Outcome) {
        if !self.settled {
            self.settled = true;
            self.outcome = Some(o);
        }
    }

    pub fn on_message(&mut self, m: ProcessingRequest) -> Step {
        if self.state == State::Start {
            if let Some(pc) = &m.protocol_config {
                let early = pc.send_body_without_waiting_for_header_response;
                self.req_mode = BodyMode::from_wire(pc.request_body_mode, early);
                self.resp_mode = BodyMode::from_wire(pc.response_body_mode, early);
            }
        }
        let md = m.metadata_context.as_ref();
        if self.served.is_none() {
            self.served = wire::served(md);
        }
        let Some(msg) = m.request else {
            // An empty message (a flow-control update): nothing to answer.
            return Step::Reply(Vec::new());
        };
        match msg {
            Msg::RequestHeaders(h) => {
                let subset = wire::subset(md);
                Step::Reply(self.request_headers(&h, subset))
            }
            Msg::RequestBody(b) => self.request_body(b),
            Msg::RequestTrailers(_) => {
                if self.state == State::Collecting {
                    self.trailers_owed = true;
                    return self.body_done();
                }
                Step::Reply(vec![wire::trailers(Dir::Request)])
            }
            Msg::ResponseHeaders(h) => Step::Reply(vec![self.response_headers(&h)]),
            Msg::ResponseBody(b) => Step::Reply(vec![self.response_body(b)]),
            Msg::ResponseTrailers(_) => Step::Reply(vec![wire::trailers(Dir::Response)]),
        }
    }

    /// Client copies of the steering headers never reach the engine's load balancer.
    fn strip(&self) -> HeaderMutation {
        HeaderMutation {
            remove_headers: vec![
                self.cfg.steer_header.clone(),
                self.cfg.prefill_header.clone(),
            ],
            ..Default::default()
        }
    }

    fn request_headers(
        &mut self,
        h: &HttpHeaders,
        subset: Option<Vec<String>>,
    ) -> Vec<ProcessingResponse> {
        if self.state != State::Start {
            self.settle(Outcome::BadStream);
            return vec![wire::headers(Dir::Request, None)];
        }
        let method = wire::header(h, ":method");
        let path = wire::header(h, ":path");
        let cut = |s: String| {
            let mut end = s.len().min(logic::MAX_KEY_BYTES);
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            s[..end].to_owned()
        };
        self.request_id = wire::header(h, "x-request-id").map(cut);
        self.session = self
            .cfg
            .session_header_names()
            .find_map(|n| wire::header(h, n).filter(|v| !v.is_empty()))
            .map(cut);
        if !self.cfg.tenant_header.is_empty() {
            self.tenant = wire::header(h, &self.cfg.tenant_header);
        }
        let named = |n: &str| (!n.is_empty()).then(|| wire::header(h, n)).flatten();
        self.class = [
            named(&self.cfg.priority_header),
            named(&self.cfg.objective_header),
            named(&self.cfg.fairness_header),
            wire::header(h, "authorization").or_else(|| wire::header(h, "x-api-key")),
        ];
        self.subset = subset;
        self.path = path.clone().unwrap_or_default();
        let pass = |me: &mut Exchange, o: Outcome| {
            me.settle(o);
            me.state = State::Passing;
            vec![wire::headers(Dir::Request, Some(me.strip()))]
        };
        if !logic::wants_body(&self.cfg, method.as_deref(), path.as_deref()) {
            return pass(self, Outcome::NotRouted);
        }
        if h.end_of_stream {
            return pass(self, Outcome::NoBody);
        }
        match self.req_mode {
            BodyMode::None | BodyMode::Streamed { early: false } => {
                pass(self, Outcome::ModeUnsupported)
            }
            BodyMode::Buffered => {
                self.state = State::Collecting;
                vec![wire::headers(Dir::Request, Some(self.strip()))]
            }
            BodyMode::FullDuplex | BodyMode::Streamed { early: true } => {
                self.state = State::Collecting;
                Vec::new()
            }
        }
    }

    fn request_body(&mut self, b: HttpBody) -> Step {
        match self.state {
            State::Collecting => {}
            State::Passing => return Step::Reply(vec![self.pass_body(Dir::Request, b)]),
            State::Start | State::Routing => {
                // Out of order: answer it as a pass-through so nothing hangs.
                self.settle(Outcome::BadStream);
                let r = self.pass_body(Dir::Request, b);
                return Step::Reply(vec![r]);
            }
        }
        if matches!(self.req_mode, BodyMode::Streamed { .. }) {
            self.held += 1;
        }
        if self.body.len() + b.body.len() > self.cfg.max_body_bytes {
            self.body.extend_from_slice(&b.body);
            self.settle(Outcome::Skip(Skip::BodyTooLarge));
            return Step::Reply(self.flush(Some(self.strip()), None, b.end_of_stream));
        }
        self.body.extend_from_slice(&b.body);
        if b.end_of_stream {
            return self.body_done();
        }
        if self.req_mode == BodyMode::Buffered {
            // Buffered mode sends the body once; a part of it (BUFFERED_PARTIAL at its
            // limit) is all there will be before the headers go.
            self.settle(Outcome::Skip(Skip::BodyTooLarge));
            return Step::Reply(self.flush(Some(self.strip()), None, false));
        }
        Step::Reply(Vec::new())
    }

    /// The body is whole: route it, or let it go unsteered if it cannot be routed.
    fn body_done(&mut self) -> Step {
        let h = FromHeaders {
            request_id: self.request_id.as_deref(),
            session: self.session.as_deref(),
            tenant: self.tenant.as_deref(),
            priority: self.class[0].as_deref(),
            objective: self.class[1].as_deref(),
            fairness: self.class[2].as_deref(),
            api_key: self.class[3].as_deref(),
        };
        let built = logic::parse(&self.cfg, &self.path, &self.body).and_then(|req| {
            let s = self.settings.clone();
            logic::build_route(&self.cfg, req, &self.body, h, |m, d| s(m, d))
        });
        match built {
            Ok((req, responses)) => {
                if responses {
                    self.head = Some(Head::default());
                }
                self.state = State::Routing;
                Step::Route(Box::new(RouteJob {
                    req,
                    subset: self.subset.clone(),
                }))
            }
            Err(skip) => {
                self.settle(Outcome::Skip(skip));
                Step::Reply(self.flush(Some(self.strip()), None, !self.trailers_owed))
            }
        }
    }

    /// Admission refused the request (`reason`, a stable label): the client gets `429`
    /// with `Retry-After` and an error body shaped as its API's, as from the filter.
    pub fn refused(&mut self, reason: &str, retry_after_s: u32) -> Vec<ProcessingResponse> {
        if self.state != State::Routing {
            self.settle(Outcome::BadStream);
            return Vec::new();
        }
        self.settle(Outcome::Saturated);
        self.refuse(429, reason, retry_after_s)
    }

    fn refuse(&mut self, status: u16, reason: &str, retry_after_s: u32) -> Vec<ProcessingResponse> {
        self.state = State::Passing;
        let r = logic::Refused {
            status,
            reason: reason.to_owned(),
            retry_after_s,
        };
        vec![wire::refused(&logic::refusal_body(&self.path, &r), &r)]
    }

    /// The sidecar decided (`at` is when): steer, refuse, or let the request go as it is.
    pub fn routed(
        &mut self,
        model: &str,
        r: Result<RouteResponse, RouteError>,
        at: Instant,
    ) -> Vec<ProcessingResponse> {
        if self.state != State::Routing {
            self.settle(Outcome::BadStream);
            return Vec::new();
        }
        let eos = !self.trailers_owed;
        let resp = match r {
            Ok(resp) if valid_steer(&resp.pod) => resp,
            Ok(_) => {
                self.settle(Outcome::Refused);
                return self.flush(Some(self.strip()), None, eos);
            }
            Err(RouteError::OutsideSubset) => {
                self.settle(Outcome::OutsideSubset);
                self.state = State::Passing;
                return vec![wire::immediate(
                    503,
                    "outside_subset",
                    "no endpoint of the requested subset can serve this request",
                )];
            }
            Err(e @ RouteError::NoReadyPod { .. }) => {
                self.settle(Outcome::NoReadyPod);
                let retry = e.retry_after_s().unwrap_or(1);
                return self.refuse(e.status(), e.reason(), retry);
            }
            Err(e) => {
                self.settle(match e {
                    RouteError::NoPod { .. } => Outcome::NoPod,
                    RouteError::DeadlinePassed => Outcome::Deadline,
                    _ => Outcome::Refused,
                });
                return self.flush(Some(self.strip()), None, eos);
            }
        };
        // The data plane steers to addresses: a pod that is one data-parallel rank is its
        // address, and the rank goes to the engine in its own header.
        let address = split_rank(&resp.pod).0;
        let mut endpoints = vec![address];
        for p in resp.ranked.iter().map(|r| r.pod.as_str()) {
            let a = split_rank(p).0;
            if endpoints.len() > FALLBACKS {
                break;
            }
            if valid_steer(p) && !endpoints.contains(&a) {
                endpoints.push(a);
            }
        }
        let list = endpoints.join(",");
        let mut mutation = HeaderMutation {
            set_headers: vec![wire::set(&self.cfg.steer_header, &list)],
            ..Default::default()
        };
        match parse_pod(&resp.pod).and_then(|(_, r)| r) {
            Some(r) => mutation
                .set_headers
                .push(wire::set(&self.cfg.rank_header, &r.to_string())),
            None => mutation.remove_headers.push(self.cfg.rank_header.clone()),
        }
        match resp.prefill_pod.as_deref().filter(|p| valid_endpoint(p)) {
            Some(p) => mutation
                .set_headers
                .push(wire::set(&self.cfg.prefill_header, p)),
            None => mutation
                .remove_headers
                .push(self.cfg.prefill_header.clone()),
        }
        if let Some(id) = resp.decision.filter(|d| !d.is_empty()) {
            self.decision = Some(Decision {
                id,
                pod: resp.pod.clone(),
                model: model.to_owned(),
                at,
            });
        }
        self.settle(Outcome::Routed);
        self.flush(Some(mutation), Some(wire::destination_metadata(&list)), eos)
    }

    /// Let the request go on with `mutation` on its headers: every answer still owed for
    /// the headers and the body held so far, in the order Envoy expects them.
    fn flush(
        &mut self,
        mutation: Option<HeaderMutation>,
        metadata: Option<envoy_types::pb::google::protobuf::Struct>,
        end_of_stream: bool,
    ) -> Vec<ProcessingResponse> {
        self.state = State::Passing;
        let mut out = Vec::new();
        let mut first = match self.req_mode {
            // The headers went on already; the body's answer carries the mutation.
            BodyMode::Buffered | BodyMode::None | BodyMode::Streamed { early: false } => {
                wire::body(Dir::Request, mutation)
            }
            BodyMode::Streamed { early: true } | BodyMode::FullDuplex => {
                wire::headers(Dir::Request, mutation)
            }
        };
        first.dynamic_metadata = metadata;
        out.push(first);
        match self.req_mode {
            BodyMode::Streamed { early: true } => {
                out.extend((0..self.held).map(|_| wire::body(Dir::Request, None)));
            }
            BodyMode::FullDuplex => {
                // In pieces: Envoy takes server messages of 4 MiB at most by default.
                let body = std::mem::take(&mut self.body);
                let n = body.len().div_ceil(ECHO_CHUNK).max(1);
                for (i, piece) in body.chunks(ECHO_CHUNK).enumerate() {
                    let last = i + 1 == n;
                    out.push(wire::streamed(
                        Dir::Request,
                        piece.to_vec(),
                        last && end_of_stream,
                    ));
                }
                if body.is_empty() {
                    out.push(wire::streamed(Dir::Request, Vec::new(), end_of_stream));
                }
            }
            _ => {}
        }
        self.held = 0;
        self.body = Vec::new();
        if self.trailers_owed {
            self.trailers_owed = false;
            out.push(wire::trailers(Dir::Request));
        }
        out
    }

    fn pass_body(&mut self, dir: Dir, b: HttpBody) -> ProcessingResponse {
        let mode = match dir {
            Dir::Request => self.req_mode,
            Dir::Response => self.resp_mode,
        };
        match mode {
            BodyMode::FullDuplex => wire::streamed(dir, b.body, b.end_of_stream),
            _ => wire::body(dir, None),
        }
    }

    fn response_headers(&mut self, h: &HttpHeaders) -> ProcessingResponse {
        self.status = wire::header(h, ":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        if self.served.is_none() {
            self.served = wire::header(h, wire::SERVED_KEY).filter(|s| valid_endpoint(s));
        }
        // The served endpoint names a pod: it is the data plane's note to the picker,
        // not the client's business.
        let m = HeaderMutation {
            remove_headers: vec![wire::SERVED_KEY.to_owned()],
            ..Default::default()
        };
        wire::headers(Dir::Response, Some(m))
    }

    fn response_body(&mut self, b: HttpBody) -> ProcessingResponse {
        self.tail.push(&b.body);
        if let Some(head) = &mut self.head {
            head.push(&b.body);
        }
        self.pass_body(Dir::Response, b)
    }

    /// The completion report of a steered request, once its stream is over (status 0:
    /// no response came, the client or the data plane gave up).
    pub fn report(&self, now: Instant) -> Option<CompletionReport> {
        let d = self.decision.as_ref()?;
        // Served where it was sent: the chosen pod (a rank keeps its rank); elsewhere (a
        // fallback): the endpoint that served.
        let pod = match self
            .served
            .as_deref()
            .and_then(|s| s.split(',').next())
            .filter(|s| valid_endpoint(s))
        {
            Some(s) if s != split_rank(&d.pod).0 => s,
            _ => &d.pod,
        };
        Some(logic::completion_report(
            &d.id,
            self.request_id.as_deref().unwrap_or_default(),
            &d.model,
            pod,
            self.status,
            self.tail.usage(),
            now.saturating_duration_since(d.at).as_secs_f64() * 1e3,
            self.head.as_ref().and_then(Head::response_id),
        ))
    }
}

#[cfg(test)]
mod tests;
