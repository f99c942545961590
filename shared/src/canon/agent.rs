//! The canonical form of the two APIs coding agents speak: Anthropic's Messages
//! (`/v1/messages`) and OpenAI's Responses (`/v1/responses`).
//!
//! They use the record encoding of `format.rs` (`tag ++ u32le(len) ++ payload`, only ever
//! appended), so the form of the first k turns is a byte prefix of the form of k+1 and no
//! content can forge a boundary. What differs from chat is what a turn holds, so the
//! block and item types are read here, each into records:
//!
//! - `T` tools (as sent, `cache_control` removed), `S` system text (Messages `system` as a
//!   string or text blocks, Responses `instructions`), then per turn `M` role;
//! - `C` text, `I` image (u64le xxh3 of its source), `U` tool use id, then `N` name and
//!   `K` input JSON (Messages `tool_use`, Responses `function_call`, whose id is the
//!   `call_id`), `R` tool result id then its content records and `E` when it is an error
//!   (Messages `tool_result`, Responses `function_call_output`), `H` thinking text (Messages
//!   `thinking`, Responses `reasoning` summary and content), `X` opaque reasoning (xxh3 of
//!   `redacted_thinking` data or `encrypted_content`), `P` any other block (`type` ++ xxh3
//!   of its JSON without `cache_control`).
//!
//! Two things a client changes every turn must not change the form, or no turn would
//! share a block with the one before: Anthropic's `cache_control` markers (Claude Code
//! moves them to the newest message) are never read, and a system text block starting
//! with `x-anthropic-billing-header` (a per-request hash Claude Code sends) is skipped —
//! vLLM drops it before its template runs for the same reason.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;
use xxhash_rust::xxh3::xxh3_64;

use super::format::{record, Content, Message, Sink};

/// The system text block Claude Code sends with a per-request hash in it.
pub const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// A Responses `input`: a string (one user message) or a list of items.
#[derive(Debug)]
pub enum Input<'a> {
    Text(Cow<'a, str>),
    Items(Vec<&'a RawValue>),
}

/// Any Messages content block or Responses item or part, with the fields the form reads
/// (unknown ones, `cache_control` among them, are skipped by serde).
#[derive(Deserialize, Default)]
struct Block<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    source: Option<&'a RawValue>,
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    call_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tool_use_id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    arguments: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    #[serde(borrow, default)]
    output: Option<Content<'a>>,
    #[serde(default)]
    is_error: Option<bool>,
    #[serde(borrow, default)]
    thinking: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    data: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    encrypted_content: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    summary: Option<Vec<&'a RawValue>>,
    #[serde(borrow, default)]
    image_url: Option<&'a RawValue>,
    #[serde(borrow, default)]
    file_id: Option<Cow<'a, str>>,
}

/// `json` with a top-level `cache_control` key removed (re-serialized only when the key
/// is there, so a body without markers is hashed as sent).
pub fn without_cache_control(json: &str) -> Cow<'_, str> {
    if !json.contains("\"cache_control\"") {
        return Cow::Borrowed(json);
    }
    match serde_json::from_str::<serde_json::Value>(json) {
        Ok(serde_json::Value::Object(mut m)) => {
            if m.remove("cache_control").is_none() {
                return Cow::Borrowed(json);
            }
            Cow::Owned(serde_json::Value::Object(m).to_string())
        }
        Ok(serde_json::Value::Array(items)) => {
            // A tools list: each tool may carry a marker.
            let items: Vec<serde_json::Value> = items
                .into_iter()
                .map(|mut v| {
                    if let Some(m) = v.as_object_mut() {
                        m.remove("cache_control");
                    }
                    v
                })
                .collect();
            Cow::Owned(serde_json::Value::Array(items).to_string())
        }
        _ => Cow::Borrowed(json),
    }
}

fn hash_record(sink: &mut impl Sink, tag: u8, bytes: &[u8]) {
    record(sink, tag, &xxh3_64(bytes).to_le_bytes());
}

fn other(sink: &mut impl Sink, kind: &str, json: &str) {
    let json = without_cache_control(json);
    let mut payload = Vec::with_capacity(kind.len() + 8);
    payload.extend_from_slice(kind.as_bytes());
    payload.extend_from_slice(&xxh3_64(json.as_bytes()).to_le_bytes());
    record(sink, b'P', &payload);
}

/// The tools record, markers removed.
pub(crate) fn write_tools(sink: &mut impl Sink, tools: Option<&RawValue>) {
    if let Some(t) = tools {
        record(sink, b'T', without_cache_control(t.get()).as_bytes());
    }
}

/// Messages `system`: a string, or text blocks (billing headers skipped).
pub(crate) fn write_system(sink: &mut impl Sink, system: Option<&Content<'_>>) {
    match system {
        Some(Content::Text(t)) if !t.is_empty() => record(sink, b'S', t.as_bytes()),
        None | Some(Content::Text(_)) => {}
        Some(Content::Parts(parts)) => {
            for raw in parts {
                match serde_json::from_str::<Block<'_>>(raw.get()) {
                    Ok(b) if b.kind == "text" => {
                        let t = b.text.unwrap_or_default();
                        if !t.is_empty() && !t.starts_with(BILLING_HEADER) {
                            record(sink, b'S', t.as_bytes());
                        }
                    }
                    Ok(b) => other(sink, &b.kind, raw.get()),
                    Err(_) => other(sink, "", raw.get()),
                }
            }
        }
    }
}

