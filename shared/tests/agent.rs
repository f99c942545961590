//! The canonical form of Anthropic Messages and OpenAI Responses bodies: every block and
//! item type, the prefix property over turns, what a client changes every turn and must
//! not change the form (cache markers, Claude Code's billing header), sessions, errors.

use kvroute_shared::canon::{canonical_bytes, parse, AdapterRule, Endpoint};
use proptest::prelude::*;
use serde_json::{json, Value};

fn form(ep: Endpoint, body: &Value) -> Vec<u8> {
    let b = body.to_string();
    canonical_bytes(&parse(ep, b.as_bytes()).expect("parses").prompt)
}

fn messages(system: Value, msgs: &[Value]) -> Value {
    json!({"model": "m", "max_tokens": 64, "system": system, "messages": msgs,
           "tools": [{"name": "Read", "description": "read a file",
                      "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}]})
}

fn claude_turns() -> Vec<Value> {
    vec![
        json!({"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                           {"type": "text", "text": "fix the bug"}]}),
        json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": "look at main.rs", "signature": "sig"},
            {"type": "text", "text": "Reading it."},
            {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "main.rs"}}]}),
        json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                            "content": [{"type": "text", "text": "fn main() {}"}]}]}),
        json!({"role": "assistant", "content": [{"type": "redacted_thinking", "data": "b64"},
                                                {"type": "text", "text": "Done."}]}),
        json!({"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": true}]}),
    ]
}

#[test]
fn endpoints_from_paths() {
    assert_eq!(
        Endpoint::from_path("/v1/messages"),
        Some(Endpoint::Messages)
    );
    assert_eq!(
        Endpoint::from_path("/v1/responses?x=1"),
        Some(Endpoint::Responses)
    );
    assert_eq!(Endpoint::from_path("/v1/messages/count_tokens"), None);
}

#[test]
fn messages_turns_prefix_the_next_turns_and_every_block_counts() {
    let system = json!([{"type": "text", "text": "You are Claude Code."}]);
    let turns = claude_turns();
    let mut last: Vec<u8> = Vec::new();
    for k in 1..=turns.len() {
        let f = form(Endpoint::Messages, &messages(system.clone(), &turns[..k]));
        assert!(f.starts_with(&last), "turn {k} extends turn {}", k - 1);
        assert!(f.len() > last.len());
        last = f;
    }
    // Each block's content is in the form: changing any one changes it.
    let base = form(Endpoint::Messages, &messages(system.clone(), &turns));
    let edits: [(usize, usize, &str, Value); 8] = [
        (0, 1, "text", json!("fix the other bug")),
        (1, 0, "thinking", json!("look at lib.rs")),
        (1, 2, "input", json!({"path": "lib.rs"})),
        (1, 2, "name", json!("Write")),
        (2, 0, "tool_use_id", json!("toolu_9")),
        (3, 0, "data", json!("b64x")),
        (
            4,
            0,
            "source",
            json!({"type": "base64", "media_type": "image/png", "data": "AAAB"}),
        ),
        (4, 2, "is_error", json!(false)),
    ];
    for (m, b, field, v) in edits {
        let mut t = turns.clone();
        t[m]["content"][b][field] = v;
        let f = form(Endpoint::Messages, &messages(system.clone(), &t));
        assert_ne!(f, base, "message {m} block {b} field {field}");
    }
    // A thinking block's signature is not content.
    let mut t = turns.clone();
    t[1]["content"][0]["signature"] = json!("other");
    assert_eq!(form(Endpoint::Messages, &messages(system, &t)), base);
}

