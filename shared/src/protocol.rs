//! Every wire type between the filter, the sidecar and the engines, in one place.
//!
//! All types are JSON with serde. Field names are a contract with tools outside the
//! project (docs/protocol.md documents each with an example that a test parses), so
//! they change only with a new `v`. Unknown fields are ignored everywhere, so newer
//! senders can talk to older receivers; unknown event types are rejected, because an
//! event we do not understand could be one that removes blocks.
//!
//! Hashes are u64. JSON numbers are the canonical form; decimal strings are accepted
//! too, because JavaScript and jq silently round integers above 2^53 and a rounded
//! hash is a silent miss.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

use crate::chain::Mode;

/// The event-batch format version this crate reads and writes.
pub const EVENT_VERSION: u32 = 1;

/// Where a KV block lives on its pod. Tier is kept off the routing hot path; it only
/// shapes the cache hint for the winning pod and the cost of a hit.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    #[default]
    Gpu,
    Cpu,
    Disk,
    Remote,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Gpu, Tier::Cpu, Tier::Disk, Tier::Remote];
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Cpu => "cpu",
            Tier::Disk => "disk",
            Tier::Remote => "remote",
        }
    }
}

/// One batch of KV cache events from one engine instance; the same bytes travel over
/// NATS and `POST /v1/events`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EventBatch {
    /// Format version; must be [`EVENT_VERSION`].
    pub v: u32,
    /// The pod's address as the gateway reaches it (`ip:port`); also its identity.
    pub pod: String,
    pub model: String,
    /// Engine instance id: changes whenever the engine restarts (its cache is then empty).
    pub epoch: String,
    /// Batch counter within an epoch: gaps mean lost batches, repeats are duplicates.
    pub seq: u64,
    /// Send time, Unix seconds (optional; used for event-lag metrics).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ts: Option<f64>,
    /// Where this pod's full cache can be fetched (an EventBatch of `stored` events), for
    /// resyncs. Taken for pods that were not registered explicitly (a registration's own
    /// `dump_url` wins); lets a restarted sidecar rebuild a pod's blocks at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dump_url: Option<String>,
    pub events: Vec<Event>,
}

/// A KV cache event. `blocks` are kvroute chain hashes of the pod's model namespace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Event {
    /// Blocks now cached. `parent` is the hash before `blocks[0]` (null at the root);
    /// `tokens` are the blocks' token ids when the engine sends them.
    Stored {
        #[serde(default)]
        tier: Tier,
        #[serde(
            default,
            deserialize_with = "opt_u64",
            skip_serializing_if = "Option::is_none"
        )]
        parent: Option<u64>,
        #[serde(deserialize_with = "u64_list")]
        blocks: Vec<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tokens: Option<Vec<u32>>,
    },
    /// Blocks evicted from `tier`.
    Removed {
        #[serde(default)]
        tier: Tier,
        #[serde(deserialize_with = "u64_list")]
        blocks: Vec<u64>,
    },
    /// The engine dropped its whole cache.
    Cleared,
    /// The engine is going away; remove the pod.
    Shutdown,
    /// The engine's own view of its load (corrects the router's projection).
    Load {
        #[serde(default)]
        running: u32,
        #[serde(default)]
        waiting: u32,
        #[serde(default)]
        kv_usage: f64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        capacity_blocks: Option<u64>,
    },
}

/// Why an event batch was refused. Each variant has a stable metric label.
#[derive(Debug, Clone, PartialEq)]
pub enum EventError {
    Json(String),
    Version(u32),
    Field(&'static str),
    Value(String),
}

impl fmt::Display for EventError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EventError::Json(m) => write!(f, "malformed event batch: {m}"),
            EventError::Version(v) => {
                write!(
                    f,
                    "unsupported event batch version {v} (this sidecar reads v{EVENT_VERSION})"
                )
            }
            EventError::Field(name) => write!(f, "event batch field `{name}` must not be empty"),
            EventError::Value(m) => write!(f, "invalid event: {m}"),
        }
    }
}

impl std::error::Error for EventError {}

