//! Hostile and malformed input: the body parser, the event decoder and the config
//! validator never panic, never hang, and answer with a reason — on random bytes, random
//! JSON of the right shape with wrong types, and the classic attack bodies.

use std::time::{Duration, Instant};

use kvroute_shared::canon::{parse, AdapterRule, Endpoint};
use kvroute_shared::protocol::{EventBatch, PolicyConfig, RouteRequest};
use proptest::prelude::*;

fn arb_json() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(serde_json::Value::from),
        ".{0,12}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::from),
            proptest::collection::btree_map(
                prop_oneof![
                    Just("model".to_string()),
                    Just("prompt".to_string()),
                    Just("messages".to_string()),
                    Just("content".to_string()),
                    Just("role".to_string()),
                    Just("type".to_string()),
                    Just("events".to_string()),
                    Just("blocks".to_string()),
                    "[a-z_]{1,8}"
                ],
                inner,
                0..5
            )
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn parsers_survive_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        for ep in [
            Endpoint::Completions,
            Endpoint::ChatCompletions,
            Endpoint::Messages,
            Endpoint::Responses,
        ] {
            if let Ok(r) = parse(ep, &bytes) {
                let _ = r.chain(&AdapterRule::default(), 16);
            }
        }
        let _ = EventBatch::decode(&bytes);
        let _ = serde_json::from_slice::<PolicyConfig>(&bytes).map(|c| c.validate());
        let _ = RouteRequest::decode_binary(&bytes);
        let _ = serde_json::from_slice::<RouteRequest>(&bytes);
        let _ = kvroute_shared::protocol::ReportBatch::decode(&bytes);
        let _ = serde_json::from_slice::<kvroute_shared::protocol::LoadDelta>(&bytes);
        let _ = serde_json::from_slice::<kvroute_shared::protocol::QueueState>(&bytes);
    }

    /// The binary route codec on bytes that start like a real body: every prefix and
    /// every single-byte corruption of a valid encoding decodes or is refused, never more.
    #[test]
    fn the_binary_route_codec_survives_corruption(
        chain in proptest::collection::vec(any::<u64>(), 0..64),
        at in any::<usize>(),
        byte in any::<u8>(),
        cut in any::<usize>(),
    ) {
        let req = RouteRequest {
            prompt_tokens: 7,
            request_id: Some("r".into()),
            ..RouteRequest::tokens("m", 16, chain)
        };
        let mut bytes = req.encode_binary();
        prop_assert_eq!(RouteRequest::decode_binary(&bytes).ok(), Some(req.clone()));
        let _ = RouteRequest::decode_binary(&bytes[..cut % (bytes.len() + 1)]);
        if !bytes.is_empty() {
            let i = at % bytes.len();
            bytes[i] = byte;
            if let Ok(r) = RouteRequest::decode_binary(&bytes) {
                prop_assert!(r.chain.len() <= bytes.len() / 8);
            }
        }
    }

    #[test]
    fn parsers_survive_json_of_the_wrong_shape(v in arb_json()) {
        let bytes = serde_json::to_vec(&v).unwrap_or_default();
        for ep in [
            Endpoint::Completions,
            Endpoint::ChatCompletions,
            Endpoint::Messages,
            Endpoint::Responses,
        ] {
            if let Ok(r) = parse(ep, &bytes) {
                let c = r.chain(&AdapterRule::default(), 4);
                prop_assert!(c.chain.len() <= bytes.len());
            }
        }
        let _ = EventBatch::decode(&bytes);
        let _ = serde_json::from_slice::<PolicyConfig>(&bytes).map(|c| c.validate());
        let _ = kvroute_shared::protocol::ReportBatch::decode(&bytes);
        let _ = serde_json::from_slice::<RouteRequest>(&bytes);
    }
}

fn timed<T>(what: &str, limit: Duration, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    let e = t.elapsed();
    println!("{what}: {e:?}");
    assert!(e < limit, "{what} took {e:?}");
    r
}

