//! Coding agents' APIs end to end: the real Anthropic Python client (`messages.create`
//! and `messages.stream`, with tools, tool results, moving cache markers and Claude
//! Code's billing header) and the real OpenAI client's Responses API (`responses.create`,
//! streamed and not, every later turn naming `previous_response_id`) through Envoy and the
//! filter, to engine simulators that publish vLLM's events through bridges.
//!
//! Messages, and Responses sessions that resend their whole conversation (`store: false`,
//! as Codex does), are routed precisely (the sidecar converts them as vLLM does and
//! tokenizes with the model's directory, so decisions come from the engines' events);
//! Responses turns naming `previous_response_id` carry only their new input and reach the
//! pod that stored the conversation by its response binding. Then a second gateway replica continues the same sessions from
//! the bindings it heard over NATS, and a pod removed mid-session is left at once.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use kvroute_tests::stack::{Stack, StackOpts};
use serde_json::Value;

fn run(
    url: &str,
    sessions: usize,
    turns: usize,
    phase: &str,
    apis: &str,
    state: &str,
) -> Vec<Value> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("e2e/agent_sessions.py");
    let out = Command::new("python3")
        .arg(script)
        .args([url, &sessions.to_string(), &turns.to_string(), phase])
        .env("KVROUTE_APIS", apis)
        .env("KVROUTE_RESP_STATE", state)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "anthropic/openai clients (make tokenizer-deps installs them): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The pod of each (api, session), asserting every turn was on it and, after the
