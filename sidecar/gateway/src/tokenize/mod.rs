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

mod agent;
mod budget;
mod cache;
mod chat;
mod chunks;
mod conversation;
mod error;
mod filters;
mod pyops;
mod pyvalue;
mod responses;
pub mod template;
#[cfg(test)]
mod testkit;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::Value;

pub use budget::{Budget, Refused, DEFAULT_BUDGET_BYTES, MAX_FIELDS_BYTES};
pub use cache::{CacheStats, SegmentCache};
pub use chunks::ChunkStats;
pub use conversation::ContentFormat;
pub use error::TokenizeError;

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
    /// Whether the pre-tokenizer allows cutting long prompts at newlines (`chunks.rs`).
    chunkable: bool,
}

pub struct ModelTokenizer {
    dir: PathBuf,
    tok: tokenizers::Tokenizer,
    env: Option<template::ChatTemplate>,
    /// Which template `env` renders: where it came from and its text's sha256, so an
    /// operator can tell which template a disagreeing model runs.
    template: Option<Arc<str>>,
    specials: HashMap<&'static str, String>,
    splitter: Option<Splitter>,
    cache: SegmentCache,
    /// Long completions prompts in cached chunks (`chunks.rs`), where the tokenizer allows.
    chunking: Option<chunks::Chunking>,
    /// vLLM's probes of the template for Messages requests (`agent.rs`), once each.
    merge_inline_system: std::sync::OnceLock<bool>,
    disabled_effort: std::sync::OnceLock<&'static str>,
    /// How the template reads `content` (`conversation.rs`), decided from its source as
    /// written (the environment holds the source after `template.rs`'s pre-passes, whose
    /// loop wrappers vLLM never sees).
    content_format: ContentFormat,
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

fn template_id(from: &str, source: &str) -> Arc<str> {
    use sha2::Digest;
    use std::fmt::Write;
    let mut id = format!("{from} sha256:");
    for b in &sha2::Sha256::digest(source.as_bytes())[..8] {
        let _ = write!(id, "{b:02x}");
    }
    id.into()
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
            Ok(s) => Some(("chat_template.jinja", s)),
            Err(_) => match &cfg["chat_template"] {
                Value::String(s) => Some(("tokenizer_config.json", s.clone())),
                Value::Array(named) => named
                    .iter()
                    .find(|t| t["name"] == "default")
                    .or(named.first())
                    .and_then(|t| t["template"].as_str())
                    .map(|s| ("tokenizer_config.json", s.to_owned())),
                _ => None,
            },
        };
        let template = source.as_ref().map(|(from, s)| template_id(from, s));
        let content_format = source.as_ref().map_or(ContentFormat::String, |(_, s)| {
            conversation::content_format_of(s)
        });
        let env = source
            .map(|(_, s)| template::environment(s))
            .transpose()
            .map_err(|e| load_err(&jinja, e))?;
        let specials = SPECIAL_NAMES
            .iter()
            .filter_map(|n| token_string(&cfg[*n]).map(|s| (*n, s)))
            .collect();
        let splitter = Self::splitter(&tj)?;
        let mut t = ModelTokenizer {
            dir: dir.to_owned(),
            tok,
            env,
            template,
            specials,
            splitter,
            cache: SegmentCache::new(cache_bytes),
            chunking: None,
            merge_inline_system: std::sync::OnceLock::new(),
            disabled_effort: std::sync::OnceLock::new(),
            content_format,
        };
        t.chunking = t.chunking_checked();
        Ok(t)
    }

    /// Chunking, if the tokenizer allows it and a sample encodes alike both ways (with
    /// its own segment cache, so the check leaves nothing in the shared one).
    fn chunking_checked(&self) -> Option<chunks::Chunking> {
        let sp = self.splitter.as_ref().filter(|sp| sp.chunkable)?;
        let probe = "a b";
        let affix = chunks::Affix::between(
            &self.encode_whole(probe, true).ok()?,
            &self.encode_whole(probe, false).ok()?,
        )?;
        let sample = chunks::sample();
        let scratch = SegmentCache::new(16 << 20);
        let chunked = self
            .encode_chunks(sp, &scratch, &affix, &sample, 256)
            .ok()?;
        (chunked == self.encode_whole(&sample, true).ok()?).then(|| chunks::Chunking::new(affix))
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
            #[serde(default)]
            pre_tokenizer: Value,
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
            chunkable: chunks::pre_tokenizer_ok(&f.pre_tokenizer),
        }))
    }

    /// Use the template in `file` instead of the directory's, as an engine started with
    /// vLLM's `--chat-template FILE` does.
    pub fn with_chat_template(mut self, file: &Path) -> Result<ModelTokenizer, TokenizeError> {
        let source = std::fs::read_to_string(file).map_err(|e| load_err(file, e))?;
        self.template = Some(template_id(&file.display().to_string(), &source));
        self.content_format = conversation::content_format_of(&source);
        self.env = Some(template::environment(source).map_err(|e| load_err(file, e))?);
        self.merge_inline_system = std::sync::OnceLock::new();
        self.disabled_effort = std::sync::OnceLock::new();
        Ok(self)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn has_template(&self) -> bool {
        self.env.is_some()
    }

    /// The chat template's identity, `<where it came from> sha256:<16 hex digits of its
    /// text's sha256>` (`sha256sum` of a template file shows the same digits).
    pub fn template_id(&self) -> Option<&Arc<str>> {
        self.template.as_ref()
    }

    /// Whether requests share encoded pieces (see the module doc).
    pub fn caches_segments(&self) -> bool {
        self.splitter.is_some()
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// Chunked completions prompts (None: this tokenizer encodes them whole).
    pub fn chunk_stats(&self) -> Option<ChunkStats> {
        self.chunking.as_ref().map(chunks::Chunking::stats)
    }

    /// The token ids of a request body: chat (rendered, then encoded without added
    /// special tokens) or completions (a string prompt, encoded with them).
    pub fn tokenize_request(&self, chat: bool, body: &Value) -> Result<Vec<u32>, TokenizeError> {
        self.tokenize_value(chat, &minijinja::Value::from_serialize(body), 0)
    }

    /// [`ModelTokenizer::tokenize_request`] of a body given as JSON text (the route
    /// path: parsed once, straight into the template's values).
    pub fn tokenize_json(&self, chat: bool, json: &str) -> Result<Vec<u32>, TokenizeError> {
        self.tokenize_value(chat, &parse_body(json)?, json.len())
    }

    /// The token ids of a request's template fields from the API they were sent to:
    /// Messages bodies are first made the chat request vLLM makes of them (`agent.rs`),
    /// Responses bodies the chat messages (`responses.rs`).
    pub fn tokenize_api(
        &self,
        chat: bool,
        api: Option<kvroute_shared::protocol::PromptApi>,
        json: &str,
    ) -> Result<Vec<u32>, TokenizeError> {
        use kvroute_shared::protocol::PromptApi;
        match api {
            None | Some(PromptApi::Chat) | Some(PromptApi::Completions) => {
                self.tokenize_json(chat, json)
            }
            // Parsed once into the template's values, converted without copying text.
            Some(PromptApi::Messages) => {
                let chat = self.messages_to_chat_value(&parse_body(json)?)?;
                self.tokenize_value(true, &chat, json.len())
            }
            Some(PromptApi::Responses) => {
                let chat = self.responses_to_chat_value(&parse_body(json)?)?;
                self.tokenize_value(true, &chat, json.len())
            }
        }
    }

    /// The token ids of a request body sent to `api`'s endpoint.
    pub fn tokenize_for(
        &self,
        api: kvroute_shared::protocol::PromptApi,
        body: &Value,
    ) -> Result<Vec<u32>, TokenizeError> {
        use kvroute_shared::protocol::PromptApi;
        match api {
            PromptApi::Completions => self.tokenize_request(false, body),
            PromptApi::Chat => self.tokenize_request(true, body),
            PromptApi::Messages => self.tokenize_value(true, &self.messages_to_chat(body)?, 0),
            PromptApi::Responses => self.tokenize_value(
                true,
                &self.responses_to_chat_value(&minijinja::Value::from_serialize(body))?,
                0,
            ),
        }
    }

    /// `size_hint`: the body's JSON length when known (0 otherwise), which bounds the
    /// rendered text closely enough to allocate it once.
    fn tokenize_value(
        &self,
        chat: bool,
        body: &minijinja::Value,
        size_hint: usize,
    ) -> Result<Vec<u32>, TokenizeError> {
        use minijinja::value::ValueKind;
        if chat {
            let text = self.render_chat_value(body, size_hint)?;
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
            Some(p) => self.encode_prompt(p),
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

    /// A completions prompt, encoded with special tokens as the engine does: a long one
    /// in chunks from the cache where the tokenizer allows (`chunks.rs`), every
    /// [`chunks::VERIFY_EVERY`]-th of those checked against the whole.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let (Some(sp), Some(ch)) = (&self.splitter, &self.chunking) else {
            return self.encode_whole(text, true);
        };
        if !ch.on() || text.len() < chunks::MIN_CHUNKED_BYTES {
            return self.encode_whole(text, true);
        }
        let check = ch.count();
        let ids = self.encode_chunks(sp, &self.cache, &ch.affix, text, chunks::MIN_CHUNK_BYTES)?;
        if !check {
            return Ok(ids);
        }
        let whole = self.encode_whole(text, true)?;
        let same = ids == whole;
        ch.checked(same);
        if !same {
            tracing::warn!(
                tokenizer = %self.dir.display(),
                "a chunked prompt encoded differently from the whole: chunking turned off"
            );
        }
        Ok(whole)
    }

    /// The chunked encoding of a completions prompt itself, unchecked and whatever its
    /// length (None: this tokenizer encodes prompts whole): what the fidelity tests hold
    /// to [`ModelTokenizer::encode_whole`].
    pub fn encode_prompt_chunks(&self, text: &str) -> Option<Result<Vec<u32>, TokenizeError>> {
        let (sp, ch) = (self.splitter.as_ref()?, self.chunking.as_ref()?);
        Some(self.encode_chunks(sp, &self.cache, &ch.affix, text, chunks::MIN_CHUNK_BYTES))
    }

    /// `affix` around the text's pieces between added tokens, each cut into chunks of
    /// at least `min` bytes, each chunk's ids from `cache`.
    fn encode_chunks(
        &self,
        sp: &Splitter,
        cache: &SegmentCache,
        affix: &chunks::Affix,
        text: &str,
        min: usize,
    ) -> Result<Vec<u32>, TokenizeError> {
        let mut ids = Vec::with_capacity(text.len() / 3 + affix.prefix.len() + affix.suffix.len());
        ids.extend_from_slice(&affix.prefix);
        for piece in split(sp, text) {
            match piece {
                Piece::Added(id) => ids.push(id),
                Piece::Text { text, at_start } => {
                    for (a, b) in chunks::cuts(text, min) {
                        let (chunk, first) = (&text[a..b], at_start && a == 0);
                        let got = cache.get_or_try_insert(chunk, first, || {
                            self.encode_piece(sp, chunk, first)
                        })?;
                        ids.extend_from_slice(&got);
                    }
                }
            }
        }
        ids.extend_from_slice(&affix.suffix);
        Ok(ids)
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

/// A request body parsed straight into the template's values.
fn parse_body(json: &str) -> Result<minijinja::Value, TokenizeError> {
    serde_json::from_str(json).map_err(|e| TokenizeError::BadRequest(format!("prompt body: {e}")))
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
