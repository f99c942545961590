//! The filter inside a real Envoy 1.40 (v8), against a stub sidecar and stub pods.
//!
//! This is where the hash chain is proven on wasm32: the chains the filter computes
//! inside v8 must be the protocol test vectors (docs/protocol.md) bit for bit.

use std::time::{Duration, Instant};

use kvroute_tests::envoy::{Envoy, EnvoyLayout, Fallback, SidecarAddr};
use kvroute_tests::stub::{Answer, StubPod, StubSidecar};
use serde_json::json;

struct Rig {
    sidecar: StubSidecar,
    pods: Vec<StubPod>,
    envoy: Envoy,
    http: reqwest::Client,
}

async fn rig(answer: Answer, filter_extra: serde_json::Value) -> Rig {
    rig_with(answer, filter_extra, true).await
}

/// `with_filter: false` is Envoy with the wasm filter gone (a VM that failed open).
async fn rig_with(answer: Answer, filter_extra: serde_json::Value, with_filter: bool) -> Rig {
    let wasm = kvroute_tests::wasm_path();
    assert!(
        wasm.exists(),
        "build the filter first: make wasm ({} missing)",
        wasm.display()
    );
    let sidecar = StubSidecar::start(answer).await.expect("stub sidecar");
    let mut pods = Vec::new();
    for name in ["a", "b", "c"] {
        pods.push(StubPod::start(name).await.expect("stub pod"));
    }
    let mut cfg = json!({
        "timeout_ms": 100,
        "default_model": {"block_size": 4, "text_block_bytes": 16},
        "adapters": {"adapters": {"a": "m"}},
    });
    if let (Some(c), Some(extra)) = (cfg.as_object_mut(), filter_extra.as_object()) {
        c.extend(extra.clone());
    }
    let layout = EnvoyLayout {
        listen_port: 0,
        sidecar: SidecarAddr::Tcp(sidecar.addr),
        engines: pods.iter().map(|p| p.addr).collect(),
        wasm_path: wasm,
        filter_config: cfg,
        with_filter,
        fallback: Fallback::RoundRobin,
        access_log: false,
    };
    let envoy = tokio::task::spawn_blocking(move || Envoy::start(&layout))
        .await
        .expect("join")
        .expect("envoy starts");
    Rig {
        sidecar,
        pods,
        envoy,
        http: reqwest::Client::new(),
    }
}

impl Rig {
    async fn post(&self, path: &str, body: &str, headers: &[(&str, &str)]) -> reqwest::Response {
        let mut r = self
            .http
            .post(self.envoy.url(path))
            .body(body.to_string())
            .header("content-type", "application/json");
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        r.send().await.expect("request through envoy")
    }

    fn pod(&self, name: &str) -> String {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.addr.to_string())
            .expect("pod")
    }
}

