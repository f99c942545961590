//! `kvroute-bench tokenize`: what precise chat routing costs, as ratios to the bare
//! `tokenizers` encode of the same text measured side by side (the library's own speed is
//! the floor; these machines differ 2–4× in absolute speed):
//! - a cold 4 KB single-turn chat: render + tokenize + chain + route, vs the bare encode
//!   of its text (target ≤ 1.2×);
//! - the 21st turn of a conversation with ~100 KB of history that adds ~1 KB, vs the bare
//!   encode of that 1 KB (target ≤ 1.5×) and vs re-encoding the whole conversation
//!   (target ≥ 20× faster);
//! - a Claude Code-shaped turn of ~100k tokens (tools, system prompt and history of the
//!   shipped sessions' median sizes) vs the bare encode of its ~2.5 KB of new text
//!   (target ≤ 1.5×), with the part that grows with the history split out;
//! - a cold ~128k-token prompt; memory held per loaded tokenizer and per cached MB
//!   (counted at the allocator);
//!   in-process route throughput with and without tokenization.
//!
//! The model directory defaults to the fidelity test's DeepSeek one (a production
//! byte-level BPE), created with `tests/tokenizer/make_fixtures.py` when missing.

use std::path::PathBuf;
use std::time::Instant;

use kvroute_shared::protocol::{PodRegistration, PolicyConfig, RouteRequest};
use kvroute_sidecar::route;
use kvroute_sidecar::Sidecar;
use kvroute_sidecar::{ModelTokenizer, Tokenizers};
use serde_json::{json, Value};

use super::{heap, Rng, Samples};

pub struct Opts {
    pub dir: Option<PathBuf>,
    pub iterations: usize,
}

fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn model_dir(o: &Opts) -> anyhow::Result<PathBuf> {
    match &o.dir {
        Some(d) => Ok(d.clone()),
        None => crate::fixture_model_dir("deepseek-tools"),
    }
}

/// Prose of about `bytes` bytes, distinct per `seed` (mixed English, code, CJK).
fn prose(rng: &mut Rng, bytes: usize) -> String {
    const WORDS: [&str; 24] = [
        "the",
        "router",
        "sends",
        "each",
        "request",
        "to",
        "pod",
        "that",
        "holds",
        "its",
        "longest",
        "cached",
        "prefix,",
        "weighing",
        "load.",
        "fn main() {}",
        "let x = 42;",
        "東京",
        "缓存",
        "前缀",
        "🙂",
        "latency",
        "prefill",
        "decode",
    ];
    let mut s = String::with_capacity(bytes + 16);
    while s.len() < bytes {
        s.push_str(WORDS[rng.below(WORDS.len())]);
        s.push(if rng.below(12) == 0 { '\n' } else { ' ' });
    }
    s
}

/// A Claude Code conversation of 20 turns (text, a tool use, its result each) with
/// tool definitions and a system prompt of the shipped sessions' median sizes.
fn claude_code_shaped(rng: &mut Rng) -> (Vec<Value>, Value, Value) {
    let mut turns: Vec<Value> = Vec::new();
    for k in 0..20 {
        turns.push(json!({"role": "user", "content": [{"type": "text", "text": prose(rng, 600)}]}));
        turns.push(json!({"role": "assistant", "content": [
            {"type": "text", "text": prose(rng, 800)},
            {"type": "tool_use", "id": format!("toolu_{k}"), "name": "Read",
             "input": {"file_path": format!("/repo/src/module_{k}.rs")}}]}));
        turns.push(json!({"role": "user", "content": [{"type": "tool_result",
            "tool_use_id": format!("toolu_{k}"), "content": prose(rng, 15_500)}]}));
    }
    let system = json!([
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=00000;"},
        {"type": "text", "text": prose(rng, 11_000), "cache_control": {"type": "ephemeral"}}]);
    let tools: Vec<Value> = (0..18)
        .map(|k| {
            json!({"name": format!("Tool{k}"), "description": prose(rng, 2_200),
                   "input_schema": {"type": "object", "required": ["path"], "properties": {
                       "path": {"type": "string", "description": prose(rng, 200)},
                       "limit": {"type": "integer", "description": prose(rng, 120)},
                       "mode": {"type": "string", "enum": ["a", "b", "c"]}}}})
        })
        .collect();
    (turns, system, Value::from(tools))
}

