//! The status page in a real headless Chromium (Debian's `chromium`, driven by
//! playwright-core from `tests/ui/status_page.mjs`) against a running stack: Envoy with
//! the filter, the sidecar, NATS and four simulated engines. The driver checks the page
//! against the sidecar's API, runs the prefix inspector on a prompt one pod holds, and
//! takes the screenshot (`target/status-page.png`; `KVROUTE_SCREENSHOT` to put it
//! elsewhere, e.g. docs/status-page.png).

use std::process::Command;
use std::time::Duration;

use kvroute_tests::stack::{Stack, StackOpts};
use serde_json::{json, Value};

async fn post(url: &str, body: &Value) -> String {
    kvroute_tests::client::post_openai(url, body).await.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_what_the_api_reports() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let driver = root.join("ui").join("status_page.mjs");
    assert!(
        root.join("ui/node_modules/playwright-core").exists(),
        "run `make ui-deps` first (installs chromium and playwright-core)"
    );
    // The model's own tokenizer and template (engines and sidecar), so chats are
    // routed from engine events and the inspector asks the sidecar for their tokens.
    let dir = kvroute_tests::fixture_model_dir("deepseek-tools").expect("model dir");
    let stack = Stack::start(StackOpts {
        engine_args: kvroute_tests::stack::engine_args(1536, 8000, 10, 0.5),
        model_dir: Some(dir),
        ..StackOpts::default()
    })
    .await
    .expect("stack");

    // Traffic: chats (routed by prediction) and token prompts with shared prefixes
    // (routed from engine events, so their reports are judged for agreement).
    let chat = stack.envoy.url("/v1/chat/completions");
    let mut chat_pods = Vec::new();
    for i in 0..8 {
        // Four users, two chats each: the second is a session's later turn.
        let body = json!({"model": "m", "max_tokens": 2, "user": format!("user-{}", i % 4), "messages": [
            {"role": "system", "content": format!("You are assistant {}. {}", i % 2, "Be brief. ".repeat(40))},
            {"role": "user", "content": format!("question {i}")}]});
        chat_pods.push(post(&chat, &body).await);
    }
    // A chat nobody else sent: one pod holds its tokens' blocks.
    let lone = json!({"model": "m", "messages": [
        {"role": "system", "content": "You only ever discuss lighthouses. ".repeat(30)},
        {"role": "user", "content": "Which lighthouse is the oldest?"}]});
    let lone_pod = post(
        &chat,
        &json!({"model": "m", "max_tokens": 2, "messages": lone["messages"]}),
    )
    .await;
    let toks = stack
        .api
        .post(
            "/v1/tokenize",
            &json!({"model": "m", "path": "/v1/chat/completions", "body": lone}),
        )
        .await
        .json;
    let ids: Vec<u32> = toks["tokens"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| t.as_u64())
                .map(|t| t as u32)
                .collect()
        })
        .unwrap_or_default();
    let lone_chain = kvroute_tests::client::token_chain("m", 16, &ids);
    assert!(lone_chain.len() > 10, "{toks}");
    let comp = stack.envoy.url("/v1/completions");
    let shared: Vec<u32> = (0..320).map(|i| (i * 7919) % 50_000).collect();
    for i in 0..10u32 {
        let mut p = shared.clone();
        p.extend((0..40).map(|j| 60_000 + i * 100 + j));
        post(&comp, &json!({"model": "m", "prompt": p, "max_tokens": 2})).await;
    }
    // The inspector's prompt: 256 tokens nobody else sent, so one pod holds it.
    let unique: Vec<u32> = (0..256).map(|i| 90_000 + i * 3).collect();
    let holder = post(
        &comp,
        &json!({"model": "m", "prompt": unique, "max_tokens": 2}),
    )
    .await;
    let chain = kvroute_tests::client::token_chain("m", 16, &unique);
    let confirmed = stack
        .api
        .until_confirmed("m", &chain, chain.len() as u64)
        .await;
    assert_eq!(
        confirmed,
        json!([{"pod": holder, "matched_blocks": chain.len(),
                "tiers": {"gpu": chain.len(), "cpu": 0, "disk": 0, "remote": 0}}]),
        "exactly one pod holds the inspector's prompt"
    );
    // Let reports land, so the counters are still when the page reads them.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let shot = std::env::var("KVROUTE_SCREENSHOT").unwrap_or_else(|_| {
        root.join("../target/status-page.png")
            .to_string_lossy()
            .into_owned()
    });
    let lq = lone_chain
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let lone_depth = stack
        .api
        .get(&format!("/v1/lookup?model=m&chain={lq}"))
        .await
        .json["confirmed"][0]["matched_blocks"]
        .as_u64()
        .unwrap_or(0);
    assert_eq!(
        lone_depth,
        lone_chain.len() as u64,
        "the engine stored the lone chat"
    );
    let expect = json!({"inspect": [{
        "path": "/v1/completions", "model": "",
        "body": json!({"model": "m", "prompt": unique}).to_string(),
        "pod": holder, "depth": chain.len(),
    }, {
        "path": "/v1/chat/completions", "model": "", "tokenized": true,
        "body": lone.to_string(), "pod": lone_pod, "depth": lone_depth,
    }]});
    let out = tokio::task::spawn_blocking(move || {
        Command::new("node")
            .arg(&driver)
            .env("KVROUTE_URL", format!("http://{}", stack.sidecar.addr))
            .env("KVROUTE_EXPECT", expect.to_string())
            .env("KVROUTE_SCREENSHOT", &shot)
            .output()
            .map(|o| (o, stack))
    })
    .await
    .expect("join")
    .expect("run node");
    let (out, stack) = out;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        eprintln!("SIDECAR LOG\n{}", stack.sidecar.log());
    }
    assert!(
        out.status.success(),
        "browser test failed:\n{stdout}\n{stderr}"
    );
    let summary: Value = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or(Value::Null);
    println!("status page: {summary}");
    let bytes = summary["page_bytes"].as_u64().unwrap_or(u64::MAX);
    assert!(
        bytes < 1 << 20,
        "the page weighs {bytes} bytes (target < 1 MB)"
    );
    assert_eq!(summary["inspector"][0]["pod"], json!(holder));
    assert_eq!(summary["inspector"][1]["pod"], json!(lone_pod));
    let _ = chat_pods;
}
