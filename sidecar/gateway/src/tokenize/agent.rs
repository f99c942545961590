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

use minijinja::value::{Value, ValueKind};
use serde_json::json;

use super::{ModelTokenizer, TokenizeError};

const BILLING: &str = kvroute_shared::canon::BILLING_HEADER;

pub(super) fn unsupported(what: &'static str) -> TokenizeError {
    TokenizeError::Unsupported(what)
}

pub(super) fn bad(m: &str) -> TokenizeError {
    TokenizeError::BadRequest(m.to_owned())
}

/// `v[key]`, when present.
pub(super) fn attr(v: &Value, key: &str) -> Option<Value> {
    v.get_attr(key).ok().filter(|x| !x.is_undefined())
}

pub(super) fn kind_of(v: &Value) -> Option<String> {
    attr(v, "type").and_then(|t| t.as_str().map(str::to_owned))
}

/// A string that Python would find truthy (present and not empty).
fn truthy_str(v: Option<Value>) -> Option<Value> {
    v.filter(|x| x.as_str().is_some_and(|s| !s.is_empty()))
}

pub(super) fn items(v: &Value) -> Result<Vec<Value>, TokenizeError> {
    Ok(v.try_iter().map_err(|e| bad(&e.to_string()))?.collect())
}

/// An ordered map (the template sees keys in this order, as in a Python dict).
pub(super) fn map(entries: Vec<(&str, Value)>) -> Value {
    entries
        .into_iter()
        .map(|(k, v)| (Value::from(k), v))
        .collect()
}

/// The text blocks of a system content list (billing headers dropped).
fn system_blocks(blocks: &Value) -> Result<Vec<Value>, TokenizeError> {
    Ok(items(blocks)?
        .into_iter()
        .filter(|b| kind_of(b).as_deref() == Some("text"))
        .filter_map(|b| truthy_str(attr(&b, "text")))
        .filter(|t| !t.as_str().is_some_and(|t| t.starts_with(BILLING)))
        .collect())
}

fn concat(parts: &[Value]) -> String {
    parts.iter().filter_map(|p| p.as_str()).collect()
}

/// The text of a system message's content (string or text blocks), billing headers
/// dropped; `None` when nothing is left.
fn system_text(content: Option<Value>) -> Result<Option<String>, TokenizeError> {
    let Some(c) = content else { return Ok(None) };
    let t = match c.kind() {
        ValueKind::String => c
            .as_str()
            .filter(|s| !s.starts_with(BILLING))
            .map(str::to_owned),
        ValueKind::Seq => Some(concat(&system_blocks(&c)?)),
        _ => None,
    };
    Ok(t.filter(|s| !s.is_empty()))
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

    /// A Messages body (JSON) as the chat body vLLM renders.
    pub fn messages_to_chat(&self, body: &serde_json::Value) -> Result<Value, TokenizeError> {
        self.messages_to_chat_value(&Value::from_serialize(body))
    }

    /// [`ModelTokenizer::messages_to_chat`] on the template's own values: strings are
    /// shared with the parsed body, not copied (the route path parses the body once).
    pub(super) fn messages_to_chat_value(&self, body: &Value) -> Result<Value, TokenizeError> {
        let merge = self.merges_inline_system();
        let msgs = attr(body, "messages")
            .filter(|m| m.kind() == ValueKind::Seq)
            .ok_or_else(|| bad("a Messages body needs `messages`"))?;
        let msgs = items(&msgs)?;
        let mut out: Vec<Value> = Vec::with_capacity(msgs.len() + 1);
        let mut system: Vec<Value> = match attr(body, "system") {
            Some(s) if s.kind() == ValueKind::String => truthy_str(Some(s)).into_iter().collect(),
            Some(s) if s.kind() == ValueKind::Seq => system_blocks(&s)?,
            _ => Vec::new(),
        };
        let role_of = |m: &Value| attr(m, "role").and_then(|r| r.as_str().map(str::to_owned));
        if merge {
            for m in &msgs {
                if role_of(m).as_deref() == Some("system") {
                    system.extend(system_text(attr(m, "content"))?.map(Value::from));
                }
            }
        }
        if !system.is_empty() {
            let content = match system.as_slice() {
                [one] => one.clone(),
                many => Value::from(concat(many)),
            };
            out.push(map(vec![
                ("role", Value::from("system")),
                ("content", content),
            ]));
        }
        for m in &msgs {
            let role = role_of(m).ok_or_else(|| bad("a message needs a `role`"))?;
            if role == "system" {
                if !merge {
                    if let Some(t) = system_text(attr(m, "content"))? {
                        out.push(map(vec![
                            ("role", Value::from("system")),
                            ("content", Value::from(t)),
                        ]));
                    }
                }
                continue;
            }
            let mut msg: Vec<(&str, Value)> = vec![("role", Value::from(role.as_str()))];
            match attr(m, "content") {
                Some(c) if c.kind() == ValueKind::String => msg.push(("content", c)),
                Some(c) if c.kind() == ValueKind::Seq => {
                    convert_blocks(&role, &items(&c)?, &mut msg, &mut out)?
                }
                _ => return Err(bad("a message's content is a string or a list of blocks")),
            }
            if role != "user" || msg.iter().any(|(k, _)| *k == "content") {
                out.push(map(msg));
            }
        }
        let mut chat: Vec<(&str, Value)> = vec![("messages", Value::from(out))];
        if let Some(tools) = attr(body, "tools").filter(|t| !t.is_none()) {
            chat.push(("tools", convert_tools(&tools)?));
        }
        let mut kwargs: Vec<(String, Value)> = match attr(body, "chat_template_kwargs") {
            Some(k) if k.kind() == ValueKind::Map => items(&k)?
                .into_iter()
                .filter_map(|key| {
                    let v = k.get_item(&key).ok()?;
                    Some((key.as_str()?.to_owned(), v))
                })
                .collect(),
            _ => Vec::new(),
        };
        let mut effort: Option<String> = attr(body, "output_config")
            .and_then(|o| attr(&o, "effort"))
            .and_then(|e| e.as_str().map(str::to_owned));
        if attr(body, "thinking").and_then(|t| kind_of(&t)).as_deref() == Some("disabled") {
            effort = Some(self.disabled_thinking_effort().to_owned());
        }
        // vLLM's chat parameters: the effort reaches the template, and switches thinking
        // unless the caller set `enable_thinking` itself ("auto" counts as unset).
        if let Some(e) = effort.filter(|e| e != "auto") {
            if !kwargs.iter().any(|(k, _)| k == "enable_thinking") {
                kwargs.push(("enable_thinking".into(), Value::from(e != "none")));
            }
            kwargs.retain(|(k, _)| k != "reasoning_effort");
            kwargs.push(("reasoning_effort".into(), Value::from(e)));
        }
        let kwargs: Value = kwargs
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect();
        if kwargs.len().unwrap_or(0) > 0 {
            chat.push(("chat_template_kwargs", kwargs));
        }
        Ok(map(chat))
    }
}

