//! Prompt canonicalization: from an OpenAI-style request body to the exact units that
//! are chained.
//!
//! Token-id prompts are chained as tokens ([`Mode::Tokens`]): the same keys the engines
//! compute, so engine events and routing meet. Text prompts are chained as bytes
//! ([`Mode::Text`]) of a canonical form that only the router sees:
//!
//! - `/v1/completions` with a string prompt: the prompt's UTF-8 bytes, unframed, so a
//!   prompt that extends another shares its blocks.
//! - `/v1/chat/completions`: a sequence of records `tag:u8 ++ u32le(len) ++ payload`:
//!   `T` tools (the `tools` JSON as sent), then per message `M` role, `N` name,
//!   `C` text, `I` image (u64le xxh3 of its URL or data), `A` audio (u64le xxh3 of its
//!   data), `P` any other part (`type` ++ u64le xxh3 of the part's JSON), `K` tool
//!   calls (JSON as sent), `D` tool call id.
//!
//! Why records with lengths: the form of the first k messages is a byte prefix of the
//! form of the first k+1 (records are only appended), and no content can forge a
//! boundary: the encoding is uniquely decodable, so two different conversations never
//! share a canonical form. Text parts are written straight into the chain hasher; the
//! body is parsed with borrowed strings, so only strings with JSON escapes are copied,
//! once. A batched prompt (a list of prompts) is routed by its first element, because a
//! request goes to one pod.
//!
//! The record encoder and the borrowed types it encodes live together here, so the
//! uniqueness argument above is checked in one file; reading a body into those types is
//! `parse.rs` (serde) and `skim.rs` (the token-list fast path).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use xxhash_rust::xxh3::xxh3_64;

use crate::chain::{ChainHasher, Mode, Namespace};

/// Which API endpoint a body was sent to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
    /// Anthropic's Messages API.
    Messages,
    /// OpenAI's Responses API.
    Responses,
}

impl Endpoint {
    /// The endpoint a request path names, ignoring a query string.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        let path = path.split('?').next().unwrap_or(path);
        match path.trim_end_matches('/') {
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/messages" => Some(Endpoint::Messages),
            "/v1/responses" => Some(Endpoint::Responses),
            _ => None,
        }
    }
}

/// Why a body cannot be routed. The request still goes through (fail open); this only
/// says why it was not steered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CanonError {
    /// Not JSON, or JSON of the wrong shape (serde's message says where).
    Json(String),
    /// The field the endpoint needs (`prompt` or `messages`) is absent.
    Missing(&'static str),
    /// The prompt holds nothing to chain.
    Empty,
    /// More chat messages than [`MAX_MESSAGES`]: not materialized, not routed.
    TooManyMessages,
}

/// The most chat messages a body may have to be routed. Every message is a small
/// allocation; without a cap an 8 MiB body of `{}` messages would build ~2.8M of them in
/// every Envoy worker's VM.
pub const MAX_MESSAGES: usize = 4096;

impl fmt::Display for CanonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CanonError::Json(m) => write!(f, "malformed body: {m}"),
            CanonError::Missing(field) => write!(f, "body has no `{field}`"),
            CanonError::Empty => f.write_str("prompt is empty"),
            CanonError::TooManyMessages => write!(f, "more than {MAX_MESSAGES} messages"),
        }
    }
}

impl std::error::Error for CanonError {}

impl CanonError {
    /// A short stable label, for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            CanonError::Json(_) => "bad_json",
            CanonError::Missing(_) => "no_prompt",
            CanonError::Empty => "empty_prompt",
            CanonError::TooManyMessages => "too_many_messages",
        }
    }
}

/// The prompt of a request, borrowed from the body where possible.
#[derive(Debug)]
pub enum Prompt<'a> {
    Tokens(Vec<u32>),
    Text(Cow<'a, str>),
    Chat {
        tools: Option<&'a RawValue>,
        messages: Vec<Message<'a>>,
    },
    /// Anthropic Messages: `system` (a string or blocks), `tools`, `messages` (whose
    /// content blocks `agent.rs` reads).
    Messages {
        system: Option<Content<'a>>,
        tools: Option<&'a RawValue>,
        messages: Vec<Message<'a>>,
    },
    /// OpenAI Responses: `instructions`, `tools`, `input`.
    Responses {
        instructions: Option<Cow<'a, str>>,
        tools: Option<&'a RawValue>,
        input: super::agent::Input<'a>,
    },
}

/// One chat message, kept as parsed; [`Message::write`] frames it.
#[derive(Debug, Deserialize)]
pub struct Message<'a> {
    #[serde(borrow, default)]
    pub role: Cow<'a, str>,
    #[serde(borrow, default)]
    pub name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub content: Option<Content<'a>>,
    #[serde(borrow, default)]
    pub tool_calls: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub tool_call_id: Option<Cow<'a, str>>,
}

