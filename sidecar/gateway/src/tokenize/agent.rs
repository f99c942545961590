//! Anthropic Messages bodies as the chat request vLLM makes of them before its template
//! runs (`AnthropicServingMessages.to_chat_completion_request` in vLLM's
//! `entrypoints/anthropic/serving.py`), so precise routing of `/v1/messages` computes the
//! tokens the engine will.
//!
//! The conversion, step by step as vLLM does it: the top-level `system` (a string, or its
//! non-empty text blocks joined with nothing between, Claude Code's billing-header block
//! dropped) becomes the first system message; inline system messages stay where they are,
//! unless the template cannot take a system message after the first turn (vLLM renders
//! `[system, user, system, user]` and merges them into the leading one when that raises);
//! per message, text blocks become text parts (one part alone becomes a string),
//! `thinking` joins into `reasoning` (the chat parser then also sets `reasoning_content`),
//! `tool_use` becomes a tool call whose arguments are its input, a user's `tool_result`
//! becomes a `tool` message placed *before* the rest of its message (text items joined by
//! newlines), an assistant's string `tool_result` becomes the text `Tool result: …`, and a
//! user message left without content is dropped. `thinking: {type: disabled}` and
//! `output_config.effort` set `reasoning_effort` (and `enable_thinking` with it, as vLLM's
//! chat parameters do); tools become function tools (`description` kept even when null,
//! a schema without a `type` given `"type": "object"`, `strict` and `defer_loading` only
//! when set). Images and the rarer blocks vLLM handles
//! with behaviour we cannot reproduce exactly (`tool_addition`/`tool_removal`, tool
//! references, an assistant's structured tool result, a tool use without an id — vLLM
//! names it by the clock) are refused, and the request keeps its text chain.

use serde_json::{json, Map, Value};

use super::{ModelTokenizer, TokenizeError};

const BILLING: &str = kvroute_shared::canon::BILLING_HEADER;

fn unsupported(what: &'static str) -> TokenizeError {
    TokenizeError::Unsupported(what)
}

fn truthy_str(v: Option<&Value>) -> Option<&str> {
    v.and_then(Value::as_str).filter(|s| !s.is_empty())
}

/// The text of a system message's content (string or text blocks), billing headers
/// dropped; `None` when nothing is left.
fn system_text(content: Option<&Value>) -> Option<String> {
    match content {
        Some(Value::String(s)) => (!s.starts_with(BILLING)).then(|| s.clone()),
        Some(Value::Array(blocks)) => {
            let parts: Vec<&str> = blocks
                .iter()
                .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
                .filter_map(|b| truthy_str(b.get("text")))
                .filter(|t| !t.starts_with(BILLING))
                .collect();
            (!parts.is_empty()).then(|| parts.concat())
        }
        _ => None,
    }
    .filter(|s| !s.is_empty())
}

impl ModelTokenizer {
    /// Does the template refuse a system message after the first turn? vLLM's probe:
    /// render `[system, user, system, user]`; an error means inline system messages are
    /// merged into the leading one. Computed once per model.
    pub(super) fn merges_inline_system(&self) -> bool {
        *self.merge_inline_system.get_or_init(|| {
            let probe = json!({"messages": [
                {"role": "system", "content": "t"}, {"role": "user", "content": "t"},
                {"role": "system", "content": "t"}, {"role": "user", "content": "t"}],
                "add_generation_prompt": false});
            self.render_chat(&probe).is_err()
        })
    }