impl EventError {
    pub fn reason(&self) -> &'static str {
        match self {
            EventError::Json(_) => "bad_json",
            EventError::Version(_) => "bad_version",
            EventError::Field(_) => "missing_field",
            EventError::Value(_) => "bad_value",
        }
    }
}

impl EventBatch {
    /// Decode and validate a batch. Never panics; a refused batch changes nothing.
    pub fn decode(bytes: &[u8]) -> Result<EventBatch, EventError> {
        let b: EventBatch =
            serde_json::from_slice(bytes).map_err(|e| EventError::Json(e.to_string()))?;
        b.validate()?;
        Ok(b)
    }

    pub fn validate(&self) -> Result<(), EventError> {
        if self.v != EVENT_VERSION {
            return Err(EventError::Version(self.v));
        }
        for (name, value) in [
            ("pod", &self.pod),
            ("model", &self.model),
            ("epoch", &self.epoch),
        ] {
            if value.is_empty() {
                return Err(EventError::Field(name));
            }
        }
        if let Some(u) = &self.dump_url {
            if !(u.starts_with("http://") || u.starts_with("https://")) || u.len() > 2048 {
                return Err(EventError::Value(format!(
                    "dump_url {u:?} is not an http(s) URL of at most 2048 bytes"
                )));
            }
        }
        for ev in &self.events {
            match ev {
                Event::Stored {
                    tokens: Some(t),
                    blocks,
                    ..
                } if !blocks.is_empty() && t.len() % blocks.len() != 0 => {
                    return Err(EventError::Value(format!(
                        "stored: {} tokens do not split evenly into {} blocks",
                        t.len(),
                        blocks.len()
                    )))
                }
                Event::Load { kv_usage, .. } if !(0.0..=1.0).contains(kv_usage) => {
                    return Err(EventError::Value(format!(
                        "load: kv_usage {kv_usage} is not in [0, 1]"
                    )))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The NATS subject this batch is published on by convention:
    /// `kvroute.events.<model>.<pod>`, with the characters NATS gives a meaning to (`.`,
    /// `*`, `>`, whitespace) and `:` replaced by `_` so each stays one subject token.
    pub fn subject(&self) -> String {
        let token = |s: &str| {
            s.chars()
                .map(|c| match c {
                    '.' | ':' | '*' | '>' => '_',
                    c if c.is_whitespace() => '_',
                    c => c,
                })
                .collect::<String>()
        };
        format!("kvroute.events.{}.{}", token(&self.model), token(&self.pod))
    }

    pub fn encode(&self) -> Vec<u8> {
        // Serializing plain data to a Vec cannot fail; fall back to empty rather than panic.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

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
    /// A session key (e.g. OpenAI's `user`), for session-affinity tie-breaks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Restrict to pods of this role (default: any pod that can serve the whole request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    /// Rank without recording a decision or projecting load (operators' lookups).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dry_run: bool,
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

/// Per-model settings the sidecar enforces.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Block size the engines use for this model; a route request with another size is
    /// refused loudly (the silent mismatch is the commonest field failure of routers).
    pub block_size: u32,
    /// Bytes per block of text-mode chains (prompts the router chains as text).
    pub text_block_bytes: u32,
    /// Cap on indexed blocks for this model (approximate LRU beyond it).
    pub max_blocks: u64,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            block_size: 16,
            text_block_bytes: 256,
            max_blocks: 4 << 20,
        }
    }
}

/// The routing policy, served and replaced whole at `/v1/config`.
///
/// Cost of sending a request to a pod, in "blocks of prefill work" (lower wins):
/// `prefill_weight · (prompt_blocks − hits) + load_weight · pending_prefill_blocks
///  + decode_weight · active_decode_blocks + queue_weight · queued_requests`, where hits
/// count confirmed blocks fully, predicted ones at `predicted_weight`, non-GPU ones at
/// `1 − tier_cost`, and a stale pod's at `stale_factor` (see sidecar/src/policy.rs).
/// Defaults were chosen with `kvroute-bench sim` (docs/policy.md).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// Set by the sidecar; a PUT carrying a version must carry the current one.
    pub version: u64,
    pub models: BTreeMap<String, ModelConfig>,
    /// Settings for models not listed in `models`.
    pub default_model: ModelConfig,
    pub prefill_weight: f64,
    pub load_weight: f64,
    /// Cost per block of KV held by the pod's running decodes (they slow its prefills).
    pub decode_weight: f64,
    /// Cost per request the engine reports waiting for a batch slot.
    pub queue_weight: f64,
    /// Worth of a predicted (not engine-confirmed) hit relative to a confirmed one.
    pub predicted_weight: f64,
    /// Estimated prefill speed of a pod, tokens/s: routed prefill work is counted as
    /// pending until it should be done at this speed (or its report arrives).
    pub prefill_tokens_per_s: f64,
    /// Fraction of a hit's prefill cost still paid when the block is in this tier.
    pub tier_cost: BTreeMap<Tier, f64>,
    /// Multiplier (0..1] on the matched blocks of a pod whose event stream has a gap.
    pub stale_factor: f64,
    /// Bounded load: no pod gets more than (1 + ε) × the mean projected load.
    pub balance_epsilon: f64,
    /// Requests above the mean a pod may always take, whatever ε says: with a handful of
    /// requests per pod, rounding alone would otherwise evict sessions from their caches.
    pub balance_slack: f64,
    /// The same slack for the requests in flight that were routed by one prefix (the
    /// per-prefix bound that spreads a hot system prompt).
    pub prefix_balance_slack: f64,
    /// Placing a cold prefix (no pod holds more of the prompt than the prefix credited to
    /// every pod): cost per block of prompt routed to the pod recently. The traffic a pod
    /// drew lately is what its cached prefixes will keep drawing, so new homes go where
    /// that is least; requests that have a home ignore it and stay with their cache.
    pub home_weight: f64,
    /// Time constant of that recent count, seconds (exponential decay).
    pub home_window_s: f64,
    /// A routing prefix with at least this many requests in flight per candidate pod (and
    /// more than `prefix_balance_slack`) is credited to every pod (0 = never): it is hot
    /// enough to be needed everywhere, so its first holders must not draw all of its new
    /// conversations.
    pub hot_prefix_per_pod: f64,
    /// A pod whose engine reports requests waiting for a batch slot is outside the
    /// bounded-load guard while any candidate has none: there a new request would wait
    /// for decodes to finish, which no cache hit repays.
    pub full_batch_guard: bool,
    /// Pods whose cost is within this much of the best (in blocks of prefill) are equals,
    /// and the request's tie key picks among them. Replicas that route concurrent cold
    /// requests before hearing of each other's decisions then spread them instead of all
    /// sending them to the one pod that looks idlest (0 = strict argmin).
    pub near_tie_cost: f64,
    /// 0 = argmin; > 0 samples from softmax(−cost / temperature).
    pub temperature: f64,
    /// Carry the per-pod breakdown in route answers (leaks cache state: off by default).
    pub explain: bool,
    /// Predicted mode: residency of routed text chains, kept this long.
    pub predicted_ttl_s: u64,
    pub predicted_capacity_blocks: u64,
    /// A pod that sent nothing for this long is removed.
    pub liveness_timeout_s: u64,
    /// Projected load of a decision is released after this long without a report.
    pub load_timeout_s: u64,
    /// Circuit breaker: this many failed reports in a row exclude a pod for `cooldown`.
    pub breaker_failures: u32,
    pub breaker_cooldown_s: u64,
    /// Refuse events from pods not registered with `PUT /v1/pods/{id}`.
    pub require_registration: bool,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            version: 0,
            models: BTreeMap::new(),
            default_model: ModelConfig::default(),
            prefill_weight: 1.0,
            load_weight: 1.0,
            decode_weight: 0.01,
            queue_weight: 0.0,
            predicted_weight: 0.7,
            prefill_tokens_per_s: 10_000.0,
            tier_cost: BTreeMap::from([
                (Tier::Gpu, 0.0),
                (Tier::Cpu, 0.2),
                (Tier::Disk, 0.5),
                (Tier::Remote, 0.6),
            ]),
            stale_factor: 0.5,
            balance_epsilon: 0.25,
            balance_slack: 10.0,
            prefix_balance_slack: 4.0,
            home_weight: 0.1,
            home_window_s: 10.0,
            hot_prefix_per_pod: 1.0,
            full_batch_guard: true,
            near_tie_cost: 3.0,
            temperature: 0.0,
            explain: false,
            predicted_ttl_s: 120,
            predicted_capacity_blocks: 1 << 16,
            liveness_timeout_s: 30,
            load_timeout_s: 300,
            breaker_failures: 5,
            breaker_cooldown_s: 10,
            require_registration: false,
        }
    }
}

