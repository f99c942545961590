//! The policy configuration (`GET`/`PUT /v1/config`) and its validation. Only the
//! sidecar and the tools need it; the filter is built without it (feature `config`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{check_block_sizes, Tier};
use crate::chain::Mode;

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
/// `1 − tier_cost`, and a stale pod's at `stale_factor` (see sidecar/gateway/src/policy.rs).
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
    /// The fleet is saturated when its candidates have this many seconds of prefill
    /// queued on average (at `prefill_tokens_per_s`; 0 = never). Then a block sent where
    /// it is not cached is work every request queued behind it waits for, not one
    /// request's latency: the uncached blocks weigh `1 + saturation_weight × (mean backlog
    /// − this) / prompt` as much, and the
    /// bounded-load and full-batch guards step aside (leaving the cache would cost more
    /// than waiting for it).
    pub saturation_backlog_s: f64,
    /// Multiplier on that extra weight (how many queued requests an uncached block is
    /// taken to delay, per prompt of backlog).
    pub saturation_weight: f64,
    /// The most prompts of backlog that extra weight counts. That far behind, a pod's
    /// cache can turn over while a request waits there, so the hits it is kept for are
    /// no longer certain, and an ever heavier weight only freezes placement while the
    /// pods' queues drift apart (agentic sessions on 4 pods of 2,048 blocks, seeds 1-16:
    /// mean TTFT 130 s uncapped, 100 s at 12).
    pub saturation_max_prompts: f64,
    /// Requests the engines report waiting for a batch slot, past this many per pod on
    /// average (default 0; `null` turns it off), count toward the saturation backlog as
    /// prompts of the request's size. Engines that hold requests behind full batches of
    /// long decodes are behind in a way their queued prefill does not show, and a fleet
    /// that ignores it spreads prompts off their caches while every line grows (agentic
    /// sessions on 4 × 4,096 blocks, seeds 1-48: mean TTFT 3,271 -> 2,779 ms; the
    /// Mooncake trace at twice its rate: 17.9 -> 11.0 s; docs/policy.md, "The engines'
    /// waiting lines").
    pub saturation_waiting_over: Option<f64>,
    /// How much more an uncached block weighs on a pod whose cache is evicting what
    /// it was sent: `1 + eviction_weight × pressure`, the pressure being the recent
    /// share of the pod's predicted hits its engine no longer held. There a prefill
    /// evicts another prompt's blocks, so copying a prefix that lives elsewhere (to
    /// save a short wait) costs the hits of whoever was using that space; 0 = off.
    pub eviction_weight: f64,
    /// The extra weight of a block this pod would prefill that another candidate is
    /// prefilling right now for a request routed moments ago (a prefix done twice):
    /// waiting there costs about what recomputing does, and the copy costs the fleet a
    /// prefill and cache space (0 = off).
    pub recompute_weight: f64,
    /// For a request whose prompt has a home (some pod holds more of it than every pod
    /// is credited), the queued-prefill weight falls as the fleet's caches evict:
    /// `load_weight / (1 + eviction_load_cut × pressure)`, the pressure being the
    /// candidates' mean. Where every cache evicts what it is sent, a prompt sent off its
    /// cache to skip a queue is prefilled whole elsewhere and pushes out the prompts
    /// cached there. New prompts keep the full weight: their placement is what spreads
    /// prompts over pods (0 = off). The pressure is the share of sessions' returning
    /// prompts their pods had evicted past 0.3 (token chains: by the index, stepping
    /// aside while the fleet is far behind; text chains: by the engines' reports, or the
    /// share of predicted hits the engines had evicted, whichever is more). 50: at a
    /// pressure of 0.2 a queue counts a tenth (docs/policy.md).
    pub eviction_load_cut: f64,
    /// Pods whose cost is within this much of the best (in blocks of prefill) are equals,
    /// and the request's tie key picks among them. Replicas that route concurrent cold
    /// requests before hearing of each other's decisions then spread them instead of all
    /// sending them to the one pod that looks idlest (0 = strict argmin). Only a request
    /// choosing a home spreads; one with a home keeps its cache.
    pub near_tie_cost: f64,
    /// With other gateway replicas routing to the same pods, each takes every R-th pod
    /// (in pod-id order, R the replicas it hears) as its own for new prompts: a request
    /// choosing a home pays this many extra blocks per prompt block on the other
    /// replicas' pods, while the fleet is busy (`peer_home_backlog_s`). Replicas hear of
    /// each other's placements a delta late, so two that place cold prompts within that
    /// delay pick the same pod that looks idlest and queue one prefill behind the other
    /// (0 = off; one replica: no effect).
    pub peer_home_weight: f64,
    /// The candidates' mean queued prefill, in seconds at `prefill_tokens_per_s`, from
    /// which `peer_home_weight` applies (0 = always). On a fleet with idle time a replica
    /// does better choosing among all pods: kept to its own share, its new conversations
    /// crowd those pods whenever it draws more of them than the other replicas
    /// (docs/policy.md, "Replicas that place new prompts apart"). A request that goes
    /// through the admission gate is kept apart whatever the backlog: there the fleet
    /// runs at its limit and the queue keeps backlogs short.
    pub peer_home_backlog_s: f64,
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
    /// Share of a session's last prompt credited as hits to the pod the session is bound
    /// to (a session header, `prompt_cache_key`, Messages `metadata.user_id`, `user`): what
    /// the pod probably still holds when the index cannot tell. Not credited where the
    /// index follows the pod's events and the pod keeps returning prompts: there the
    /// prompt is gone and the session chooses a home again. Where pods evict returning
    /// prompts it also keeps a session home when nothing holds its prompt any more, which
    /// evicts fewer other sessions than re-prefilling it on the idlest pod (0.6 against
    /// 0.5: +1.8 points of hit rate on the live-shaped agentic case, docs/policy.md).
    /// 0 turns it off.
    pub session_weight: f64,
    /// Bindings (sessions, Responses ids) unused this long are forgotten.
    pub binding_ttl_s: u64,
    /// At most this many bindings of each kind (oldest first out); about 96 bytes each.
    pub max_bindings: u64,
    /// Queueing requests in the router while a model's pods have no room for them.
    pub admission: AdmissionConfig,
}

