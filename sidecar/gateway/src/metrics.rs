//! The sidecar's Prometheus metrics, kept with `prometheus-client` (the same library the
//! bridge uses): counters and histograms updated where things happen, gauges that
//! describe state (pods, index size, decisions in flight) set from a [`Gauges`]
//! snapshot when scraped. Exposed as OpenMetrics text.
//!
//! Metric names are a contract with dashboards; counters get their `_total` suffix from
//! the library. Labelled counters carry one label each ([`Labeled`]).

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// The label set of a one-label family.
type Label = Vec<(&'static str, String)>;

/// A counter family keyed by one label.
#[derive(Clone)]
pub struct Labeled {
    label: &'static str,
    family: Family<Label, Counter>,
}

impl Labeled {
    fn new(label: &'static str) -> Labeled {
        Labeled {
            label,
            family: Family::default(),
        }
    }

    pub fn inc(&self, value: &str, by: u64) {
        self.family
            .get_or_create(&vec![(self.label, value.to_string())])
            .inc_by(by);
    }

    pub fn get(&self, value: &str) -> u64 {
        self.family
            .get_or_create(&vec![(self.label, value.to_string())])
            .get()
    }

    /// Every label value seen and its count (the status page). The family is read
    /// through its own exposition, the one read API `prometheus-client` offers.
    pub fn snapshot(&self) -> Vec<(String, u64)> {
        let mut r = Registry::default();
        r.register("x", "", self.family.clone());
        let mut text = String::new();
        if encode(&mut text, &r).is_err() {
            return Vec::new();
        }
        let prefix = format!("x_total{{{}=\"", self.label);
        text.lines()
            .filter_map(|l| {
                let rest = l.strip_prefix(&prefix)?;
                let (value, count) = rest.rsplit_once("\"} ")?;
                Some((
                    value.replace("\\\"", "\"").replace("\\\\", "\\"),
                    count.trim().parse().ok()?,
                ))
            })
            .collect()
    }

    fn forget(&self, value: &str) {
        self.family.remove(&vec![(self.label, value.to_string())]);
    }
}

pub const LATENCY_BOUNDS: [f64; 11] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05,
];
pub const QUEUE_BOUNDS: [f64; 10] = [
    0.000_1, 0.000_5, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.0,
];
pub const WAIT_BOUNDS: [f64; 10] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0];
pub const BLOCK_BOUNDS: [f64; 9] = [0.0, 1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0];

