//! Precise chat routing end to end: the real OpenAI Python client streams multi-turn
//! chats through Envoy and the filter (`sidecar_tokenizes` for model "m"), the sidecar
//! tokenizes them with the model's directory (`--tokenizer`), and simulated engines
//! tokenize with the same directory and publish vLLM's ZMQ events, translated by a
//! bridge each. Every later turn must land on the pod holding its history **from the
//! engines' events** (token-mode decisions with matched blocks; the engine reports the
//! cached tokens), and an engine restart must drop its blocks from the index at once.
//! With a sidecar template that renders differently from the engines', the agreement
//! check must name that template as the one that disagrees.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use kvroute_shared::protocol::PromptBody;
use kvroute_tests::stack::{Stack, StackOpts};
use serde_json::{json, Value};

/// The stack of these tests: engines tokenizing with the DeepSeek fixture directory, the
/// sidecar with it too (plus `sidecar_args`).
async fn stack(sidecar_args: Vec<String>) -> Stack {
    let dir = kvroute_tests::fixture_model_dir("deepseek-tools").expect("model dir");
    Stack::start(StackOpts {
        engine_args: kvroute_tests::stack::engine_args(4096, 8000, 10, 0.2),
        vllm_events: true,
        model_dir: Some(dir),
        sidecar_args,
        ..StackOpts::default()
    })
    .await
    .expect("stack")
}