fn convert_blocks(
    role: &str,
    blocks: &[Value],
    msg: &mut Vec<(&str, Value)>,
    out: &mut Vec<Value>,
) -> Result<(), TokenizeError> {
    let mut parts: Vec<Value> = Vec::new();
    let mut calls: Vec<Value> = Vec::new();
    let mut reasoning: Vec<Value> = Vec::new();
    let mut any_reasoning = false;
    for b in blocks {
        let kind = kind_of(b).unwrap_or_default();
        match kind.as_str() {
            "text" => {
                if let Some(t) = truthy_str(attr(b, "text")) {
                    parts.push(map(vec![("type", Value::from("text")), ("text", t)]));
                }
            }
            "image" => return Err(TokenizeError::Multimodal),
            "thinking" => {
                if let Some(t) = attr(b, "thinking").filter(|t| t.kind() == ValueKind::String) {
                    reasoning.push(t);
                    any_reasoning = true;
                }
            }
            "redacted_thinking" | "tool_reference" => {}
            "tool_use" => {
                let id =
                    truthy_str(attr(b, "id")).ok_or_else(|| unsupported("tool_use without id"))?;
                // `json.dumps(block.input or {})`, which the chat parser reads back.
                let input = match attr(b, "input") {
                    Some(i) if i.kind() == ValueKind::Map => i,
                    Some(i) if !i.is_none() => return Err(bad("tool_use input is an object")),
                    _ => map(Vec::new()),
                };
                let name = attr(b, "name").filter(|n| n.kind() == ValueKind::String);
                let function = map(vec![
                    ("name", name.unwrap_or_else(|| Value::from(""))),
                    ("arguments", input),
                ]);
                calls.push(map(vec![
                    ("id", id),
                    ("type", Value::from("function")),
                    ("function", function),
                ]));
            }
            "tool_result" => {
                let content = attr(b, "content").filter(|c| !c.is_none());
                if role == "user" {
                    let text = match &content {
                        Some(c) if c.kind() == ValueKind::String => c.clone(),
                        Some(c) if c.kind() == ValueKind::Seq => {
                            let mut texts: Vec<String> = Vec::new();
                            for item in items(c)?.iter().filter(|i| i.kind() == ValueKind::Map) {
                                match kind_of(item).as_deref() {
                                    Some("text") => texts.push(
                                        attr(item, "text")
                                            .and_then(|t| t.as_str().map(str::to_owned))
                                            .unwrap_or_default(),
                                    ),
                                    Some("image") => return Err(TokenizeError::Multimodal),
                                    Some("tool_reference") => {
                                        return Err(unsupported("tool_reference"))
                                    }
                                    _ => {}
                                }
                            }
                            Value::from(texts.join("\n"))
                        }
                        None => Value::from(""),
                        Some(_) => return Err(bad("tool_result content")),
                    };
                    let id = attr(b, "tool_use_id")
                        .filter(|i| i.kind() == ValueKind::String)
                        .unwrap_or_else(|| Value::from(""));
                    out.push(map(vec![
                        ("role", Value::from("tool")),
                        ("tool_call_id", id),
                        ("content", text),
                    ]));
                } else {
                    let text = match &content {
                        Some(c) if c.kind() == ValueKind::String => c.as_str().unwrap_or_default(),
                        None => "",
                        Some(_) => {
                            return Err(unsupported("an assistant's structured tool_result"))
                        }
                    };
                    parts.push(map(vec![
                        ("type", Value::from("text")),
                        ("text", Value::from(format!("Tool result: {text}"))),
                    ]));
                }
            }
            "tool_addition" | "tool_removal" => {
                return Err(unsupported("tool_addition/tool_removal"))
            }
            // vLLM's request model refuses any other block type.
            other => return Err(bad(&format!("content block type {other:?}"))),
        }
    }
    // vLLM's chat parser keeps an assistant's reasoning (also as `reasoning_content`)
    // and no one else's.
    if any_reasoning && role == "assistant" {
        let r = match reasoning.as_slice() {
            [one] => one.clone(),
            many => Value::from(concat(many)),
        };
        msg.push(("reasoning", r.clone()));
        msg.push(("reasoning_content", r));
    }
    if !calls.is_empty() {
        msg.push(("tool_calls", Value::from(calls)));
    }
    match parts.as_slice() {
        [] => {}
        [one] if kind_of(one).as_deref() == Some("text") => {
            msg.push(("content", attr(one, "text").unwrap_or_default()));
        }
        _ => msg.push(("content", Value::from(parts))),
    }
    Ok(())
}