/// State gauges, set from a snapshot at scrape time.
struct StateGauges {
    pods: Family<Label, Gauge>,
    index_entries: Family<Label, Gauge>,
    index_bytes: Family<Label, Gauge>,
    predicted_entries: Gauge,
    inflight: Gauge,
    /// Requests in the admission queue per model, priority and tenant.
    queued: Family<Vec<(&'static str, String)>, Gauge>,
    /// Each model tokenizer's segment cache and chunked prompts.
    segment_bytes: Family<Label, Gauge>,
    segment_entries: Family<Label, Gauge>,
    chunking_on: Family<Label, Gauge>,
    segment_lookups: Family<Vec<(&'static str, String)>, Counter>,
    segment_evicted: Family<Label, Counter>,
    prompt_chunks: Family<Vec<(&'static str, String)>, Counter>,
}

pub struct Metrics {
    registry: Registry,
    state: StateGauges,
    /// One scrape at a time sets the state series: two clearing and setting them at once
    /// could add a mirrored count twice.
    rendering: parking_lot::Mutex<()>,
    pub route_seconds: Histogram,
    /// How long NATS batches waited in their pod's queue before a worker took them.
    pub event_queue_seconds: Histogram,
    pub matched_blocks: Histogram,
    pub decisions: Labeled,
    pub route_errors: Labeled,
    pub events_applied: Counter,
    pub event_blocks: Counter,
    pub events_rejected: Labeled,
    pub duplicates: Counter,
    pub seq_gaps: Counter,
    pub resyncs: Labeled,
    pub epochs: Counter,
    pub pods_refused: Counter,
    pub reports: Counter,
    pub reports_rejected: Counter,
    pub cached_tokens: Labeled,
    pub mispredictions: Counter,
    /// Reports short of the prediction only in guesses whose first prefill had not been
    /// reported when the request was routed (not evictions: no capacity cut).
    pub predicted_in_flight: Counter,
    pub pods_removed: Labeled,
    pub load_released: Labeled,
    /// Reports by whether they named an outstanding decision ("released", "unknown",
    /// "none" when the report carries no decision id).
    pub report_decisions: Labeled,
    /// Load deltas between replicas: "queued", "published", "dropped_full",
    /// "publish_failed", "applied", "ignored", "own" (this replica's, heard back).
    pub replica_deltas: Labeled,
    /// Routed requests that carried a session key, by where they went against the
    /// session's binding: "new" (no binding), "stayed" (its bound pod), "moved" (another
    /// pod: the turn left its cache for load, or its pod was gone).
    pub session_turns: Labeled,
    /// Admission queue states between replicas: "published", "publish_failed",
    /// "applied", "no_room" (this replica queues nothing for the model), "malformed",
    /// "subject_mismatch", and the refusals' labels ("own", "too_large", "bad_number",
    /// "too_many_peers").
    pub replica_queues: Labeled,
    event_lag: Family<Label, Gauge<f64, AtomicU64>>,
    pub nats_connected: Gauge,
    pub nats_messages: Counter,
    pub config_version: Gauge,
    pub config_rejected: Counter,
    /// Route requests carrying a prompt body: "tokens" when the sidecar tokenized it,
    /// else why not (routed by the text chain).
    pub precise: Labeled,
    /// API requests refused before any handler ran, by reason ("unauthorized",
    /// "foreign_origin", "foreign_host", "content_type").
    pub api_refused: Labeled,
    /// Connections to the TCP listeners, by what became of them (`http_server::ConnEvent`).
    pub api_connections: Labeled,
    /// Requests seen by the endpoint picker, by outcome ("routed", or why not:
    /// `picker::Outcome`, and "stream_error" for a stream that broke).
    pub picker: Labeled,
    /// Route requests under admission, by what became of them: "routed" at once,
    /// "queued", and how queued ones left ("dispatched", "expired", "displaced",
    /// "unclaimed", "cancelled", "failed", "stopping"), or why one was refused
    /// ("queue_full", "too_large", "shed").
    pub admission: Labeled,
    /// How long dispatched requests waited in the admission queue.
    pub admission_wait_seconds: Histogram,
    /// Reports judged against the index, by model, chat template and outcome (`agreement`).
    cache_agreement: Family<Label, Counter>,
}

impl Metrics {
    /// One judged report; `template` is the chat template the sidecar rendered the
    /// model's prompts with ("" when the filter hashed tokens itself).
    pub fn agreement(&self, model: &str, template: Option<&str>, outcome: &'static str) {
        self.cache_agreement
            .get_or_create(&vec![
                ("model", model.to_owned()),
                ("template", template.unwrap_or_default().to_owned()),
                ("outcome", outcome.to_owned()),
            ])
            .inc();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut r = Registry::default();
        let m = Metrics {
            route_seconds: Histogram::new(LATENCY_BOUNDS),
            event_queue_seconds: Histogram::new(QUEUE_BOUNDS),
            matched_blocks: Histogram::new(BLOCK_BOUNDS),
            decisions: Labeled::new("pod"),
            route_errors: Labeled::new("reason"),
            events_applied: Counter::default(),
            event_blocks: Counter::default(),
            events_rejected: Labeled::new("reason"),
            duplicates: Counter::default(),
            seq_gaps: Counter::default(),
            resyncs: Labeled::new("how"),
            epochs: Counter::default(),
            pods_refused: Counter::default(),
            reports: Counter::default(),
            reports_rejected: Counter::default(),
            cached_tokens: Labeled::new("source"),
            mispredictions: Counter::default(),
            predicted_in_flight: Counter::default(),
            pods_removed: Labeled::new("reason"),
            load_released: Labeled::new("how"),
            report_decisions: Labeled::new("outcome"),
            replica_deltas: Labeled::new("outcome"),
            session_turns: Labeled::new("outcome"),
            replica_queues: Labeled::new("outcome"),
            event_lag: Family::default(),
            nats_connected: Gauge::default(),
            nats_messages: Counter::default(),
            config_version: Gauge::default(),
            config_rejected: Counter::default(),
            cache_agreement: Family::default(),
            precise: Labeled::new("outcome"),
            api_refused: Labeled::new("reason"),
            api_connections: Labeled::new("outcome"),
            picker: Labeled::new("outcome"),
            admission: Labeled::new("outcome"),
            admission_wait_seconds: Histogram::new(WAIT_BOUNDS),
            state: StateGauges {
                pods: Family::default(),
                index_entries: Family::default(),
                index_bytes: Family::default(),
                predicted_entries: Gauge::default(),
                inflight: Gauge::default(),
                queued: Family::default(),
                segment_bytes: Family::default(),
                segment_entries: Family::default(),
                chunking_on: Family::default(),
                segment_lookups: Family::default(),
                segment_evicted: Family::default(),
                prompt_chunks: Family::default(),
            },
            registry: Registry::default(),
            rendering: parking_lot::Mutex::new(()),
        };
        let h = |r: &mut Registry, name: &str, help: &str, x: &Histogram| {
            r.register(name, help, x.clone())
        };
        h(
            &mut r,
            "kvroute_route_seconds",
            "Time to answer a route request.",
            &m.route_seconds,
        );
        h(
            &mut r,
            "kvroute_event_queue_seconds",
            "Time NATS event batches waited in their pod's queue.",
            &m.event_queue_seconds,
        );
        h(
            &mut r,
            "kvroute_admission_wait_seconds",
            "Time dispatched requests waited in the admission queue.",
            &m.admission_wait_seconds,
        );
        h(
            &mut r,
            "kvroute_matched_blocks",
            "Blocks the chosen pod already held.",
            &m.matched_blocks,
        );
        let labeled = [
            (
                "kvroute_decisions",
                "Route decisions per pod.",
                &m.decisions,
            ),
            (
                "kvroute_route_errors",
                "Route requests refused.",
                &m.route_errors,
            ),
            (
                "kvroute_event_batches_rejected",
                "Event batches refused.",
                &m.events_rejected,
            ),
            ("kvroute_resyncs", "Pod resyncs after a gap.", &m.resyncs),
            (
                "kvroute_cached_tokens",
                "Cached prompt tokens, as the router predicted and as engines reported.",
                &m.cached_tokens,
            ),
            ("kvroute_pods_removed", "Pods removed.", &m.pods_removed),
            (
                "kvroute_load_released",
                "Projected load released.",
                &m.load_released,
            ),
            (
                "kvroute_report_decisions",
                "Completion reports by the decision they named.",
                &m.report_decisions,
            ),
            (
                "kvroute_precise_prompts",
                "Route requests with a prompt body: tokenized by the sidecar (tokens), or why they were routed by their text chain.",
                &m.precise,
            ),
            (
                "kvroute_api_refused",
                "API requests refused before reaching a handler (token, origin, host, content type).",
                &m.api_refused,
            ),
            (
                "kvroute_api_connections",
                "Connections to the TCP listeners: accepted at once, accepted after waiting for a slot (--max-connections), closed for sending no request head in time (--header-timeout-ms), requests whose body was not whole in time (--body-timeout-ms), closed on an error.",
                &m.api_connections,
            ),
            (
                "kvroute_picker_requests",
                "Requests seen by the endpoint picker (ext_proc), by outcome: routed, or why they went on unsteered.",
                &m.picker,
            ),
            (
                "kvroute_admission",
                "Route requests under admission control, by outcome (routed at once, queued, and how queued ones left or why one was refused).",
                &m.admission,
            ),
            (
                "kvroute_replica_deltas",
                "Load deltas exchanged with other replicas.",
                &m.replica_deltas,
            ),
            (
                "kvroute_session_turns",
                "Requests with a session key, by whether they went to the session's bound pod (stayed), to another (moved) or had no binding (new).",
                &m.session_turns,
            ),
            (
                "kvroute_replica_queues",
                "Admission queue states exchanged with other replicas (tenants' turns across gateways).",
                &m.replica_queues,
            ),
        ];
        for (name, help, f) in labeled {
            r.register(name, help, f.family.clone());
        }
        let counters = [
            (
                "kvroute_event_batches_applied",
                "Event batches applied.",
                &m.events_applied,
            ),
            (
                "kvroute_event_blocks",
                "Block changes carried by applied events.",
                &m.event_blocks,
            ),
            (
                "kvroute_event_duplicates",
                "Batches ignored as duplicates or replays.",
                &m.duplicates,
            ),
            (
                "kvroute_event_seq_gaps",
                "Sequence gaps detected (pod marked stale).",
                &m.seq_gaps,
            ),
            (
                "kvroute_engine_restarts",
                "New epochs seen (engine restarts).",
                &m.epochs,
            ),
            (
                "kvroute_pods_refused",
                "Pods refused (model full, unregistered).",
                &m.pods_refused,
            ),
            (
                "kvroute_reports",
                "Completion reports received.",
                &m.reports,
            ),
            (
                "kvroute_reports_rejected",
                "Completion reports refused as malformed (a bad body, or one element of a batch).",
                &m.reports_rejected,
            ),
            (
                "kvroute_mispredictions",
                "Reports of predicted decisions that found settled guesses evicted.",
                &m.mispredictions,
            ),
            (
                "kvroute_predicted_in_flight",
                "Reports short of the prediction only where the guess was still being prefilled.",
                &m.predicted_in_flight,
            ),
            (
                "kvroute_nats_messages",
                "Messages received from NATS.",
                &m.nats_messages,
            ),
            (
                "kvroute_config_rejected",
                "Config updates refused.",
                &m.config_rejected,
            ),
        ];
        for (name, help, c) in counters {
            r.register(name, help, c.clone());
        }
        r.register(
            "kvroute_cache_agreement",
            "Reports on decisions made from engine events, by whether the engine's cached_tokens agreed with the index (agree, over: the index expected more, under).",
            m.cache_agreement.clone(),
        );
        r.register(
            "kvroute_event_lag_seconds",
            "Now minus the last batch's ts, per pod.",
            m.event_lag.clone(),
        );
        r.register("kvroute_pods", "Pods by state.", m.state.pods.clone());
        r.register(
            "kvroute_admission_queued",
            "Requests waiting in the admission queue, per model, priority and tenant (a model with any is saturated).",
            m.state.queued.clone(),
        );
        r.register(
            "kvroute_tokenizer_segment_cache_bytes",
            "Bytes a model tokenizer's segment cache accounts (text and ids).",
            m.state.segment_bytes.clone(),
        );
        r.register(
            "kvroute_tokenizer_segment_cache_entries",
            "Pieces in a model tokenizer's segment cache.",
            m.state.segment_entries.clone(),
        );
        r.register(
            "kvroute_tokenizer_segment_lookups",
            "Segment cache lookups per model, by outcome (hit, miss).",
            m.state.segment_lookups.clone(),
        );
        r.register(
            "kvroute_tokenizer_segment_evicted",
            "Pieces evicted from a model tokenizer's segment cache.",
            m.state.segment_evicted.clone(),
        );
        r.register(
            "kvroute_tokenizer_prompt_chunking",
            "1 while a model's long completions prompts are encoded in chunks, 0 once a check found the chunks' ids differ and prompts are encoded whole (no series: the tokenizer does not qualify).",
            m.state.chunking_on.clone(),
        );
        r.register(
            "kvroute_tokenizer_prompt_chunks",
            "Completions prompts encoded in chunks per model, by outcome: chunked, verified (also encoded whole to check), mismatch (the check differed; chunking then stops).",
            m.state.prompt_chunks.clone(),
        );
        r.register(
            "kvroute_index_entries",
            "Blocks in the index.",
            m.state.index_entries.clone(),
        );
        r.register(
            "kvroute_index_bytes",
            "Heap bytes of the index.",
            m.state.index_bytes.clone(),
        );
        let gauges = [
            (
                "kvroute_predicted_entries",
                "Blocks of predicted residency.",
                &m.state.predicted_entries,
            ),
            (
                "kvroute_inflight_decisions",
                "Decisions whose load is still projected.",
                &m.state.inflight,
            ),
            (
                "kvroute_nats_connected",
                "1 when the NATS connection is up.",
                &m.nats_connected,
            ),
            (
                "kvroute_config_version",
                "Version of the policy in force.",
                &m.config_version,
            ),
        ];
        for (name, help, g) in gauges {
            r.register(name, help, g.clone());
        }
        Metrics { registry: r, ..m }
    }
}

/// Point-in-time gauges the renderer asks the state for.
#[derive(Default)]
pub struct Gauges {
    pub pods_live: u64,
    pub pods_stale: u64,
    pub pods_draining: u64,
    /// (model, entries, heap bytes) of the confirmed index.
    pub index: Vec<(String, u64, u64)>,
    pub predicted_entries: u64,
    pub inflight: u64,
    /// (model, priority, tenant, requests) in the admission queues.
    pub queued: Vec<(String, i32, String, usize)>,
    /// (model, segment cache, chunked prompts when the tokenizer chunks them).
    pub tokenizers: Vec<(
        String,
        crate::tokenize::CacheStats,
        Option<crate::tokenize::ChunkStats>,
    )>,
}

fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Metrics {
    /// The last event lag recorded for `pod`, if any batch carried a timestamp.
    pub fn event_lag(&self, pod: &str) -> Option<f64> {
        let key = vec![("pod", pod.to_string())];
        // `get` would create the series; only read one that exists.
        self.event_lag.get(&key).map(|g| g.get())
    }

    /// The event stream of `pod` is this many seconds behind.
    pub fn set_event_lag(&self, pod: &str, seconds: f64) {
        self.event_lag
            .get_or_create(&vec![("pod", pod.to_string())])
            .set(seconds);
    }

    /// A pod left: its per-pod series go with it.
    pub fn forget_pod(&self, pod: &str) {
        self.event_lag.remove(&vec![("pod", pod.to_string())]);
        self.decisions.forget(pod);
    }

    /// The OpenMetrics text of every metric, with the state gauges set from `g`.
    pub fn render(&self, g: &Gauges) -> String {
        let _one = self.rendering.lock();
        let s = &self.state;
        for (state, v) in [
            ("live", g.pods_live),
            ("stale", g.pods_stale),
            ("draining", g.pods_draining),
        ] {
            s.pods
                .get_or_create(&vec![("state", state.to_string())])
                .set(gauge_value(v));
        }
        // Models come and go: only the current ones are shown.
        s.index_entries.clear();
        s.index_bytes.clear();
        for (m, e, b) in &g.index {
            let l = vec![("model", m.clone())];
            s.index_entries.get_or_create(&l).set(gauge_value(*e));
            s.index_bytes.get_or_create(&l).set(gauge_value(*b));
        }
        s.queued.clear();
        for (m, p, t, n) in &g.queued {
            s.queued
                .get_or_create(&vec![
                    ("model", m.clone()),
                    ("priority", p.to_string()),
                    ("tenant", t.clone()),
                ])
                .set(gauge_value(*n as u64));
        }
        // The tokenizers' own counts, set afresh at each scrape: a model's series go when
        // its tokenizer does, and a count that restarts when its tokenizer is loaded
        // again reads to Prometheus as a counter reset.
        for f in [&s.segment_bytes, &s.segment_entries, &s.chunking_on] {
            f.clear();
        }
        s.segment_evicted.clear();
        s.segment_lookups.clear();
        s.prompt_chunks.clear();
        for (m, c, chunks) in &g.tokenizers {
            let l = vec![("model", m.clone())];
            s.segment_bytes
                .get_or_create(&l)
                .set(gauge_value(c.bytes as u64));
            s.segment_entries
                .get_or_create(&l)
                .set(gauge_value(c.entries as u64));
            s.segment_evicted.get_or_create(&l).inc_by(c.evicted);
            for (outcome, v) in [("hit", c.hits), ("miss", c.misses)] {
                let l = vec![("model", m.clone()), ("outcome", outcome.to_string())];
                s.segment_lookups.get_or_create(&l).inc_by(v);
            }
            let Some(k) = chunks else { continue };
            s.chunking_on.get_or_create(&l).set(i64::from(k.on));
            for (outcome, v) in [
                ("chunked", k.chunked),
                ("verified", k.verified),
                ("mismatch", k.mismatches),
            ] {
                let l = vec![("model", m.clone()), ("outcome", outcome.to_string())];
                s.prompt_chunks.get_or_create(&l).inc_by(v);
            }
        }
        s.predicted_entries.set(gauge_value(g.predicted_entries));
        s.inflight.set(gauge_value(g.inflight));
        let mut out = String::with_capacity(8192);
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_labeled_family_reads_back() {
        let l = Labeled::new("reason");
        l.inc("no_pod", 2);
        l.inc("bad \"json\"", 1);
        let mut s = l.snapshot();
        s.sort();
        assert_eq!(
            s,
            vec![("bad \"json\"".to_string(), 1), ("no_pod".to_string(), 2)]
        );
    }
}
