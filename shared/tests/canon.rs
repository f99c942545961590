//! Canonicalization: every prompt shape, the adapter rule, and the error paths.

use kvroute_shared::canon::{canonical_bytes, parse, AdapterRule, CanonError, Endpoint, Prompt};
use kvroute_shared::{Mode, Namespace};

fn chain(path: &str, body: &str, bs: u32) -> Vec<u64> {
    let ep = Endpoint::from_path(path).expect("known path");
    parse(ep, body.as_bytes())
        .expect("parses")
        .chain(&AdapterRule::default(), bs)
        .chain
}

#[test]
fn endpoints_from_paths() {
    assert_eq!(
        Endpoint::from_path("/v1/completions"),
        Some(Endpoint::Completions)
    );
    assert_eq!(
        Endpoint::from_path("/v1/chat/completions?x=1"),
        Some(Endpoint::ChatCompletions)
    );
    assert_eq!(
        Endpoint::from_path("/v1/chat/completions/"),
        Some(Endpoint::ChatCompletions)
    );
    assert_eq!(Endpoint::from_path("/v1/embeddings"), None);
}

#[test]
fn token_prompt_matches_reference_vector() {
    let c = chain(
        "/v1/completions",
        r#"{"model":"m","prompt":[0,1,2,3,4,5,6,7,8,9]}"#,
        4,
    );
    assert_eq!(c, [12505186680924831797, 7943115681171077851]);
    // A batch of token lists is routed by its first list.
    let c = chain(
        "/v1/completions",
        r#"{"model":"m","prompt":[[0,1,2,3,4,5,6,7,8,9],[5]]}"#,
        4,
    );
    assert_eq!(c, [12505186680924831797, 7943115681171077851]);
}

#[test]
fn text_prompt_matches_reference_vector() {
    let body =
        r#"{"model":"m","prompt":"The quick brown fox jumps over the lazy dog","stream":true}"#;
    let req = parse(Endpoint::Completions, body.as_bytes()).expect("parses");
    assert!(req.stream);
    assert_eq!(req.prompt.mode(), Mode::Text);
    assert!(
        matches!(req.prompt, Prompt::Text(std::borrow::Cow::Borrowed(_))),
        "unescaped text is borrowed"
    );
    assert_eq!(
        req.chain(&AdapterRule::default(), 16).chain,
        [5154235071411025064, 2942950958069661582]
    );
    let batch = r#"{"model":"m","prompt":["The quick brown fox jumps over the lazy dog","other"]}"#;
    assert_eq!(
        chain("/v1/completions", batch, 16),
        [5154235071411025064, 2942950958069661582]
    );
}

#[test]
fn salt_and_adapter_enter_the_namespace() {
    let body = r#"{"model":"m","prompt":[0,1,2,3,4,5,6,7,8,9],"cache_salt":"s"}"#;
    assert_eq!(
        chain("/v1/completions", body, 4),
        [354002652557409732, 10636323012749482335]
    );

    let rule = AdapterRule {
        adapters: [("a".to_string(), "m".to_string())].into(),
        separator: None,
    };
    let req = parse(
        Endpoint::Completions,
        br#"{"model":"a","prompt":[0,1,2,3,4,5,6,7,8,9]}"#,
    )
    .expect("parses");
    let c = req.chain(&rule, 4);
    assert_eq!((c.base_model.as_str(), c.adapter.as_str()), ("m", "a"));
    assert_eq!(c.chain, [14521725862862998063, 12194196787045017334]);

    let rule = AdapterRule {
        adapters: Default::default(),
        separator: Some(":".into()),
    };
    assert_eq!(rule.resolve("m:a"), ("m", "a"));
    assert_eq!(rule.resolve(":a"), (":a", ""));
    assert_eq!(rule.resolve("plain"), ("plain", ""));
}

#[test]
fn chat_parts_and_markers_are_stable() {
    let a = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}"#;
    let b = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAB"}}]}]}"#;
    let ca = parse(Endpoint::ChatCompletions, a.as_bytes()).expect("a");
    let cb = parse(Endpoint::ChatCompletions, b.as_bytes()).expect("b");
    let (ba, bb) = (canonical_bytes(&ca.prompt), canonical_bytes(&cb.prompt));
    assert_ne!(ba, bb, "different images give different markers");
    assert_eq!(
        ba.len(),
        bb.len(),
        "an image is a fixed-size marker, whatever its size"
    );
    // String content and a single text part are the same message.
    let s = r#"{"messages":[{"role":"user","content":"hi"}]}"#;
    let p = r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#;
    assert_eq!(
        canonical_bytes(
            &parse(Endpoint::ChatCompletions, s.as_bytes())
                .expect("s")
                .prompt
        ),
        canonical_bytes(
            &parse(Endpoint::ChatCompletions, p.as_bytes())
                .expect("p")
                .prompt
        )
    );
}

#[test]
fn tools_lead_the_form() {
    let with = r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#;
    let without = r#"{"messages":[{"role":"user","content":"x"}]}"#;
    let w = canonical_bytes(
        &parse(Endpoint::ChatCompletions, with.as_bytes())
            .expect("w")
            .prompt,
    );
    let wo = canonical_bytes(
        &parse(Endpoint::ChatCompletions, without.as_bytes())
            .expect("wo")
            .prompt,
    );
    assert_eq!(w.first(), Some(&b'T'));
    assert!(w.ends_with(&wo));
}

#[test]
fn errors_are_reasons_not_panics() {
    let bad: &[(&[u8], &str)] = &[
        (b"not json", "bad_json"),
        (b"{\"prompt\": 5}", "bad_json"),
        (b"{\"prompt\": [1, -2]}", "bad_json"),
        (b"{\"prompt\": [4294967296]}", "bad_json"),
        (b"{\"prompt\": \"\"}", "empty_prompt"),
        (b"{\"prompt\": []}", "empty_prompt"),
        (b"{\"model\": \"m\"}", "no_prompt"),
        (b"\xff\xfe", "bad_json"),
    ];
    for (body, reason) in bad {
        let e = parse(Endpoint::Completions, body).expect_err("must fail");
        assert_eq!(e.reason(), *reason, "{e}");
    }
    assert_eq!(
        parse(Endpoint::ChatCompletions, b"{\"messages\":[]}")
            .expect_err("empty")
            .reason(),
        "empty_prompt"
    );
    assert!(matches!(
        parse(Endpoint::ChatCompletions, b"{}"),
        Err(CanonError::Missing("messages"))
    ));
    let deep = "[".repeat(100_000);
    assert!(parse(
        Endpoint::Completions,
        format!("{{\"prompt\":{deep}").as_bytes()
    )
    .is_err());
}

#[test]
fn escaped_text_still_chains_like_unescaped() {
    let ns = Namespace {
        mode: Mode::Text,
        block_size: 4,
        model: "m",
        adapter: "",
        cache_salt: "",
    };
    let want = ns.chain_bytes("a\nb\"cdefgh".as_bytes());
    assert_eq!(
        chain(
            "/v1/completions",
            r#"{"model":"m","prompt":"a\nb\"cdefgh"}"#,
            4
        ),
        want
    );
}