/// When a model is saturated and what happens to its requests then (docs/policy.md).
///
/// A pod has room for a request while, with it, its queued prefill stays within
/// `max_backlog_s`, its engine reports fewer than `max_waiting` requests waiting and it
/// has fewer than `max_inflight` in flight (0 turns a check off). A model is saturated
/// for a request when no pod has room, or the pods with room would lose more than
/// `cache_loss` of the prompt's cached prefix: the request then waits in the model's
/// queue in its priority band, tenants taking turns, until room appears (it is scored
/// again then) or its band's TTL passes (429 with `Retry-After`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Off: every request is routed at once, whatever the load (the engines queue it).
    pub enabled: bool,
    pub max_backlog_s: f64,
    pub max_waiting: u32,
    /// Set it to the engines' batch size (vLLM's `max_num_seqs`): a request sent past
    /// it waits inside the engine, where no priority applies.
    pub max_inflight: u32,
    pub cache_loss: f64,
    /// In-flight slots per pod kept for the highest band waiting.
    pub reserve_inflight: u32,
    /// Bounds of one model's queue.
    pub max_queued: u32,
    pub max_queued_bytes: u64,
    /// Priority of a request that names none.
    pub default_priority: i32,
    /// Gateway API Inference Extension objectives (`x-gateway-inference-objective`) and
    /// the priority each stands for; an unknown objective has `default_priority`.
    pub objectives: BTreeMap<String, i32>,
    /// How long a request may wait, by priority: the band with the highest `priority`
    /// at or below the request's applies; below every band, `ttl_s`.
    pub bands: Vec<AdmissionBand>,
    pub ttl_s: f64,
    /// Told to a refused client (`Retry-After`, seconds).
    pub retry_after_s: u32,
    /// A queued request whose filter has not claimed it within this long is dropped
    /// (the filter went away between its two calls).
    pub claim_timeout_ms: u64,
}

