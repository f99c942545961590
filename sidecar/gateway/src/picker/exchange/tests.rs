//! The exchange per body mode, message by message, as Envoy sends them.

use super::*;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response::Response as Resp, HttpTrailers, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use kvroute_shared::protocol::Ranked;

fn cfg() -> Arc<FilterConfig> {
    let mut c = FilterConfig::default();
    c.default_model.block_size = 4;
    Arc::new(c)
}

fn exchange() -> Exchange {
    Exchange::new(cfg(), Arc::new(|_, s| *s))
}

fn headers(pairs: &[(&str, &str)], eos: bool) -> HttpHeaders {
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: (*k).into(),
                    raw_value: v.as_bytes().to_vec(),
                    ..Default::default()
                })
                .collect(),
        }),
        end_of_stream: eos,
        ..Default::default()
    }
}

fn post() -> HttpHeaders {
    headers(
        &[
            (":method", "POST"),
            (":path", "/v1/completions"),
            ("x-request-id", "r1"),
            ("x-session-id", "s1"),
        ],
        false,
    )
}

fn first(
    mode: BodySendMode,
    early: bool,
    h: HttpHeaders,
    md: Option<Metadata>,
) -> ProcessingRequest {
    ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode as i32,
            response_body_mode: mode as i32,
            send_body_without_waiting_for_header_response: early,
        }),
        metadata_context: md,
        request: Some(Msg::RequestHeaders(h)),
        ..Default::default()
    }
}

fn msg(m: Msg) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(m),
        ..Default::default()
    }
}

fn chunk(b: &[u8], eos: bool) -> ProcessingRequest {
    msg(Msg::RequestBody(HttpBody {
        body: b.to_vec(),
        end_of_stream: eos,
        ..Default::default()
    }))
}

const BODY: &[u8] = br#"{"model":"m","prompt":[0,1,2,3,4,5,6,7,8,9]}"#;

fn replies(s: Step) -> Vec<ProcessingResponse> {
    match s {
        Step::Reply(r) => r,
        Step::Route(_) => panic!("asked to route"),
    }
}

fn job(s: Step) -> RouteJob {
    match s {
        Step::Route(j) => *j,
        Step::Reply(r) => panic!("answered {r:?}"),
    }
}

fn decided() -> Result<RouteResponse, RouteError> {
    Ok(RouteResponse {
        pod: "10.0.0.1:8000".into(),
        decision: Some("d-1".into()),
        ranked: [
            "10.0.0.1:8000",
            "10.0.0.2:8000",
            "bad pod",
            "10.0.0.3:8000",
            "10.0.0.4:8000",
        ]
        .iter()
        .map(|p| Ranked {
            pod: (*p).into(),
            matched_blocks: 0,
            score: None,
        })
        .collect(),
        tier_hint: None,
        prefill_pod: None,
        policy_version: 1,
        explain: None,
    })
}

/// The steering header's value in a header mutation, if set.
fn steer(r: &ProcessingResponse) -> Option<String> {
    let common = match r.response.as_ref()? {
        Resp::RequestHeaders(h) => h.response.as_ref()?,
        Resp::RequestBody(b) => b.response.as_ref()?,
        _ => return None,
    };
    let hv = common
        .header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .find_map(|o| {
            o.header
                .as_ref()
                .filter(|h| h.key == "x-gateway-destination-endpoint")
        })?;
    Some(String::from_utf8_lossy(&hv.raw_value).into_owned())
}

fn metadata_steer(r: &ProcessingResponse) -> Option<String> {
    let lb = r.dynamic_metadata.as_ref()?.fields.get("envoy.lb")?;
    let Some(Kind::StructValue(s)) = &lb.kind else {
        return None;
    };
    match &s.fields.get("x-gateway-destination-endpoint")?.kind {
        Some(Kind::StringValue(v)) => Some(v.clone()),
        _ => None,
    }
}

