//! A model's own tokenizer and chat template, so chat and text prompts are chained as the
//! token ids the engine computes — and match its KV events block for block.
//!
//! Semantics are the engine's (vLLM's `/v1/chat/completions` and `/v1/completions`):
//! - chat: the template rendered with `messages` (assistant tool calls' `arguments` as
//!   objects, as vLLM passes them: `engine_messages`), `tools`, `add_generation_prompt=True`,
//!   the special tokens' strings and the request's `chat_template_kwargs`; the text then
//!   encoded without adding special tokens (the template writes them; they are parsed
//!   as special tokens, so there is no second BOS);
//! - completions: the prompt encoded with special tokens added.
//!
//! Loading reads a Hugging Face model directory: `tokenizer.json` (the `tokenizers`
//! library — no hand-written BPE), the chat template from `chat_template.jinja` or
//! `tokenizer_config.json` (a string, or named templates of which `default` or the
//! first is used), and the special tokens there. Special tokens are added as
//! `tokenizer.json`'s post-processor says; `add_bos_token`/`add_eos_token` in the config
//! are ignored as transformers ignores them when `tokenizer.json` is present (the fidelity
//! test's trained fixture sets them against its post-processor to hold us to that).
//!
//! Cost proportional to what is new: the tokenizer splits text at its added tokens
//! before anything else and encodes the pieces between them independently, so a piece's
//! ids depend only on the piece (and, for some pre-tokenizers, on whether it starts the
//! text). [`cache::SegmentCache`] keeps the ids of pieces already seen, shared by all
//! requests: a conversation's next turn encodes only its new messages, a system prompt
//! is encoded once. A piece not at the start is encoded behind a special token that is
//! then dropped, so it sees exactly the context it has in the whole text. A tokenizer
//! whose added tokens strip whitespace or match on normalized text (with a normalizer
//! that changes text) gets no cache: every request is encoded whole, still exactly.

mod cache;
pub mod template;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::Value;

pub use cache::{CacheStats, SegmentCache};

/// Why a prompt could not be tokenized; `reason()` is the stable label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizeError {
    /// The model directory could not be loaded.
    Load(String),
    /// The model has no chat template.
    NoTemplate,
    /// The template failed (including its own `raise_exception`).
    Template(String),
    /// A message part the template cannot take as text (image, audio, ...).
    Multimodal,
    /// The request body is not a chat/completions body.
    BadRequest(String),
    Encode(String),
}

impl TokenizeError {
    pub fn reason(&self) -> &'static str {
        match self {
            TokenizeError::Load(_) => "tokenizer_load",
            TokenizeError::NoTemplate => "no_chat_template",
            TokenizeError::Template(_) => "template_error",
            TokenizeError::Multimodal => "multimodal",
            TokenizeError::BadRequest(_) => "bad_request",
            TokenizeError::Encode(_) => "encode_error",
        }
    }
}

impl std::fmt::Display for TokenizeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenizeError::Load(e) => write!(f, "cannot load the tokenizer: {e}"),
            TokenizeError::NoTemplate => f.write_str("the model directory has no chat template"),
            TokenizeError::Template(e) => write!(f, "chat template: {e}"),
            TokenizeError::Multimodal => {
                f.write_str("the messages have non-text parts; routed by prediction")
            }
            TokenizeError::BadRequest(e) => write!(f, "{e}"),
            TokenizeError::Encode(e) => write!(f, "encoding: {e}"),
        }
    }
}

impl std::error::Error for TokenizeError {}

/// The special tokens' strings a template may print.
const SPECIAL_NAMES: [&str; 4] = ["bos_token", "eos_token", "unk_token", "pad_token"];

/// How the text is cut at added tokens (None: no cache for this tokenizer).
struct Splitter {
    /// Added tokens matched on the raw text, and their ids.
    raw: AhoCorasick,
    raw_ids: Vec<u32>,
    /// Added tokens matched on normalized text (the normalizer leaves text unchanged).
    normalized: Option<(AhoCorasick, Vec<u32>)>,
    /// A special token to put in front of a piece that does not start the text.
    lead: (String, u32),
}

