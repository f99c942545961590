//! kvroute's hash chain for JavaScript: `kvroute-shared` compiled to wasm and wrapped
//! with `wasm-bindgen`, so a browser, a Node service or a TypeScript gateway computes
//! exactly the hashes the filter computes — there is no second implementation to drift.
//!
//! Hashes cross into JavaScript as decimal strings: a u64 does not fit a JS number, and
//! strings go straight into the sidecar's JSON API (`/v1/lookup`, `/v1/route`). Errors
//! are thrown as `Error`s whose message starts with a stable reason label
//! (`bad_mode: ...`, `bad_request: ...`).
//!
//! The API is thin on purpose: every rule (canonical form, namespace seed, adapter
//! resolution) lives in `kvroute-shared`.

use kvroute_shared::canon::{self, AdapterRule, Endpoint};
use kvroute_shared::{Mode, Namespace};
use wasm_bindgen::prelude::*;

fn decimal(chain: &[u64]) -> Vec<String> {
    chain.iter().map(u64::to_string).collect()
}

fn fail(reason: &str, msg: impl std::fmt::Display) -> JsError {
    JsError::new(&format!("{reason}: {msg}"))
}

fn mode(s: &str) -> Result<Mode, JsError> {
    s.parse::<Mode>().map_err(|e| fail("bad_mode", e))
}

fn namespace<'a>(
    mode: Mode,
    model: &'a str,
    adapter: &'a str,
    cache_salt: &'a str,
    block_size: u32,
) -> Result<Namespace<'a>, JsError> {
    if block_size == 0 {
        return Err(fail("bad_block_size", "block size must be positive"));
    }
    Ok(Namespace {
        mode,
        block_size,
        model,
        adapter,
        cache_salt,
    })
}

/// The chain of token ids in the namespace (model, adapter, cache salt, block size),
/// as decimal strings. Only full blocks are hashed.
#[wasm_bindgen(js_name = chainTokens)]
pub fn chain_tokens(
    tokens: &[u32],
    model: &str,
    adapter: &str,
    cache_salt: &str,
    block_size: u32,
) -> Result<Vec<String>, JsError> {
    let ns = namespace(Mode::Tokens, model, adapter, cache_salt, block_size)?;
    Ok(decimal(&ns.chain_tokens(tokens)))
}

/// The chain of a text prompt's UTF-8 bytes (text mode: `block_size` bytes a block).
#[wasm_bindgen(js_name = chainText)]
pub fn chain_text(
    text: &str,
    model: &str,
    adapter: &str,
    cache_salt: &str,
    block_size: u32,
) -> Result<Vec<String>, JsError> {
    let ns = namespace(Mode::Text, model, adapter, cache_salt, block_size)?;
    Ok(decimal(&ns.chain_bytes(text.as_bytes())))
}

/// The namespace seed (`h[-1]`), as a decimal string.
#[wasm_bindgen(js_name = namespaceSeed)]
pub fn namespace_seed(
    mode_name: &str,
    model: &str,
    adapter: &str,
    cache_salt: &str,
    block_size: u32,
) -> Result<String, JsError> {
    let ns = Namespace {
        mode: mode(mode_name)?,
        block_size,
        model,
        adapter,
        cache_salt,
    };
    Ok(ns.seed().to_string())
}

/// A request body chained as the filter chains it.
#[wasm_bindgen]
pub struct ChainedRequest {
    mode: Mode,
    model: String,
    adapter: String,
    cache_salt: String,
    block_size: u32,
    units: usize,
    chain: Vec<String>,
}

#[wasm_bindgen]
impl ChainedRequest {
    /// `"tokens"` (token-id prompts) or `"text"` (everything else).
    #[wasm_bindgen(getter)]
    pub fn mode(&self) -> String {
        self.mode.as_str().to_owned()
    }
    /// The base model (after adapter resolution): the pod pool and the namespace.
    #[wasm_bindgen(getter)]
    pub fn model(&self) -> String {
        self.model.clone()
    }
    #[wasm_bindgen(getter)]
    pub fn adapter(&self) -> String {
        self.adapter.clone()
    }
    #[wasm_bindgen(getter, js_name = cacheSalt)]
    pub fn cache_salt(&self) -> String {
        self.cache_salt.clone()
    }
    #[wasm_bindgen(getter, js_name = blockSize)]
    pub fn block_size(&self) -> u32 {
        self.block_size
    }
    /// Prompt length in the mode's units (tokens, or canonical bytes).
    #[wasm_bindgen(getter)]
    pub fn units(&self) -> usize {
        self.units
    }
    /// The chain, decimal strings.
    #[wasm_bindgen(getter)]
    pub fn chain(&self) -> Vec<String> {
        self.chain.clone()
    }
}

/// Parse an OpenAI request body sent to `path` (`/v1/completions` or
/// `/v1/chat/completions`) and chain it as the filter does. Token-id prompts use
/// `token_block_size`, text and chat use `text_block_bytes` (both from the sidecar's
/// model config). `adapters_json` is the filter's adapter rule (`{"adapters": {...},
/// "separator": ":"}`), or empty for none.
#[wasm_bindgen(js_name = chainRequest)]
pub fn chain_request(
    path: &str,
    body: &str,
    token_block_size: u32,
    text_block_bytes: u32,
    adapters_json: &str,
) -> Result<ChainedRequest, JsError> {
    let endpoint = Endpoint::from_path(path).ok_or_else(|| {
        fail(
            "bad_path",
            format!("{path:?} is not an OpenAI completions path"),
        )
    })?;
    let rule: AdapterRule = if adapters_json.trim().is_empty() {
        AdapterRule::default()
    } else {
        serde_json::from_str(adapters_json).map_err(|e| fail("bad_adapters", e))?
    };
    let req = canon::parse(endpoint, body.as_bytes()).map_err(|e| fail(e.reason(), e))?;
    let block_size = match req.prompt.mode() {
        Mode::Tokens => token_block_size,
        Mode::Text => text_block_bytes,
    };
    if block_size == 0 {
        return Err(fail("bad_block_size", "block size must be positive"));
    }
    let c = req.chain(&rule, block_size);
    Ok(ChainedRequest {
        mode: c.mode,
        model: c.base_model,
        adapter: c.adapter,
        cache_salt: req.cache_salt.to_string(),
        block_size,
        units: req.prompt.units(),
        chain: decimal(&c.chain),
    })
}

/// The canonical text form of a request body (what text mode chains), for inspection.
#[wasm_bindgen(js_name = canonicalBytes)]
pub fn canonical_bytes(path: &str, body: &str) -> Result<Vec<u8>, JsError> {
    let endpoint = Endpoint::from_path(path).ok_or_else(|| {
        fail(
            "bad_path",
            format!("{path:?} is not an OpenAI completions path"),
        )
    })?;
    let req = canon::parse(endpoint, body.as_bytes()).map_err(|e| fail(e.reason(), e))?;
    Ok(canon::canonical_bytes(&req.prompt))
}

/// The package's version (the workspace's).
#[wasm_bindgen]
pub fn version() -> String {
    env!("CARGO_PKG_VERSION").to_owned()
}
