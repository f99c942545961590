//! Rendering a chat request with the model's template, as vLLM's server renders it:
//! the request switches it honours (`add_generation_prompt`, `continue_final_message`,
//! `chat_template_kwargs`), the special tokens' strings, and the messages as vLLM hands
//! them to the template (its chat parser, `conversation.rs`, then `engine_messages`).

use serde_json::Value;

use super::{parse_body, template, ModelTokenizer, TokenizeError};

impl ModelTokenizer {
    /// The chat prompt as the engine renders it. `body` is the request body's JSON.
    pub fn render_chat(&self, body: &Value) -> Result<String, TokenizeError> {
        self.render_chat_value(&minijinja::Value::from_serialize(body), 0)
    }

    pub(super) fn render_chat_value(
        &self,
        body: &minijinja::Value,
        size_hint: usize,
    ) -> Result<String, TokenizeError> {
        use minijinja::value::ValueKind;
        let env = self.env.as_ref().ok_or(TokenizeError::NoTemplate)?;
        let bad = |m: &str| TokenizeError::BadRequest(m.to_owned());
        let messages = body
            .get_attr("messages")
            .ok()
            .filter(|m| m.kind() == ValueKind::Seq)
            .ok_or_else(|| bad("a chat body needs `messages`"))?;
        for m in messages.try_iter().map_err(|e| bad(&e.to_string()))? {
            let content = m.get_attr("content").unwrap_or_default();
            if content.kind() == ValueKind::Seq {
                for part in content.try_iter().map_err(|e| bad(&e.to_string()))? {
                    // vLLM's text part types (Responses items carry `input_text` and
                    // `output_text`); anything else is media.
                    let kind = part.get_attr("type").ok();
                    if !matches!(
                        kind.as_ref().and_then(|t| t.as_str()),
                        Some("text" | "input_text" | "output_text" | "refusal" | "thinking")
                    ) {
                        return Err(TokenizeError::Multimodal);
                    }
                }
            }
        }
        let mut ctx: std::collections::BTreeMap<String, minijinja::Value> = self
            .specials
            .iter()
            .map(|(k, v)| ((*k).to_owned(), minijinja::Value::from(v.as_str())))
            .collect();
        // vLLM's request switches (defaults: generation prompt on, no continuation).
        let flag = |name: &str, default: bool| {
            body.get_attr(name)
                .ok()
                .filter(|v| !v.is_undefined() && !v.is_none())
                .map_or(default, |v| v.is_true())
        };
        ctx.insert(
            "add_generation_prompt".into(),
            minijinja::Value::from(
                flag("add_generation_prompt", true) && !flag("continue_final_message", false),
            ),
        );
        if let Ok(kw) = body.get_attr("chat_template_kwargs") {
            if kw.kind() == ValueKind::Map {
                for k in kw.try_iter().map_err(|e| bad(&e.to_string()))? {
                    if let (Some(name), Ok(v)) = (k.as_str(), kw.get_item(&k)) {
                        ctx.insert(name.to_owned(), v);
                    }
                }
            }
        }
        let parsed = super::conversation::parse_messages(&messages, self.content_format())?;
        let messages = engine_messages(&parsed)?;
        ctx.insert("messages".into(), messages.clone());
        let tools = body.get_attr("tools").unwrap_or_default();
        ctx.insert(
            "tools".into(),
            if tools.is_undefined() {
                minijinja::Value::from(())
            } else {
                tools
            },
        );
        if let Ok(d) = body.get_attr("documents") {
            if !d.is_undefined() {
                ctx.insert("documents".into(), d);
            }
        }
        let mut text = template::render(env, minijinja::Value::from(ctx), size_hint)
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        if flag("continue_final_message", false) {
            cut_after_final(&mut text, &messages)?;
        }
        Ok(text)
    }

    /// [`ModelTokenizer::render_chat`] of a body given as JSON text: the route path's
    /// first stage (parse and render), on its own so a benchmark can say what it costs.
    pub fn render_chat_json(&self, json: &str) -> Result<String, TokenizeError> {
        self.render_chat_value(&parse_body(json)?, json.len())
    }
}