fn sidecar(t: ModelTokenizer) -> std::sync::Arc<Sidecar> {
    let (sc, ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    std::mem::forget(ch); // keep its channels open for the process's life
    let mut toks = Tokenizers::default();
    toks.insert("m", t);
    sc.set_tokenizers(toks);
    for p in 0..8 {
        let reg: PodRegistration = serde_json::from_value(json!({"model": "m"})).expect("reg");
        sc.register(&format!("10.0.0.{p}:8000"), reg)
            .expect("register");
    }
    sc
}

/// Route decisions per second for one second, cycling through `reqs`, on this thread.
fn routes_per_second(sc: &Sidecar, reqs: &[RouteRequest]) -> f64 {
    let t0 = Instant::now();
    let mut k = 0usize;
    while t0.elapsed().as_secs_f64() < 1.0 {
        let _ = route(sc, &reqs[k % reqs.len()]);
        k += 1;
    }
    k as f64 / t0.elapsed().as_secs_f64()
}

fn chat_req(body: &Value) -> RouteRequest {
    crate::client::chat_route_req("m", body)
}

/// A route call for a `/v1/messages` body, its template fields sent as the filter sends them.
fn messages_route_req(body: &Value) -> RouteRequest {
    RouteRequest {
        prompt_body: kvroute_shared::protocol::PromptBody::extract(
            kvroute_shared::protocol::PromptApi::Messages,
            "",
            body.to_string().as_bytes(),
        )
        .ok(),
        ..chat_req(&json!({"messages": []}))
    }
}

pub fn run(o: &Opts) -> anyhow::Result<Value> {
    let dir = model_dir(o)?;
    println!("kvroute-bench tokenize: {}", dir.display());
    // Memory is counted at the allocator (`heap`): bytes a loaded tokenizer holds, and
    // bytes the segment cache holds per MB it accounts for (text + ids + its fixed
    // per-entry charge), so the cap in `--tokenizer-cache-mb` can be checked against
    // what the process really keeps.
    let rss_before = rss_kb();
    let (t, tokenizer_bytes) = heap::held_by(|| ModelTokenizer::load(&dir, 512 << 20));
    let t = t?;
    // As `serve` does after loading: the parse buffers' pages go back to the system.
    kvroute_sidecar::release_free_memory();
    let tokenizer_rss_mb = rss_kb().saturating_sub(rss_before) as f64 / 1024.0;
    let tokenizer_mb = tokenizer_bytes as f64 / (1 << 20) as f64;
    // A second instance for the bare encodes, so its work never warms the routed one.
    let bare = ModelTokenizer::load(&dir, 0)?;
    let sc = sidecar(t);
    let toks = sc.tokenizers();
    let mt = toks.get("m").expect("tokenizer");
    let n = o.iterations.max(10);
    let mut rng = Rng(11);
    let bodies: Vec<RouteRequest> = (0..400)
        .map(|_| {
            chat_req(
                &json!({"messages": [{"role": "user", "content": prose(&mut rng, 32 * 1024)}]}),
            )
        })
        .collect();
    let s0 = mt.cache_stats();
    let ((), cache_bytes) = heap::held_by(|| {
        for req in &bodies {
            let _ = route(&sc, req);
        }
    });
    drop(bodies);
    let s1 = mt.cache_stats();
    let cached_mb = (s1.bytes - s0.bytes) as f64 / (1 << 20) as f64;
    let heap_per_cached_mb = cache_bytes as f64 / (1 << 20) as f64 / cached_mb.max(1e-9);
    println!(
        "  memory: a loaded tokenizer holds {tokenizer_mb:.1} MB of heap (the process grew {tokenizer_rss_mb:.1} MB); the segment cache holds {heap_per_cached_mb:.2} MB per MB it accounts ({cached_mb:.1} MB accounted, cap {} MB)",
        s1.cap_bytes >> 20
    );

    // 1. Cold 4 KB single-turn chats, each with new content.
    let (mut cold, mut bare4) = (Samples::default(), Samples::default());
    for _ in 0..n {
        let text = prose(&mut rng, 4096);
        let body = json!({"messages": [{"role": "user", "content": text}]});
        let req = chat_req(&body);
        let _ = bare4.time(|| bare.encode_whole(&text, false));
        let r = cold.time(|| route(&sc, &req));
        anyhow::ensure!(r.is_ok(), "route: {r:?}");
    }
    let (cold50, bare4_50) = (cold.pct(50.0), bare4.pct(50.0));
    println!(
        "  cold 4 KB chat: render+tokenize+chain+route p50 {:.0} us; bare encode of its text {:.0} us ({:.2}x)",
        cold50 as f64 / 1e3,
        bare4_50 as f64 / 1e3,
        cold50 as f64 / bare4_50.max(1) as f64
    );

    // 2. The 21st turn: 20 turns of ~5 KB (100 KB), then a new ~1 KB user message.
    let mut history = vec![json!({"role": "system", "content": prose(&mut rng, 2000)})];
    for _ in 0..20 {
        history.push(json!({"role": "user", "content": prose(&mut rng, 1000)}));
        history.push(json!({"role": "assistant", "content": prose(&mut rng, 4000)}));
    }
    let hist_bytes: usize = history
        .iter()
        .map(|m| m["content"].as_str().map_or(0, str::len))
        .sum();
    // The history was routed before (turn 20): its pieces are in the cache.
    route(&sc, &chat_req(&json!({"messages": history})))
        .map_err(|e| anyhow::anyhow!("route: {e}"))?;
    let (mut turn, mut bare1, mut whole, mut render) = (
        Samples::default(),
        Samples::default(),
        Samples::default(),
        Samples::default(),
    );
    for i in 0..n {
        let new = prose(&mut rng, 1024);
        let mut msgs = history.clone();
        msgs.push(json!({"role": "user", "content": new}));
        let body = json!({"messages": msgs});
        let req = chat_req(&body);
        let _ = bare1.time(|| bare.encode_whole(&new, false));
        let r = turn.time(|| route(&sc, &req));
        anyhow::ensure!(r.is_ok(), "route: {r:?}");
        // What is proportional to the whole conversation, not to what is new: parsing
        // the body and rendering the template over every message.
        if let Some(b) = &req.prompt_body {
            let _ = render.time(|| mt.render_chat_json(b.fields.get()));
        }
        if i < 20 {
            let text = mt.render_chat(&body)?;
            let _ = whole.time(|| bare.encode_whole(&text, false));
        }
    }
    let (turn50, bare1_50, whole50) = (turn.pct(50.0), bare1.pct(50.0), whole.pct(50.0));
    let render50 = render.pct(50.0);
    println!(
        "  21st turn ({} KB history + 1 KB): p50 {:.0} us; bare encode of the 1 KB {:.0} us ({:.2}x); re-encoding the conversation {:.0} us ({:.0}x slower)",
        hist_bytes / 1024,
        turn50 as f64 / 1e3,
        bare1_50 as f64 / 1e3,
        turn50 as f64 / bare1_50.max(1) as f64,
        whole50 as f64 / 1e3,
        whole50 as f64 / turn50.max(1) as f64
    );
    println!(
        "    of which parsing the body and rendering the template over all {} messages: {:.0} us ({:.2}x the bare encode; the part that grows with the history)",
        history.len() + 1,
        render50 as f64 / 1e3,
        render50 as f64 / bare1_50.max(1) as f64
    );

    // 2b. The same for a coding agent on the Messages API: system blocks (a billing
    // header, cache markers), 20 turns of text, tool uses and tool results, then 1 KB
    // new; converted as vLLM converts it, rendered, tokenized, chained, routed.
    let mut turns: Vec<Value> = Vec::new();
    for k in 0..20 {
        turns.push(
            json!({"role": "user", "content": [{"type": "text", "text": prose(&mut rng, 1000)}]}),
        );
        turns.push(json!({"role": "assistant", "content": [
            {"type": "text", "text": prose(&mut rng, 3000)},
            {"type": "tool_use", "id": format!("toolu_{k}"), "name": "read_file",
             "input": {"path": format!("src/file_{k}.rs")}}]}));
        turns.push(json!({"role": "user", "content": [{"type": "tool_result",
            "tool_use_id": format!("toolu_{k}"), "content": prose(&mut rng, 1000)}]}));
    }
    let system = json!([
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=00000;"},
        {"type": "text", "text": prose(&mut rng, 2000), "cache_control": {"type": "ephemeral"}}]);
    let tools = json!([{"name": "read_file", "description": "Read a file.",
                        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]);
    let messages_req = |msgs: &[Value]| {
        messages_route_req(
            &json!({"model": "m", "max_tokens": 1024, "system": system, "tools": tools, "messages": msgs}),
        )
    };
    route(&sc, &messages_req(&turns)).map_err(|e| anyhow::anyhow!("route: {e}"))?;
    let (mut mturn, mut mbare) = (Samples::default(), Samples::default());
    for _ in 0..n {
        let new = prose(&mut rng, 1024);
        let mut msgs = turns.clone();
        msgs.push(json!({"role": "user", "content": [{"type": "text", "text": new}]}));
        let req = messages_req(&msgs);
        let _ = mbare.time(|| bare.encode_whole(&new, false));
        let r = mturn.time(|| route(&sc, &req));
        anyhow::ensure!(r.is_ok(), "route: {r:?}");
    }
    let (mturn50, mbare50) = (mturn.pct(50.0), mbare.pct(50.0));
    let precise_tokens = sc.metrics.precise.get("tokens");
    anyhow::ensure!(precise_tokens > 0, "Messages bodies were not tokenized");
    println!(
        "  Messages API, 21st turn (~100 KB history: text, tool uses, tool results + 1 KB): p50 {:.0} us; bare encode of the 1 KB {:.0} us ({:.2}x)",
        mturn50 as f64 / 1e3,
        mbare50 as f64 / 1e3,
        mturn50 as f64 / mbare50.max(1) as f64
    );

    // 2c. The target's own shape: a Claude Code turn of ~100k tokens. Sized from the
    // shipped sessions (tests/data/agentic): tool definitions of ~12k tokens and a
    // system prompt of ~3k (their medians), a history of 20 turns whose tool results
    // carry the rest (~340 KB of text in 61 messages), and as new text the median that a
    // turn of a 50k+ token prompt adds to the one before (~625 tokens, ~2.5 KB). Split:
    // the same body routed a second time (its new text then cached too) is the part
    // that grows with the history.
    let (cc_turns, cc_system, cc_tools) = claude_code_shaped(&mut rng);
    let cc_req = |msgs: &[Value]| {
        messages_route_req(&json!({"model": "m", "max_tokens": 32000, "stream": true,
            "system": cc_system, "tools": cc_tools, "messages": msgs}))
    };
    // The history was routed before (the previous turn): its pieces are in the cache.
    let previous = cc_req(&cc_turns);
    let cc_bytes = previous
        .prompt_body
        .as_ref()
        .map_or(0, |b| b.fields.get().len());
    route(&sc, &previous).map_err(|e| anyhow::anyhow!("route: {e}"))?;
    let (mut cturn, mut cbare, mut chist) =
        (Samples::default(), Samples::default(), Samples::default());
    let mut cc_tokens = 0;
    for _ in 0..n {
        let new = prose(&mut rng, 2500);
        let mut msgs = cc_turns.clone();
        msgs.push(json!({"role": "user", "content": [{"type": "tool_result",
            "tool_use_id": "toolu_19", "content": &new}]}));
        let req = cc_req(&msgs);
        let _ = cbare.time(|| bare.encode_whole(&new, false));
        let r = cturn.time(|| route(&sc, &req));
        anyhow::ensure!(r.is_ok(), "route: {r:?}");
        let r = chist.time(|| route(&sc, &req));
        anyhow::ensure!(r.is_ok(), "route: {r:?}");
        if cc_tokens == 0 {
            cc_tokens = kvroute_sidecar::precise(&sc, &req)
                .ok_or_else(|| anyhow::anyhow!("the Claude Code-shaped body was not tokenized"))?
                .prompt_tokens;
        }
    }
    let (cturn50, cbare50, chist50) = (cturn.pct(50.0), cbare.pct(50.0), chist.pct(50.0));
    println!(
        "  Claude Code-shaped turn ({cc_tokens} tokens: {} KB body, {} messages, ~12k tokens of tools; 2.5 KB new): p50 {:.0} us; bare encode of the new text {:.0} us ({:.2}x); of which the history's part (the same body again) {:.0} us",
        cc_bytes / 1024,
        cc_turns.len() + 1,
        cturn50 as f64 / 1e3,
        cbare50 as f64 / 1e3,
        cturn50 as f64 / cbare50.max(1) as f64,
        chist50 as f64 / 1e3,
    );

    // 2d. A completions prompt that extends one routed before (an agent's next turn sent
    // as text): ~50 KB of history, 2.5 KB new. Cut into chunks at newlines, its text_history
    // comes from the cache; without chunking it is encoded whole.
    let mut text_history = String::new();
    while text_history.len() < 50 * 1024 {
        text_history.push_str(&prose(&mut rng, 700));
        text_history.push('\n');
    }
    let _ = mt.encode_prompt(&text_history)?;
    let (mut ptext, mut pwhole, mut pbare) =
        (Samples::default(), Samples::default(), Samples::default());
    for _ in 0..n {
        let new = prose(&mut rng, 2500);
        let prompt = format!("{text_history}{new}\n");
        let _ = pbare.time(|| bare.encode_whole(&new, false));
        let _ = pwhole.time(|| bare.encode_whole(&prompt, true));
        let r = ptext.time(|| mt.encode_prompt(&prompt));
        anyhow::ensure!(r.is_ok(), "encode: {r:?}");
    }
    let (ptext50, pwhole50, pbare50) = (ptext.pct(50.0), pwhole.pct(50.0), pbare.pct(50.0));
    let chunks = mt.chunk_stats();
    println!(
        "  completions prompt extending one seen ({} KB + 2.5 KB new): p50 {:.0} us ({}); whole {:.0} us; bare encode of the new text {:.0} us ({:.2}x)",
        text_history.len() / 1024,
        ptext50 as f64 / 1e3,
        chunks.as_ref().map_or("encoded whole: this tokenizer is not chunked".to_string(), |c| format!(
            "chunked; {} of {} checked against the whole, {} differed", c.verified, c.chunked, c.mismatches
        )),
        pwhole50 as f64 / 1e3,
        pbare50 as f64 / 1e3,
        ptext50 as f64 / pbare50.max(1) as f64,
    );

    // 3. A cold prompt of ~128k tokens (completions: encoded whole, special tokens added).
    let big = prose(&mut rng, 128 * 1024 * 4);
    let t0 = Instant::now();
    let ids = mt.encode(&big, true)?;
    let big_ms = t0.elapsed().as_secs_f64() * 1e3;
    println!("  cold {}-token prompt: {big_ms:.0} ms", ids.len());

    // 5. Route throughput, one thread: 21st-turn chat bodies vs token chains.
    let bodies: Vec<RouteRequest> = (0..50)
        .map(|_| {
            let mut msgs = history.clone();
            msgs.push(json!({"role": "user", "content": prose(&mut rng, 1024)}));
            chat_req(&json!({"messages": msgs}))
        })
        .collect();
    let precise_rps = routes_per_second(&sc, &bodies);
    let chains: Vec<RouteRequest> = bodies
        .iter()
        .map(|r| kvroute_sidecar::precise(&sc, r).expect("tokenized"))
        .collect();
    let chain_rps = routes_per_second(&sc, &chains);
    println!(
        "  route throughput (in-process, one thread): {precise_rps:.0}/s with tokenization of 21st turns, {chain_rps:.0}/s for their token chains"
    );
    // The flood's sidecar caches no pieces: an attacker's chats are all new text, and
    // the segment cache is bounded on its own (measured above).
    let flood = flood(&dir, &sidecar(ModelTokenizer::load(&dir, 0)?), &mut rng)?;
    Ok(json!({
        "flood": flood,
        "dir": dir, "iterations": n,
        "cold_4k_chat_p50_us": cold50 as f64 / 1e3, "bare_encode_4k_p50_us": bare4_50 as f64 / 1e3,
        "cold_4k_ratio": cold50 as f64 / bare4_50.max(1) as f64,
        "turn21_p50_us": turn50 as f64 / 1e3,
        "prompt_extended_p50_us": ptext50 as f64 / 1e3, "prompt_whole_p50_us": pwhole50 as f64 / 1e3,
        "prompt_new_bare_p50_us": pbare50 as f64 / 1e3, "bare_encode_1k_p50_us": bare1_50 as f64 / 1e3,
        "turn21_ratio": turn50 as f64 / bare1_50.max(1) as f64,
        "messages_turn21_p50_us": mturn50 as f64 / 1e3,
        "messages_turn21_ratio": mturn50 as f64 / mbare50.max(1) as f64,
        "claude_code_turn_tokens": cc_tokens,
        "claude_code_turn_p50_us": cturn50 as f64 / 1e3,
        "claude_code_turn_ratio": cturn50 as f64 / cbare50.max(1) as f64,
        "claude_code_turn_history_p50_us": chist50 as f64 / 1e3,
        "reencode_conversation_p50_us": whole50 as f64 / 1e3,
        "turn21_speedup_vs_reencode": whole50 as f64 / turn50.max(1) as f64,
        "turn21_parse_render_p50_us": render50 as f64 / 1e3,
        "history_kb": hist_bytes / 1024,
        "cold_128k_tokens": ids.len(), "cold_128k_ms": big_ms,
        "tokenizer_heap_mb": tokenizer_mb, "tokenizer_rss_mb": tokenizer_rss_mb,
        "heap_mb_per_cached_mb": heap_per_cached_mb,
        "precise_routes_per_s": precise_rps, "token_chain_routes_per_s": chain_rps,
    }))
}

/// A flood of maximum-size chats against the tokenizing budget, side by side: the peak
/// heap per tokenized byte (in process); then the release sidecar binary, started with
/// the model's tokenizer and no segment cache (an attacker's chats are all new text; the
/// cache is bounded on its own, above), takes 64 concurrent HTTP clients each sending
/// chats of the largest tokenized size for 3 s, beside one client of small token routes
/// — with the one-per-core limiter's settings on a 16-core node (16 x 2 MiB in flight),
/// the default budget on that node, and the defaults on this one. Printed: the process's RSS growth to its peak
/// (VmHWM), how many chats were tokenized or routed by text, and the small routes'
/// latency against the filter's 25 ms timeout.
fn flood(
    dir: &std::path::Path,
    sc: &std::sync::Arc<Sidecar>,
    rng: &mut Rng,
) -> anyhow::Result<Value> {
    use kvroute_sidecar::{DEFAULT_BUDGET_BYTES, MAX_FIELDS_BYTES};
    const CLIENTS: usize = 64;
    let max = MAX_FIELDS_BYTES / 16 * 15;
    let one = chat_req(&json!({"messages": [{"role": "user", "content": prose(rng, max)}]}));
    let field_bytes = one.prompt_body.as_ref().map_or(0, |b| b.fields.get().len());
    let (r, peak) = heap::peak_of(|| kvroute_sidecar::precise(sc, &one));
    anyhow::ensure!(
        r.is_some(),
        "the largest chat ({field_bytes} bytes of fields) is tokenized: {:?}",
        [
            "too_large",
            "busy",
            "template_error",
            "bad_request",
            "encode_error",
            "no_tokenizer"
        ]
        .map(|l| (l, sc.metrics.precise.get(l)))
    );
    let per_byte = peak as f64 / field_bytes.max(1) as f64;
    println!(
        "  tokenizing a {:.1} MiB chat peaks at {:.0} MiB of heap: {per_byte:.0} bytes per byte of text",
        field_bytes as f64 / (1 << 20) as f64,
        peak as f64 / (1 << 20) as f64
    );
    let bodies: Vec<bytes::Bytes> = (0..CLIENTS)
        .map(|_| {
            let req =
                chat_req(&json!({"messages": [{"role": "user", "content": prose(rng, max)}]}));
            serde_json::to_vec(&req).map(bytes::Bytes::from)
        })
        .collect::<Result<_, _>>()?;
    let small = serde_json::to_vec(&route_req_small())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut rows = Vec::new();
    // The one-per-core limiter on a 16-core node (16 x 2 MiB tokenizing, 16 large routes
    // at once); the default budget on that node; the defaults on this one.
    for (label, budget, large) in [
        (
            "16 cores, one chat per core",
            16 * MAX_FIELDS_BYTES,
            Some(16),
        ),
        ("16 cores, default budget", DEFAULT_BUDGET_BYTES, Some(16)),
        ("this node, defaults", DEFAULT_BUDGET_BYTES, None),
    ] {
        let model = format!("m={}", dir.display());
        let mb = (budget >> 20).to_string();
        let mut args = vec![
            "--tokenizer".to_string(),
            model,
            "--tokenizer-cache-mb".into(),
            "0".into(),
            "--tokenize-budget-mb".into(),
            mb,
        ];
        if let Some(n) = large {
            args.extend(["--large-routes".into(), n.to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let proc = crate::services::SidecarProc::start(&args, false)?;
        let row = rt.block_on(flood_one(&proc, &bodies, &small))?;
        println!(
            "  {CLIENTS} clients of {:.0} MiB chats, {label} ({} MiB tokenizing): {} tokenized, {} routed by text (busy); RSS +{:.0} MiB; small routes p50 {:.2} ms p99 {:.2} ms (filter timeout 25 ms)",
            field_bytes as f64 / (1 << 20) as f64,
            budget >> 20,
            row["tokenized"], row["busy"], row["rss_growth_mb"].as_f64().unwrap_or(0.0),
            row["small_route_p50_ms"].as_f64().unwrap_or(0.0),
            row["small_route_p99_ms"].as_f64().unwrap_or(0.0),
        );
        let mut row = row;
        row["budget"] = json!(label);
        row["budget_mb"] = json!(budget >> 20);
        row["large_routes"] = json!(large);
        rows.push(row);
    }
    Ok(json!({"peak_heap_bytes_per_text_byte": per_byte, "runs": rows}))
}

/// One flood against a running sidecar: 3 s of `bodies` from 64 clients and small
/// routes from one, timed; RSS from the process's own accounting.
async fn flood_one(
    proc: &crate::services::SidecarProc,
    bodies: &[bytes::Bytes],
    small: &[u8],
) -> anyhow::Result<Value> {
    let api = crate::client::Api::new(proc.addr);
    for p in 0..8 {
        api.register(&format!("10.0.0.{p}:8000"), "m").await;
    }
    let url = format!("http://{}/v1/route", proc.addr);
    let http = reqwest::Client::new();
    let post = |body: bytes::Bytes| {
        http.post(&url)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    // Warm: one small route and one chat, so the baseline holds what a running sidecar does.
    let _ = post(bytes::Bytes::copy_from_slice(small)).await?;
    let _ = post(bodies[0].clone()).await?;
    let status = |key: &str| crate::procs::status_kib(proc.pid(), key);
    let before = status("VmRSS:");
    let run = std::time::Duration::from_secs(3);
    let t0 = Instant::now();
    let flood = bodies.iter().cloned().map(|b| {
        let post = &post;
        async move {
            while t0.elapsed() < run {
                if let Ok(r) = post(b.clone()).await {
                    let _ = r.bytes().await;
                }
            }
        }
    });
    let probe = async {
        let mut lat = Samples::default();
        let small = bytes::Bytes::copy_from_slice(small);
        while t0.elapsed() < run {
            let t = Instant::now();
            if let Ok(r) = post(small.clone()).await {
                let _ = r.bytes().await;
            }
            lat.push(t.elapsed().as_nanos() as u64);
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        lat
    };
    let (_, mut lat) = tokio::join!(futures::future::join_all(flood), probe);
    let peak = status("VmHWM:");
    let tokenized = api
        .metric("kvroute_precise_prompts_total{outcome=\"tokens\"}")
        .await;
    let busy = api
        .metric("kvroute_precise_prompts_total{outcome=\"busy\"}")
        .await;
    Ok(json!({
        "rss_growth_mb": peak.saturating_sub(before) as f64 / 1024.0,
        "tokenized": tokenized, "busy": busy,
        "small_route_p50_ms": lat.pct(50.0) as f64 / 1e6,
        "small_route_p99_ms": lat.pct(99.0) as f64 / 1e6,
    }))
}

/// A small token-mode route (what most routes are) for the latency probe.
fn route_req_small() -> RouteRequest {
    crate::client::route_req("m", &(1..=64).collect::<Vec<u64>>(), 16)
}