/// `content` as a string, or as a list of typed parts (each kept as raw JSON until
/// framed, so unknown part types cost nothing to carry).
#[derive(Debug)]
pub enum Content<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<&'a RawValue>),
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Content<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or a list of content parts")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Content::Text(Cow::Owned(v)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
                while let Some(p) = seq.next_element::<&'de RawValue>()? {
                    parts.push(p);
                }
                Ok(Content::Parts(parts))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    image_url: Option<UrlField<'a>>,
    #[serde(borrow, default)]
    input_audio: Option<AudioField<'a>>,
}

/// `image_url` is `{"url": ...}` in the OpenAI schema; some clients send a bare string.
#[derive(Deserialize)]
#[serde(untagged)]
enum UrlField<'a> {
    Obj {
        #[serde(borrow)]
        url: Cow<'a, str>,
    },
    Bare(#[serde(borrow)] Cow<'a, str>),
}

#[derive(Deserialize)]
struct AudioField<'a> {
    #[serde(borrow, default)]
    data: Cow<'a, str>,
}

/// Where canonical bytes go: the chain hasher on the hot path, a `Vec` for display.
pub trait Sink {
    fn put(&mut self, bytes: &[u8]);

    /// Token ids as u32le (the chain hasher encodes them in bulk).
    fn put_tokens(&mut self, tokens: &[u32]) {
        for t in tokens {
            self.put(&t.to_le_bytes());
        }
    }
}

impl Sink for ChainHasher {
    fn put(&mut self, bytes: &[u8]) {
        self.update(bytes)
    }

    fn put_tokens(&mut self, tokens: &[u32]) {
        self.push_tokens(tokens)
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes)
    }
}

pub(crate) fn record(sink: &mut impl Sink, tag: u8, payload: &[u8]) {
    let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
    let mut head = [0u8; 5];
    head[0] = tag;
    head[1..].copy_from_slice(&len.to_le_bytes());
    sink.put(&head);
    sink.put(payload);
}

impl Message<'_> {
    fn write(&self, sink: &mut impl Sink) {
        record(sink, b'M', self.role.as_bytes());
        if let Some(name) = &self.name {
            record(sink, b'N', name.as_bytes());
        }
        match &self.content {
            None => {}
            Some(Content::Text(t)) => record(sink, b'C', t.as_bytes()),
            Some(Content::Parts(parts)) => {
                for raw in parts {
                    write_part(sink, raw);
                }
            }
        }
        if let Some(calls) = self.tool_calls {
            record(sink, b'K', calls.get().as_bytes());
        }
        if let Some(id) = &self.tool_call_id {
            record(sink, b'D', id.as_bytes());
        }
    }
}

fn write_part(sink: &mut impl Sink, raw: &RawValue) {
    let json = raw.get();
    match serde_json::from_str::<Part<'_>>(json) {
        Ok(Part {
            kind,
            text: Some(text),
            ..
        }) if kind == "text" || kind == "input_text" => record(sink, b'C', text.as_bytes()),
        Ok(Part {
            image_url: Some(u), ..
        }) => {
            let url = match &u {
                UrlField::Obj { url } | UrlField::Bare(url) => url,
            };
            record(sink, b'I', &xxh3_64(url.as_bytes()).to_le_bytes())
        }
        Ok(Part {
            input_audio: Some(a),
            ..
        }) => record(sink, b'A', &xxh3_64(a.data.as_bytes()).to_le_bytes()),
        // Any other part (or one we cannot read): a stable marker of its type and JSON.
        Ok(Part { kind, .. }) => other_part(sink, &kind, json),
        Err(_) => other_part(sink, "", json),
    }
}

fn other_part(sink: &mut impl Sink, kind: &str, json: &str) {
    let mut payload = Vec::with_capacity(kind.len() + 8);
    payload.extend_from_slice(kind.as_bytes());
    payload.extend_from_slice(&xxh3_64(json.as_bytes()).to_le_bytes());
    record(sink, b'P', &payload);
}