/// Messages tools as vLLM's function tools dump them for the template.
fn convert_tools(tools: &Value) -> Result<Value, TokenizeError> {
    if tools.kind() != ValueKind::Seq {
        return Err(bad("`tools` is a list"));
    }
    let mut out = Vec::new();
    for t in items(tools)? {
        let name = attr(&t, "name")
            .filter(|n| n.kind() == ValueKind::String)
            .ok_or_else(|| bad("a tool needs a `name`"))?;
        // vLLM's request model gives a schema without a type `"type": "object"` (last).
        let schema = attr(&t, "input_schema")
            .filter(|s| s.kind() == ValueKind::Map)
            .ok_or_else(|| bad("a tool's input_schema is an object"))?;
        let schema = if attr(&schema, "type").is_some() {
            schema
        } else {
            let mut entries: Vec<(Value, Value)> = items(&schema)?
                .into_iter()
                .filter_map(|k| Some((k.clone(), schema.get_item(&k).ok()?)))
                .collect();
            entries.push((Value::from("type"), Value::from("object")));
            entries.into_iter().collect()
        };
        let mut f = vec![
            ("name", name),
            (
                "description",
                attr(&t, "description").unwrap_or_else(|| Value::from(())),
            ),
            ("parameters", schema),
        ];
        let set = |k: &str| attr(&t, k).filter(|v| !v.is_none());
        for key in ["strict", "defer_loading"] {
            if let Some(v) = set(key) {
                f.push((key, v));
            }
        }
        let mut tool = vec![("type", Value::from("function")), ("function", map(f))];
        if let Some(v) = set("defer_loading") {
            tool.push(("defer_loading", v));
        }
        out.push(map(tool));
    }
    Ok(Value::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    use super::super::testkit::{arb_json, printing_tokenizer};

    const WORDS: &str = "(text|image|tool_use|tool_result|thinking|system|user|assistant|x-anthropic-billing-header|.{0,6})";
    const KEYS: &str = "(type|text|role|content|messages|system|tools|name|input|input_schema|id|tool_use_id|thinking|source|thinking|output_config|effort|chat_template_kwargs)";

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Any JSON a client sends to /v1/messages: converted or refused, never a panic,
        /// and a conversion is always a chat body with a message list.
        #[test]
        fn hostile_messages_bodies_are_converted_or_refused(body in arb_json(WORDS, KEYS)) {
            let t = printing_tokenizer();
            if let Ok(chat) = t.messages_to_chat(&body) {
                prop_assert_eq!(chat.get_attr("messages").map(|m| m.kind()).ok(), Some(ValueKind::Seq));
                let _ = t.tokenize_value(true, &chat, 0);
            }
            let v = Value::from_serialize(&body);
            let _ = convert_tools(&v);
            let (mut msg, mut out) = (Vec::new(), Vec::new());
            if let Ok(blocks) = items(&v) {
                let _ = convert_blocks("user", &blocks, &mut msg, &mut out);
                let _ = convert_blocks("assistant", &blocks, &mut msg, &mut out);
            }
        }
    }
}