impl PolicyConfig {
    /// Every problem with this config, so an operator can fix them all at once.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut errs = Vec::new();
        let mut finite_nonneg = |name: &str, v: f64| {
            if !v.is_finite() || v < 0.0 {
                errs.push(format!("{name} must be a finite number >= 0 (got {v})"));
            }
        };
        finite_nonneg("prefill_weight", self.prefill_weight);
        finite_nonneg("load_weight", self.load_weight);
        finite_nonneg("queue_weight", self.queue_weight);
        finite_nonneg("decode_weight", self.decode_weight);
        finite_nonneg("balance_epsilon", self.balance_epsilon);
        finite_nonneg("balance_slack", self.balance_slack);
        finite_nonneg("prefix_balance_slack", self.prefix_balance_slack);
        finite_nonneg("home_weight", self.home_weight);
        finite_nonneg("hot_prefix_per_pod", self.hot_prefix_per_pod);
        finite_nonneg("near_tie_cost", self.near_tie_cost);
        finite_nonneg("temperature", self.temperature);
        for (tier, c) in &self.tier_cost {
            if !(0.0..=1.0).contains(c) {
                errs.push(format!(
                    "tier_cost.{} must be in [0, 1] (got {c})",
                    tier.as_str()
                ));
            }
        }
        if !(self.home_window_s.is_finite() && self.home_window_s >= 0.001) {
            errs.push(format!(
                "home_window_s must be >= 0.001 (got {})",
                self.home_window_s
            ));
        }
        if !(self.prefill_tokens_per_s.is_finite() && self.prefill_tokens_per_s >= 1.0) {
            errs.push(format!(
                "prefill_tokens_per_s must be >= 1 (got {})",
                self.prefill_tokens_per_s
            ));
        }
        if !(0.0..=1.0).contains(&self.predicted_weight) {
            errs.push(format!(
                "predicted_weight must be in [0, 1] (got {})",
                self.predicted_weight
            ));
        }
        if !(self.stale_factor > 0.0 && self.stale_factor <= 1.0) {
            errs.push(format!(
                "stale_factor must be in (0, 1] (got {})",
                self.stale_factor
            ));
        }
        let models = std::iter::once(("default_model", &self.default_model))
            .chain(self.models.iter().map(|(k, v)| (k.as_str(), v)));
        for (name, m) in models {
            check_block_sizes(name, m.block_size, m.text_block_bytes, &mut errs);
            if m.max_blocks == 0 {
                errs.push(format!("{name}: max_blocks must be > 0"));
            }
        }
        if self.models.contains_key("") {
            errs.push("models: the empty model name is not allowed".into());
        }
        if self.liveness_timeout_s == 0 {
            errs.push("liveness_timeout_s must be > 0".into());
        }
        if self.load_timeout_s == 0 {
            errs.push("load_timeout_s must be > 0".into());
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs)
        }
    }

    pub fn model(&self, name: &str) -> &ModelConfig {
        self.models.get(name).unwrap_or(&self.default_model)
    }

    /// The block size a chain of `mode` must use for `model`.
    pub fn block_size(&self, model: &str, mode: Mode) -> u32 {
        let m = self.model(model);
        match mode {
            Mode::Tokens => m.block_size,
            Mode::Text => m.text_block_bytes,
        }
    }
}

