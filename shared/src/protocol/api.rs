//! The sidecar's HTTP API types: pod registration, the route question and answer,
//! completion reports, and the endpoint shape pods are named by.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::hashes::u64_list;
use super::Tier;
use crate::chain::Mode;

/// A pod's role when a model runs prefill and decode on separate pods.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    #[default]
    Both,
    Prefill,
    Decode,
}

/// `PUT /v1/pods/{id}`: register or update a pod (`id` is its `ip:port`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PodRegistration {
    pub model: String,
    #[serde(default)]
    pub role: Role,
    /// LoRA adapters this pod serves (empty: base model only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_blocks: Option<u64>,
    /// Where to fetch a full cache dump (an [`EventBatch`] of `stored` events) on resync.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dump_url: Option<String>,
}

impl PodRegistration {
    /// Every string bounded ([`super::MAX_NAME_BYTES`], [`super::MAX_URL_BYTES`],
    /// [`super::MAX_REGISTRATION_ITEMS`]); the model named.
    pub fn validate(&self) -> Result<(), String> {
        use super::{MAX_NAME_BYTES, MAX_REGISTRATION_ITEMS};
        if self.model.is_empty() {
            return Err("model must not be empty".into());
        }
        let long = |s: &String| s.len() > MAX_NAME_BYTES;
        if long(&self.model)
            || self.adapters.iter().any(long)
            || self.labels.iter().any(|(k, v)| long(k) || long(v))
        {
            return Err(format!(
                "model, adapters and labels must be at most {MAX_NAME_BYTES} bytes each"
            ));
        }
        if self.adapters.len() > MAX_REGISTRATION_ITEMS
            || self.labels.len() > MAX_REGISTRATION_ITEMS
        {
            return Err(format!(
                "at most {MAX_REGISTRATION_ITEMS} adapters and {MAX_REGISTRATION_ITEMS} labels"
            ));
        }
        if let Some(u) = &self.dump_url {
            if !super::http_url(u) {
                return Err(format!(
                    "dump_url must be an http(s) URL of at most {} bytes",
                    super::MAX_URL_BYTES
                ));
            }
        }
        Ok(())
    }
}

/// `POST /v1/route`: the filter's question.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouteRequest {
    pub model: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub adapter: String,
    pub mode: Mode,
    pub block_size: u32,
    #[serde(deserialize_with = "u64_list")]
    pub chain: Vec<u64>,
    /// Prompt length in tokens (estimated for text), for load projection.
    #[serde(default)]
    pub prompt_tokens: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// A session key (a session header, `prompt_cache_key`, Messages `metadata.user_id`,
    /// OpenAI's `user`): the sidecar binds it to the pod it routed the session to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Responses `previous_response_id`: the pod that served that response holds the
    /// conversation (the body carries only the new turn).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_response: Option<String>,
    /// Restrict to pods of this role (default: any pod that can serve the whole request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    /// Rank without recording a decision or projecting load (operators' lookups).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dry_run: bool,
    /// With `dry_run`: answer with the per-pod cost breakdown even when the policy's
    /// `explain` switch is off (the status page's "why").
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub explain: bool,
    /// For models whose prompts the sidecar tokenizes: what the chat template or the
    /// tokenizer reads. The sidecar then chains the model's token ids; the `chain` above
    /// (text mode) is used only when it cannot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_body: Option<PromptBody>,
    /// Who is asking and how urgently, for the admission queue while the fleet is
    /// saturated (docs/protocol.md). Read by the filter from headers it is configured to
    /// trust; absent, the policy's defaults apply.
    #[serde(default, skip_serializing_if = "Admission::is_empty")]
    pub admission: Admission,
}

impl RouteRequest {
    /// A request to route a token chain of `model`, `prompt_tokens` being the chain's
    /// blocks' worth, with nothing else set (tools, tests and benchmarks fill in the rest
    /// with struct update syntax).
    pub fn tokens(model: &str, block_size: u32, chain: Vec<u64>) -> RouteRequest {
        RouteRequest {
            model: model.to_owned(),
            adapter: String::new(),
            mode: Mode::Tokens,
            block_size,
            prompt_tokens: u32::try_from(chain.len())
                .unwrap_or(u32::MAX)
                .saturating_mul(block_size),
            chain,
            request_id: None,
            session: None,
            previous_response: None,
            role: None,
            dry_run: false,
            explain: false,
            prompt_body: None,
            admission: Admission::default(),
        }
    }
}