/// first, served mostly from the engine's cache.
fn pods_per_session(turns: &[Value], first_is_cold: bool) -> Vec<(String, u64, String)> {
    let mut out: Vec<(String, u64, String)> = Vec::new();
    for t in turns {
        let key = (
            t["api"].as_str().unwrap_or_default().to_string(),
            t["session"].as_u64().unwrap_or(0),
        );
        let pod = t["pod"].as_str().unwrap_or_default().to_string();
        match out.iter().find(|(a, s, _)| (a, s) == (&key.0, &key.1)) {
            Some((_, _, p)) => assert_eq!(*p, pod, "a later turn stays on its session's pod: {t}"),
            None => out.push((key.0, key.1, pod)),
        }
        let (cached, prompt) = (
            t["cached_tokens"].as_u64().unwrap_or(0),
            t["prompt_tokens"].as_u64().unwrap_or(0),
        );
        if !(first_is_cold && t["turn"] == 0) {
            assert!(
                cached * 10 >= prompt * 7,
                "served from the engine's cache: {t}"
            );
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_sessions_stay_with_their_pods() {
    let dir = kvroute_tests::fixture_model_dir("deepseek-tools").expect("model dir");
    let stack = Stack::start(StackOpts {
        engine_args: kvroute_tests::stack::engine_args(4096, 8000, 10, 0.2),
        vllm_events: true,
        model_dir: Some(dir.clone()),
        ..StackOpts::default()
    })
    .await
    .expect("stack");
    let tmp = tempfile::tempdir().expect("tmp");
    let state = tmp.path().join("responses.json").display().to_string();
    let url = stack.envoy.url("");
    let (u, st) = (url.clone(), state.clone());
    let first = tokio::task::spawn_blocking(move || {
        run(&u, 3, 4, "a", "messages,responses,responses_full", &st)
    })
    .await
    .expect("join");
    assert_eq!(first.len(), 36, "{first:?}");
    let homes = pods_per_session(&first, true);
    assert_eq!(homes.len(), 9);
    assert!(
        homes
            .iter()
            .map(|h| &h.2)
            .collect::<std::collections::BTreeSet<_>>()
            .len()
            > 1,
        "sessions spread over pods: {homes:?}"
    );

    // Messages were tokenized by the sidecar and later turns decided from engine events.
    let metrics = reqwest::get(format!("http://{}/metrics", stack.sidecar.addr))
        .await
        .expect("metrics")
        .text()
        .await
        .unwrap_or_default();
    let precise = |outcome: &str| {
        metrics
            .lines()
            .find(|l| {
                l.starts_with(&format!(
                    "kvroute_precise_prompts_total{{outcome=\"{outcome}\"}}"
                ))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert_eq!(
        precise("tokens"),
        27.0,
        "every Messages turn, every stateless Responses turn and the first of each continued one in token mode"
    );
    assert_eq!(
        precise("continued_response"),
        9.0,
        "Responses turns continuing a stored response keep their text chain"
    );
    let decisions = stack.api.get("/v1/decisions?limit=36").await.json;
    let list = decisions["decisions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let from_events = list
        .iter()
        .filter(|d| {
            d["mode"] == "tokens"
                && d["candidates"][0]["pod"] == d["pod"]
                && d["candidates"][0]["matched_blocks"].as_u64().unwrap_or(0) > 10
        })
        .count();
    // Every later Messages and stateless Responses turn (18), and first turns that found
    // the shared system prompt.
    assert!(
        from_events >= 18,
        "later Messages and Responses turns matched their history: {decisions}"
    );
    let status = stack.api.get("/v1/status").await.json;
    // Sessions: Claude Code's header and the Responses sessions' prompt_cache_key (both
    // kinds); responses: every response id learned, stored or not.
    assert_eq!(status["bindings"]["session"], 9, "{}", status["bindings"]);
    assert_eq!(status["bindings"]["response"], 24, "{}", status["bindings"]);
    // Every session's first turn placed it, and every later turn found its binding's pod.
    let turns = &status["counters"]["session_turns"];
    assert_eq!(
        (
            &turns["new"],
            &turns["stayed"],
            turns["moved"].as_u64().unwrap_or(0)
        ),
        (&serde_json::json!(9), &serde_json::json!(27), 0),
        "{turns}"
    );
    // The engines stamp their event batches with the wall clock, as vLLM does: the lag
    // the sidecar reads off them is the events' trip, not the epoch.
    let lags: Vec<f64> = status["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["event_lag_s"].as_f64())
        .collect();
    assert!(
        !lags.is_empty() && lags.iter().all(|l| *l < 60.0),
        "event lags {lags:?}"
    );

    // A second gateway replica: its own sidecar (the same NATS) behind its own Envoy.
    let replica = stack.replica().await.expect("replica");
    let api2 = &replica.api;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Bindings made before it started are not replayed; the sessions' next turns on the
    // first gateway are heard by both.
    let (u, st) = (url.clone(), state.clone());
    let again = tokio::task::spawn_blocking(move || run(&u, 3, 1, "b", "responses", &st))
        .await
        .expect("join");
    assert_eq!(again.len(), 3);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let heard = api2.get("/v1/status").await.json;
    assert_eq!(
        heard["bindings"]["response"], 3,
        "replica 2 heard the responses' bindings: {} {}",
        heard["bindings"], heard["counters"]
    );
    let (u2, st) = (replica.envoy.url(""), state.clone());
    let second = tokio::task::spawn_blocking(move || run(&u2, 3, 3, "c", "responses", &st)).await;
    if second.is_err() {
        let d = api2.get("/v1/decisions?limit=6").await.json;
        panic!("a continued response missed its pod; replica 2 decided: {d}");
    }
    let second = second.expect("join");
    assert_eq!(
        second.len(),
        9,
        "every continued response found its pod: {second:?}"
    );
    for t in &second {
        let home = homes
            .iter()
            .find(|h| h.0 == "responses" && Some(h.1) == t["session"].as_u64())
            .expect("home");
        assert_eq!(
            t["pod"].as_str(),
            Some(home.2.as_str()),
            "replica 2 honours the binding: {t}"
        );
    }
    let st2 = api2.get("/v1/status").await.json;
    assert!(
        st2["bindings"]["response"].as_u64().unwrap_or(0) >= 3,
        "{}",
        st2["bindings"]
    );

    // A pod removed mid-session (its endpoint gone, deregistered on both replicas): the
    // session's next turn is served elsewhere at once and stays there.
    let gone = homes
        .iter()
        .find(|h| h.0 == "messages" && h.1 == 0)
        .map(|h| h.2.clone())
        .expect("session 0");
    for a in [&stack.api, api2] {
        let r = a.delete(&format!("/v1/pods/{gone}")).await;
        assert!(r.status / 100 == 2, "{}", r.json);
    }
    let (u, st) = (url.clone(), state.clone());
    let moved = tokio::task::spawn_blocking(move || run(&u, 1, 3, "d", "messages", &st))
        .await
        .expect("join");
    assert_eq!(moved.len(), 3);
    let new_home = pods_per_session(&moved, true);
    assert_ne!(new_home[0].2, gone, "rebound off the removed pod");
    let turns = stack.api.get("/v1/status").await.json["counters"]["session_turns"].clone();
    assert_eq!(
        turns["moved"], 1,
        "the first turn after the removal moved: {turns}"
    );
    drop(replica);
}