#[test]
fn buffered_headers_go_on_at_once_and_the_bodys_answer_steers() {
    let mut ex = exchange();
    let r = replies(ex.on_message(first(BodySendMode::Buffered, false, post(), None)));
    assert!(matches!(
        r[..],
        [ProcessingResponse {
            response: Some(Resp::RequestHeaders(_)),
            ..
        }]
    ));
    assert_eq!(steer(&r[0]), None, "no steer before the body");
    let j = job(ex.on_message(chunk(BODY, true)));
    assert_eq!(j.req.chain, [12505186680924831797, 7943115681171077851]);
    assert_eq!(j.req.session.as_deref(), Some("s1"));
    assert_eq!(j.subset, None);
    let r = ex.routed("m", decided(), Instant::now());
    assert_eq!(r.len(), 1);
    assert!(matches!(r[0].response, Some(Resp::RequestBody(_))));
    let list = "10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000";
    assert_eq!(
        steer(&r[0]).as_deref(),
        Some(list),
        "chosen first, two valid fallbacks"
    );
    assert_eq!(
        metadata_steer(&r[0]).as_deref(),
        Some(list),
        "header and metadata agree"
    );
    assert_eq!(ex.take_outcome(), Some(Outcome::Routed));
    // The response: the served endpoint comes back in the metadata; usage in the body.
    let served = Metadata {
        filter_metadata: [(
            "envoy.lb".to_owned(),
            Struct {
                fields: [(
                    "x-gateway-destination-endpoint-served".to_owned(),
                    Value {
                        kind: Some(Kind::StringValue("10.0.0.2:8000".into())),
                    },
                )]
                .into(),
            },
        )]
        .into(),
        ..Default::default()
    };
    let mut rh = msg(Msg::ResponseHeaders(headers(&[(":status", "200")], false)));
    rh.metadata_context = Some(served);
    replies(ex.on_message(rh));
    let usage = br#"{"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":8}}}"#;
    let r = replies(ex.on_message(msg(Msg::ResponseBody(HttpBody {
        body: usage.to_vec(),
        end_of_stream: true,
        ..Default::default()
    }))));
    assert!(matches!(
        r[..],
        [ProcessingResponse {
            response: Some(Resp::ResponseBody(_)),
            ..
        }]
    ));
    let rep = ex
        .report(Instant::now())
        .expect("a steered request reports");
    assert_eq!(
        (
            rep.decision.as_str(),
            rep.pod.as_str(),
            rep.status,
            rep.cached_tokens
        ),
        ("d-1", "10.0.0.2:8000", 200, Some(8)),
        "released on the endpoint that served it"
    );
    assert_eq!(rep.request_id, "r1");
    assert_eq!(ex.take_outcome(), None, "counted once");
}

#[test]
fn full_duplex_holds_the_headers_until_the_body_is_whole_then_echoes_it() {
    let mut ex = exchange();
    assert!(
        replies(ex.on_message(first(BodySendMode::FullDuplexStreamed, false, post(), None)))
            .is_empty()
    );
    let (a, b) = BODY.split_at(20);
    assert!(replies(ex.on_message(chunk(a, false))).is_empty());
    job(ex.on_message(chunk(b, true)));
    let r = ex.routed("m", decided(), Instant::now());
    assert_eq!(r.len(), 2);
    assert!(matches!(r[0].response, Some(Resp::RequestHeaders(_))));
    assert!(steer(&r[0]).is_some() && metadata_steer(&r[0]).is_some());
    let Some(Resp::RequestBody(body)) = &r[1].response else {
        panic!("{r:?}")
    };
    let m = body
        .response
        .as_ref()
        .and_then(|c| c.body_mutation.as_ref());
    let Some(body_mutation::Mutation::StreamedResponse(s)) = m.and_then(|m| m.mutation.as_ref())
    else {
        panic!("{m:?}")
    };
    assert_eq!(
        (s.body.as_slice(), s.end_of_stream),
        (BODY, true),
        "the body, whole, once"
    );
    // The response body is echoed chunk by chunk.
    let r = replies(ex.on_message(msg(Msg::ResponseBody(HttpBody {
        body: b"data: x\n\n".to_vec(),
        ..Default::default()
    }))));
    assert!(matches!(&r[0].response, Some(Resp::ResponseBody(_))));
}