    /// What `thinking: {type: disabled}` becomes: `reasoning_effort` "none", unless the
    /// template ignores it (renders the same prompt as with an effort) or refuses it —
    /// then "low", as vLLM's probe decides. Computed once per model.
    fn disabled_thinking_effort(&self) -> &'static str {
        self.disabled_effort.get_or_init(|| {
            let render = |effort: &str| {
                self.render_chat(&json!({
                    "messages": [{"role": "user", "content": "Hi"}],
                    "chat_template_kwargs": {"reasoning_effort": effort,
                                             "enable_thinking": effort != "none"}}))
                    .ok()
            };
            let Some(none) = render("none") else {
                return "low";
            };
            if ["low", "medium", "high", "xhigh", "max"]
                .iter()
                .any(|e| render(e).as_ref() == Some(&none))
            {
                "low"
            } else {
                "none"
            }
        })
    }

    /// A Messages body as the chat body vLLM renders.
    pub fn messages_to_chat(&self, body: &Value) -> Result<Value, TokenizeError> {
        let bad = |m: &str| TokenizeError::BadRequest(m.to_owned());
        let merge = self.merges_inline_system();
        let msgs = body
            .get("messages")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("a Messages body needs `messages`"))?;
        let mut out: Vec<Value> = Vec::with_capacity(msgs.len() + 1);
        let mut system = match body.get("system") {
            Some(Value::String(s)) if !s.is_empty() => vec![s.clone()],
            Some(Value::Array(blocks)) => blocks
                .iter()
                .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
                .filter_map(|b| truthy_str(b.get("text")))
                .filter(|t| !t.starts_with(BILLING))
                .map(str::to_owned)
                .collect(),
            _ => Vec::new(),
        };
        if merge {
            for m in msgs {
                if m.get("role").and_then(Value::as_str) == Some("system") {
                    system.extend(system_text(m.get("content")));
                }
            }
        }
        if !system.is_empty() {
            out.push(json!({"role": "system", "content": system.concat()}));
        }
        for m in msgs {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("a message needs a `role`"))?;
            if role == "system" {
                if !merge {
                    if let Some(t) = system_text(m.get("content")) {
                        out.push(json!({"role": "system", "content": t}));
                    }
                }
                continue;
            }
            let mut msg = Map::new();
            msg.insert("role".into(), Value::from(role));
            match m.get("content") {
                Some(Value::String(s)) => {
                    msg.insert("content".into(), Value::from(s.as_str()));
                }
                Some(Value::Array(blocks)) => convert_blocks(role, blocks, &mut msg, &mut out)?,
                _ => return Err(bad("a message's content is a string or a list of blocks")),
            }
            if role != "user" || msg.contains_key("content") {
                out.push(Value::Object(msg));
            }
        }
        let mut chat = Map::new();
        chat.insert("messages".into(), Value::Array(out));
        if let Some(tools) = body.get("tools").filter(|t| !t.is_null()) {
            chat.insert("tools".into(), convert_tools(tools)?);
        }
        let mut kwargs = match body.get("chat_template_kwargs") {
            Some(Value::Object(k)) => k.clone(),
            _ => Map::new(),
        };
        let mut effort: Option<String> = None;
        if let Some(e) = body
            .get("output_config")
            .and_then(|o| o.get("effort"))
            .and_then(Value::as_str)
        {
            effort = Some(e.to_owned());
        }
        if body
            .get("thinking")
            .and_then(|t| t.get("type"))
            .and_then(Value::as_str)
            == Some("disabled")
        {
            effort = Some(self.disabled_thinking_effort().to_owned());
        }
        // vLLM's chat parameters: the effort reaches the template, and switches thinking
        // unless the caller set `enable_thinking` itself ("auto" counts as unset).
        if let Some(e) = effort.filter(|e| e != "auto") {
            if !kwargs.contains_key("enable_thinking") {
                kwargs.insert("enable_thinking".into(), Value::from(e != "none"));
            }
            kwargs.insert("reasoning_effort".into(), Value::from(e));
        }
        if !kwargs.is_empty() {
            chat.insert("chat_template_kwargs".into(), Value::Object(kwargs));
        }
        Ok(Value::Object(chat))
    }
}

fn convert_blocks(
    role: &str,
    blocks: &[Value],
    msg: &mut Map<String, Value>,
    out: &mut Vec<Value>,
) -> Result<(), TokenizeError> {
    let mut parts: Vec<Value> = Vec::new();
    let mut calls: Vec<Value> = Vec::new();
    let mut reasoning: Vec<&str> = Vec::new();
    let mut any_reasoning = false;
    for b in blocks {
        let kind = b.get("type").and_then(Value::as_str).unwrap_or_default();
        match kind {
            "text" => {
                if let Some(t) = truthy_str(b.get("text")) {
                    parts.push(json!({"type": "text", "text": t}));
                }
            }
            "image" => return Err(TokenizeError::Multimodal),
            "thinking" => {
                if let Some(t) = b.get("thinking").and_then(Value::as_str) {
                    reasoning.push(t);
                    any_reasoning = true;
                }
            }
            "redacted_thinking" => {}
            "tool_use" => {
                let id =
                    truthy_str(b.get("id")).ok_or_else(|| unsupported("tool_use without id"))?;
                let input = match b.get("input") {
                    Some(Value::Object(o)) if !o.is_empty() => Value::Object(o.clone()),
                    None | Some(Value::Null) | Some(Value::Object(_)) => json!({}),
                    Some(_) => {
                        return Err(TokenizeError::BadRequest(
                            "tool_use input is an object".into(),
                        ))
                    }
                };
                calls.push(json!({"id": id, "type": "function", "function": {
                    "name": b.get("name").and_then(Value::as_str).unwrap_or_default(),
                    "arguments": input}}));
            }
            "tool_result" => {
                let content = b.get("content");
                if role == "user" {
                    let text = match content {
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Array(items)) => {
                            let mut texts = Vec::new();
                            for item in items.iter().filter(|i| i.is_object()) {
                                match item.get("type").and_then(Value::as_str) {
                                    Some("text") => texts.push(
                                        item.get("text")
                                            .and_then(Value::as_str)
                                            .unwrap_or_default(),
                                    ),
                                    Some("image") => return Err(TokenizeError::Multimodal),
                                    Some("tool_reference") => {
                                        return Err(unsupported("tool_reference"))
                                    }
                                    _ => {}
                                }
                            }
                            texts.join("\n")
                        }
                        None | Some(Value::Null) => String::new(),
                        Some(_) => {
                            return Err(TokenizeError::BadRequest("tool_result content".into()))
                        }
                    };
                    let id = b
                        .get("tool_use_id")
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    out.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
                } else {
                    let text = match content {
                        Some(Value::String(s)) => s.as_str(),
                        None | Some(Value::Null) => "",
                        Some(_) => {
                            return Err(unsupported("an assistant's structured tool_result"))
                        }
                    };
                    parts.push(json!({"type": "text", "text": format!("Tool result: {text}")}));
                }
            }
            "tool_reference" => {}
            "tool_addition" | "tool_removal" => {
                return Err(unsupported("tool_addition/tool_removal"))
            }
            // vLLM's request model refuses any other block type.
            other => {
                return Err(TokenizeError::BadRequest(format!(
                    "content block type {other:?}"
                )))
            }
        }
    }
    // vLLM's chat parser keeps an assistant's reasoning (also as `reasoning_content`)
    // and no one else's.
    if any_reasoning && role == "assistant" {
        let r = Value::from(reasoning.concat());
        msg.insert("reasoning".into(), r.clone());
        msg.insert("reasoning_content".into(), r);
    }
    if !calls.is_empty() {
        msg.insert("tool_calls".into(), Value::Array(calls));
    }
    match parts.len() {
        0 => {}
        1 if parts[0].get("type").and_then(Value::as_str) == Some("text") => {
            let t = parts[0].get("text").cloned().unwrap_or_default();
            msg.insert("content".into(), t);
        }
        _ => {
            msg.insert("content".into(), Value::Array(parts));
        }
    }
    Ok(())
}

