//! kvroute as the endpoint picker behind a real Envoy's `ext_proc` filter, in the shapes
//! of the Gateway API Inference Extension's gateway conformance tests: routing follows
//! the picker (every body mode), the subset hint restricts it, an unavailable picker
//! fails open, the served endpoint is reported back, two gateways share one picker and
//! one gateway spreads over two pickers; hostile input is refused and counted while
//! everything else goes on.

use std::net::SocketAddr;
use std::time::Duration;

use kvroute_tests::client::{batch, stored, token_chain, Api};
use kvroute_tests::envoy::{Envoy, PickerLayout};
use kvroute_tests::services::SidecarProc;
use kvroute_tests::stub::StubPod;
use serde_json::json;

const MODEL: &str = "m";

pub struct Rig {
    pub pods: Vec<StubPod>,
    pub sidecars: Vec<SidecarProc>,
}

/// Three stub pods and `n` sidecars with the picker on, each knowing the pods, and
/// pod `b` holding the prompt [`prompt`] makes (from its events).
pub async fn rig(n: usize) -> Rig {
    let mut pods = Vec::new();
    for name in ["a", "b", "c"] {
        pods.push(StubPod::start(name).await.expect("stub pod"));
    }
    let mut sidecars = Vec::new();
    // The picker's settings in the filter's keys: a 1 MiB body cap (the stub pods take
    // 2 MiB bodies at most).
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("picker.json");
    std::fs::write(&cfg, r#"{"max_body_bytes": 1048576}"#).expect("write");
    let cfg = cfg.display().to_string();
    for _ in 0..n {
        let cfg = cfg.clone();
        let sc = tokio::task::spawn_blocking(move || {
            SidecarProc::start(
                &["--picker-listen", "127.0.0.1:0", "--picker-config", &cfg],
                false,
            )
        })
        .await
        .expect("join")
        .expect("sidecar");
        let api = Api::new(sc.addr);
        for p in &pods {
            let r = api.register(&p.addr.to_string(), MODEL).await;
            assert!(r.status < 300, "register: {}", r.json);
        }
        let chain = token_chain(MODEL, 16, &tokens());
        let b = pods[1].addr.to_string();
        let r = api
            .events(&batch(&b, MODEL, "e1", 0, vec![stored(&chain)]))
            .await;
        assert!(r.status < 300, "events: {}", r.json);
        api.until_confirmed(MODEL, &chain, chain.len() as u64).await;
        sidecars.push(sc);
    }
    Rig { pods, sidecars }
}

pub fn tokens() -> Vec<u32> {
    (1000..1064).collect()
}

pub fn prompt() -> String {
    json!({"model": MODEL, "prompt": tokens(), "max_tokens": 4}).to_string()
}

impl Rig {
    /// A gateway whose requests go to the picker in `body_mode` (responses streamed, or
    /// full-duplex with full-duplex requests).
    pub fn layout(&self, body_mode: &'static str) -> PickerLayout {
        let response = if body_mode == "FULL_DUPLEX_STREAMED" {
            body_mode
        } else {
            "STREAMED"
        };
        PickerLayout {
            listen_port: 0,
            pickers: self.pickers(),
            engines: self.pods.iter().map(|p| p.addr).collect(),
            request_body_mode: body_mode,
            response_body_mode: response,
            subset: None,
            message_timeout_ms: 2000,
            access_log: false,
        }
    }

    pub fn pickers(&self) -> Vec<SocketAddr> {
        self.sidecars
            .iter()
            .map(|s| s.picker_addr().expect("picker address in the log"))
            .collect()
    }

    pub fn addr(&self, name: &str) -> String {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.addr.to_string())
            .expect("pod")
    }

    pub async fn metric(&self, i: usize, name: &str) -> f64 {
        Api::new(self.sidecars[i].addr).metric(name).await
    }
}

pub async fn envoy(layout: PickerLayout) -> Envoy {
    tokio::task::spawn_blocking(move || Envoy::start_picker(&layout))
        .await
        .expect("join")
        .expect("envoy starts")
}

pub struct Answer {
    pub rank: String,
    pub status: u16,
    pub pod: String,
    pub seen_steer: String,
    pub served_header: bool,
    pub body: String,
}