/// A request's class for the admission queue: its priority (a number, or the name of a
/// Gateway API Inference Extension objective the policy maps to one) and the tenant
/// whose share of dispatches it counts against.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Admission {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub objective: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

impl Admission {
    pub fn is_empty(&self) -> bool {
        self.priority.is_none() && self.objective.is_none() && self.tenant.is_none()
    }
}

/// The longest objective name or tenant id a route request may carry.
pub const MAX_ADMISSION_ID: usize = 256;

/// `202` answer to a route call the sidecar has queued: the filter claims the decision
/// with `POST /v1/route/wait` ([`WaitRequest`]), waiting up to `wait_ms`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteQueued {
    pub ticket: u64,
    /// The longest the request may wait (its band's TTL): the sidecar answers before.
    pub wait_ms: u64,
}

/// `POST /v1/route/wait`: claim a queued request's decision. The call is answered when
/// the request leaves the queue: a [`RouteResponse`] (200), or `429` with the reason
/// and `retry_after_s`. Ending the call takes the request out of the queue.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitRequest {
    pub model: String,
    pub ticket: u64,
}

/// The parts of an OpenAI request body a chat template (or, for completions, the
/// tokenizer) reads, as the client sent them: `messages`, `tools`,
/// `chat_template_kwargs`, `documents`, or `prompt`, and vLLM's switches
/// `add_generation_prompt`, `continue_final_message`, `add_special_tokens`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PromptBody {
    /// Rendered with the chat template (chat, Messages, Responses), else `/v1/completions`.
    pub chat: bool,
    /// The API the fields are in, when not chat's or completions' own: the sidecar turns
    /// them into the chat request the engine renders.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api: Option<PromptApi>,
    /// The namespace's salt as the gateway resolved it (the tenant's, or the body's).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cache_salt: String,
    /// A JSON object holding those fields.
    pub fields: Box<serde_json::value::RawValue>,
}

/// Which API a [`PromptBody`]'s fields come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptApi {
    Completions,
    Chat,
    Messages,
    Responses,
}

impl From<crate::canon::Endpoint> for PromptApi {
    fn from(e: crate::canon::Endpoint) -> PromptApi {
        use crate::canon::Endpoint;
        match e {
            Endpoint::Completions => PromptApi::Completions,
            Endpoint::ChatCompletions => PromptApi::Chat,
            Endpoint::Messages => PromptApi::Messages,
            Endpoint::Responses => PromptApi::Responses,
        }
    }
}

impl PartialEq for PromptBody {
    fn eq(&self, o: &PromptBody) -> bool {
        self.chat == o.chat
            && self.api == o.api
            && self.cache_salt == o.cache_salt
            && self.fields.get() == o.fields.get()
    }
}

impl PromptBody {
    /// The fields of `body` a template or tokenizer reads, copied as sent (no re-encoding).
    pub fn extract(api: PromptApi, cache_salt: &str, body: &[u8]) -> Result<PromptBody, String> {
        #[derive(Deserialize)]
        struct Fields<'a> {
            #[serde(borrow, default)]
            messages: Option<&'a serde_json::value::RawValue>,
            #[serde(borrow, default)]
            tools: Option<&'a serde_json::value::RawValue>,
            #[serde(borrow, default)]
            chat_template_kwargs: Option<&'a serde_json::value::RawValue>,
            #[serde(borrow, default)]
            documents: Option<&'a serde_json::value::RawValue>,
            #[serde(borrow, default)]
            prompt: Option<&'a serde_json::value::RawValue>,
            #[serde(borrow, default)]
            add_generation_prompt: Option<&'a serde_json::value::RawValue>,
            #[serde(borrow, default)]
            continue_final_message: Option<&'a serde_json::value::RawValue>,
            #[serde(borrow, default)]
            add_special_tokens: Option<&'a serde_json::value::RawValue>,
            // Messages
            #[serde(borrow, default)]
            system: Option<&'a serde_json::value::RawValue>,
            #[serde(borrow, default)]
            thinking: Option<&'a serde_json::value::RawValue>,
            #[serde(borrow, default)]
            tool_choice: Option<&'a serde_json::value::RawValue>,
            #[serde(borrow, default)]
            output_config: Option<&'a serde_json::value::RawValue>,
            // Responses
            #[serde(borrow, default)]
            instructions: Option<&'a serde_json::value::RawValue>,
            #[serde(borrow, default)]
            input: Option<&'a serde_json::value::RawValue>,
            #[serde(borrow, default)]
            reasoning: Option<&'a serde_json::value::RawValue>,
        }
        let f: Fields<'_> = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        let mut out = String::with_capacity(body.len().min(1 << 20) + 16);
        out.push('{');
        let parts = [
            ("messages", f.messages),
            ("tools", f.tools),
            ("chat_template_kwargs", f.chat_template_kwargs),
            ("documents", f.documents),
            ("prompt", f.prompt),
            ("add_generation_prompt", f.add_generation_prompt),
            ("continue_final_message", f.continue_final_message),
            ("add_special_tokens", f.add_special_tokens),
            ("system", f.system),
            ("thinking", f.thinking),
            ("tool_choice", f.tool_choice),
            ("output_config", f.output_config),
            ("instructions", f.instructions),
            ("input", f.input),
            ("reasoning", f.reasoning),
        ];
        for (name, v) in parts {
            if let Some(v) = v {
                if out.len() > 1 {
                    out.push(',');
                }
                out.push('"');
                out.push_str(name);
                out.push_str("\":");
                out.push_str(v.get());
            }
        }
        out.push('}');
        let fields = serde_json::value::RawValue::from_string(out).map_err(|e| e.to_string())?;
        let chat = api != PromptApi::Completions;
        let api = matches!(api, PromptApi::Messages | PromptApi::Responses).then_some(api);
        Ok(PromptBody {
            chat,
            api,
            cache_salt: cache_salt.to_owned(),
            fields,
        })
    }
}