fn served_by(r: &reqwest::Response) -> String {
    r.headers()
        .get("x-pod")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasm_chain_matches_reference_vectors() {
    let rig = rig(Answer::Status(503), json!({})).await;
    let toks = "[0,1,2,3,4,5,6,7,8,9]";
    let cases = [
        (
            format!(r#"{{"model":"m","prompt":{toks}}}"#),
            vec![12505186680924831797u64, 7943115681171077851],
        ),
        (
            format!(r#"{{"model":"a","prompt":{toks}}}"#),
            vec![14521725862862998063, 12194196787045017334],
        ),
        (
            format!(r#"{{"model":"m","prompt":{toks},"cache_salt":"s"}}"#),
            vec![354002652557409732, 10636323012749482335],
        ),
        (
            format!(r#"{{"model":"m2","prompt":{toks}}}"#),
            vec![16843217685244874434, 3919959493303384019],
        ),
        (
            r#"{"model":"m","prompt":"The quick brown fox jumps over the lazy dog"}"#.to_string(),
            vec![5154235071411025064, 2942950958069661582],
        ),
    ];
    for (body, _) in &cases {
        let r = rig.post("/v1/completions", body, &[]).await;
        assert_eq!(r.status(), 200, "fails open on a 503 from the sidecar");
    }
    let log = rig.sidecar.log.lock();
    assert_eq!(log.routes.len(), cases.len());
    for (got, (_, want)) in log.routes.iter().zip(&cases) {
        assert_eq!(
            &got.chain, want,
            "chain computed in Envoy's v8 for model {}",
            got.model
        );
    }
    assert_eq!(log.routes[1].adapter, "a");
    assert_eq!(log.routes[1].model, "m");
    println!(
        "wasm32 (Envoy v8) reproduced all {} protocol test vectors (docs/protocol.md)",
        cases.len()
    );
}

/// With the wasm VM out of the way (failed open), Envoy itself still drops the client's
/// steering headers: a spoofed endpoint pins nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spoofed_steering_headers_are_stripped_natively_without_the_filter() {
    let rig = rig_with(Answer::Status(503), json!({}), false).await;
    let a = rig.pod("a");
    let mut seen = std::collections::HashSet::new();
    for _ in 0..6 {
        let r = rig
            .post(
                "/v1/completions",
                r#"{"model":"m","prompt":[1,2,3,4,5]}"#,
                &[
                    ("x-gateway-destination-endpoint", &a),
                    ("x-kvroute-prefill-endpoint", &a),
                ],
            )
            .await;
        assert_eq!(r.status(), 200);
        seen.insert(served_by(&r));
    }
    assert!(
        seen.len() > 1,
        "a spoofed header pinned requests without the filter: {seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steers_to_the_sidecars_pod_and_strips_spoofed_headers() {
    let rig = rig(Answer::Status(503), json!({})).await;
    let b = rig.pod("b");
    rig.sidecar.set_answer(Answer::Pod(b.clone()));
    let a = rig.pod("a");
    for _ in 0..6 {
        let r = rig
            .post(
                "/v1/completions",
                r#"{"model":"m","prompt":[1,2,3,4,5]}"#,
                &[("x-gateway-destination-endpoint", &a)],
            )
            .await;
        assert_eq!(r.status(), 200);
        assert_eq!(
            served_by(&r),
            "b",
            "steered to the sidecar's pod, not the client's"
        );
    }
    // Not routed (GET, other path) still loses the client's steering header.
    rig.sidecar.set_answer(Answer::Status(503));
    let mut seen = std::collections::HashSet::new();
    for _ in 0..6 {
        let r = rig
            .http
            .get(rig.envoy.url("/v1/models"))
            .header("x-gateway-destination-endpoint", &a)
            .send()
            .await
            .expect("get");
        assert_eq!(r.status(), 200);
        seen.insert(served_by(&r));
    }
    assert!(
        seen.len() > 1,
        "a spoofed header must not pin GETs to one pod: {seen:?}"
    );
    assert_eq!(rig.envoy.stat("wasmcustom.kvroute_routed"), Some(6));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fails_open_on_every_sidecar_failure() {
    let rig = rig(Answer::Garbage, json!({"timeout_ms": 50})).await;
    let body = r#"{"model":"m","prompt":[1,2,3,4,5,6,7,8]}"#;
    // Garbage answer.
    assert_eq!(rig.post("/v1/completions", body, &[]).await.status(), 200);
    // Error status.
    rig.sidecar.set_answer(Answer::Status(500));
    assert_eq!(rig.post("/v1/completions", body, &[]).await.status(), 200);
    // A pod outside the cluster: Envoy's override-host falls back by itself.
    rig.sidecar.set_answer(Answer::Pod("127.0.0.1:1".into()));
    assert_eq!(rig.post("/v1/completions", body, &[]).await.status(), 200);
    // Slower than the timeout: the request goes on after ~timeout.
    rig.sidecar.set_answer(Answer::Pod(rig.pod("c")));
    rig.sidecar.set_delay(Duration::from_millis(800));
    let t0 = Instant::now();
    for _ in 0..5 {
        assert_eq!(rig.post("/v1/completions", body, &[]).await.status(), 200);
    }
    let per = t0.elapsed() / 5;
    println!("sidecar 800 ms slow, timeout 50 ms: {per:?} per request");
    assert!(
        per < Duration::from_millis(400),
        "timeout bounds the wait: {per:?}"
    );
    assert!(
        rig.envoy
            .stat("wasmcustom.kvroute_fail_open_timeout")
            .unwrap_or(0)
            >= 5
    );
    assert!(
        rig.envoy
            .stat("wasmcustom.kvroute_fail_open_bad_answer")
            .unwrap_or(0)
            >= 1
    );
    assert!(
        rig.envoy
            .stat("wasmcustom.kvroute_fail_open_sidecar_error")
            .unwrap_or(0)
            >= 1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecar_down_means_plain_load_balancing() {
    let rig = rig(Answer::Status(503), json!({})).await;
    // Point Envoy at a sidecar address nobody listens on.
    let dead = std::net::SocketAddr::from(([127, 0, 0, 1], kvroute_tests::procs::free_port()));
    let layout = EnvoyLayout {
        listen_port: 0,
        sidecar: SidecarAddr::Tcp(dead),
        engines: rig.pods.iter().map(|p| p.addr).collect(),
        wasm_path: kvroute_tests::wasm_path(),
        filter_config: json!({"default_model": {"block_size": 4}}),
        with_filter: true,
        fallback: Fallback::RoundRobin,
        access_log: false,
    };
    let envoy = tokio::task::spawn_blocking(move || Envoy::start(&layout))
        .await
        .expect("join")
        .expect("envoy");
    let mut pods = std::collections::HashSet::new();
    for i in 0..30 {
        let r = rig
            .http
            .post(envoy.url("/v1/completions"))
            .body(format!(r#"{{"model":"m","prompt":[{i},2,3,4,5]}}"#))
            .send()
            .await
            .expect("request");
        assert_eq!(r.status(), 200);
        pods.insert(served_by(&r));
    }
    assert_eq!(pods.len(), 3, "fallback round-robin spreads requests");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_requests_pass_through_unharmed() {
    let rig = rig(Answer::Status(503), json!({"max_body_bytes": 65536})).await;
    rig.sidecar.set_answer(Answer::Pod(rig.pod("a")));
    for body in ["{not json", "[]", r#"{"prompt": 5}"#, "\u{1F600}"] {
        let r = rig.post("/v1/completions", body, &[]).await;
        assert_eq!(r.status(), 200, "body {body:?} passes to the engine");
    }
    let big = format!(r#"{{"model":"m","prompt":"{}"}}"#, "x".repeat(300_000));
    assert_eq!(rig.post("/v1/completions", &big, &[]).await.status(), 200);
    assert_eq!(rig.post("/v1/unknown", "{}", &[]).await.status(), 404);
    assert_eq!(
        rig.sidecar.log.lock().routes.len(),
        0,
        "none of these was routed"
    );
    assert!(
        rig.envoy
            .stat("wasmcustom.kvroute_fail_open_bad_json")
            .unwrap_or(0)
            >= 3
    );
    assert_eq!(
        rig.envoy
            .stat("wasmcustom.kvroute_fail_open_body_too_large"),
        Some(1)
    );
}

/// The coding agents' APIs in a real Envoy: hostile Messages and Responses bodies pass
/// to the engine unharmed and counted; good ones are routed with their session (Claude
/// Code's header first) and `previous_response_id`, and a Responses report carries the id
/// the engine gave its response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_apis_are_routed_and_hostile_bodies_pass() {
    let rig = rig(Answer::Status(503), json!({"max_body_bytes": 65536})).await;
    rig.sidecar.set_answer(Answer::Pod(rig.pod("a")));
    let hostile = [
        ("/v1/messages", "{not json"),
        ("/v1/messages", r#"{"messages": 5}"#),
        ("/v1/messages", r#"{"model":"m","messages":[]}"#),
        (
            "/v1/messages",
            r#"{"model":"m","system":{"x":1},"messages":[{"role":"user","content":"hi"}]}"#,
        ),
        ("/v1/responses", r#"{"model":"m"}"#),
        ("/v1/responses", r#"{"model":"m","input":7}"#),
        ("/v1/responses", r#"{"model":"m","input":""}"#),
        ("/v1/responses", "\u{1F600}"),
    ];
    for (path, body) in hostile {
        let r = rig.post(path, body, &[]).await;
        assert_eq!(r.status(), 200, "{path} {body:?} passes to the engine");
    }
    let big = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(300_000)
    );
    assert_eq!(rig.post("/v1/messages", &big, &[]).await.status(), 200);
    assert_eq!(rig.sidecar.log.lock().routes.len(), 0, "none was routed");
    let stat = |s: &str| {
        rig.envoy
            .stat(&format!("wasmcustom.kvroute_fail_open_{s}"))
            .unwrap_or(0)
    };
    assert_eq!(
        (
            stat("bad_json"),
            stat("no_prompt"),
            stat("empty_prompt"),
            stat("body_too_large")
        ),
        (5, 1, 2, 1)
    );

    let msg = r#"{"model":"m","max_tokens":8,"metadata":{"user_id":"u_1"},"system":[{"type":"text","text":"be brief","cache_control":{"type":"ephemeral"}}],"messages":[{"role":"user","content":[{"type":"text","text":"hello there, how are you today?"}]}]}"#;
    let r = rig
        .post("/v1/messages", msg, &[("x-claude-code-session-id", "cc-7")])
        .await;
    assert_eq!((r.status().as_u16(), served_by(&r)), (200, "a".to_string()));
    let resp = r#"{"model":"m","input":"what changed in the last commit?","previous_response_id":"resp_prev","prompt_cache_key":"codex-1"}"#;
    let r = rig.post("/v1/responses", resp, &[]).await;
    assert_eq!(r.status(), 200);
    let routes = rig.sidecar.log.lock().routes.clone();
    assert_eq!(routes.len(), 2);
    assert_eq!(
        routes[0].session.as_deref(),
        Some("cc-7"),
        "the header before the body"
    );
    assert_eq!(routes[0].mode, kvroute_shared::Mode::Text);
    assert_eq!(
        (
            routes[1].session.as_deref(),
            routes[1].previous_response.as_deref()
        ),
        (Some("codex-1"), Some("resp_prev"))
    );
    let routed = kvroute_tests::procs::wait_until(Duration::from_secs(5), || {
        let l = rig.sidecar.log.lock();
        let routed: Vec<_> = l
            .reports
            .iter()
            .filter(|r| !r.decision.is_empty())
            .cloned()
            .collect();
        (routed.len() == 2).then_some(routed)
    })
    .expect("both routed requests reported");
    let ids: Vec<Option<&str>> = routed.iter().map(|r| r.response_id.as_deref()).collect();
    assert!(
        ids.contains(&Some("cmpl")) && ids.contains(&None),
        "{ids:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_pass_chunk_by_chunk_and_usage_is_reported() {
    let rig = rig(Answer::Status(503), json!({})).await;
    rig.sidecar.set_answer(Answer::Pod(rig.pod("b")));
    let t0 = Instant::now();
    let mut r = rig
        .post(
            "/v1/completions",
            r#"{"model":"m","prompt":[1,2,3,4,5,6,7,8],"stream":true}"#,
            &[("x-request-id", "req-42")],
        )
        .await;
    assert_eq!(served_by(&r), "b");
    let first = r.chunk().await.expect("read").expect("a first chunk");
    let first_at = t0.elapsed();
    let mut rest = Vec::new();
    while let Some(c) = r.chunk().await.expect("read") {
        rest.extend_from_slice(&c);
    }
    let total = t0.elapsed();
    assert!(String::from_utf8_lossy(&first).starts_with("data: "));
    assert!(
        total - first_at > Duration::from_millis(300),
        "first chunk {first_at:?} arrived well before the end {total:?}"
    );
    // The report comes from on_log, after the stream ends.
    let report = kvroute_tests::procs::wait_until(Duration::from_secs(5), || {
        rig.sidecar.log.lock().reports.first().cloned()
    })
    .expect("a completion report");
    assert_eq!(report.request_id, "req-42");
    assert!(
        report.decision.starts_with("stub-"),
        "the report echoes the sidecar's decision id: {report:?}"
    );
    assert_eq!(report.pod, rig.pod("b"));
    assert_eq!(
        (report.status, report.cached_tokens, report.prompt_tokens),
        (200, Some(7), Some(10))
    );
    // Non-streaming JSON usage too.
    let r = rig
        .post(
            "/v1/chat/completions",
            r#"{"model":"m","messages":[{"role":"user","content":"hello there, how are you?"}]}"#,
            &[],
        )
        .await;
    assert_eq!(r.status(), 200);
    let n = kvroute_tests::procs::wait_until(Duration::from_secs(5), || {
        let l = rig.sidecar.log.lock();
        (l.reports.len() == 2).then(|| l.reports[1].cached_tokens)
    });
    assert_eq!(n, Some(Some(7)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_sidecar_over_uds_steers_by_cache_and_gets_reports() {
    use kvroute_tests::client::{batch, stored, Api};
    let sc = kvroute_tests::services::SidecarProc::start(&[], true).expect("sidecar");
    let api = Api::new(sc.addr);
    let mut pods = Vec::new();
    for name in ["a", "b", "c"] {
        pods.push(StubPod::start(name).await.expect("pod"));
    }
    for p in &pods {
        assert_eq!(api.register(&p.addr.to_string(), "m").await.status, 200);
    }
    let layout = EnvoyLayout {
        listen_port: 0,
        sidecar: SidecarAddr::Uds(sc.uds.clone().expect("uds")),
        engines: pods.iter().map(|p| p.addr).collect(),
        wasm_path: kvroute_tests::wasm_path(),
        filter_config: json!({"timeout_ms": 200, "default_model": {"block_size": 16}}),
        with_filter: true,
        fallback: Fallback::RoundRobin,
        access_log: false,
    };
    let envoy = tokio::task::spawn_blocking(move || Envoy::start(&layout))
        .await
        .expect("join")
        .expect("envoy");
    // Pod b's engine says it holds the first 3 blocks of this prompt.
    let tokens: Vec<u32> = (0..64).collect();
    let chain = kvroute_tests::client::token_chain("m", 16, &tokens);
    let b = pods[1].addr.to_string();
    api.events(&batch(&b, "m", "e", 0, vec![stored(&chain[..3])]))
        .await;
    let body = serde_json::to_string(&json!({"model": "m", "prompt": tokens})).expect("json");
    let http = reqwest::Client::new();
    for i in 0..5 {
        let r = http
            .post(envoy.url("/v1/completions"))
            .header("x-request-id", format!("real-{i}"))
            .body(body.clone())
            .send()
            .await
            .expect("request");
        assert_eq!(r.status(), 200);
        assert_eq!(served_by(&r), "b", "the pod whose cache holds the prefix");
    }
    let reported = kvroute_tests::procs::wait_until(Duration::from_secs(5), || {
        let rt = tokio::runtime::Handle::current();
        let v = tokio::task::block_in_place(|| rt.block_on(api.metric("kvroute_reports_total")));
        (v >= 5.0).then_some(v)
    });
    assert_eq!(reported, Some(5.0), "reports arrive at the sidecar");
    assert_eq!(
        api.metric("kvroute_cached_tokens_total{source=\"reported\"}")
            .await,
        35.0,
        "5 x cached_tokens 7"
    );
    assert_eq!(
        api.metric("kvroute_inflight_decisions").await,
        0.0,
        "reports released the load"
    );
}