#[test]
fn streamed_with_early_bodies_acknowledges_each_held_chunk_after_the_headers() {
    let mut ex = exchange();
    assert!(replies(ex.on_message(first(BodySendMode::Streamed, true, post(), None))).is_empty());
    let (a, b) = BODY.split_at(10);
    assert!(replies(ex.on_message(chunk(a, false))).is_empty());
    job(ex.on_message(chunk(b, true)));
    let r = ex.routed("m", decided(), Instant::now());
    let kinds: Vec<bool> = r
        .iter()
        .map(|x| matches!(x.response, Some(Resp::RequestHeaders(_))))
        .collect();
    assert_eq!(
        kinds,
        [true, false, false],
        "headers, then one answer per chunk"
    );
}

#[test]
fn streamed_without_early_bodies_cannot_steer_and_says_so() {
    let mut ex = exchange();
    let r = replies(ex.on_message(first(BodySendMode::Streamed, false, post(), None)));
    assert_eq!(r.len(), 1);
    assert_eq!(ex.take_outcome(), Some(Outcome::ModeUnsupported));
    let r = replies(ex.on_message(chunk(BODY, true)));
    assert!(matches!(
        r[..],
        [ProcessingResponse {
            response: Some(Resp::RequestBody(_)),
            ..
        }]
    ));
    assert!(ex.report(Instant::now()).is_none());
}