#[test]
fn cache_markers_and_billing_headers_do_not_change_the_form() {
    let turns = claude_turns();
    let system = json!([{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc12;"},
                        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]);
    let base = form(Endpoint::Messages, &messages(system, &turns));
    // The next request: another billing hash, the markers moved to the newest message.
    let system = json!([{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=f00d9;"},
                        {"type": "text", "text": "You are Claude Code."}]);
    let mut t = turns.clone();
    t[4]["content"][2]["cache_control"] = json!({"type": "ephemeral"});
    t[0]["content"][1]["cache_control"] = json!({"type": "ephemeral", "ttl": "1h"});
    let mut body = messages(system, &t);
    body["tools"][0]
        .as_object_mut()
        .map(|o| o.remove("cache_control"));
    assert_eq!(form(Endpoint::Messages, &body), base);
    // The system as a plain string is the same system text.
    let plain = form(
        Endpoint::Messages,
        &messages(json!("You are Claude Code."), &turns),
    );
    assert_eq!(plain, base);
}

#[test]
fn an_image_is_a_fixed_size_marker() {
    let img = |data: &str| {
        json!({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]}]})
    };
    let (a, b) = (
        form(Endpoint::Messages, &img("AAAA")),
        form(Endpoint::Messages, &img(&"B".repeat(100_000))),
    );
    assert_ne!(a, b);
    assert_eq!(a.len(), b.len());
}