/// 4 conversations x 4 turns through the gateway with the real OpenAI client: a JSON
/// object per turn (`e2e/openai_chats.py`).
async fn chats(stack: &Stack) -> Vec<Value> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("e2e/openai_chats.py");
    let url = stack.envoy.url("");
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .arg(script)
            .args([url.as_str(), "4", "4"])
            .output()
    })
    .await
    .expect("join")
    .expect("python3");
    assert!(
        out.status.success(),
        "openai client (make tokenizer-deps installs it): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let turns: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert_eq!(turns.len(), 16, "{turns:?}");
    turns
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chats_follow_the_engines_events() {
    let stack = stack(vec![]).await;
    let turns = chats(&stack).await;
    for t in &turns {
        if t["turn"] == 0 {
            continue;
        }
        let first = turns
            .iter()
            .find(|x| x["conv"] == t["conv"] && x["turn"] == 0)
            .expect("turn 0");
        assert_eq!(
            t["pod"], first["pod"],
            "a later turn stays with its history: {t}"
        );
        let (cached, prompt) = (
            t["cached_tokens"].as_u64().unwrap_or(0),
            t["prompt_tokens"].as_u64().unwrap_or(0),
        );
        assert!(
            cached * 10 >= prompt * 7,
            "the engine served the history from its cache: {t}"
        );
    }
    // Every request was tokenized by the sidecar, and later turns were decided from
    // engine events: token mode, the chosen pod's matched blocks > 0.
    let metrics = stack.api.metrics_text().await;
    assert!(
        metrics.contains("kvroute_precise_prompts_total{outcome=\"tokens\"} 16"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("precise"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // Later turns reuse the pieces earlier ones encoded, and a long completions prompt
    // (and its extension) is encoded in chunks, the first checked against the whole: all
    // of it visible to Prometheus per model.
    let mut text = String::new();
    for i in 0..60 {
        text.push_str(&format!(
            "Line {i} of a long prompt about caches and routers.\n"
        ));
    }
    for prompt in [text.clone(), format!("{text}And one more line.\n")] {
        let body = PromptBody::extract(
            kvroute_shared::protocol::PromptApi::Completions,
            "",
            json!({ "prompt": prompt }).to_string().as_bytes(),
        )
        .expect("fields");
        let dry = json!({"model": "m", "mode": "text", "block_size": 256, "chain": [],
                         "dry_run": true, "prompt_body": body});
        stack.api.post("/v1/route", &dry).await;
    }
    let metrics = stack.api.metrics_text().await;
    let value = |series: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in:\n{metrics}"))
    };
    assert!(value("kvroute_tokenizer_segment_lookups_total{model=\"m\",outcome=\"hit\"}") > 0);
    assert!(value("kvroute_tokenizer_segment_cache_bytes{model=\"m\"}") > 0);
    assert_eq!(value("kvroute_tokenizer_prompt_chunking{model=\"m\"}"), 1);
    assert_eq!(
        value("kvroute_tokenizer_prompt_chunks_total{model=\"m\",outcome=\"chunked\"}"),
        2
    );
    assert_eq!(
        value("kvroute_tokenizer_prompt_chunks_total{model=\"m\",outcome=\"verified\"}"),
        1
    );
    assert_eq!(
        value("kvroute_tokenizer_prompt_chunks_total{model=\"m\",outcome=\"mismatch\"}"),
        0
    );
    let decisions = stack.api.get("/v1/decisions?limit=16").await.json;
    let list = decisions["decisions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(list.len(), 16);
    let from_events = list
        .iter()
        .filter(|d| {
            d["mode"] == "tokens"
                && d["candidates"][0]["pod"] == d["pod"]
                && d["candidates"][0]["matched_blocks"].as_u64().unwrap_or(0) > 10
        })
        .count();
    assert_eq!(
        from_events, 12,
        "every later turn matched its history: {decisions}"
    );
    // Agreement: the index's expectation and the engines' cached_tokens agree.
    let st = stack.api.get("/v1/status").await.json;
    assert_eq!(
        st["agreement"][0]["over"], 0,
        "no decision expected more than the engine had: {}",
        st["agreement"]
    );
    // The agreement names the chat template the sidecar rendered with (where it came
    // from and its sha256), in the API and the metric, as the model's tokenizer shows it.
    let template = st["agreement"][0]["template"].as_str().unwrap_or_default();
    let digits = template
        .strip_prefix("tokenizer_config.json sha256:")
        .unwrap_or_default();
    assert!(
        digits.len() == 16 && digits.chars().all(|c| c.is_ascii_hexdigit()),
        "{}",
        st["agreement"]
    );
    let model = st["models"]
        .as_array()
        .and_then(|ms| ms.iter().find(|m| m["model"] == "m"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(model["tokenizer"]["template"], template, "{model}");
    let series = format!(
        "kvroute_cache_agreement_total{{model=\"m\",template=\"{template}\",outcome=\"agree\"}}"
    );
    assert!(stack.api.metric(&series).await > 0.0, "{series}");

    // An engine restart: its blocks leave the index at once (new epoch via the bridge).
    let pod = turns[0]["pod"].as_str().unwrap_or_default().to_string();
    let history = json!({"messages": [
        {"role": "system", "content": format!("Conversation 0. {}", "You answer about caches, routers and 東京. ".repeat(30))},
        {"role": "user", "content": "Question 0 of conversation 0: why do prefixes matter? 🙂"}]});
    let body = PromptBody::extract(
        kvroute_shared::protocol::PromptApi::Chat,
        "",
        history.to_string().as_bytes(),
    )
    .expect("fields");
    let dry = json!({"model": "m", "mode": "text", "block_size": 256, "chain": [],
                     "dry_run": true, "prompt_body": body});
    let matched_on = |v: &Value| {
        v["ranked"]
            .as_array()
            .and_then(|r| r.iter().find(|x| x["pod"] == pod.as_str()))
            .and_then(|x| x["matched_blocks"].as_u64())
            .unwrap_or(0)
    };
    let before = stack.api.post("/v1/route", &dry).await.json;
    assert!(matched_on(&before) > 10, "{before}");
    reqwest::Client::new()
        .post(format!("http://{pod}/admin/restart"))
        .send()
        .await
        .expect("restart");
    let mut gone = false;
    for _ in 0..100 {
        if matched_on(&stack.api.post("/v1/route", &dry).await.json) == 0 {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(gone, "the restarted engine's blocks left the index");
}

/// The same chats with the sidecar rendering a template that differs from the engines'
/// by one space after each user marker (an operator's edited copy, say): every prompt
/// past the system message chains differently from the engines' blocks, which is silent
/// in routing. The agreement check must show it, naming the template the sidecar used
/// (the override file and its sha256) in the API and the metric: the engines report the
/// histories cached where the sidecar expected only the system prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_that_differs_from_the_engines_shows_in_the_agreement() {
    let dir = kvroute_tests::fixture_model_dir("deepseek-tools").expect("model dir");
    let config: Value = serde_json::from_slice(
        &std::fs::read(dir.join("tokenizer_config.json")).expect("tokenizer_config.json"),
    )
    .expect("json");
    let template = config["chat_template"].as_str().expect("template");
    let edited = template.replace("'<｜User｜>' +", "'<｜User｜> ' +");
    assert_ne!(
        edited, template,
        "the user marker is where the template says"
    );
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("edited.jinja");
    std::fs::write(&file, &edited).expect("write");
    let stack = stack(vec![format!("--chat-template=m={}", file.display())]).await;
    chats(&stack).await;
    let st = stack.api.get("/v1/status").await.json;
    let a = st["agreement"]
        .as_array()
        .and_then(|v| v.iter().find(|m| m["model"] == "m"))
        .cloned()
        .unwrap_or_default();
    let named = a["template"].as_str().unwrap_or_default().to_owned();
    assert!(
        named.contains("edited.jinja sha256:"),
        "the override is named: {a}"
    );
    // Turn 0 of each chat agrees (nothing cached, nothing expected); most later turns
    // find their histories cached beyond what the sidecar's chains matched (8 of 12).
    assert!(a["under"].as_u64().unwrap_or(0) >= 6, "{a}");
    assert!(a["recent_ratio"].as_f64().unwrap_or(1.0) < 0.8, "{a}");
    let series = format!(
        "kvroute_cache_agreement_total{{model=\"m\",template=\"{named}\",outcome=\"under\"}}"
    );
    assert!(stack.api.metric(&series).await >= 6.0, "{series}");
}