#[test]
fn unrouted_paths_bodiless_requests_and_bad_bodies_go_on_unsteered() {
    let mut ex = exchange();
    let get = headers(&[(":method", "GET"), (":path", "/v1/models")], true);
    let r = replies(ex.on_message(first(BodySendMode::Buffered, false, get, None)));
    assert_eq!(r.len(), 1);
    assert_eq!(ex.take_outcome(), Some(Outcome::NotRouted));

    let mut ex = exchange();
    let h = headers(&[(":method", "POST"), (":path", "/v1/completions")], true);
    replies(ex.on_message(first(BodySendMode::Buffered, false, h, None)));
    assert_eq!(ex.take_outcome(), Some(Outcome::NoBody));

    for (body, skip) in [
        (&b"{oops"[..], Skip::BadJson),
        (b"{}", Skip::NoPrompt),
        (br#"{"prompt":""}"#, Skip::EmptyPrompt),
    ] {
        let mut ex = exchange();
        ex.on_message(first(BodySendMode::FullDuplexStreamed, false, post(), None));
        let r = replies(ex.on_message(chunk(body, true)));
        assert_eq!(r.len(), 2, "headers and the echoed body");
        assert_eq!(steer(&r[0]), None);
        assert_eq!(ex.take_outcome(), Some(Outcome::Skip(skip)));
    }
}

#[test]
fn a_body_over_the_cap_stops_being_read_and_flows_through() {
    let c = FilterConfig {
        max_body_bytes: 16,
        ..Default::default()
    };
    let mut ex = Exchange::new(Arc::new(c), Arc::new(|_, s| *s));
    ex.on_message(first(BodySendMode::FullDuplexStreamed, false, post(), None));
    assert!(replies(ex.on_message(chunk(&[b'x'; 10], false))).is_empty());
    let r = replies(ex.on_message(chunk(&[b'y'; 10], false)));
    assert_eq!(r.len(), 2, "headers, then what was held");
    assert_eq!(ex.take_outcome(), Some(Outcome::Skip(Skip::BodyTooLarge)));
    let r = replies(ex.on_message(chunk(b"zz", true)));
    assert_eq!(r.len(), 1, "later chunks echoed as they come");
}

fn subset_md(list: &[&str]) -> Metadata {
    Metadata {
        filter_metadata: [(
            "envoy.lb.subset_hint".to_owned(),
            Struct {
                fields: [(
                    "x-gateway-destination-endpoint-subset".to_owned(),
                    Value {
                        kind: Some(Kind::ListValue(ListValue {
                            values: list
                                .iter()
                                .map(|s| Value {
                                    kind: Some(Kind::StringValue((*s).into())),
                                })
                                .collect(),
                        })),
                    },
                )]
                .into(),
            },
        )]
        .into(),
        ..Default::default()
    }
}

#[test]
fn the_subset_hint_goes_to_the_route_and_an_empty_choice_is_503() {
    let mut ex = exchange();
    let md = subset_md(&["10.0.0.2:8000", "10.0.0.3:8000"]);
    ex.on_message(first(BodySendMode::Buffered, false, post(), Some(md)));
    let j = job(ex.on_message(chunk(BODY, true)));
    assert_eq!(
        j.subset.as_deref(),
        Some(&["10.0.0.2:8000".to_owned(), "10.0.0.3:8000".to_owned()][..])
    );
    let r = ex.routed("m", Err(RouteError::OutsideSubset), Instant::now());
    let Some(Resp::ImmediateResponse(i)) = &r[0].response else {
        panic!("{r:?}")
    };
    assert_eq!(i.status.map(|s| s.code), Some(503));
    assert_eq!(ex.take_outcome(), Some(Outcome::OutsideSubset));
    assert!(ex.report(Instant::now()).is_none(), "nothing was committed");
}

/// A request admission refused is answered 429 with `Retry-After`, its API's error
/// body and its admission class taken from the headers, as the filter does.
#[test]
fn a_refused_request_is_answered_429_with_retry_after() {
    let mut ex = exchange();
    let h = headers(
        &[
            (":method", "POST"),
            (":path", "/v1/messages"),
            ("x-gateway-inference-objective", "interactive"),
            ("x-gateway-inference-fairness-id", "team-a"),
        ],
        false,
    );
    ex.on_message(first(BodySendMode::Buffered, false, h, None));
    let body = br#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#;
    let j = job(ex.on_message(chunk(body, true)));
    assert_eq!(j.req.admission.objective.as_deref(), Some("interactive"));
    assert_eq!(j.req.admission.tenant.as_deref(), Some("team-a"));
    let r = ex.refused("expired", 3);
    let Some(Resp::ImmediateResponse(i)) = &r[0].response else {
        panic!("{r:?}")
    };
    assert_eq!(i.status.map(|s| s.code), Some(429));
    let hs = &i.headers.as_ref().expect("headers").set_headers;
    let get = |k: &str| {
        hs.iter()
            .filter_map(|h| h.header.as_ref())
            .find(|h| h.key == k)
            .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
    };
    assert_eq!(get("retry-after").as_deref(), Some("3"));
    assert_eq!(get("x-kvroute-refused").as_deref(), Some("expired"));
    let b: serde_json::Value = serde_json::from_slice(&i.body).expect("json");
    assert_eq!(
        b["error"]["type"], "rate_limit_error",
        "Anthropic's shape: {b}"
    );
    assert_eq!(ex.take_outcome(), Some(Outcome::Saturated));
    assert!(ex.report(Instant::now()).is_none(), "nothing was committed");
}

#[test]
fn no_pod_and_late_decisions_fail_open() {
    for (e, o) in [
        (
            RouteError::NoPod {
                model: "m".into(),
                adapter: String::new(),
            },
            Outcome::NoPod,
        ),
        (RouteError::DeadlinePassed, Outcome::Deadline),
    ] {
        let mut ex = exchange();
        ex.on_message(first(BodySendMode::Buffered, false, post(), None));
        job(ex.on_message(chunk(BODY, true)));
        let r = ex.routed("m", Err(e), Instant::now());
        assert_eq!(r.len(), 1);
        assert_eq!(steer(&r[0]), None);
        assert_eq!(ex.take_outcome(), Some(o));
    }
}

/// Every pod failing (breakers open, admission on): the client is answered 503 with
/// Retry-After, as through the filter.
#[test]
fn no_ready_pod_is_answered_503() {
    let mut ex = exchange();
    ex.on_message(first(BodySendMode::Buffered, false, post(), None));
    job(ex.on_message(chunk(BODY, true)));
    let e = RouteError::NoReadyPod {
        model: "m".into(),
        retry_after_s: 4,
    };
    let r = ex.routed("m", Err(e), Instant::now());
    let Some(Resp::ImmediateResponse(i)) = &r[0].response else {
        panic!("{r:?}")
    };
    assert_eq!(i.status.map(|s| s.code), Some(503));
    let retry = i
        .headers
        .as_ref()
        .expect("headers")
        .set_headers
        .iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == "retry-after")
        .map(|h| h.raw_value.clone());
    assert_eq!(retry.as_deref(), Some(&b"4"[..]));
    let b: serde_json::Value = serde_json::from_slice(&i.body).expect("json");
    assert_eq!(b["error"]["code"], "no_ready_pod", "{b}");
    assert_eq!(ex.take_outcome(), Some(Outcome::NoReadyPod));
}