/// A priority band's rules (see [`AdmissionConfig::bands`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionBand {
    /// The lowest priority in the band.
    pub priority: i32,
    pub ttl_s: f64,
    /// Refused at once while saturated instead of queued (batch traffic that would
    /// rather retry elsewhere than wait).
    pub sheddable: bool,
}

impl Default for AdmissionBand {
    fn default() -> Self {
        AdmissionBand {
            priority: 0,
            ttl_s: 30.0,
            sheddable: false,
        }
    }
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            enabled: false,
            max_backlog_s: 1.0,
            max_waiting: 0,
            max_inflight: 0,
            cache_loss: 0.5,
            reserve_inflight: 0,
            max_queued: 1024,
            max_queued_bytes: 64 << 20,
            default_priority: 0,
            objectives: BTreeMap::new(),
            bands: Vec::new(),
            ttl_s: 30.0,
            retry_after_s: 2,
            claim_timeout_ms: 1000,
        }
    }
}

/// The most bands or objectives an admission config may list.
pub const MAX_ADMISSION_CLASSES: usize = 64;

impl AdmissionConfig {
    /// The priority of a request's class: its own number, else its objective's.
    pub fn priority(&self, a: &super::Admission) -> i32 {
        a.priority
            .or_else(|| {
                a.objective
                    .as_ref()
                    .and_then(|o| self.objectives.get(o).copied())
            })
            .unwrap_or(self.default_priority)
    }

    /// The band a priority falls in (`None`: below every band).
    pub fn band(&self, priority: i32) -> Option<&AdmissionBand> {
        self.bands
            .iter()
            .filter(|b| b.priority <= priority)
            .max_by_key(|b| b.priority)
    }

    /// How long a request of `priority` may wait.
    pub fn ttl(&self, priority: i32) -> std::time::Duration {
        let s = self.band(priority).map_or(self.ttl_s, |b| b.ttl_s);
        std::time::Duration::from_secs_f64(s.clamp(0.0, 86_400.0))
    }

    pub fn sheddable(&self, priority: i32) -> bool {
        self.band(priority).is_some_and(|b| b.sheddable)
    }