impl Prompt<'_> {
    pub fn mode(&self) -> Mode {
        match self {
            Prompt::Tokens(_) => Mode::Tokens,
            _ => Mode::Text,
        }
    }

    /// Write the canonical text form (text modes only; a token prompt writes its u32le
    /// bytes, which is what token mode chains).
    pub fn write_canonical(&self, sink: &mut impl Sink) {
        match self {
            Prompt::Tokens(t) => sink.put_tokens(t),
            Prompt::Text(t) => sink.put(t.as_bytes()),
            Prompt::Chat { tools, messages } => {
                if let Some(tools) = tools {
                    record(sink, b'T', tools.get().as_bytes());
                }
                for m in messages {
                    m.write(sink);
                }
            }
            Prompt::Messages {
                system,
                tools,
                messages,
            } => {
                super::agent::write_tools(sink, *tools);
                super::agent::write_system(sink, system.as_ref());
                for m in messages {
                    super::agent::write_message(sink, m);
                }
            }
            Prompt::Responses {
                instructions,
                tools,
                input,
            } => {
                super::agent::write_tools(sink, *tools);
                super::agent::write_instructions(sink, instructions.as_deref());
                super::agent::write_input(sink, input);
            }
        }
    }

    /// Length in the mode's units: tokens, or canonical bytes.
    pub fn units(&self) -> usize {
        match self {
            Prompt::Tokens(t) => t.len(),
            Prompt::Text(t) => t.len(),
            Prompt::Chat { .. } | Prompt::Messages { .. } | Prompt::Responses { .. } => {
                let mut c = Counter(0);
                self.write_canonical(&mut c);
                c.0
            }
        }
    }

    /// An estimate of the prompt's token count, for load accounting: exact for token
    /// prompts, about four bytes a token for text.
    pub fn approx_tokens(&self) -> usize {
        match self {
            Prompt::Tokens(t) => t.len(),
            _ => self.units().div_ceil(4),
        }
    }
}

struct Counter(usize);
impl Sink for Counter {
    fn put(&mut self, bytes: &[u8]) {
        self.0 += bytes.len();
    }
}

/// How a requested model name maps to (base model, LoRA adapter).
///
/// vLLM serves a LoRA adapter under its own model name; its KV is only reusable by
/// requests for the same adapter, so the adapter joins the namespace while the base
/// model picks the pod pool.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdapterRule {
    /// Adapter name → base model it runs on.
    pub adapters: BTreeMap<String, String>,
    /// If set, `base<sep>adapter` names an adapter too (e.g. `llama-3:sql-lora`).
    pub separator: Option<String>,
}

impl AdapterRule {
    /// `(base model, adapter)`; adapter is empty for a plain model.
    pub fn resolve<'m>(&'m self, model: &'m str) -> (&'m str, &'m str) {
        if let Some(base) = self.adapters.get(model) {
            return (base.as_str(), model);
        }
        if let Some(sep) = self.separator.as_deref().filter(|s| !s.is_empty()) {
            if let Some((base, adapter)) = model.split_once(sep) {
                if !base.is_empty() && !adapter.is_empty() {
                    return (base, adapter);
                }
            }
        }
        (model, "")
    }
}

/// What routing needs from a request body.
#[derive(Debug)]
pub struct Request<'a> {
    pub model: Cow<'a, str>,
    /// vLLM's `cache_salt`: tenants with different salts must never share KV.
    pub cache_salt: Cow<'a, str>,
    pub stream: bool,
    /// A key the client keeps for a conversation, from the body: `prompt_cache_key`,
    /// Anthropic's `metadata.user_id` (per session for Claude Code), or OpenAI's `user`.
    pub session: Option<Cow<'a, str>>,
    /// Responses `previous_response_id`: the conversation so far lives on the engine that
    /// stored that response, and only this turn's input is in the body.
    pub previous_response: Option<Cow<'a, str>>,
    pub prompt: Prompt<'a>,
}

impl Request<'_> {
    /// The chain of this request under `rule`, with `block_size` from the model's config.
    /// Returns the namespace pieces used, so callers can report them.
    pub fn chain(&self, rule: &AdapterRule, block_size: u32) -> Chained {
        let (base, adapter) = rule.resolve(&self.model);
        let ns = Namespace {
            mode: self.prompt.mode(),
            block_size,
            model: base,
            adapter,
            cache_salt: &self.cache_salt,
        };
        let mut h = ChainHasher::new(&ns);
        self.prompt.write_canonical(&mut h);
        Chained {
            mode: ns.mode,
            base_model: base.to_owned(),
            adapter: adapter.to_owned(),
            chain: h.finish(),
        }
    }
}

/// The outcome of [`Request::chain`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chained {
    pub mode: Mode,
    pub base_model: String,
    pub adapter: String,
    pub chain: Vec<u64>,
}

/// The canonical bytes of a body, for operators' tools (`kvroute-sidecar hash --request`).
pub fn canonical_bytes(prompt: &Prompt<'_>) -> Vec<u8> {
    let mut v = Vec::new();
    prompt.write_canonical(&mut v);
    v
}