pub struct ModelTokenizer {
    dir: PathBuf,
    tok: tokenizers::Tokenizer,
    env: Option<minijinja::Environment<'static>>,
    specials: HashMap<&'static str, String>,
    splitter: Option<Splitter>,
    cache: SegmentCache,
}

/// One piece of text between added tokens.
enum Piece<'a> {
    Added(u32),
    Text { text: &'a str, at_start: bool },
}

fn token_string(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

fn load_err(p: &Path, e: impl std::fmt::Display) -> TokenizeError {
    TokenizeError::Load(format!("{}: {e}", p.display()))
}

impl ModelTokenizer {
    /// Load a Hugging Face model directory; `cache_bytes` bounds the segment cache.
    pub fn load(dir: &Path, cache_bytes: usize) -> Result<ModelTokenizer, TokenizeError> {
        let tj = dir.join("tokenizer.json");
        let tok = tokenizers::Tokenizer::from_file(&tj).map_err(|e| load_err(&tj, e))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Value = match std::fs::read(&cfg_path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| load_err(&cfg_path, e))?,
            Err(_) => Value::Null,
        };
        let jinja = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&jinja) {
            Ok(s) => Some(s),
            Err(_) => match &cfg["chat_template"] {
                Value::String(s) => Some(s.clone()),
                Value::Array(named) => named
                    .iter()
                    .find(|t| t["name"] == "default")
                    .or(named.first())
                    .and_then(|t| t["template"].as_str())
                    .map(str::to_owned),
                _ => None,
            },
        };
        let env = source
            .map(template::environment)
            .transpose()
            .map_err(|e| load_err(&jinja, e))?;
        let specials = SPECIAL_NAMES
            .iter()
            .filter_map(|n| token_string(&cfg[*n]).map(|s| (*n, s)))
            .collect();
        let splitter = Self::splitter(&tj)?;
        Ok(ModelTokenizer {
            dir: dir.to_owned(),
            tok,
            env,
            specials,
            splitter,
            cache: SegmentCache::new(cache_bytes),
        })
    }

    /// The added tokens as the tokenizer splits on them, when pieces can be encoded
    /// independently (see the module doc).
    fn splitter(tj: &Path) -> Result<Option<Splitter>, TokenizeError> {
        #[derive(serde::Deserialize)]
        struct Added {
            id: u32,
            content: String,
            #[serde(default)]
            single_word: bool,
            #[serde(default)]
            lstrip: bool,
            #[serde(default)]
            rstrip: bool,
            #[serde(default)]
            normalized: bool,
            #[serde(default)]
            special: bool,
        }
        #[derive(serde::Deserialize)]
        struct File {
            #[serde(default)]
            added_tokens: Vec<Added>,
            #[serde(default)]
            normalizer: Value,
        }
        let f: File = serde_json::from_slice(&std::fs::read(tj).map_err(|e| load_err(tj, e))?)
            .map_err(|e| load_err(tj, e))?;
        let trivial_normalizer = match &f.normalizer {
            Value::Null => true,
            v => v["type"] == "Sequence" && v["normalizers"].as_array().is_some_and(Vec::is_empty),
        };
        if f.added_tokens
            .iter()
            .any(|a| a.single_word || a.lstrip || a.rstrip || (a.normalized && !trivial_normalizer))
        {
            return Ok(None);
        }
        let Some(lead) = f
            .added_tokens
            .iter()
            .find(|a| a.special && !a.normalized && !a.content.is_empty())
            .map(|a| (a.content.clone(), a.id))
        else {
            return Ok(None);
        };
        let build = |set: Vec<&Added>| -> Result<(AhoCorasick, Vec<u32>), TokenizeError> {
            let ac = AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(set.iter().map(|a| a.content.as_str()))
                .map_err(|e| load_err(tj, e))?;
            Ok((ac, set.iter().map(|a| a.id).collect()))
        };
        let (raw, raw_ids) = build(f.added_tokens.iter().filter(|a| !a.normalized).collect())?;
        let norm: Vec<&Added> = f.added_tokens.iter().filter(|a| a.normalized).collect();
        let normalized = if norm.is_empty() {
            None
        } else {
            Some(build(norm)?)
        };
        Ok(Some(Splitter {
            raw,
            raw_ids,
            normalized,
            lead,
        }))
    }

    /// Use the template in `file` instead of the directory's, as an engine started with
    /// vLLM's `--chat-template FILE` does.
    pub fn with_chat_template(mut self, file: &Path) -> Result<ModelTokenizer, TokenizeError> {
        let source = std::fs::read_to_string(file).map_err(|e| load_err(file, e))?;
        self.env = Some(template::environment(source).map_err(|e| load_err(file, e))?);
        Ok(self)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn has_template(&self) -> bool {
        self.env.is_some()
    }

    /// Whether requests share encoded pieces (see the module doc).
    pub fn caches_segments(&self) -> bool {
        self.splitter.is_some()
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// The chat prompt as the engine renders it. `body` is the request body's JSON.
    pub fn render_chat(&self, body: &Value) -> Result<String, TokenizeError> {
        self.render_chat_value(&minijinja::Value::from_serialize(body))
    }

    fn render_chat_value(&self, body: &minijinja::Value) -> Result<String, TokenizeError> {
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
                    if part.get_attr("type").ok().as_ref().and_then(|t| t.as_str()) != Some("text")
                    {
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
        ctx.insert("messages".into(), engine_messages(&messages)?);
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
        let t = env
            .get_template(template::NAME)
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        let mut text = t
            .render(ctx)
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        if flag("continue_final_message", false) {
            cut_after_final(&mut text, &messages)?;
        }
        Ok(text)
    }

    /// The token ids of a request body: chat (rendered, then encoded without added
    /// special tokens) or completions (a string prompt, encoded with them).
    pub fn tokenize_request(&self, chat: bool, body: &Value) -> Result<Vec<u32>, TokenizeError> {
        self.tokenize_value(chat, &minijinja::Value::from_serialize(body))
    }

    /// [`ModelTokenizer::tokenize_request`] of a body given as JSON text (the route
    /// path: parsed once, straight into the template's values).
    pub fn tokenize_json(&self, chat: bool, json: &str) -> Result<Vec<u32>, TokenizeError> {
        self.tokenize_value(chat, &parse_body(json)?)
    }

    /// [`ModelTokenizer::render_chat`] of a body given as JSON text: the route path's
    /// first stage (parse and render), on its own so a benchmark can say what it costs.
    pub fn render_chat_json(&self, json: &str) -> Result<String, TokenizeError> {
        self.render_chat_value(&parse_body(json)?)
    }

    fn tokenize_value(
        &self,
        chat: bool,
        body: &minijinja::Value,
    ) -> Result<Vec<u32>, TokenizeError> {
        use minijinja::value::ValueKind;
        if chat {
            let text = self.render_chat_value(body)?;
            let special = body
                .get_attr("add_special_tokens")
                .ok()
                .is_some_and(|v| v.is_true());
            return self.encode(&text, special);
        }
        let prompt = body.get_attr("prompt").unwrap_or_default();
        let first = match prompt.kind() {
            // A batch goes to one pod: route by its first prompt, as the filter does.
            ValueKind::Seq => prompt.get_item_by_index(0).unwrap_or_default(),
            _ => prompt,
        };
        match first.as_str() {
            Some(p) => self.encode(p, true),
            None => Err(TokenizeError::BadRequest(
                "a completions body needs a string `prompt`".into(),
            )),
        }
    }

    /// Encode `text` as the engine does; pieces between added tokens come from the
    /// cache when they can (chat), the whole text otherwise.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        match (&self.splitter, add_special_tokens) {
            (Some(sp), false) => self.encode_pieces(sp, text),
            _ => self.encode_whole(text, add_special_tokens),
        }
    }

    /// The reference: the tokenizer on the whole text, no cache.
    pub fn encode_whole(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        self.tok
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    fn encode_pieces(&self, sp: &Splitter, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let mut ids = Vec::with_capacity(text.len() / 3);
        for piece in split(sp, text) {
            match piece {
                Piece::Added(id) => ids.push(id),
                Piece::Text { text, at_start } => {
                    let got = self.cache.get_or_try_insert(text, at_start, || {
                        self.encode_piece(sp, text, at_start)
                    })?;
                    ids.extend_from_slice(&got);
                }
            }
        }
        Ok(ids)
    }

    fn encode_piece(
        &self,
        sp: &Splitter,
        text: &str,
        at_start: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        if at_start {
            return self.encode_whole(text, false);
        }
        let mut s = String::with_capacity(sp.lead.0.len() + text.len());
        s.push_str(&sp.lead.0);
        s.push_str(text);
        let ids = self.encode_whole(&s, false)?;
        match ids.split_first() {
            Some((first, rest)) if *first == sp.lead.1 => Ok(rest.to_vec()),
            _ => Err(TokenizeError::Encode(format!(
                "the lead token {:?} did not encode alone",
                sp.lead.0
            ))),
        }
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

/// A request body parsed straight into the template's values.
fn parse_body(json: &str) -> Result<minijinja::Value, TokenizeError> {
    serde_json::from_str(json).map_err(|e| TokenizeError::BadRequest(format!("prompt body: {e}")))
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

/// Cut `text` at added tokens as the tokenizer does: first the raw-text tokens
/// (leftmost-longest), then, inside what is left, the normalized-text ones.
fn split<'a>(sp: &Splitter, text: &'a str) -> Vec<Piece<'a>> {
    let mut out = Vec::new();
    let push_text = |out: &mut Vec<Piece<'a>>, start: usize, end: usize| {
        if start >= end {
            return;
        }
        let seg = &text[start..end];
        match &sp.normalized {
            None => out.push(Piece::Text {
                text: seg,
                at_start: start == 0,
            }),
            Some((ac, ids)) => {
                let mut at = start;
                for m in ac.find_iter(seg) {
                    if start + m.start() > at {
                        out.push(Piece::Text {
                            text: &text[at..start + m.start()],
                            at_start: at == 0,
                        });
                    }
                    out.push(Piece::Added(ids[m.pattern().as_usize()]));
                    at = start + m.end();
                }
                if at < end {
                    out.push(Piece::Text {
                        text: &text[at..end],
                        at_start: at == 0,
                    });
                }
            }
        }
    };
    let mut at = 0;
    for m in sp.raw.find_iter(text) {
        push_text(&mut out, at, m.start());
        out.push(Piece::Added(sp.raw_ids[m.pattern().as_usize()]));
        at = m.end();
    }
    push_text(&mut out, at, text.len());
    out
}

/// Tokenizers by model, loaded at start (`--tokenizer MODEL=DIR`).
#[derive(Default)]
pub struct Tokenizers {
    by_model: HashMap<String, Arc<ModelTokenizer>>,
}

impl Tokenizers {
    pub fn insert(&mut self, model: &str, t: ModelTokenizer) {
        self.by_model.insert(model.to_owned(), Arc::new(t));
    }

    pub fn get(&self, model: &str) -> Option<&Arc<ModelTokenizer>> {
        self.by_model.get(model)
    }

    pub fn models(&self) -> impl Iterator<Item = (&String, &Arc<ModelTokenizer>)> {
        self.by_model.iter()
    }
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