/// A u64 from a JSON number or a decimal string.
struct U64Visitor;

impl<'de> Visitor<'de> for U64Visitor {
    type Value = u64;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a u64 hash, as a JSON number or a decimal string")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        u64::try_from(v).map_err(|_| E::custom(format!("hash {v} is negative")))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<u64, E> {
        Err(E::custom(format!(
            "hash {v} is not an integer (send u64 hashes as integers or strings)"
        )))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
        v.parse()
            .map_err(|_| E::custom(format!("hash string {v:?} is not a decimal u64")))
    }
}

struct LenientU64(u64);
impl<'de> Deserialize<'de> for LenientU64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(U64Visitor).map(LenientU64)
    }
}

fn u64_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Vec<u64>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a list of u64 hashes")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u64>, A::Error> {
            // size_hint comes from the peer: cap the up-front allocation.
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
            while let Some(LenientU64(h)) = seq.next_element()? {
                out.push(h);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(V)
}

fn opt_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<LenientU64>::deserialize(d).map(|o| o.map(|x| x.0))
}

/// Load that one sidecar replica projected onto a pod, or released, broadcast on NATS
/// (`kvroute.load.<model>`) so that replicas in front of the same pods see each other's
/// decisions instead of all piling onto the same "best" pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadDelta {
    /// The sending replica (receivers skip their own).
    pub replica: String,
    /// The decision's id (unique per replica); a release names the add it undoes.
    pub id: String,
    pub pod: String,
    pub model: String,
    pub op: LoadOp,
    #[serde(default)]
    pub prefill_tokens: u64,
    #[serde(default)]
    pub blocks: u64,
    /// The cached prefix the decision was routed by (its last block's hash), so every
    /// replica bounds a hot prefix's load across all gateways.
    #[serde(
        default,
        deserialize_with = "opt_u64",
        skip_serializing_if = "Option::is_none"
    )]
    pub prefix: Option<u64>,
    /// The decision runs on this pod (false for a prefill pod's share of a disaggregated
    /// request, which only adds prefill work).
    #[serde(default = "yes")]
    pub inflight: bool,
}

