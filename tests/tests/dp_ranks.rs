//! Data-parallel ranks end to end: one engine simulator running four ranks behind one
//! port (each its own cache and event stream, pod `ip:port@rank`), a real sidecar and a
//! real Envoy in front through either front door. Multi-turn conversations must keep
//! landing on the rank that holds them, told to the engine in `x-data-parallel-rank`,
//! cache as much as the same conversations over four separate engines, and at least 1.5x
//! what the engine balancing its own ranks caches.

use std::collections::HashMap;

use kvroute_tests::envoy::{Envoy, EnvoyLayout, Fallback, PickerLayout, SidecarAddr};
use kvroute_tests::services::SidecarProc;
use kvroute_tests::stack::{engine_args, EngineProc};
use serde_json::json;

const MODEL: &str = "m";
/// Time between a turn's answer and the next turn.
const THINK: std::time::Duration = std::time::Duration::from_millis(150);

/// The share of later turns' prompt tokens that [`conversations`] of 5 turns can find
/// cached: turn t (1-4) sends 256 + 64t tokens, of which 256 + 64(t-1) were sent before.
const CEILING: f64 = (256.0 + 320.0 + 384.0 + 448.0) / (320.0 + 384.0 + 448.0 + 512.0);

/// `n` conversations of `turns` turns (distinct per `seed`), each turn the previous
/// prompt plus 64 new tokens, the conversations of a turn sent at once (so ranks are
/// busy and an engine left to itself spreads them): the engine-reported share of turns
/// 2..'s prompt tokens served from cache, how often a conversation changed rank, and the
/// pods that served. Between turns each conversation thinks for [`THINK`], as an agent
/// runs its tool: the engine's KV events of a turn reach the sidecar before the next
/// turn routes, as they do in front of a real engine whose answers take longer than a
/// loopback hop (this engine's eight tokens take a fraction of a millisecond).
async fn conversations(url: &str, seed: u32, n: usize, turns: usize) -> (f64, usize, Vec<String>) {
    let http = reqwest::Client::new();
    let mut prompts: Vec<Vec<u32>> = (0..n)
        .map(|c| {
            (0..256u32)
                .map(|i| 1_000_000 * seed + 10_000 * (c as u32 + 1) + i)
                .collect()
        })
        .collect();
    let (mut cached, mut total) = (0u64, 0u64);
    let mut homes: HashMap<usize, String> = HashMap::new();
    let mut moved = 0;
    let mut served = Vec::new();
    for t in 0..turns {
        if t > 0 {
            tokio::time::sleep(THINK).await;
        }
        let mut calls = Vec::new();
        for (c, p) in prompts.iter_mut().enumerate() {
            if t > 0 {
                p.extend(
                    (0..64u32)
                        .map(|i| 900_000_000 + seed * 100_000 + (c * 1000 + t * 64) as u32 + i),
                );
            }
            let body = json!({"model": MODEL, "prompt": p, "max_tokens": 8});
            let (http, url) = (http.clone(), url.to_owned());
            calls.push(tokio::spawn(async move {
                let r = http.post(url).json(&body).send().await.expect("request");
                assert!(r.status().is_success(), "{}", r.status());
                let pod = r
                    .headers()
                    .get("x-pod")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned();
                let v: serde_json::Value = r.json().await.expect("json");
                (pod, v)
            }));
        }
        for (c, call) in calls.into_iter().enumerate() {
            let (pod, v) = call.await.expect("join");
            if t > 0 {
                cached += v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0);
                total += v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
                if homes.get(&c) != Some(&pod) {
                    moved += 1;
                }
            }
            homes.insert(c, pod.clone());
            served.push(pod);
        }
    }
    (cached as f64 / total.max(1) as f64, moved, served)
}