pub async fn send(envoy: &Envoy, path: &str, body: String) -> Answer {
    let r = reqwest::Client::new()
        .post(envoy.url(path))
        .header("content-type", "application/json")
        .header("x-request-id", "rid-1")
        // A client naming its own pod is ignored.
        .header("x-gateway-destination-endpoint", "127.0.0.1:1")
        .body(body)
        .timeout(Duration::from_secs(20))
        .send()
        .await
        .expect("request through envoy");
    let h = |k: &str| {
        r.headers()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let (pod, seen_steer, rank) = (h("x-pod"), h("x-seen-steer"), h("x-seen-rank"));
    let served_header = r
        .headers()
        .contains_key("x-gateway-destination-endpoint-served");
    let status = r.status().as_u16();
    Answer {
        rank,
        status,
        pod,
        seen_steer,
        served_header,
        body: r.text().await.unwrap_or_default(),
    }
}

/// Wait up to 5 s for a sidecar metric to reach `want`.
pub async fn until_metric(rig: &Rig, i: usize, name: &str, want: f64) -> f64 {
    let mut v = 0.0;
    for _ in 0..100 {
        v = rig.metric(i, name).await;
        if v >= want {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_follows_the_picker_in_every_body_mode_and_the_served_endpoint_releases_it() {
    let rig = rig(1).await;
    let b = rig.addr("b");
    let mut routed = 0.0;
    for mode in ["FULL_DUPLEX_STREAMED", "BUFFERED", "STREAMED"] {
        let gw = envoy(rig.layout(mode)).await;
        for _ in 0..3 {
            let a = send(&gw, "/v1/completions", prompt()).await;
            assert_eq!((a.status, a.pod.as_str()), (200, "b"), "{mode}: {}", a.body);
            assert!(
                a.seen_steer.starts_with(&b),
                "{mode}: the chosen pod leads the list the engine saw: {:?}",
                a.seen_steer
            );
            assert!(
                a.seen_steer.split(',').count() >= 2,
                "{mode}: fallbacks follow: {:?}",
                a.seen_steer
            );
            assert!(
                !a.served_header,
                "{mode}: the data plane's note stays inside"
            );
        }
        routed += 3.0;
        let got = until_metric(
            &rig,
            0,
            "kvroute_picker_requests_total{outcome=\"routed\"}",
            routed,
        )
        .await;
        assert_eq!(got, routed, "{mode}");
        // Every decision is released by its report when the stream ends, with the usage
        // the engine sent (the stub reports 7 cached tokens).
        let released = until_metric(
            &rig,
            0,
            "kvroute_report_decisions_total{outcome=\"released\"}",
            routed,
        )
        .await;
        assert_eq!(released, routed, "{mode}: every decision released");
    }
    // A streamed completion flows through the full-duplex picker chunk by chunk.
    let gw = envoy(rig.layout("FULL_DUPLEX_STREAMED")).await;
    let body = json!({"model": MODEL, "prompt": tokens(), "stream": true}).to_string();
    let a = send(&gw, "/v1/completions", body).await;
    assert_eq!((a.status, a.pod.as_str()), (200, "b"));
    assert_eq!(a.body.matches("data: ").count(), 7, "{}", a.body);
    // A request the picker does not route goes on, counted.
    let r = reqwest::get(gw.url("/v1/models")).await.expect("get");
    assert_eq!(r.status(), 200);
    assert!(
        until_metric(
            &rig,
            0,
            "kvroute_picker_requests_total{outcome=\"not_routed\"}",
            1.0
        )
        .await
            >= 1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_restricts_the_choice_and_an_impossible_one_is_503() {
    let rig = rig(1).await;
    let mut l = rig.layout("FULL_DUPLEX_STREAMED");
    l.subset = Some(vec![rig.addr("c")]);
    let gw = envoy(l).await;
    for _ in 0..3 {
        let a = send(&gw, "/v1/completions", prompt()).await;
        assert_eq!(
            (a.status, a.pod.as_str()),
            (200, "c"),
            "b holds the prompt, but only c may be chosen"
        );
        assert!(
            a.seen_steer.split(',').all(|p| p == rig.addr("c")),
            "no fallback outside the subset: {:?}",
            a.seen_steer
        );
    }
    let mut l = rig.layout("BUFFERED");
    l.subset = Some(vec!["127.0.0.1:1".into()]);
    let gw = envoy(l).await;
    let a = send(&gw, "/v1/completions", prompt()).await;
    assert_eq!(a.status, 503, "{}", a.body);
    assert!(a.body.contains("outside_subset"), "{}", a.body);
    assert!(a.pod.is_empty(), "no engine saw it");
    assert_eq!(
        rig.metric(
            0,
            "kvroute_picker_requests_total{outcome=\"outside_subset\"}"
        )
        .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_share_one_picker_and_one_gateway_spreads_over_two() {
    let rig = rig(2).await;
    // Two gateways, one picker (the first sidecar's).
    let mut one = rig.layout("FULL_DUPLEX_STREAMED");
    one.pickers.truncate(1);
    let (g1, g2) = (envoy(one.clone()).await, envoy(one).await);
    for gw in [&g1, &g2, &g1, &g2] {
        let a = send(gw, "/v1/completions", prompt()).await;
        assert_eq!((a.status, a.pod.as_str()), (200, "b"));
    }
    assert_eq!(
        until_metric(
            &rig,
            0,
            "kvroute_picker_requests_total{outcome=\"routed\"}",
            4.0
        )
        .await,
        4.0
    );
    // One gateway, two pickers: each stream goes to either, both route alike.
    let both = envoy(rig.layout("BUFFERED")).await;
    for _ in 0..8 {
        let a = send(&both, "/v1/completions", prompt()).await;
        assert_eq!((a.status, a.pod.as_str()), (200, "b"));
    }
    let first = rig
        .metric(0, "kvroute_picker_requests_total{outcome=\"routed\"}")
        .await;
    let second = rig
        .metric(1, "kvroute_picker_requests_total{outcome=\"routed\"}")
        .await;
    assert_eq!(first + second, 12.0, "{first} + {second}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unavailable_picker_fails_open() {
    let mut rig = rig(1).await;
    // Buffered, as shipped: in full-duplex mode the body is already the picker's, and
    // Envoy answers 500 when the picker goes away (docs/architecture.md).
    let gw = envoy(rig.layout("BUFFERED")).await;
    let a = send(&gw, "/v1/completions", prompt()).await;
    assert_eq!((a.status, a.pod.as_str()), (200, "b"));
    rig.sidecars[0].kill();
    let mut pods = std::collections::HashSet::new();
    for _ in 0..6 {
        let a = send(&gw, "/v1/completions", prompt()).await;
        assert_eq!(a.status, 200, "unsteered, not refused: {}", a.body);
        assert!(a.seen_steer.is_empty(), "nothing steered it");
        pods.insert(a.pod);
    }
    assert!(pods.len() >= 2, "Envoy balanced on its own: {pods:?}");
    // A picker that never existed: the same.
    let mut l = rig.layout("STREAMED");
    l.pickers = vec![SocketAddr::from(([127, 0, 0, 1], 1))];
    let gw = envoy(l).await;
    let a = send(&gw, "/v1/completions", prompt()).await;
    assert_eq!(a.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_bodies_and_frames_are_counted_and_harm_nothing() {
    let rig = rig(1).await;
    let gw = envoy(rig.layout("FULL_DUPLEX_STREAMED")).await;
    // Bodies the picker cannot route pass to an engine unharmed.
    let bad = [
        ("{not json".to_owned(), "bad_json"),
        (r#"{"model":"m"}"#.to_owned(), "no_prompt"),
        (r#"{"model":"m","prompt":""}"#.to_owned(), "empty_prompt"),
        // Over the picker's cap, streamed to it in many chunks.
        (
            format!(r#"{{"model":"m","prompt":"{}"}}"#, "x".repeat(3 << 19)),
            "body_too_large",
        ),
    ];
    for (body, label) in &bad {
        let a = send(&gw, "/v1/completions", body.clone()).await;
        assert_eq!(
            a.status,
            200,
            "{label}: {}",
            a.body.get(..300).unwrap_or(&a.body)
        );
        assert!(a.seen_steer.is_empty(), "{label}: not steered");
        let m = format!("kvroute_picker_requests_total{{outcome=\"{label}\"}}");
        assert_eq!(until_metric(&rig, 0, &m, 1.0).await, 1.0, "{label}");
    }
    // Garbage on the picker's port, then a gRPC stream with a message over its cap.
    let picker = rig.pickers()[0];
    {
        use tokio::io::AsyncWriteExt;
        let mut s = tokio::net::TcpStream::connect(picker)
            .await
            .expect("connect");
        let _ = s
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\xff\xff\xff\xff garbage")
            .await;
        let _ = s.write_all(&[0u8; 4096]).await;
    }
    oversized_message(picker).await;
    assert!(
        until_metric(
            &rig,
            0,
            "kvroute_picker_requests_total{outcome=\"stream_error\"}",
            1.0
        )
        .await
            >= 1.0
    );
    // Everything else is as it was.
    let a = send(&gw, "/v1/completions", prompt()).await;
    assert_eq!((a.status, a.pod.as_str()), (200, "b"));
    health(picker).await;
}

async fn oversized_message(picker: SocketAddr) {
    use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        processing_request::Request, HttpBody, ProcessingRequest,
    };
    let mut c = ExternalProcessorClient::connect(format!("http://{picker}"))
        .await
        .expect("grpc connect")
        .max_encoding_message_size(64 << 20);
    let big = ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: vec![b'x'; 40 << 20],
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    };
    let r = c.process(futures::stream::iter(vec![big])).await;
    if let Ok(resp) = r {
        let mut s = resp.into_inner();
        while let Ok(Some(_)) = s.message().await {}
    }
}

async fn health(picker: SocketAddr) {
    use tonic_health::pb::{
        health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest,
    };
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{picker}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("health connect");
    let mut c = HealthClient::new(channel);
    for service in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let r = c
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .expect("health answers")
            .into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32, "{service}");
    }
}

/// Four data-parallel ranks behind one engine address are four pods: the rank holding the
/// prompt is chosen, the data plane steers to the address (once in the list), and the
/// engine is told the rank, through the picker and through the wasm filter alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_parallel_ranks_are_pods_and_the_engine_is_told_which() {
    let engine = StubPod::start("dp").await.expect("stub pod");
    let other = StubPod::start("other").await.expect("stub pod");
    let sc = tokio::task::spawn_blocking(|| {
        SidecarProc::start(&["--picker-listen", "127.0.0.1:0"], true)
    })
    .await
    .expect("join")
    .expect("sidecar");
    let api = Api::new(sc.addr);
    let ranks: Vec<String> = (0..4).map(|r| format!("{}@{r}", engine.addr)).collect();
    for p in ranks.iter().chain([&other.addr.to_string()]) {
        let r = api.register(p, MODEL).await;
        assert!(r.status < 300, "register {p}: {}", r.json);
    }
    let chain = token_chain(MODEL, 16, &tokens());
    let r = api
        .events(&batch(&ranks[2], MODEL, "e1", 0, vec![stored(&chain)]))
        .await;
    assert!(r.status < 300, "events: {}", r.json);
    api.until_confirmed(MODEL, &chain, chain.len() as u64).await;

    let picker = envoy(PickerLayout {
        listen_port: 0,
        pickers: vec![sc.picker_addr().expect("picker")],
        engines: vec![engine.addr, other.addr],
        request_body_mode: "BUFFERED",
        response_body_mode: "STREAMED",
        subset: None,
        message_timeout_ms: 2000,
        access_log: false,
    })
    .await;
    let wasm = {
        let layout = kvroute_tests::envoy::EnvoyLayout {
            listen_port: 0,
            sidecar: kvroute_tests::envoy::SidecarAddr::Uds(sc.uds.clone().expect("uds")),
            engines: vec![engine.addr, other.addr],
            wasm_path: kvroute_tests::wasm_path(),
            filter_config: json!({"timeout_ms": 2000, "default_model": {"block_size": 16}}),
            with_filter: true,
            fallback: kvroute_tests::envoy::Fallback::RoundRobin,
            access_log: false,
        };
        tokio::task::spawn_blocking(move || Envoy::start(&layout))
            .await
            .expect("join")
            .expect("envoy")
    };
    for (door, gw) in [("picker", &picker), ("wasm", &wasm)] {
        for _ in 0..3 {
            let a = send(gw, "/v1/completions", prompt()).await;
            assert_eq!(
                (a.status, a.pod.as_str(), a.rank.as_str()),
                (200, "dp", "2"),
                "{door}: {}",
                a.body
            );
            let listed: Vec<&str> = a.seen_steer.split(',').collect();
            assert_eq!(listed[0], engine.addr.to_string(), "{door}");
            assert_eq!(
                listed
                    .iter()
                    .filter(|p| **p == engine.addr.to_string())
                    .count(),
                1,
                "{door}: an address once in the list: {listed:?}"
            );
        }
    }
    // The reports released the rank's decisions (the served address is the rank's).
    let released = api
        .metric_reaching("kvroute_report_decisions_total{outcome=\"released\"}", 6.0)
        .await;
    assert_eq!(released, 6.0);
    let pods = api.get("/v1/status").await.json;
    assert!(
        pods.to_string().contains(&ranks[2]),
        "the rank is a pod of its own on the status: {pods}"
    );
}
