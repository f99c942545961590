//! The messages as vLLM's chat parser hands them on (`parse_chat_message_content` in
//! `vllm/renderers/chat_utils/chat_message.py`), before its tool-call clean-up
//! (`chat.rs`) and the template.
//!
//! The parser rebuilds every message: content becomes what the template's *content
//! format* expects — for a "string" template, the text parts joined by newlines (no
//! content or an empty list: `""`; empty texts dropped); for an "openai" template, a list
//! of `{"type": "text", "text": …}` parts (a string becomes one, empty texts kept) — and
//! only the keys vLLM
//! knows survive: `role`, `content`, an assistant's `tool_calls` and `reasoning` (also as
//! `reasoning_content`), a tool's `tool_call_id` (its text parts joined for either format),
//! a string `name`, a string `task`; a system message's text part that starts with Claude
//! Code's billing header keeps only what follows its first line.
//!
//! vLLM decides the format from the template's syntax tree (a loop over a message's
//! `content` means "openai"); here a scan of the template's source finds the same loops
//! (`content_format_of`), held to vLLM's decision on every template it ships.

use minijinja::value::{Value, ValueKind};

use super::{ModelTokenizer, TokenizeError};

/// How a template reads `content` (vLLM's `ChatTemplateContentFormat`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContentFormat {
    /// A string: text parts joined by newlines.
    String,
    /// A list of typed parts.
    OpenAi,
}

const BILLING: &str = kvroute_shared::canon::BILLING_HEADER;

fn bad(m: &str) -> TokenizeError {
    TokenizeError::BadRequest(m.to_owned())
}

fn attr(v: &Value, key: &str) -> Option<Value> {
    v.get_attr(key).ok().filter(|x| !x.is_undefined())
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    entries
        .into_iter()
        .map(|(k, v)| (Value::from(k), v))
        .collect()
}

impl ModelTokenizer {
    /// The template's content format, decided at load from its source as written.
    pub fn content_format(&self) -> ContentFormat {
        self.content_format
    }
}

/// vLLM's rule on a template's source: a `for` loop over a message's `content`
/// (`x.content`, `x['content']`) or over a variable named `content` means "openai".
/// vLLM walks the syntax tree (following aliases of `messages` and macro parameters);
/// the fidelity test holds this scan to its decision on every template vLLM ships.
pub fn content_format_of(source: &str) -> ContentFormat {
    static LOOP: std::sync::OnceLock<Option<regex::Regex>> = std::sync::OnceLock::new();
    let re = LOOP.get_or_init(|| {
        regex::Regex::new(
            r#"\{%-?\s*for\s+\w+\s+in\s+(?:[A-Za-z_][\w.]*?(?:\.content|\[\s*['"]content['"]\s*\])|content)\s*(?:\||-?%\}|if\b)"#,
        )
        .ok()
    });
    match re {
        Some(re) if re.is_match(source) => ContentFormat::OpenAi,
        _ => ContentFormat::String,
    }
}

/// Claude Code's billing header dropped from a system message's text parts (the rest of
/// such a part after its first line is kept).
fn strip_billing(parts: Vec<Value>) -> Vec<Value> {
    let mut out = Vec::with_capacity(parts.len());
    for p in parts {
        let text = match p.kind() {
            ValueKind::String => Some(p.clone()),
            ValueKind::Map
                if attr(&p, "type").as_ref().and_then(|t| t.as_str()) == Some("text") =>
            {
                attr(&p, "text")
            }
            _ => None,
        };
        let Some(t) = text
            .as_ref()
            .and_then(|t| t.as_str())
            .filter(|t| t.starts_with(BILLING))
        else {
            out.push(p);
            continue;
        };
        let Some((_, rest)) = t.split_once('\n').filter(|(_, r)| !r.is_empty()) else {
            continue;
        };
        let rest = Value::from(rest);
        out.push(if p.kind() == ValueKind::String {
            rest
        } else {
            let mut entries: Vec<(Value, Value)> = p
                .try_iter()
                .into_iter()
                .flatten()
                .filter_map(|k| Some((k.clone(), p.get_item(&k).ok()?)))
                .collect();
            for e in &mut entries {
                if e.0.as_str() == Some("text") {
                    e.1 = rest.clone();
                }
            }
            entries.into_iter().collect()
        });
    }
    out
}