#[test]
fn out_of_order_messages_are_answered_never_left_hanging() {
    let mut ex = exchange();
    // A body before any headers.
    let r = replies(ex.on_message(chunk(BODY, true)));
    assert_eq!(r.len(), 1);
    assert_eq!(ex.take_outcome(), Some(Outcome::BadStream));
    // Headers twice.
    let mut ex = exchange();
    ex.on_message(first(BodySendMode::Buffered, false, post(), None));
    let r = replies(ex.on_message(msg(Msg::RequestHeaders(post()))));
    assert_eq!(r.len(), 1);
    // A decision nobody asked for.
    assert!(ex.routed("m", decided(), Instant::now()).is_empty());
    // Trailers and an empty message.
    let r = replies(ex.on_message(msg(Msg::ResponseTrailers(HttpTrailers::default()))));
    assert_eq!(r.len(), 1);
    assert!(replies(ex.on_message(ProcessingRequest::default())).is_empty());
}

#[test]
fn trailers_end_a_full_duplex_body_and_their_answer_follows_it() {
    let mut ex = exchange();
    ex.on_message(first(BodySendMode::FullDuplexStreamed, false, post(), None));
    assert!(replies(ex.on_message(chunk(BODY, false))).is_empty());
    job(ex.on_message(msg(Msg::RequestTrailers(HttpTrailers::default()))));
    let r = ex.routed("m", decided(), Instant::now());
    assert_eq!(r.len(), 3);
    assert!(matches!(r[2].response, Some(Resp::RequestTrailers(_))));
}

#[test]
fn a_model_the_sidecar_tokenizes_hands_the_route_its_prompt_body() {
    let mut c = FilterConfig::default();
    c.default_model.sidecar_tokenizes = true;
    c.tenant_header = "x-tenant".into();
    let mut ex = Exchange::new(Arc::new(c), Arc::new(|_, s| *s));
    let h = headers(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("x-tenant", "t1"),
            ("x-claude-code-session-id", "sess-9"),
        ],
        false,
    );
    ex.on_message(first(BodySendMode::Buffered, false, h, None));
    let body = json_chat(&"hello there, ".repeat(60));
    let j = job(ex.on_message(chunk(body.as_bytes(), true)));
    assert!(
        j.req.prompt_body.is_some(),
        "precise mode: the template's fields go along"
    );
    assert_eq!(j.req.session.as_deref(), Some("sess-9"));
    assert!(
        !j.req.chain.is_empty(),
        "and the text chain, for when it cannot tokenize"
    );
}

fn json_chat(text: &str) -> String {
    serde_json::json!({"model": "m", "messages": [{"role": "user", "content": text}]}).to_string()
}