fn responses(instructions: &str, items: &[Value]) -> Value {
    json!({"model": "m", "instructions": instructions, "input": items,
           "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]})
}

fn codex_items() -> Vec<Value> {
    vec![
        json!({"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>"}]}),
        json!({"role": "user", "content": "list files"}),
        json!({"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "use ls"}],
               "encrypted_content": "gAAA"}),
        json!({"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
               "arguments": "{\"cmd\":[\"ls\"]}"}),
        json!({"type": "function_call_output", "call_id": "call_1", "output": "a.rs\nb.rs"}),
        json!({"type": "message", "role": "assistant", "id": "msg_1",
               "content": [{"type": "output_text", "text": "Two files.", "annotations": []}]}),
        json!({"role": "user", "content": [{"type": "input_text", "text": "and this?"},
                                           {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}),
    ]
}

#[test]
fn responses_items_prefix_the_next_items_and_every_item_counts() {
    let items = codex_items();
    let mut last = Vec::new();
    for k in 1..=items.len() {
        let f = form(Endpoint::Responses, &responses("be brief", &items[..k]));
        assert!(f.starts_with(&last) && f.len() > last.len(), "item {k}");
        last = f;
    }
    let base = form(Endpoint::Responses, &responses("be brief", &items));
    assert_ne!(
        form(Endpoint::Responses, &responses("be verbose", &items)),
        base
    );
    let edits: [(usize, &str, Value); 5] = [
        (2, "encrypted_content", json!("gAAB")),
        (3, "arguments", json!("{\"cmd\":[\"ls\",\"-a\"]}")),
        (3, "call_id", json!("call_2")),
        (4, "output", json!("c.rs")),
        (6, "content", json!("and that?")),
    ];
    for (i, field, v) in edits {
        let mut t = items.clone();
        t[i][field] = v;
        assert_ne!(
            form(Endpoint::Responses, &responses("be brief", &t)),
            base,
            "item {i} {field}"
        );
    }
    // A string input is one user message.
    let s = form(
        Endpoint::Responses,
        &json!({"model": "m", "input": "list files"}),
    );
    let l = form(
        Endpoint::Responses,
        &json!({"model": "m", "input": [{"role": "user", "content": "list files"}]}),
    );
    assert_eq!(s, l);
}

#[test]
fn sessions_and_response_chains_are_read_from_the_body() {
    let p = |ep, b: Value| {
        let s = b.to_string();
        let r = parse(ep, s.as_bytes()).expect("parses");
        (
            r.session.map(|s| s.into_owned()),
            r.previous_response.map(|s| s.into_owned()),
        )
    };
    let msgs = json!([{"role": "user", "content": "hi"}]);
    assert_eq!(
        p(
            Endpoint::Messages,
            json!({"messages": msgs, "metadata": {"user_id": "user_a_account_b_session_c"}})
        ),
        (Some("user_a_account_b_session_c".into()), None)
    );
    assert_eq!(
        p(
            Endpoint::Responses,
            json!({"input": "", "previous_response_id": "resp_1", "prompt_cache_key": "k", "user": "u"})
        ),
        (Some("k".into()), Some("resp_1".into()))
    );
    assert_eq!(
        p(
            Endpoint::ChatCompletions,
            json!({"messages": msgs, "user": ""})
        ),
        (None, None)
    );
    // A chained turn with no new input still routes (by its chain's binding).
    let r = parse(
        Endpoint::Responses,
        br#"{"input":[],"previous_response_id":"resp_1"}"#,
    )
    .expect("routable");
    assert!(r.chain(&AdapterRule::default(), 16).chain.is_empty());
}

#[test]
fn errors_are_reasons() {
    let cases: [(Endpoint, &[u8], &str); 7] = [
        (Endpoint::Messages, b"{}", "no_prompt"),
        (Endpoint::Messages, b"{\"messages\":[]}", "empty_prompt"),
        (
            Endpoint::Messages,
            b"{\"messages\":[],\"system\":5}",
            "bad_json",
        ),
        (Endpoint::Responses, b"{}", "no_prompt"),
        (Endpoint::Responses, b"{\"input\":\"\"}", "empty_prompt"),
        (Endpoint::Responses, b"{\"input\":5}", "bad_json"),
        (
            Endpoint::Responses,
            b"{\"input\":\"x\",\"metadata\":3}",
            "bad_json",
        ),
    ];
    for (ep, body, reason) in cases {
        let e = parse(ep, body).expect_err("refused");
        assert_eq!(e.reason(), reason, "{}", String::from_utf8_lossy(body));
    }
    let many = format!(
        "{{\"input\":[{}]}}",
        vec!["{}"; kvroute_shared::canon::MAX_MESSAGES + 1].join(",")
    );
    assert_eq!(
        parse(Endpoint::Responses, many.as_bytes())
            .expect_err("too many")
            .reason(),
        "too_many_messages"
    );
}

fn arb_block() -> impl Strategy<Value = Value> {
    let s = ".{0,12}";
    prop_oneof![
        s.prop_map(|t| json!({"type": "text", "text": t})),
        s.prop_map(|t| json!({"type": "thinking", "thinking": t, "signature": "x"})),
        (s, s).prop_map(
            |(id, n)| json!({"type": "tool_use", "id": id, "name": n, "input": {"a": n}})
        ),
        (s, s).prop_map(|(id, c)| json!({"type": "tool_result", "tool_use_id": id, "content": c})),
        s.prop_map(|d| json!({"type": "image", "source": {"type": "base64", "data": d}})),
        s.prop_map(|d| json!({"type": "redacted_thinking", "data": d})),
        s.prop_map(
            |d| json!({"type": "search_result", "title": d, "cache_control": {"type": "ephemeral"}})
        ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Over random turns of random blocks: k turns prefix k+1, and moving every cache
    /// marker never changes the form.
    #[test]
    fn messages_form_prefixes_and_ignores_markers(
        turns in proptest::collection::vec(
            ("(user|assistant)", proptest::collection::vec(arb_block(), 1..4)), 1..6),
    ) {
        let msgs: Vec<Value> = turns.iter()
            .map(|(r, blocks)| json!({"role": r, "content": blocks}))
            .collect();
        let body = |m: &[Value]| json!({"model": "m", "messages": m});
        for k in 1..msgs.len() {
            let a = form(Endpoint::Messages, &body(&msgs[..k]));
            let b = form(Endpoint::Messages, &body(&msgs[..k + 1]));
            prop_assert!(b.starts_with(&a) && b.len() > a.len());
        }
        let mut marked = msgs.clone();
        for m in &mut marked {
            if let Some(blocks) = m["content"].as_array_mut() {
                for b in blocks {
                    b["cache_control"] = json!({"type": "ephemeral"});
                }
            }
        }
        prop_assert_eq!(form(Endpoint::Messages, &body(&marked)), form(Endpoint::Messages, &body(&msgs)));
    }
}