/// One candidate in a route answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ranked {
    pub pod: String,
    pub matched_blocks: u32,
    /// Policy cost (lower is better).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score: Option<f64>,
}

/// Where the winner's matched blocks live, e.g. "10 in GPU, 2 in CPU".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierHint {
    pub gpu: u32,
    pub cpu: u32,
    pub disk: u32,
    pub remote: u32,
}

impl TierHint {
    pub fn add(&mut self, tier: Tier, n: u32) {
        let slot = match tier {
            Tier::Gpu => &mut self.gpu,
            Tier::Cpu => &mut self.cpu,
            Tier::Disk => &mut self.disk,
            Tier::Remote => &mut self.remote,
        };
        *slot = slot.saturating_add(n);
    }
}

/// The sidecar's answer to [`RouteRequest`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouteResponse {
    pub pod: String,
    /// The decision's id, issued by the sidecar (absent for a dry run). The filter
    /// echoes it in its completion report; it is the only way to release the decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<String>,
    pub ranked: Vec<Ranked>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier_hint: Option<TierHint>,
    /// Set when the model runs disaggregated: the pod that prefills (`pod` decodes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_pod: Option<String>,
    #[serde(default)]
    pub policy_version: u64,
    /// Per-pod cost breakdown; only when the policy's `explain` switch is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub explain: Option<serde_json::Value>,
}

/// `POST /v1/report`: what happened to a routed request, sent by the filter from
/// `on_log`. `cached_tokens` is the engine's own count, the ground truth for predictions.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionReport {
    /// The client's request id, for logs only.
    #[serde(default)]
    pub request_id: String,
    /// The decision id from the route answer: the ledger entry this report releases.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub decision: String,
    pub pod: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model: String,
    pub status: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens: Option<u32>,
    #[serde(default)]
    pub duration_ms: f64,
    /// The id the engine gave its response (Responses API), which a later turn names as
    /// `previous_response_id`: the sidecar binds it to this pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_id: Option<String>,
}

/// The reports in one `POST /v1/report` body: a single object, or an array of them (the
/// filter batches reports so that a completion costs Envoy a fraction of a callout).
#[derive(Debug, Default)]
pub struct ReportBatch {
    pub reports: Vec<CompletionReport>,
    /// One line per rejected element (`index: reason`); the others still count.
    pub rejected: Vec<String>,
}

impl ReportBatch {
    /// Decodes a body. A body that is not JSON (or neither an object nor an array) is an
    /// error; inside an array each element stands alone, so one bad report loses nothing else.
    pub fn decode(body: &[u8]) -> Result<ReportBatch, String> {
        let first = body.iter().find(|b| !b.is_ascii_whitespace());
        if first != Some(&b'[') {
            return serde_json::from_slice::<CompletionReport>(body)
                .map(|r| ReportBatch {
                    reports: vec![r],
                    rejected: vec![],
                })
                .map_err(|e| format!("malformed completion report: {e}"));
        }
        let items: Vec<&serde_json::value::RawValue> = serde_json::from_slice(body)
            .map_err(|e| format!("malformed completion report batch: {e}"))?;
        let mut out = ReportBatch::default();
        for (i, raw) in items.iter().enumerate() {
            match serde_json::from_str::<CompletionReport>(raw.get()) {
                Ok(r) => out.reports.push(r),
                Err(e) => out.rejected.push(format!("{i}: {e}")),
            }
        }
        Ok(out)
    }
}