/// One Messages turn.
pub(crate) fn write_message(sink: &mut impl Sink, m: &Message<'_>) {
    record(sink, b'M', m.role.as_bytes());
    match &m.content {
        None => {}
        Some(Content::Text(t)) => record(sink, b'C', t.as_bytes()),
        Some(Content::Parts(parts)) => {
            for raw in parts {
                write_block(sink, raw, m.role == "system");
            }
        }
    }
}

fn write_content(sink: &mut impl Sink, c: &Content<'_>) {
    match c {
        Content::Text(t) => record(sink, b'C', t.as_bytes()),
        Content::Parts(parts) => {
            for raw in parts {
                write_block(sink, raw, false);
            }
        }
    }
}

/// A Messages content block or a Responses content part.
fn write_block(sink: &mut impl Sink, raw: &RawValue, system: bool) {
    let json = raw.get();
    let Ok(b) = serde_json::from_str::<Block<'_>>(json) else {
        return other(sink, "", json);
    };
    match b.kind.as_ref() {
        "text" | "input_text" | "output_text" | "refusal" => {
            let t = b.text.as_deref().unwrap_or_default();
            if system && t.starts_with(BILLING_HEADER) {
                return;
            }
            record(sink, b'C', t.as_bytes())
        }
        "image" | "input_image" => match (b.source, b.image_url, b.file_id) {
            (Some(s), _, _) | (None, Some(s), _) => hash_record(sink, b'I', s.get().as_bytes()),
            (None, None, Some(f)) => hash_record(sink, b'I', f.as_bytes()),
            _ => other(sink, &b.kind, json),
        },
        "tool_use" | "server_tool_use" => {
            record(sink, b'U', b.id.as_deref().unwrap_or_default().as_bytes());
            record(sink, b'N', b.name.as_deref().unwrap_or_default().as_bytes());
            record(sink, b'K', b.input.map_or("{}", RawValue::get).as_bytes());
        }
        "tool_result" => {
            record(
                sink,
                b'R',
                b.tool_use_id.as_deref().unwrap_or_default().as_bytes(),
            );
            if let Some(c) = &b.content {
                write_content(sink, c);
            }
            if b.is_error == Some(true) {
                record(sink, b'E', b"");
            }
        }
        "thinking" => record(
            sink,
            b'H',
            b.thinking.as_deref().unwrap_or_default().as_bytes(),
        ),
        "redacted_thinking" => {
            hash_record(sink, b'X', b.data.as_deref().unwrap_or_default().as_bytes())
        }
        kind => other(sink, kind, json),
    }
}

/// Responses `instructions`.
pub(crate) fn write_instructions(sink: &mut impl Sink, instructions: Option<&str>) {
    if let Some(t) = instructions.filter(|t| !t.is_empty()) {
        record(sink, b'S', t.as_bytes());
    }
}

/// Responses `input`.
pub(crate) fn write_input(sink: &mut impl Sink, input: &Input<'_>) {
    match input {
        Input::Text(t) => {
            record(sink, b'M', b"user");
            record(sink, b'C', t.as_bytes());
        }
        Input::Items(items) => {
            for raw in items {
                write_item(sink, raw);
            }
        }
    }
}

fn write_item(sink: &mut impl Sink, raw: &RawValue) {
    let json = raw.get();
    let Ok(b) = serde_json::from_str::<Block<'_>>(json) else {
        return other(sink, "", json);
    };
    match (b.kind.as_ref(), &b.role) {
        ("message", Some(role)) | ("", Some(role)) => {
            record(sink, b'M', role.as_bytes());
            if let Some(c) = &b.content {
                write_content(sink, c);
            }
        }
        ("function_call" | "custom_tool_call", _) => {
            record(
                sink,
                b'U',
                b.call_id.as_deref().unwrap_or_default().as_bytes(),
            );
            record(sink, b'N', b.name.as_deref().unwrap_or_default().as_bytes());
            let args = b
                .arguments
                .as_deref()
                .or_else(|| b.input.map(RawValue::get))
                .unwrap_or_default();
            record(sink, b'K', args.as_bytes());
        }
        ("function_call_output" | "custom_tool_call_output", _) => {
            record(
                sink,
                b'R',
                b.call_id.as_deref().unwrap_or_default().as_bytes(),
            );
            if let Some(c) = &b.output {
                write_content(sink, c);
            }
        }
        ("reasoning", _) => {
            for part in b.summary.iter().flatten() {
                reasoning_text(sink, part);
            }
            if let Some(Content::Parts(parts)) = &b.content {
                for part in parts {
                    reasoning_text(sink, part);
                }
            }
            if let Some(e) = &b.encrypted_content {
                hash_record(sink, b'X', e.as_bytes());
            }
        }
        (kind, _) => other(sink, kind, json),
    }
}

fn reasoning_text(sink: &mut impl Sink, raw: &RawValue) {
    match serde_json::from_str::<Block<'_>>(raw.get()) {
        Ok(Block { text: Some(t), .. }) => record(sink, b'H', t.as_bytes()),
        Ok(b) => other(sink, &b.kind, raw.get()),
        Err(_) => other(sink, "", raw.get()),
    }
}