    fn validate(&self, errs: &mut Vec<String>) {
        let mut nonneg = |name: &str, v: f64, max: f64| {
            if !(v.is_finite() && (0.0..=max).contains(&v)) {
                errs.push(format!("admission.{name} must be in [0, {max}] (got {v})"));
            }
        };
        nonneg("max_backlog_s", self.max_backlog_s, 86_400.0);
        nonneg("cache_loss", self.cache_loss, 1.0);
        nonneg("ttl_s", self.ttl_s, 86_400.0);
        for b in &self.bands {
            nonneg("bands[].ttl_s", b.ttl_s, 86_400.0);
        }
        if self.bands.len() > MAX_ADMISSION_CLASSES || self.objectives.len() > MAX_ADMISSION_CLASSES
        {
            errs.push(format!(
                "admission: at most {MAX_ADMISSION_CLASSES} bands and {MAX_ADMISSION_CLASSES} objectives"
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for b in &self.bands {
            if !seen.insert(b.priority) {
                errs.push(format!(
                    "admission.bands: priority {} listed twice",
                    b.priority
                ));
            }
        }
        if self
            .objectives
            .keys()
            .any(|k| k.is_empty() || k.len() > super::MAX_ADMISSION_ID)
        {
            errs.push(format!(
                "admission.objectives: names must be 1-{} bytes",
                super::MAX_ADMISSION_ID
            ));
        }
        if self.max_queued == 0 || self.max_queued > 1_000_000 {
            errs.push(format!(
                "admission.max_queued must be in [1, 1000000] (got {})",
                self.max_queued
            ));
        }
        if self.max_queued_bytes == 0 || self.max_queued_bytes > 16 << 30 {
            errs.push(format!(
                "admission.max_queued_bytes must be in [1, 16 GiB] (got {})",
                self.max_queued_bytes
            ));
        }
        if self.reserve_inflight > 0 && self.reserve_inflight >= self.max_inflight {
            errs.push(format!(
                "admission.reserve_inflight ({}) must be below max_inflight ({})",
                self.reserve_inflight, self.max_inflight
            ));
        }
        if self.retry_after_s > 3600 {
            errs.push(format!(
                "admission.retry_after_s must be at most 3600 (got {})",
                self.retry_after_s
            ));
        }
        if !(1..=60_000).contains(&self.claim_timeout_ms) {
            errs.push(format!(
                "admission.claim_timeout_ms must be in [1, 60000] (got {})",
                self.claim_timeout_ms
            ));
        }
    }
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
            saturation_backlog_s: 2.0,
            saturation_weight: 8.0,
            saturation_max_prompts: 12.0,
            saturation_waiting_over: Some(0.0),
            eviction_weight: 0.0,
            recompute_weight: 0.5,
            eviction_load_cut: 50.0,
            near_tie_cost: 3.0,
            peer_home_weight: 0.25,
            peer_home_backlog_s: 0.25,
            temperature: 0.0,
            explain: false,
            predicted_ttl_s: 120,
            predicted_capacity_blocks: 1 << 16,
            liveness_timeout_s: 30,
            load_timeout_s: 300,
            breaker_failures: 5,
            breaker_cooldown_s: 10,
            require_registration: false,
            session_weight: 0.6,
            binding_ttl_s: 3600,
            max_bindings: 65_536,
            admission: AdmissionConfig::default(),
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
        finite_nonneg("peer_home_weight", self.peer_home_weight);
        finite_nonneg("peer_home_backlog_s", self.peer_home_backlog_s);
        finite_nonneg("saturation_backlog_s", self.saturation_backlog_s);
        finite_nonneg("saturation_weight", self.saturation_weight);
        finite_nonneg("saturation_max_prompts", self.saturation_max_prompts);
        if let Some(v) = self.saturation_waiting_over {
            finite_nonneg("saturation_waiting_over", v);
        }
        finite_nonneg("eviction_weight", self.eviction_weight);
        finite_nonneg("recompute_weight", self.recompute_weight);
        finite_nonneg("eviction_load_cut", self.eviction_load_cut);
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
        if !(0.0..=1.0).contains(&self.session_weight) {
            errs.push(format!(
                "session_weight must be in [0, 1] (got {})",
                self.session_weight
            ));
        }
        if self.binding_ttl_s == 0 {
            errs.push("binding_ttl_s must be > 0".to_string());
        }
        if self.max_bindings > 10_000_000 {
            errs.push(format!(
                "max_bindings must be at most 10000000 (got {})",
                self.max_bindings
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
        self.admission.validate(&mut errs);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Admission;

    #[test]
    fn a_requests_priority_picks_its_band() {
        let a = AdmissionConfig {
            objectives: [("interactive".to_string(), 10), ("batch".to_string(), -10)].into(),
            bands: vec![
                AdmissionBand {
                    priority: -10,
                    ttl_s: 5.0,
                    sheddable: true,
                },
                AdmissionBand {
                    priority: 10,
                    ttl_s: 60.0,
                    sheddable: false,
                },
            ],
            ttl_s: 30.0,
            ..AdmissionConfig::default()
        };
        let class = |priority: Option<i32>, objective: Option<&str>| Admission {
            priority,
            objective: objective.map(str::to_owned),
            tenant: None,
        };
        assert_eq!(a.priority(&class(None, Some("interactive"))), 10);
        assert_eq!(
            a.priority(&class(Some(3), Some("interactive"))),
            3,
            "a number wins"
        );
        assert_eq!(a.priority(&class(None, Some("unknown"))), 0);
        assert_eq!(a.ttl(10).as_secs(), 60);
        assert_eq!(a.ttl(50).as_secs(), 60);
        assert_eq!(a.ttl(0).as_secs(), 5, "the -10 band reaches up to 9");
        assert_eq!(a.ttl(-11).as_secs(), 30, "below every band");
        assert!(a.sheddable(-10) && a.sheddable(9) && !a.sheddable(10) && !a.sheddable(-11));
    }
}