/// Messages tools as vLLM's function tools dump them for the template.
fn convert_tools(tools: &Value) -> Result<Value, TokenizeError> {
    let list = tools
        .as_array()
        .ok_or_else(|| TokenizeError::BadRequest("`tools` is a list".into()))?;
    let mut out = Vec::with_capacity(list.len());
    for t in list {
        let name = t
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| TokenizeError::BadRequest("a tool needs a `name`".into()))?;
        let mut f = Map::new();
        f.insert("name".into(), Value::from(name));
        f.insert(
            "description".into(),
            t.get("description").cloned().unwrap_or(Value::Null),
        );
        // vLLM's request model gives a schema without a type `"type": "object"` (last).
        let mut schema = t.get("input_schema").cloned().unwrap_or(Value::Null);
        match schema.as_object_mut() {
            Some(o) if !o.contains_key("type") => {
                o.insert("type".into(), Value::from("object"));
            }
            Some(_) => {}
            None => {
                return Err(TokenizeError::BadRequest(
                    "a tool's input_schema is an object".into(),
                ))
            }
        }
        f.insert("parameters".into(), schema);
        for key in ["strict", "defer_loading"] {
            if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
                f.insert(key.into(), v.clone());
            }
        }
        let mut tool = Map::new();
        tool.insert("type".into(), Value::from("function"));
        tool.insert("function".into(), Value::Object(f));
        if let Some(v) = t.get("defer_loading").filter(|v| !v.is_null()) {
            tool.insert("defer_loading".into(), v.clone());
        }
        out.push(Value::Object(tool));
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "(text|image|tool_use|tool_result|thinking|system|user|assistant|x-anthropic-billing-header|.{0,6})"
                .prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                proptest::collection::btree_map(
                    "(type|text|role|content|messages|system|tools|name|input|input_schema|id|tool_use_id|thinking|source|thinking|output_config|effort|chat_template_kwargs)",
                    inner,
                    0..6
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Any JSON a client sends to /v1/messages: converted or refused, never a panic,
        /// and a conversion is always a chat body with a message list.
        #[test]
        fn hostile_messages_bodies_are_converted_or_refused(body in arb_json()) {
            static T: std::sync::OnceLock<Option<ModelTokenizer>> = std::sync::OnceLock::new();
            let t = T.get_or_init(|| {
                // A word-level tokenizer and a template that prints every message.
                let dir = std::env::temp_dir().join(format!("kvroute-agent-{}", std::process::id()));
                std::fs::create_dir_all(&dir).ok()?;
                let tj = json!({"version": "1.0", "truncation": null, "padding": null,
                    "added_tokens": [], "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
                    "post_processor": null, "decoder": null,
                    "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1}, "unk_token": "[UNK]"}});
                std::fs::write(dir.join("tokenizer.json"), tj.to_string()).ok()?;
                let tpl = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
                std::fs::write(dir.join("tokenizer_config.json"), json!({"chat_template": tpl}).to_string()).ok()?;
                ModelTokenizer::load(&dir, 1 << 20).ok()
            });
            let t = t.as_ref().expect("the test tokenizer loads");
            if let Ok(chat) = t.messages_to_chat(&body) {
                prop_assert!(chat["messages"].is_array());
                let _ = t.tokenize_request(true, &chat);
            }
            let _ = convert_tools(&body);
            let mut msg = Map::new();
            let mut out = Vec::new();
            if let Some(blocks) = body.as_array() {
                let _ = convert_blocks("user", blocks, &mut msg, &mut out);
                let _ = convert_blocks("assistant", blocks, &mut msg, &mut out);
            }
        }
    }
}
