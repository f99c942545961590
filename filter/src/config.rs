//! The plugin configuration: parsed and validated once per VM in `on_configure`, then
//! shared read-only by every request of that VM.
//!
//! Every problem is reported (not just the first) so that an operator fixes a config in
//! one round; an invalid config makes `on_configure` return false and Envoy refuses it,
//! which is better than a filter that silently routes nothing.

use std::collections::BTreeMap;

use kvroute_shared::canon::AdapterRule;
use serde::Deserialize;

#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSettings {
    /// Tokens per block: must equal the engines' block size for this model.
    pub block_size: u32,
    /// Bytes per block for text prompts (chained in text mode, predicted residency).
    pub text_block_bytes: u32,
    /// Route text prompts at all (false: only token-id prompts are steered, unless the
    /// sidecar tokenizes them).
    pub route_text: bool,
    /// The sidecar holds this model's tokenizer and chat template (`--tokenizer`): chat
    /// and text prompts go to it as their messages/tools/prompt, and it chains the
    /// model's token ids — matching the engines' KV events — instead of canonical text.
    pub sidecar_tokenizes: bool,
}

impl Default for ModelSettings {
    fn default() -> Self {
        ModelSettings {
            block_size: 16,
            text_block_bytes: 256,
            route_text: true,
            sidecar_tokenizes: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilterConfig {
    /// Envoy cluster of the sidecar (a Unix socket cluster in the shipped config).
    pub sidecar_cluster: String,
    /// `:authority` sent to the sidecar.
    pub sidecar_authority: String,
    pub route_path: String,
    pub report_path: String,
    /// Where the decision of a request the sidecar queued is claimed, and where the
    /// filter says its client went away.
    pub wait_path: String,
    pub cancel_path: String,
    /// Callout timeout: past it the request goes on unsteered.
    pub timeout_ms: u64,
    /// Request paths that are routed (exact match, query string ignored).
    pub paths: Vec<String>,
    /// Bodies larger than this are not parsed (they still pass through).
    pub max_body_bytes: usize,
    /// Header Envoy's override-host load balancer reads.
    pub steer_header: String,
    /// Header carrying the prefill pod of a disaggregated model.
    pub prefill_header: String,
    /// Header telling the engine which data-parallel rank runs the request, when the
    /// chosen pod is one rank (`ip:port@rank`): vLLM's `X-data-parallel-rank`.
    pub rank_header: String,
    /// A header tried first for the session key (empty: none).
    pub session_header: String,
    /// Headers whose first present value is the session key, after `session_header`;
    /// without one, the body's `prompt_cache_key`, `metadata.user_id` or `user`. The
    /// default names what agent clients send: Claude Code's `x-claude-code-session-id`,
    /// Codex's `session-id` / `session_id`, and the generic `x-session-id` and
    /// `x-session-affinity`.
    pub session_headers: Vec<String>,
    /// A header the gateway's authentication sets (the tenant): when configured, its
    /// value is the cache namespace's salt and the client's `cache_salt` is ignored, so
    /// one tenant cannot learn another's prompts from where its requests are steered.
    /// Empty: the body's `cache_salt` is used, as the engine uses it.
    pub tenant_header: String,
    /// A header holding a request's priority for the sidecar's admission queue (an
    /// integer; higher goes first while the model is saturated). Empty: not read.
    pub priority_header: String,
    /// The Gateway API Inference Extension's objective header: its value names a
    /// priority in the sidecar's `admission.objectives`. Empty: not read.
    pub objective_header: String,
    /// The header naming the tenant whose share of dispatches a request counts against
    /// while saturated (GIE's fairness id). Without it (and without `tenant_header`,
    /// which wins), a hash of the request's API key (`authorization` or `x-api-key`).
    pub fairness_header: String,
    /// The longest a request the sidecar has queued may wait for its decision, whatever
    /// the sidecar says (past it the request goes on unsteered).
    pub max_wait_ms: u64,
    pub models: BTreeMap<String, ModelSettings>,
    pub default_model: ModelSettings,
    pub adapters: AdapterRule,
    /// Send completion reports from `on_log`.
    pub report: bool,
    /// Reports sent together in one callout (1: each on its own). A callout costs Envoy
    /// about as much CPU as proxying a small request, so reports travel in batches.
    pub report_batch: usize,
    /// A batch that is not full goes out after at most this long.
    pub report_flush_ms: u64,
    /// Add `x-kvroute-pod` / `x-kvroute-matched-blocks` to responses (leaks cache state).
    pub debug_headers: bool,
    /// Bytes of a response body's tail kept to find `usage` in.
    pub usage_window_bytes: usize,
    /// Chains longer than this go to the sidecar in the compact binary form.
    pub binary_above_blocks: usize,
}

impl Default for FilterConfig {
    fn default() -> Self {
        FilterConfig {
            sidecar_cluster: "kvroute_sidecar".into(),
            sidecar_authority: "kvroute-sidecar".into(),
            route_path: "/v1/route".into(),
            report_path: "/v1/report".into(),
            wait_path: "/v1/route/wait".into(),
            cancel_path: "/v1/route/cancel".into(),
            timeout_ms: 25,
            paths: vec![
                "/v1/completions".into(),
                "/v1/chat/completions".into(),
                "/v1/messages".into(),
                "/v1/responses".into(),
            ],
            max_body_bytes: 8 << 20,
            steer_header: "x-gateway-destination-endpoint".into(),
            prefill_header: "x-kvroute-prefill-endpoint".into(),
            rank_header: "x-data-parallel-rank".into(),
            session_header: String::new(),
            session_headers: DEFAULT_SESSION_HEADERS.map(String::from).to_vec(),
            tenant_header: String::new(),
            priority_header: "x-kvroute-priority".into(),
            objective_header: "x-gateway-inference-objective".into(),
            fairness_header: "x-gateway-inference-fairness-id".into(),
            max_wait_ms: 120_000,
            models: BTreeMap::new(),
            default_model: ModelSettings::default(),
            adapters: AdapterRule::default(),
            report: true,
            report_batch: 32,
            report_flush_ms: 20,
            debug_headers: false,
            usage_window_bytes: 16 << 10,
            binary_above_blocks: 512,
        }
    }
}

/// The session headers agent clients send (see [`FilterConfig::session_headers`]).
pub const DEFAULT_SESSION_HEADERS: [&str; 5] = [
    "x-claude-code-session-id",
    "session-id",
    "session_id",
    "x-session-id",
    "x-session-affinity",
];

fn valid_header_name(h: &str) -> bool {
    !h.is_empty()
        && h.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

impl FilterConfig {
    /// Parse the plugin configuration (absent or empty means all defaults).
    pub fn parse(bytes: Option<&[u8]>) -> Result<FilterConfig, Vec<String>> {
        let cfg: FilterConfig = match bytes {
            None => FilterConfig::default(),
            Some(b) if b.iter().all(u8::is_ascii_whitespace) => FilterConfig::default(),
            Some(b) => serde_json::from_slice(b)
                .map_err(|e| vec![format!("configuration is not valid: {e}")])?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut errs = Vec::new();
        if self.sidecar_cluster.is_empty() {
            errs.push("sidecar_cluster must not be empty".to_string());
        }
        for (name, p) in [
            ("route_path", &self.route_path),
            ("report_path", &self.report_path),
            ("wait_path", &self.wait_path),
            ("cancel_path", &self.cancel_path),
        ] {
            if !p.starts_with('/') {
                errs.push(format!("{name} must start with '/' (got {p:?})"));
            }
        }
        if self.timeout_ms == 0 || self.timeout_ms > 10_000 {
            errs.push(format!(
                "timeout_ms must be in 1..=10000 (got {})",
                self.timeout_ms
            ));
        }
        if self.max_wait_ms > 3_600_000 {
            errs.push(format!(
                "max_wait_ms must be at most 3600000 (got {})",
                self.max_wait_ms
            ));
        }
        if self.paths.is_empty() {
            errs.push("paths must list at least one path".to_string());
        }
        for p in &self.paths {
            if kvroute_shared::canon::Endpoint::from_path(p).is_none() {
                errs.push(format!(
                    "paths: {p:?} is not a routed API path (/v1/completions, /v1/chat/completions, /v1/messages, /v1/responses)"
                ));
            }
        }
        if self.max_body_bytes == 0 {
            errs.push("max_body_bytes must be > 0".to_string());
        }
        for (name, h) in [
            ("steer_header", &self.steer_header),
            ("prefill_header", &self.prefill_header),
            ("rank_header", &self.rank_header),
        ] {
            if !valid_header_name(h) {
                errs.push(format!(
                    "{name} must be a lowercase header name (got {h:?})"
                ));
            }
        }
        for (name, h) in [
            ("session_header", &self.session_header),
            ("tenant_header", &self.tenant_header),
            ("priority_header", &self.priority_header),
            ("objective_header", &self.objective_header),
            ("fairness_header", &self.fairness_header),
        ] {
            if !h.is_empty() && !valid_header_name(h) {
                errs.push(format!(
                    "{name} must be a lowercase header name (got {h:?})"
                ));
            }
        }
        if self.session_headers.len() > 16 {
            errs.push(format!(
                "session_headers lists at most 16 headers (got {})",
                self.session_headers.len()
            ));
        }
        for h in &self.session_headers {
            if !valid_header_name(h) {
                errs.push(format!(
                    "session_headers: {h:?} is not a lowercase header name"
                ));
            }
        }
        let models = std::iter::once(("default_model", &self.default_model))
            .chain(self.models.iter().map(|(k, v)| (k.as_str(), v)));
        for (name, m) in models {
            kvroute_shared::protocol::check_block_sizes(
                name,
                m.block_size,
                m.text_block_bytes,
                &mut errs,
            );
        }
        if self.usage_window_bytes < 256 || self.usage_window_bytes > 1 << 20 {
            errs.push(format!(
                "usage_window_bytes must be in 256..=1048576 (got {})",
                self.usage_window_bytes
            ));
        }
        if !(1..=1024).contains(&self.report_batch) {
            errs.push(format!(
                "report_batch must be in 1..=1024 (got {})",
                self.report_batch
            ));
        }
        if !(1..=10_000).contains(&self.report_flush_ms) {
            errs.push(format!(
                "report_flush_ms must be in 1..=10000 (got {})",
                self.report_flush_ms
            ));
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs)
        }
    }

    pub fn model(&self, base_model: &str) -> &ModelSettings {
        self.models.get(base_model).unwrap_or(&self.default_model)
    }

    /// Is this request path one we route?
    /// The session headers in the order they are tried.
    pub fn session_header_names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.session_header.as_str())
            .filter(|h| !h.is_empty())
            .chain(self.session_headers.iter().map(String::as_str))
    }

    pub fn routes_path(&self, path: &str) -> bool {
        let path = path.split('?').next().unwrap_or(path);
        self.paths.iter().any(|p| p == path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        assert_eq!(FilterConfig::parse(None), Ok(FilterConfig::default()));
        assert_eq!(
            FilterConfig::parse(Some(b"  ")),
            Ok(FilterConfig::default())
        );
        assert!(FilterConfig::parse(Some(b"{}")).is_ok());
    }

    #[test]
    fn every_problem_is_listed() {
        let bad = br#"{"timeout_ms":0,"paths":["/x"],"steer_header":"Bad Header","default_model":{"block_size":0}}"#;
        let errs = FilterConfig::parse(Some(bad)).expect_err("invalid");
        assert_eq!(errs.len(), 4, "{errs:?}");
        let unknown = FilterConfig::parse(Some(br#"{"timeout":5}"#)).expect_err("unknown key");
        assert!(unknown[0].contains("unknown field"), "{unknown:?}");
    }

    #[test]
    fn paths_ignore_query() {
        let c = FilterConfig::default();
        assert!(c.routes_path("/v1/completions?stream=1"));
        assert!(!c.routes_path("/v1/models"));
    }
}