fn yes() -> bool {
    true
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadOp {
    Add,
    Release,
}

/// Content type of the compact route body: `u32le(len) ++ JSON of the request with an
/// empty chain ++ chain as u64le`. JSON decoding of a 128k-token prompt's chain (8,192
/// hashes) costs ~330 µs in the sidecar; this form is a copy (`kvroute-bench route`).
pub const ROUTE_BINARY_CONTENT_TYPE: &str = "application/x-kvroute-route";

impl RouteRequest {
    pub fn encode_binary(&self) -> Vec<u8> {
        let head = RouteRequest {
            chain: Vec::new(),
            ..self.clone()
        };
        let json = serde_json::to_vec(&head).unwrap_or_default();
        let mut out = Vec::with_capacity(4 + json.len() + self.chain.len() * 8);
        out.extend_from_slice(&(json.len() as u32).to_le_bytes());
        out.extend_from_slice(&json);
        for h in &self.chain {
            out.extend_from_slice(&h.to_le_bytes());
        }
        out
    }

    pub fn decode_binary(bytes: &[u8]) -> Result<RouteRequest, String> {
        let (len, rest) = bytes
            .split_first_chunk::<4>()
            .ok_or("binary route body shorter than its header")?;
        let len = u32::from_le_bytes(*len) as usize;
        if rest.len() < len {
            return Err(format!(
                "binary route body: JSON part of {len} bytes is truncated"
            ));
        }
        let (json, chain) = rest.split_at(len);
        let mut req: RouteRequest =
            serde_json::from_slice(json).map_err(|e| format!("binary route body: {e}"))?;
        if chain.len() % 8 != 0 {
            return Err(format!(
                "binary route body: chain of {} bytes is not a whole number of u64",
                chain.len()
            ));
        }
        if !req.chain.is_empty() {
            return Err("binary route body: the JSON part must not carry a chain".into());
        }
        req.chain = chain
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        Ok(req)
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

/// The block-size rules the filter's and the sidecar's configs share: a token block of
/// 1..=2^20 tokens, a text block of 16..=2^20 bytes.
pub fn check_block_sizes(
    name: &str,
    block_size: u32,
    text_block_bytes: u32,
    errs: &mut Vec<String>,
) {
    if block_size == 0 || block_size > 1 << 20 {
        errs.push(format!(
            "{name}: block_size must be in 1..=1048576 (got {block_size})"
        ));
    }
    if !(16..=1 << 20).contains(&text_block_bytes) {
        errs.push(format!(
            "{name}: text_block_bytes must be in 16..=1048576 (got {text_block_bytes})"
        ));
    }
}