#[test]
fn classic_attack_bodies() {
    let limit = Duration::from_secs(20);
    // Deep nesting: refused by serde_json's recursion limit, not a stack overflow.
    let deep = format!("{{\"model\":\"m\",\"messages\":{}", "[".repeat(1_000_000));
    assert!(timed("1M-deep nesting", limit, || parse(
        Endpoint::ChatCompletions,
        deep.as_bytes()
    )
    .is_err()));
    // Invalid UTF-8 inside a string.
    let mut bad = br#"{"model":"m","prompt":""#.to_vec();
    bad.extend_from_slice(&[0xff, 0xfe, 0xfd]);
    bad.extend_from_slice(br#""}"#);
    assert!(parse(Endpoint::Completions, &bad).is_err());
    // A 100 MB prompt: parsed borrowed, chained once.
    let big = format!(
        "{{\"model\":\"m\",\"prompt\":\"{}\"}}",
        "a".repeat(100 << 20)
    );
    let n = timed("100 MB prompt", limit, || {
        parse(Endpoint::Completions, big.as_bytes())
            .map(|r| r.chain(&AdapterRule::default(), 256).chain.len())
    });
    assert_eq!(n, Ok((100 << 20) / 256));
    drop(big);
    // One million tiny messages.
    let mut msgs = String::from("{\"model\":\"m\",\"messages\":[");
    for i in 0..1_000_000 {
        if i > 0 {
            msgs.push(',');
        }
        msgs.push_str("{\"role\":\"user\",\"content\":\"x\"}");
    }
    msgs.push_str("]}");
    let n = timed("1M tiny messages", limit, || {
        parse(Endpoint::ChatCompletions, msgs.as_bytes())
            .map(|r| r.chain(&AdapterRule::default(), 256).chain.len())
    });
    // Refused (more than MAX_MESSAGES), quickly, without building them.
    assert_eq!(n, Err(kvroute_shared::canon::CanonError::TooManyMessages));
    drop(msgs);
    // A giant token array (4M tokens) and one with a token out of range at the end.
    let toks = (0..4_000_000u32)
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let body = format!("{{\"model\":\"m\",\"prompt\":[{toks}]}}");
    let n = timed("4M-token prompt", limit, || {
        parse(Endpoint::Completions, body.as_bytes())
            .map(|r| r.chain(&AdapterRule::default(), 16).chain.len())
    });
    assert_eq!(n, Ok(250_000));
    let body = format!("{{\"model\":\"m\",\"prompt\":[{toks},4294967296]}}");
    assert!(parse(Endpoint::Completions, body.as_bytes()).is_err());
    // Wrong types everywhere.
    for b in [
        r#"{"model":5,"prompt":"x"}"#,
        r#"{"prompt":{"a":1}}"#,
        r#"{"messages":"hi"}"#,
        r#"{"messages":[{"content":5}]}"#,
        r#"{"prompt":[true]}"#,
        r#"{"stream":"yes","prompt":"x"}"#,
    ] {
        let _ = parse(Endpoint::Completions, b.as_bytes());
        let _ = parse(Endpoint::ChatCompletions, b.as_bytes());
    }
    // An event batch with an absurd declared size is bounded by what was actually sent.
    let huge = format!("{{\"v\":1,\"pod\":\"p:1\",\"model\":\"m\",\"epoch\":\"e\",\"seq\":1,\"events\":[{{\"type\":\"stored\",\"blocks\":[{}]}}]}}", (0..1_000_000).map(|i: u64| i.to_string()).collect::<Vec<_>>().join(","));
    let b = timed("1M-block event batch", limit, || {
        EventBatch::decode(huge.as_bytes())
    });
    assert!(b.is_ok());
}

#[test]
fn different_salts_never_share_a_block() {
    let tok: Vec<u32> = (0..4096).collect();
    let a = kvroute_shared::Namespace {
        mode: kvroute_shared::Mode::Tokens,
        block_size: 16,
        model: "m",
        adapter: "",
        cache_salt: "tenant-a",
    };
    let b = kvroute_shared::Namespace {
        cache_salt: "tenant-b",
        ..a
    };
    let (ca, cb) = (a.chain_tokens(&tok), b.chain_tokens(&tok));
    let sa: std::collections::HashSet<u64> = ca.into_iter().collect();
    assert!(cb.iter().all(|h| !sa.contains(h)));
}

/// A chat body with more messages than the filter will materialize is refused with its
/// own reason, however small each message is; at the limit it is routed.
#[test]
fn chat_bodies_with_too_many_messages_are_refused_not_materialized() {
    use kvroute_shared::canon::{parse, CanonError, Endpoint, MAX_MESSAGES};
    let body = |n: usize| {
        let one = r#"{"role":"user","content":"x"}"#;
        format!(r#"{{"model":"m","messages":[{}]}}"#, vec![one; n].join(","))
    };
    assert!(parse(Endpoint::ChatCompletions, body(MAX_MESSAGES).as_bytes()).is_ok());
    assert_eq!(
        parse(Endpoint::ChatCompletions, body(MAX_MESSAGES + 1).as_bytes()).map(|_| ()),
        Err(CanonError::TooManyMessages)
    );
    // Millions of empty objects: read past, never built.
    let flood = format!(
        r#"{{"model":"m","messages":[{}]}}"#,
        vec!["{}"; 2_000_000].join(",")
    );
    let r = parse(Endpoint::ChatCompletions, flood.as_bytes()).map(|_| ());
    assert!(r.is_err(), "{r:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    /// Subjects name exactly one model and pod: names that differ only in characters NATS
    /// gives a meaning to (`a.b`, `a_b`, `a b`, `a*b`) once folded to one token, and a
    /// bridge allowed one subject could then speak for every model folding to it.
    #[test]
    fn subject_tokens_are_injective_and_nats_safe(
        a in "[a-z0-9._:~% *>/-]{0,8}",
        b in "[a-z0-9._:~% *>/-]{0,8}",
    ) {
        use kvroute_shared::protocol::subject_token;
        let (ta, tb) = (subject_token(&a), subject_token(&b));
        prop_assert_eq!(a == b, ta == tb, "{:?} -> {:?}, {:?} -> {:?}", a, ta, b, tb);
        prop_assert!(!ta.contains(['.', '*', '>', ' ']), "{:?}", ta);
    }
}

#[test]
fn pod_subjects_stay_readable() {
    use kvroute_shared::protocol::subject_token;
    assert_eq!(subject_token("10.0.3.7:8000"), "10_0_3_7~8000");
    assert_eq!(
        subject_token("meta-llama/Llama-3.1-8B"),
        "meta-llama%2FLlama-3_1-8B"
    );
    for (x, y) in [
        ("a.b", "a_b"),
        ("a b", "a_b"),
        ("a*b", "a>b"),
        ("a:b", "a~b"),
    ] {
        assert_ne!(subject_token(x), subject_token(y), "{x} vs {y}");
    }
}
