//! Envoy's ext_proc messages, read and built: the request's headers and the data plane's
//! metadata on the way in, continue / steer / immediate answers on the way out. Only
//! shapes here; what to answer is [`super::exchange`]'s business.

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, common_response::ResponseStatus, processing_response::Response as Resp,
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders,
    ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

/// The namespace the chosen endpoints go in, and the served endpoint comes back in.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The namespace of the data plane's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
pub const DESTINATION_KEY: &str = "x-gateway-destination-endpoint";
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// Endpoints a subset hint may name before the rest are ignored.
pub const MAX_SUBSET: usize = 1024;

/// Which way a message travels: the client's request or the engine's response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    Request,
    Response,
}

/// A header's value (Envoy sends `raw_value`; older ones `value`), if it is UTF-8.
pub fn header(h: &HttpHeaders, name: &str) -> Option<String> {
    let hv = h
        .headers
        .as_ref()?
        .headers
        .iter()
        .find(|v| v.key.eq_ignore_ascii_case(name))?;
    if !hv.raw_value.is_empty() {
        return String::from_utf8(hv.raw_value.clone()).ok();
    }
    Some(hv.value.clone())
}

fn field<'a>(md: Option<&'a Metadata>, ns: &str, key: &str) -> Option<&'a Kind> {
    md?.filter_metadata.get(ns)?.fields.get(key)?.kind.as_ref()
}

/// The data plane's subset hint: `Some(list)` when the key is present (an empty or
/// unusable list means no pod may be chosen), `None` when there is no hint.
pub fn subset(md: Option<&Metadata>) -> Option<Vec<String>> {
    let strings = |k: &Kind| -> Vec<String> {
        match k {
            Kind::ListValue(l) => l
                .values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .take(MAX_SUBSET)
                .collect(),
            // A single endpoint, or several comma-separated, as some data planes write it.
            Kind::StringValue(s) => s
                .split(',')
                .map(|x| x.trim().to_owned())
                .filter(|x| !x.is_empty())
                .take(MAX_SUBSET)
                .collect(),
            _ => Vec::new(),
        }
    };
    field(md, SUBSET_NAMESPACE, SUBSET_KEY).map(strings)
}

/// The endpoint that served the response, from the data plane's metadata.
pub fn served(md: Option<&Metadata>) -> Option<String> {
    match field(md, LB_NAMESPACE, SERVED_KEY)? {
        Kind::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

fn common(mutation: Option<HeaderMutation>, body: Option<BodyMutation>) -> CommonResponse {
    CommonResponse {
        status: ResponseStatus::Continue as i32,
        header_mutation: mutation,
        body_mutation: body,
        ..Default::default()
    }
}

fn answer(r: Resp) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        ..Default::default()
    }
}

/// Go on with the headers, changed by `mutation`.
pub fn headers(dir: Dir, mutation: Option<HeaderMutation>) -> ProcessingResponse {
    let h = HeadersResponse {
        response: Some(common(mutation, None)),
    };
    answer(match dir {
        Dir::Request => Resp::RequestHeaders(h),
        Dir::Response => Resp::ResponseHeaders(h),
    })
}

/// Go on with a body chunk (buffered and streamed modes), headers changed by `mutation`
/// (buffered mode only).
pub fn body(dir: Dir, mutation: Option<HeaderMutation>) -> ProcessingResponse {
    let b = BodyResponse {
        response: Some(common(mutation, None)),
    };
    answer(match dir {
        Dir::Request => Resp::RequestBody(b),
        Dir::Response => Resp::ResponseBody(b),
    })
}

/// Full-duplex mode: the body bytes Envoy forwards, as the server hands them back.
pub fn streamed(dir: Dir, bytes: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    let m = BodyMutation {
        mutation: Some(body_mutation::Mutation::StreamedResponse(
            StreamedBodyResponse {
                body: bytes,
                end_of_stream,
                ..Default::default()
            },
        )),
    };
    let b = BodyResponse {
        response: Some(common(None, Some(m))),
    };
    answer(match dir {
        Dir::Request => Resp::RequestBody(b),
        Dir::Response => Resp::ResponseBody(b),
    })
}

pub fn trailers(dir: Dir) -> ProcessingResponse {
    let t = TrailersResponse::default();
    answer(match dir {
        Dir::Request => Resp::RequestTrailers(t),
        Dir::Response => Resp::ResponseTrailers(t),
    })
}

/// Answer the client at once with `status` and a JSON error body.
pub fn immediate(status: u16, reason: &str, message: &str) -> ProcessingResponse {
    let body = serde_json::json!({
        "error": {"message": message, "type": reason, "code": status}
    });
    let mutation = HeaderMutation {
        set_headers: vec![set("content-type", "application/json")],
        ..Default::default()
    };
    answer(Resp::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(status),
        }),
        headers: Some(mutation),
        body: serde_json::to_vec(&body).unwrap_or_default(),
        details: format!("kvroute_{reason}"),
        ..Default::default()
    }))
}

/// Answer a request the sidecar refused: `429` (saturated) or `503` (no ready pod) with
/// `Retry-After` and `body` (the API's own error shape, `logic::refusal_body`).
pub fn refused(body: &[u8], r: &kvroute_filter::logic::Refused) -> ProcessingResponse {
    let mutation = HeaderMutation {
        set_headers: vec![
            set("content-type", "application/json"),
            set("retry-after", &r.retry_after_s.to_string()),
            set("x-kvroute-refused", &r.reason),
        ],
        ..Default::default()
    };
    answer(Resp::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(r.status),
        }),
        headers: Some(mutation),
        body: body.to_vec(),
        details: format!("kvroute_{}", r.reason),
        ..Default::default()
    }))
}

/// A header set (replacing any value already there).
pub fn set(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// The dynamic metadata naming the chosen endpoints (`envoy.lb`), equal to the header.
pub fn destination_metadata(endpoints: &str) -> Struct {
    let inner = Struct {
        fields: [(
            DESTINATION_KEY.to_owned(),
            Value {
                kind: Some(Kind::StringValue(endpoints.to_owned())),
            },
        )]
        .into(),
    };
    Struct {
        fields: [(
            LB_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}
