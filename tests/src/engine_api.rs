//! The engine simulator's four APIs: which one a path is, how a Messages or Responses
//! body reads as text when no model directory is given, the Responses store (a
//! `previous_response_id` is honoured only by the engine that stored it, as vLLM's
//! in-memory store does), and each API's response and stream events in the shapes the
//! real servers send (so the real Anthropic and OpenAI SDKs parse them).

use std::collections::{HashMap, VecDeque};

use serde_json::{json, Value};

/// Which API a request came on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Completions,
    Chat,
    Messages,
    Responses,
}

impl Api {
    pub fn of(path: &str) -> Api {
        if path.ends_with("/chat/completions") {
            Api::Chat
        } else if path.ends_with("/messages") {
            Api::Messages
        } else if path.ends_with("/responses") {
            Api::Responses
        } else {
            Api::Completions
        }
    }
}

fn block_text(b: &Value, out: &mut String) {
    match b {
        Value::String(s) => out.push_str(s),
        Value::Array(items) => {
            for i in items {
                block_text(i, out);
            }
        }
        Value::Object(o) => {
            for key in [
                "text",
                "thinking",
                "name",
                "arguments",
                "output",
                "content",
                "summary",
            ] {
                if let Some(v) = o.get(key) {
                    block_text(v, out);
                    out.push(' ');
                }
            }
            if let Some(input) = o.get("input").filter(|v| v.is_object()) {
                out.push_str(&input.to_string());
            }
        }
        _ => {}
    }
}

/// A Messages or Responses body as ChatML-shaped text (the simulator's own template for
/// engines started without a model directory): system or instructions, then each turn's
/// role and the text of its blocks or items.
pub fn agent_text(api: Api, v: &Value) -> Result<String, String> {
    let mut text = String::new();
    let mut turn = |role: &str, content: &Value| {
        text.push_str("<|im_start|>");
        text.push_str(role);
        text.push('\n');
        block_text(content, &mut text);
        text.push_str("<|im_end|>\n");
    };
    match api {
        Api::Messages => {
            if let Some(s) = v.get("system").filter(|s| !s.is_null()) {
                // vLLM drops Claude Code's per-request billing header before rendering.
                let kept: Vec<Value> = match s {
                    Value::Array(blocks) => blocks
                        .iter()
                        .filter(|b| {
                            !b["text"].as_str().is_some_and(|t| {
                                t.starts_with(kvroute_shared::canon::BILLING_HEADER)
                            })
                        })
                        .cloned()
                        .collect(),
                    other => vec![other.clone()],
                };
                turn("system", &Value::Array(kept));
            }
            let msgs = v["messages"]
                .as_array()
                .ok_or("`messages` must be a list")?;
            for m in msgs {
                turn(m["role"].as_str().unwrap_or("user"), &m["content"]);
            }
        }
        Api::Responses => {
            // A continued response's instructions are already in its stored history.
            let continued = v["previous_response_id"].is_string();
            if let Some(s) = v
                .get("instructions")
                .filter(|s| s.is_string() && !continued)
            {
                turn("system", s);
            }
            match &v["input"] {
                Value::String(s) => turn("user", &Value::from(s.as_str())),
                Value::Array(items) => {
                    for i in items {
                        let role = i["role"].as_str().unwrap_or("tool");
                        turn(role, i.get("content").unwrap_or(i));
                    }
                }
                _ => return Err("`input` is a string or a list".into()),
            }
        }
        _ => return Err("not an agent API".into()),
    }
    text.push_str("<|im_start|>assistant\n");
    Ok(text)
}

/// Stored Responses: id → the whole conversation's tokens (prompt and output), oldest
/// dropped past `cap`.
pub struct ResponseStore {
    map: HashMap<String, Vec<u32>>,
    order: VecDeque<String>,
    cap: usize,
    next: u64,
}

impl ResponseStore {
    pub fn new(cap: usize) -> ResponseStore {
        ResponseStore {
            map: HashMap::new(),
            order: VecDeque::new(),
            cap,
            next: 0,
        }
    }

    /// A new id, unique to this engine (`pod` is in it).
    pub fn new_id(&mut self, pod: &str) -> String {
        self.next += 1;
        let tag = xxhash_rust::xxh3::xxh3_64(pod.as_bytes());
        format!("resp_{tag:016x}{:08}", self.next)
    }

    pub fn get(&self, id: &str) -> Option<&Vec<u32>> {
        self.map.get(id)
    }

    pub fn put(&mut self, id: String, tokens: Vec<u32>) {
        if self.map.insert(id.clone(), tokens).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > self.cap {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }
}

/// The numbers every API's usage is made of.
#[derive(Clone, Copy, Debug)]
pub struct Counts {
    pub prompt: u64,
    pub cached: u64,
    pub output: u64,
}

/// `usage` as `api` writes it.
pub fn usage(api: Api, c: Counts) -> Value {
    match api {
        Api::Messages => json!({"input_tokens": c.prompt - c.cached,
                                "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": c.cached, "output_tokens": c.output}),
        Api::Responses => json!({"input_tokens": c.prompt,
                                 "input_tokens_details": {"cached_tokens": c.cached},
                                 "output_tokens": c.output,
                                 "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": c.prompt + c.output}),
        _ => json!({"prompt_tokens": c.prompt, "completion_tokens": c.output,
                    "total_tokens": c.prompt + c.output,
                    "prompt_tokens_details": {"cached_tokens": c.cached}}),
    }
}

/// The identity of one response: its id and what it answers.
pub struct Reply<'a> {
    pub id: &'a str,
    pub model: &'a str,
    pub previous: Option<&'a str>,
}