/// A pod's identity: an IP literal and a port (`10.0.0.7:8000`, `[fd00::7]:8000`), as
/// Envoy's original-destination override takes it (a DNS name there is never steered),
/// or one data-parallel rank of the engine there (`10.0.0.7:8000@2`: each rank has its
/// own KV cache, so each is a pod of its own). Subjects, tombstones and index slots are
/// keyed by it, so it is checked before any of them is created.
pub fn valid_pod_addr(s: &str) -> bool {
    s.len() <= 64 && parse_pod(s).is_some()
}

/// The highest data-parallel rank a pod id may name.
pub const MAX_DP_RANK: u16 = 1023;

/// A pod id's address and data-parallel rank. The rank is written without leading zeros,
/// so one rank has one id.
pub fn parse_pod(s: &str) -> Option<(std::net::SocketAddr, Option<u16>)> {
    let (addr, rank) = split_rank(s);
    let addr = addr.parse::<std::net::SocketAddr>().ok()?;
    let rank = match rank {
        None => None,
        Some(r) => {
            let canonical = !r.is_empty()
                && r.bytes().all(|b| b.is_ascii_digit())
                && (r == "0" || !r.starts_with('0'));
            let n: u16 = r.parse().ok().filter(|n| canonical && *n <= MAX_DP_RANK)?;
            Some(n)
        }
    };
    Some((addr, rank))
}

/// A steerable pod id: its address as [`valid_endpoint`] takes it and, if any, a rank as
/// [`parse_pod`] takes it. What the filter and the picker accept from a route answer.
pub fn valid_steer(s: &str) -> bool {
    let (addr, rank) = split_rank(s);
    valid_endpoint(addr) && rank.is_none_or(|_| parse_pod(s).is_some())
}

/// A pod id cut into what the data plane steers to (`ip:port`) and the data-parallel rank
/// the engine is told, if any. Not validated: see [`parse_pod`].
pub fn split_rank(s: &str) -> (&str, Option<&str>) {
    match s.rsplit_once('@') {
        Some((addr, rank)) => (addr, Some(rank)),
        None => (s, None),
    }
}

/// `host:port` as Envoy's override-host header carries it (a pod's identity). Also keeps
/// control characters (header injection) out of anything the filter puts in a header.
pub fn valid_endpoint(s: &str) -> bool {
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    let port_ok = !port.is_empty()
        && port.len() <= 5
        && port.bytes().all(|b| b.is_ascii_digit())
        && port.parse::<u16>().is_ok();
    let host_ok = !host.is_empty()
        && host.len() <= 253
        && host.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b':' | b'[' | b']')
        });
    port_ok && host_ok
}

#[cfg(test)]
mod pod_id_tests {
    use super::*;

    #[test]
    fn a_rank_is_a_pod_of_its_own_with_one_spelling() {
        let a: std::net::SocketAddr = "10.0.0.7:8000".parse().expect("addr");
        assert_eq!(parse_pod("10.0.0.7:8000"), Some((a, None)));
        assert_eq!(parse_pod("10.0.0.7:8000@0"), Some((a, Some(0))));
        assert_eq!(parse_pod("10.0.0.7:8000@1023"), Some((a, Some(1023))));
        assert!(parse_pod("[fd00::7]:8000@3").is_some());
        for bad in [
            "10.0.0.7:8000@",
            "10.0.0.7:8000@01",
            "10.0.0.7:8000@1024",
            "10.0.0.7:8000@-1",
            "10.0.0.7:8000@1@2",
            "10.0.0.7@1",
            "pod:8000@1",
            "10.0.0.7:8000@1 ",
        ] {
            assert!(!valid_pod_addr(bad), "{bad}");
        }
        assert_eq!(split_rank("10.0.0.7:8000@2"), ("10.0.0.7:8000", Some("2")));
        assert!(valid_steer("pod-a.ns.svc:80") && valid_steer("10.0.0.7:8000@2"));
        assert!(!valid_steer("10.0.0.7:8000@02") && !valid_steer("a b:80@1"));
    }
}
