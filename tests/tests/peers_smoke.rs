//! The comparison harness does not rot: every peer router `kvroute-bench peers` runs
//! (SGLang's `smg`, vLLM's `vllm-router`, as `make peers-deps` installs them) starts once
//! over two engine simulators publishing vLLM's KV events, routes requests to them, and
//! sends a repeated prompt where its cache is — which for `kv_aware` means it decoded
//! the simulator's events and used its render API.

use kvroute_tests::peers::{Kind, Peer, Worker};
use kvroute_tests::procs::free_port;
use kvroute_tests::stack::EngineProc;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_peer_routes_through_the_engine_simulators() {
    let mut engines = Vec::new();
    let mut workers = Vec::new();
    for seed in 1..=2 {
        let zmq = format!("tcp://127.0.0.1:{}", free_port());
        let args: Vec<String> = ["--seed", &seed.to_string(), "--zmq-events", &zmq]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let e = EngineProc::start(&args).expect("engine sim");
        workers.push(Worker {
            http: e.addr,
            zmq: Some(zmq),
        });
        engines.push(e);
    }
    let pods: Vec<String> = workers.iter().map(|w| w.http.to_string()).collect();
    let http = reqwest::Client::new();
    let dir = tempfile::tempdir().expect("tempdir");
    for kind in Kind::ALL {
        let log = dir
            .path()
            .join(format!("{}.log", kind.label().replace(' ', "-")));
        let peer = Peer::start(kind, &workers, 16, &log)
            .await
            .unwrap_or_else(|e| panic!("{}: {e:#}", kind.label()));
        // A prompt of its own per peer (the engines' caches outlive each peer), long
        // enough for several 16-token blocks.
        let prompt = format!(
            "{} asks: {}",
            kind.label(),
            "which pod holds the prefix of this prompt? ".repeat(12)
        );
        let mut cached = Vec::new();
        let mut served_by = Vec::new();
        for _ in 0..3 {
            let r = http
                .post(format!("{}/v1/completions", peer.url))
                .json(&json!({"model": "m", "prompt": prompt, "max_tokens": 2}))
                .send()
                .await
                .expect("request through the peer");
            assert!(r.status().is_success(), "{}: {}", kind.label(), r.status());
            let pod = r
                .headers()
                .get("x-pod")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            let v: Value = r.json().await.expect("json");
            assert!(pods.contains(&pod), "{}: served by {pod:?}", kind.label());
            served_by.push(pod);
            cached.push(
                v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0),
            );
            // kv_aware learns the first request's blocks from the engine's events.
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        }
        assert_eq!(cached[0], 0, "{}: a fresh prompt was cached", kind.label());
        assert!(
            cached[1] > 0 && cached[2] > 0,
            "{}: the repeated prompt missed the cache (cached tokens {cached:?}, pods {served_by:?}; log {})",
            kind.label(),
            log.display()
        );
    }
}