fn message(r: &Reply<'_>, text: &str, usage: Value) -> Value {
    json!({"id": r.id, "type": "message", "role": "assistant", "model": r.model,
           "content": [{"type": "text", "text": text}], "stop_reason": "max_tokens",
           "stop_sequence": null, "usage": usage})
}

fn response(r: &Reply<'_>, status: &str, text: Option<&str>, usage: Value) -> Value {
    let output = match text {
        Some(t) => json!([{"type": "message", "id": format!("msg_{}", r.id), "status": "completed",
                           "role": "assistant",
                           "content": [{"type": "output_text", "text": t, "annotations": []}]}]),
        None => json!([]),
    };
    json!({"id": r.id, "object": "response", "created_at": 0, "status": status, "model": r.model,
           "output": output, "parallel_tool_calls": true, "tool_choice": "auto", "tools": [],
           "previous_response_id": r.previous, "usage": usage})
}

/// The whole (non-streamed) response body of `api`.
pub fn body(api: Api, r: &Reply<'_>, text: &str, c: Counts) -> Value {
    match api {
        Api::Messages => message(r, text, usage(api, c)),
        Api::Responses => response(r, "completed", Some(text), usage(api, c)),
        Api::Chat => json!({"id": r.id, "object": "chat.completion", "model": r.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "length"}], "usage": usage(api, c)}),
        Api::Completions => json!({"id": r.id, "object": "text_completion", "model": r.model,
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": usage(api, c)}),
    }
}

fn sse(event: Option<&str>, data: &Value) -> String {
    match event {
        Some(e) => format!("event: {e}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    }
}

/// What a stream sends before its first token.
pub fn stream_start(api: Api, r: &Reply<'_>, c: Counts) -> String {
    match api {
        Api::Messages => {
            let mut m = message(r, "", usage(api, Counts { output: 0, ..c }));
            m["content"] = json!([]);
            m["stop_reason"] = Value::Null;
            sse(
                Some("message_start"),
                &json!({"type": "message_start", "message": m}),
            ) + &sse(
                Some("content_block_start"),
                &json!({"type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}}),
            )
        }
        Api::Responses => {
            let created = response(r, "in_progress", None, Value::Null);
            sse(
                Some("response.created"),
                &json!({"type": "response.created", "sequence_number": 0, "response": created}),
            ) + &sse(
                Some("response.output_item.added"),
                &json!({"type": "response.output_item.added", "sequence_number": 1,
                               "output_index": 0,
                               "item": {"type": "message", "id": format!("msg_{}", r.id),
                                        "status": "in_progress", "role": "assistant", "content": []}}),
            ) + &sse(
                Some("response.content_part.added"),
                &json!({"type": "response.content_part.added", "sequence_number": 2,
                               "item_id": format!("msg_{}", r.id), "output_index": 0,
                               "content_index": 0,
                               "part": {"type": "output_text", "text": "", "annotations": []}}),
            )
        }
        _ => String::new(),
    }
}

/// One token's chunk.
pub fn stream_token(api: Api, r: &Reply<'_>, i: u64, piece: &str) -> String {
    match api {
        Api::Messages => sse(
            Some("content_block_delta"),
            &json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": piece}}),
        ),
        Api::Responses => sse(
            Some("response.output_text.delta"),
            &json!({"type": "response.output_text.delta", "sequence_number": 3 + i,
                    "item_id": format!("msg_{}", r.id), "output_index": 0, "content_index": 0,
                    "delta": piece, "logprobs": []}),
        ),
        Api::Chat => sse(
            None,
            &json!({"object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {"content": piece}}], "usage": null}),
        ),
        Api::Completions => sse(
            None,
            &json!({"object": "text_completion",
                    "choices": [{"index": 0, "text": piece}], "usage": null}),
        ),
    }
}

/// What a stream sends after its last token (`with_usage`: chat and completions only
/// send usage when asked).
pub fn stream_end(api: Api, r: &Reply<'_>, text: &str, c: Counts, with_usage: bool) -> String {
    match api {
        Api::Messages => {
            sse(
                Some("content_block_stop"),
                &json!({"type": "content_block_stop", "index": 0}),
            ) + &sse(
                Some("message_delta"),
                &json!({"type": "message_delta",
                               "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
                               "usage": usage(api, c)}),
            ) + &sse(Some("message_stop"), &json!({"type": "message_stop"}))
        }
        Api::Responses => {
            let n = 3 + c.output;
            let item = format!("msg_{}", r.id);
            let part = json!({"type": "output_text", "text": text, "annotations": []});
            sse(
                Some("response.output_text.done"),
                &json!({"type": "response.output_text.done", "sequence_number": n,
                        "item_id": item, "output_index": 0, "content_index": 0, "text": text,
                        "logprobs": []}),
            ) + &sse(
                Some("response.content_part.done"),
                &json!({"type": "response.content_part.done", "sequence_number": n + 1,
                               "item_id": item, "output_index": 0, "content_index": 0,
                               "part": part}),
            ) + &sse(
                Some("response.output_item.done"),
                &json!({"type": "response.output_item.done", "sequence_number": n + 2,
                               "output_index": 0,
                               "item": {"type": "message", "id": item, "status": "completed",
                                        "role": "assistant", "content": [part]}}),
            ) + &sse(
                Some("response.completed"),
                &json!({"type": "response.completed", "sequence_number": n + 3,
                               "response": response(r, "completed", Some(text), usage(api, c))}),
            )
        }
        _ => {
            let mut s = String::new();
            if with_usage {
                s = sse(
                    None,
                    &json!({"object": "chunk", "choices": [], "usage": usage(api, c)}),
                );
            }
            s + "data: [DONE]\n\n"
        }
    }
}
