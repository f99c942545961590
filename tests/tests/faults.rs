//! Fault scenarios on the real stack, each with a pass criterion and a printed figure.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_tests::client::Api;
use kvroute_tests::stack::{Stack, StackOpts};
use parking_lot::Mutex;
use serde_json::json;

fn engine_args() -> Vec<String> {
    [
        "--capacity-blocks",
        "2048",
        "--prefill-tps",
        "20000",
        "--decode-ms",
        "2",
        "--max-batch",
        "8",
        "--time-scale",
        "0.5",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[derive(Default)]
struct Log {
    /// (seconds since start, status, steered by kvroute, cached tokens)
    rows: Vec<(f64, u16, bool, u64)>,
}

/// Kill the sidecar under load, restart it: no client request fails (fail-open), steering
/// resumes, and the hit rate recovers as the new sidecar rebuilds its index from events
/// and the engines' dumps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecar_killed_under_load_fails_open_and_recovers() {
    let opts = StackOpts {
        engine_args: engine_args(),
        filter_config: json!({"timeout_ms": 50, "default_model": {"block_size": 16}, "debug_headers": true}),
        ..StackOpts::default()
    };
    let mut stack = Stack::start(opts).await.expect("stack");
    let url = stack.envoy.url("/v1/completions");
    let docs: Arc<Vec<Vec<u32>>> = Arc::new(
        (0..8u32)
            .map(|d| (0..1024).map(|t| d * 100_000 + t).collect())
            .collect(),
    );
    let log = Arc::new(Mutex::new(Log::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut clients = Vec::new();
    for c in 0..4u32 {
        let (url, docs, log, stop, sent) = (
            url.clone(),
            docs.clone(),
            log.clone(),
            stop.clone(),
            sent.clone(),
        );
        clients.push(tokio::spawn(async move {
            let http = reqwest::Client::new();
            let mut i = c;
            while !stop.load(Ordering::Relaxed) {
                let mut p = docs[(i % 8) as usize].clone();
                p.extend([i, i + 1]);
                i += 4;
                sent.fetch_add(1, Ordering::Relaxed);
                let r = http
                    .post(&url)
                    .json(&json!({"model": "m", "prompt": p, "max_tokens": 2}))
                    .send()
                    .await;
                let row = match r {
                    Ok(r) => {
                        let status = r.status().as_u16();
                        let steered = r.headers().contains_key("x-kvroute-pod");
                        let v: serde_json::Value = r.json().await.unwrap_or_default();
                        (
                            t0.elapsed().as_secs_f64(),
                            status,
                            steered,
                            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                                .as_u64()
                                .unwrap_or(0),
                        )
                    }
                    Err(_) => (t0.elapsed().as_secs_f64(), 0, false, 0),
                };
                log.lock().rows.push(row);
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let kill_at = t0.elapsed().as_secs_f64();
    stack.sidecar.kill();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let restart_at = t0.elapsed().as_secs_f64();
    stack.sidecar.restart().expect("restart");
    stack.api = Api::new(stack.sidecar.addr);
    // A controller (or --pods) registers the pods again, with their dump URLs.
    for e in &stack.engines {
        stack
            .api
            .put(
                &format!("/v1/pods/{}", e.addr),
                json!({"model": "m", "dump_url": format!("http://{}/kvroute/dump", e.addr)}),
            )
            .await;
    }
    tokio::time::sleep(Duration::from_millis(3000)).await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.await;
    }
    let log = log.lock();
    let failed = log.rows.iter().filter(|r| r.1 != 200).count();
    let during = log
        .rows
        .iter()
        .filter(|r| r.0 > kill_at + 0.1 && r.0 < restart_at)
        .count();
    let steered_during = log
        .rows
        .iter()
        .filter(|r| r.0 > kill_at + 0.1 && r.0 < restart_at && r.2)
        .count();
    let first_steered = log
        .rows
        .iter()
        .filter(|r| r.0 > restart_at && r.2)
        .map(|r| r.0 - restart_at)
        .fold(f64::INFINITY, f64::min);
    let after: Vec<_> = log.rows.iter().filter(|r| r.0 > restart_at + 1.0).collect();
    let hit_after = after.iter().filter(|r| r.3 > 0).count() as f64 / after.len().max(1) as f64;
    println!(
        "sidecar kill: {} requests, {failed} failed; {during} served while it was down ({steered_during} steered); steering resumed {first_steered:.2}s after restart; {:.0}% of requests hit cache from 1s after restart",
        log.rows.len(),
        hit_after * 100.0
    );
    assert_eq!(failed, 0, "fail-open: no client request fails");
    assert!(during > 0 && steered_during == 0);
    assert!(
        first_steered < 3.0,
        "steering resumes within seconds: {first_steered}"
    );
    assert!(hit_after > 0.5, "cache hits recover: {hit_after}");
}

/// A pod removed while requests are being routed: no decision names it after phase 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_pod_is_never_chosen_after_phase_one() {
    let stack = Stack::start(StackOpts {
        engine_args: engine_args(),
        ..StackOpts::default()
    })
    .await
    .expect("stack");
    let victim = stack.engines[0].addr.to_string();
    let api = stack.api.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let removed = Arc::new(AtomicBool::new(false));
    let bad = Arc::new(AtomicU64::new(0));
    let n = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..3u64 {
        let (api, stop, removed, bad, n, victim) = (
            api.clone(),
            stop.clone(),
            removed.clone(),
            bad.clone(),
            n.clone(),
            victim.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut i = c;
            while !stop.load(Ordering::Relaxed) {
                let was_removed = removed.load(Ordering::SeqCst);
                let chain = kvroute_tests::client::chain("m", i as u32, 8, 16);
                let r = api
                    .post(
                        "/v1/route",
                        kvroute_tests::client::route_req("m", &chain, 16),
                    )
                    .await;
                if was_removed && r.json["pod"] == victim.as_str() {
                    bad.fetch_add(1, Ordering::Relaxed);
                }
                n.fetch_add(1, Ordering::Relaxed);
                i += 3;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(api.delete(&format!("/v1/pods/{victim}")).await.status, 204);
    removed.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.store(true, Ordering::Relaxed);
    let pods = api.get("/v1/pods").await.json;
    println!(
        "pods after removal: {}",
        pods["pods"]
            .as_array()
            .map(|a| a
                .iter()
                .map(|p| p["pod"].to_string())
                .collect::<Vec<_>>()
                .join(","))
            .unwrap_or_default()
    );
    println!(
        "victim {victim}; refused removed_pod: {}",
        api.metric("kvroute_event_batches_rejected_total{reason=\"removed_pod\"}")
            .await
    );
    for t in tasks {
        let _ = t.await;
    }
    println!(
        "pod removal under load: {} decisions, {} named the removed pod after phase 1",
        n.load(Ordering::Relaxed),
        bad.load(Ordering::Relaxed)
    );
    assert_eq!(bad.load(Ordering::Relaxed), 0);
}