/// Envoy with the wasm filter in front of `engines`, calling `sc` over its socket.
fn filter_layout(sc: &SidecarProc, engines: Vec<std::net::SocketAddr>) -> EnvoyLayout {
    EnvoyLayout {
        listen_port: 0,
        sidecar: SidecarAddr::Uds(sc.uds.clone().expect("uds")),
        engines,
        wasm_path: kvroute_tests::wasm_path(),
        filter_config: json!({"timeout_ms": 2000, "default_model": {"block_size": 16}}),
        with_filter: true,
        fallback: Fallback::RoundRobin,
        access_log: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_stay_on_their_rank_through_both_front_doors() {
    let sc = tokio::task::spawn_blocking(|| {
        SidecarProc::start(&["--picker-listen", "127.0.0.1:0"], true)
    })
    .await
    .expect("join")
    .expect("sidecar");
    let mut args = engine_args(4096, 200_000, 1, 0.05);
    args.extend(
        [
            "--dp-ranks",
            "4",
            "--model",
            MODEL,
            "--sidecar",
            &format!("http://{}", sc.addr),
        ]
        .map(String::from),
    );
    let engine = tokio::task::spawn_blocking(move || EngineProc::start(&args))
        .await
        .expect("join")
        .expect("engine");
    let picker = sc.picker_addr().expect("picker");
    let wasm_layout = filter_layout(&sc, vec![engine.addr]);
    let picker_layout = PickerLayout {
        listen_port: 0,
        pickers: vec![picker],
        engines: vec![engine.addr],
        request_body_mode: "BUFFERED",
        response_body_mode: "STREAMED",
        subset: None,
        message_timeout_ms: 2000,
        access_log: false,
    };
    let wasm = tokio::task::spawn_blocking(move || Envoy::start(&wasm_layout))
        .await
        .expect("join")
        .expect("envoy");
    let via_picker = tokio::task::spawn_blocking(move || Envoy::start_picker(&picker_layout))
        .await
        .expect("join")
        .expect("envoy");
    let direct = format!("http://{}/v1/completions", engine.addr);
    // The engine balancing its own ranks, as without kvroute's ranks: the baseline.
    // Its spread depends on how arrivals interleave, so two runs are averaged.
    let (blind_a, _, _) = conversations(&direct, 1, 8, 5).await;
    let (blind_b, _, _) = conversations(&direct, 4, 8, 5).await;
    let blind = (blind_a + blind_b) / 2.0;
    let mut through_ranks = HashMap::new();
    for (seed, door, gw) in [(2, "wasm", &wasm), (3, "picker", &via_picker)] {
        let (hit, moved, ranks) = conversations(&gw.url("/v1/completions"), seed, 8, 5).await;
        through_ranks.insert(seed, hit);
        let distinct: std::collections::HashSet<&String> = ranks.iter().collect();
        eprintln!(
            "{door}: cached share {hit:.3} (engine balancing ranks: {blind:.3}), {moved} moves, ranks used {}",
            distinct.len()
        );
        assert!(hit >= 0.7, "{door}: later turns cached {hit:.3}");
        assert!(
            moved <= 2,
            "{door}: conversations kept their rank ({moved} moves)"
        );
        assert!(
            distinct.len() >= 2,
            "{door}: new conversations spread: {distinct:?}"
        );
        assert!(
            distinct
                .iter()
                .all(|p| p.starts_with(&format!("{}@", engine.addr))),
            "{door}: served by ranks: {distinct:?}"
        );
        // Every later turn finds all of its conversation's earlier turns: the ceiling.
        assert!(
            hit >= CEILING - 0.01,
            "{door}: later turns cached {hit:.3}, ceiling {CEILING:.3}"
        );
        // How far the engine's own balancing falls short depends on how arrivals happen
        // to interleave (0.33-0.46 on a quiet machine, 0.58 once beside a build), so the
        // margin asked of the ranks is absolute, not a ratio.
        assert!(
            hit >= blind + 0.1,
            "{door}: {hit:.3} vs engine-balanced {blind:.3}"
        );
    }
    drop((wasm, via_picker, engine));

    // The same conversations over four separate engines (one rank each) behind their own
    // sidecar and Envoy: ranks as pods must cache as much as pods do.
    let sc = tokio::task::spawn_blocking(|| SidecarProc::start(&[], true))
        .await
        .expect("join")
        .expect("sidecar");
    let mut engines = Vec::new();
    for _ in 0..4 {
        let mut args = engine_args(4096, 200_000, 1, 0.05);
        args.extend(
            [
                "--model",
                MODEL,
                "--sidecar",
                &format!("http://{}", sc.addr),
            ]
            .map(String::from),
        );
        engines.push(
            tokio::task::spawn_blocking(move || EngineProc::start(&args))
                .await
                .expect("join")
                .expect("engine"),
        );
    }
    let layout = filter_layout(&sc, engines.iter().map(|e| e.addr).collect());
    let pods = tokio::task::spawn_blocking(move || Envoy::start(&layout))
        .await
        .expect("join")
        .expect("envoy");
    let (hit, moved, served) = conversations(&pods.url("/v1/completions"), 2, 8, 5).await;
    let ranks = through_ranks[&2];
    eprintln!(
        "four separate pods: cached share {hit:.3} ({moved} moves; ranks as pods {ranks:.3})"
    );
    assert!(
        served.iter().all(|p| !p.contains('@')),
        "separate pods serve as themselves: {served:?}"
    );
    assert!(
        (hit - ranks).abs() <= 0.02,
        "ranks as pods {ranks:.3} vs four separate pods {hit:.3}"
    );
}