/// The messages as vLLM hands them to the template: an assistant message's tool calls
/// carry their `arguments` as an object — a JSON string is parsed, anything empty,
/// unparseable or not an object becomes `{}` — and an empty `tool_calls` list is dropped
/// (vLLM's `_postprocess_messages`, so that templates writing `arguments | tojson` see
/// what the engine's template saw). Messages without tool calls are passed through as
/// they are (shared, not copied). A tool call that is not a function object fails the
/// request there, and so it does here.
fn engine_messages(messages: &minijinja::Value) -> Result<minijinja::Value, TokenizeError> {
    use minijinja::value::{Value, ValueKind};
    let bad = |m: &str| TokenizeError::BadRequest(m.to_owned());
    // `map` with `key` set to `v` (or removed), keys in their order.
    let with = |map: &Value, key: &str, v: Option<Value>| -> Result<Value, TokenizeError> {
        let mut out = Vec::new();
        let mut set = false;
        for k in map.try_iter().map_err(|e| bad(&e.to_string()))? {
            if k.as_str() != Some(key) {
                let item = map.get_item(&k).map_err(|e| bad(&e.to_string()))?;
                out.push((k, item));
            } else if let Some(v) = &v {
                out.push((k, v.clone()));
                set = true;
            }
        }
        if let (false, Some(v)) = (set, v) {
            out.push((Value::from(key), v)); // a new key goes last, as in a Python dict
        }
        Ok(out.into_iter().collect())
    };
    let mut out = Vec::with_capacity(messages.len().unwrap_or(0));
    for m in messages.try_iter().map_err(|e| bad(&e.to_string()))? {
        let calls = m.get_attr("tool_calls").unwrap_or_default();
        let role = m.get_attr("role").unwrap_or_default();
        if role.as_str() != Some("assistant") || calls.kind() != ValueKind::Seq {
            out.push(m);
            continue;
        }
        if calls.len() == Some(0) {
            out.push(with(&m, "tool_calls", None)?);
            continue;
        }
        let mut fixed = Vec::new();
        for call in calls.try_iter().map_err(|e| bad(&e.to_string()))? {
            let function = call.get_attr("function").unwrap_or_default();
            let kind = call.get_attr("type").unwrap_or_default();
            if call.kind() != ValueKind::Map
                || function.kind() != ValueKind::Map
                || !(kind.is_undefined() || kind.as_str() == Some("function"))
            {
                return Err(bad("assistant tool_calls entries must be function objects"));
            }
            let args = function.get_attr("arguments").unwrap_or_default();
            let parsed = if !args.is_true() {
                None
            } else if args.kind() == ValueKind::Map {
                Some(args)
            } else if let Some(s) = args.as_str() {
                serde_json::from_str::<Value>(s)
                    .ok()
                    .filter(|v| v.kind() == ValueKind::Map)
            } else {
                None
            };
            let parsed =
                parsed.unwrap_or_else(|| Vec::<(Value, Value)>::new().into_iter().collect());
            let function = with(&function, "arguments", Some(parsed))?;
            fixed.push(with(&call, "function", Some(function))?);
        }
        out.push(with(&m, "tool_calls", Some(Value::from(fixed)))?);
    }
    Ok(minijinja::Value::from(out))
}

/// `continue_final_message`: the rendered prompt ends right after the last message's
/// content (transformers cuts at its last occurrence, trying it as is, then stripped).
fn cut_after_final(text: &mut String, messages: &minijinja::Value) -> Result<(), TokenizeError> {
    use minijinja::value::ValueKind;
    let n = messages.len().unwrap_or(0);
    let last = messages
        .get_item_by_index(n.saturating_sub(1))
        .unwrap_or_default()
        .get_attr("content")
        .unwrap_or_default();
    let content = match last.kind() {
        ValueKind::Seq => last
            .get_item_by_index(last.len().unwrap_or(1).saturating_sub(1))
            .unwrap_or_default()
            .get_attr("text")
            .unwrap_or_default(),
        _ => last,
    };
    let Some(c) = content.as_str() else {
        return Err(TokenizeError::BadRequest(
            "continue_final_message needs a text final message".into(),
        ));
    };
    for needle in [c, c.trim()] {
        if let Some(at) = text.rfind(needle) {
            text.truncate(at + needle.len());
            return Ok(());
        }
    }
    Err(TokenizeError::Template(
        "the final message is not in the rendered prompt".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(messages: serde_json::Value) -> Result<serde_json::Value, TokenizeError> {
        let v = engine_messages(&minijinja::Value::from_serialize(&messages))?;
        serde_json::to_value(&v).map_err(|e| TokenizeError::BadRequest(e.to_string()))
    }

    // The transformations themselves are held against vLLM's own function by the fidelity
    // test; these are the cases it does not generate.
    #[test]
    fn tool_calls_are_normalized_as_vllm_does() {
        let out = engine(serde_json::json!([
            {"role": "user", "content": "hi", "tool_calls": [{"function": {"arguments": "{}"}}]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [true]}"}},
                {"type": "function", "function": {"name": "g", "arguments": "42"}},
                {"function": {"name": "h"}}
            ]},
            {"role": "assistant", "content": "x", "tool_calls": null}
        ]))
        .expect("normalized");
        assert_eq!(
            out,
            serde_json::json!([
                {"role": "user", "content": "hi", "tool_calls": [{"function": {"arguments": "{}"}}]},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"function": {"name": "f", "arguments": {"b": 1, "a": [true]}}},
                    {"type": "function", "function": {"name": "g", "arguments": {}}},
                    {"function": {"name": "h", "arguments": {}}}
                ]},
                {"role": "assistant", "content": "x", "tool_calls": null}
            ])
        );
    }

    #[test]
    fn tool_calls_vllm_refuses_are_refused() {
        for calls in [
            serde_json::json!(["not an object"]),
            serde_json::json!([{"type": "custom", "function": {"name": "f"}}]),
            serde_json::json!([{"type": "function", "function": "f"}]),
        ] {
            let r = engine(serde_json::json!([{"role": "assistant", "tool_calls": calls}]));
            assert_eq!(r.map_err(|e| e.reason()), Err("bad_request"), "{calls}");
        }
    }
}