/// A part's text, or `None` when vLLM skips it; refused as vLLM refuses it.
fn part_text(part: &Value) -> Result<Option<Value>, TokenizeError> {
    if part.kind() == ValueKind::String {
        return Ok(Some(part.clone()));
    }
    if part.kind() != ValueKind::Map {
        return Err(bad("a content part is a string or an object"));
    }
    if attr(part, "uuid").is_some() {
        return Err(TokenizeError::Multimodal);
    }
    let kind = attr(part, "type");
    let field = match kind.as_ref().map(|k| (k.kind(), k.as_str())) {
        Some((_, Some("text" | "input_text" | "output_text"))) => "text",
        Some((_, Some("thinking"))) => "thinking",
        Some((_, Some("refusal"))) => "refusal",
        Some((_, Some("tool_reference"))) => {
            return Err(TokenizeError::Unsupported("tool_reference"))
        }
        Some((ValueKind::String, _)) => return Err(TokenizeError::Multimodal),
        None => return Err(TokenizeError::Multimodal),
        Some(_) => return Err(bad("a content part's type is a string")),
    };
    let text = attr(part, field).filter(|t| !t.is_none());
    match text {
        Some(t) if t.kind() == ValueKind::String => Ok(Some(t)),
        None => Ok(None),
        // vLLM joins them as strings and fails; so does this.
        Some(_) => Err(bad("a text part's text is a string")),
    }
}

/// One message as vLLM's parser rebuilds it.
fn parse_message(m: &Value, format: ContentFormat) -> Result<Value, TokenizeError> {
    if m.kind() != ValueKind::Map {
        return Err(bad("a message is an object"));
    }
    let role = attr(m, "role").ok_or_else(|| bad("a message needs a `role`"))?;
    let role_s = role.as_str().unwrap_or_default().to_owned();
    let content = attr(m, "content").filter(|c| !c.is_none());
    let mut parts: Vec<Value> = match &content {
        None => Vec::new(),
        Some(c) if c.kind() == ValueKind::String => vec![c.clone()],
        Some(c) if c.kind() == ValueKind::Seq => {
            c.try_iter().map_err(|e| bad(&e.to_string()))?.collect()
        }
        Some(_) => return Err(bad("content is a string, a list of parts or null")),
    };
    if role_s == "system" {
        parts = strip_billing(parts);
    }
    let mut texts: Vec<Value> = Vec::with_capacity(parts.len());
    for p in &parts {
        if let Some(t) = part_text(p)? {
            // vLLM keeps what is truthy: a part (a dict) always, a string when not empty.
            if format == ContentFormat::OpenAi || t.as_str().is_some_and(|s| !s.is_empty()) {
                texts.push(t);
            }
        }
    }
    let joined = |texts: &[Value]| -> Value {
        match texts {
            [] => Value::from(""),
            [one] => one.clone(),
            many => Value::from(
                many.iter()
                    .filter_map(|t| t.as_str())
                    .collect::<Vec<_>>()
                    .join("\n"),
            ),
        }
    };
    let content = match format {
        // A tool message's parts are joined for either format (all text here).
        _ if role_s == "tool" => joined(&texts),
        ContentFormat::String => joined(&texts),
        ContentFormat::OpenAi => Value::from(
            texts
                .iter()
                .map(|t| map(vec![("type", Value::from("text")), ("text", t.clone())]))
                .collect::<Vec<_>>(),
        ),
    };
    let mut out = vec![("role", role), ("content", content)];
    match role_s.as_str() {
        "assistant" => {
            if let Some(calls) = attr(m, "tool_calls").filter(|c| !c.is_none()) {
                out.push(("tool_calls", calls));
            }
            if let Some(r) = attr(m, "reasoning").filter(|r| !r.is_none()) {
                out.push(("reasoning", r.clone()));
                out.push(("reasoning_content", r));
            }
        }
        "tool" => {
            if let Some(id) = attr(m, "tool_call_id") {
                out.push(("tool_call_id", id));
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        if let Some(v) = attr(m, key).filter(|v| v.kind() == ValueKind::String) {
            out.push((key, v));
        }
    }
    if role_s == "developer" {
        out.push(("tools", attr(m, "tools").unwrap_or_else(|| Value::from(()))));
    }
    Ok(map(out))
}

/// Every message as vLLM's parser rebuilds them.
pub(super) fn parse_messages(
    messages: &Value,
    format: ContentFormat,
) -> Result<Value, TokenizeError> {
    let mut out = Vec::with_capacity(messages.len().unwrap_or(0));
    for m in messages.try_iter().map_err(|e| bad(&e.to_string()))? {
        out.push(parse_message(&m, format)?);
    }
    Ok(Value::from(out))
}
