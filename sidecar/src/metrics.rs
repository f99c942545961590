//! Prometheus metrics, hand-rolled: a few counters, gauges and histograms rendered in the
//! text exposition format. A client library would bring a registry and macros we do not
//! need; the hot-path updates here are single atomic adds, and labelled families (per
//! pod, per reason) take a short mutex only where the label set is open-ended.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

/// A histogram with fixed upper bounds.
pub struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<AtomicU64>,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.sum_micros
            .fetch_add((v * 1e6).max(0.0) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.buckets) {
            cum += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// A counter family keyed by one label value.
#[derive(Default)]
pub struct Family(Mutex<BTreeMap<String, u64>>);

impl Family {
    pub fn inc(&self, label: &str, by: u64) {
        let mut m = self.0.lock();
        match m.get_mut(label) {
            Some(v) => *v += by,
            None => {
                m.insert(label.to_string(), by);
            }
        }
    }

    pub fn get(&self, label: &str) -> u64 {
        self.0.lock().get(label).copied().unwrap_or(0)
    }

    fn render(&self, out: &mut String, name: &str, label: &str, help: &str, kind: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (k, v) in self.0.lock().iter() {
            let _ = writeln!(out, "{name}{{{label}=\"{}\"}} {v}", escape(k));
        }
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

pub const LATENCY_BOUNDS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05,
];
pub const BLOCK_BOUNDS: &[f64] = &[0.0, 1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0];

pub struct Metrics {
    pub route_seconds: Histogram,
    pub matched_blocks: Histogram,
    pub decisions: Family,
    pub route_errors: Family,
    pub events_applied: AtomicU64,
    pub event_blocks: AtomicU64,
    pub events_rejected: Family,
    pub duplicates: AtomicU64,
    pub seq_gaps: AtomicU64,
    pub resyncs: Family,
    pub epochs: AtomicU64,
    pub pods_refused: AtomicU64,
    pub reports: AtomicU64,
    pub reports_rejected: AtomicU64,
    pub cached_tokens: Family,
    pub mispredictions: AtomicU64,
    pub pods_removed: Family,
    pub load_released: Family,
    /// Reports by whether they named an outstanding decision ("released", "unknown",
    /// "none" when the report carries no decision id).
    pub report_decisions: Family,
    /// Load deltas between replicas: "published", "dropped_full", "publish_failed",
    /// "applied", "ignored".
    pub replica_deltas: Family,
    pub event_lag: Mutex<BTreeMap<String, f64>>,
    pub nats_connected: AtomicU64,
    pub nats_messages: AtomicU64,
    pub config_version: AtomicU64,
    pub config_rejected: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            route_seconds: Histogram::new(LATENCY_BOUNDS),
            matched_blocks: Histogram::new(BLOCK_BOUNDS),
            decisions: Family::default(),
            route_errors: Family::default(),
            events_applied: AtomicU64::new(0),
            event_blocks: AtomicU64::new(0),
            events_rejected: Family::default(),
            duplicates: AtomicU64::new(0),
            seq_gaps: AtomicU64::new(0),
            resyncs: Family::default(),
            epochs: AtomicU64::new(0),
            pods_refused: AtomicU64::new(0),
            reports: AtomicU64::new(0),
            reports_rejected: AtomicU64::new(0),
            cached_tokens: Family::default(),
            mispredictions: AtomicU64::new(0),
            pods_removed: Family::default(),
            load_released: Family::default(),
            report_decisions: Family::default(),
            replica_deltas: Family::default(),
            event_lag: Mutex::new(BTreeMap::new()),
            nats_connected: AtomicU64::new(0),
            nats_messages: AtomicU64::new(0),
            config_version: AtomicU64::new(0),
            config_rejected: AtomicU64::new(0),
        }
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
}

impl Metrics {
    pub fn render(&self, g: &Gauges) -> String {
        let mut o = String::with_capacity(4096);
        let c = |o: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |o: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        self.route_seconds.render(
            &mut o,
            "kvroute_route_seconds",
            "Time to answer a route request.",
        );
        self.matched_blocks.render(
            &mut o,
            "kvroute_matched_blocks",
            "Blocks the chosen pod already held.",
        );
        self.decisions.render(
            &mut o,
            "kvroute_decisions_total",
            "pod",
            "Route decisions per pod.",
            "counter",
        );
        self.route_errors.render(
            &mut o,
            "kvroute_route_errors_total",
            "reason",
            "Route requests refused.",
            "counter",
        );
        let r = |v: &AtomicU64| v.load(Ordering::Relaxed);
        c(
            &mut o,
            "kvroute_event_batches_applied_total",
            "Event batches applied.",
            r(&self.events_applied),
        );
        c(
            &mut o,
            "kvroute_event_blocks_total",
            "Block changes carried by applied events.",
            r(&self.event_blocks),
        );
        self.events_rejected.render(
            &mut o,
            "kvroute_event_batches_rejected_total",
            "reason",
            "Event batches refused.",
            "counter",
        );
        c(
            &mut o,
            "kvroute_event_duplicates_total",
            "Batches ignored as duplicates or replays.",
            r(&self.duplicates),
        );
        c(
            &mut o,
            "kvroute_event_seq_gaps_total",
            "Sequence gaps detected (pod marked stale).",
            r(&self.seq_gaps),
        );
        self.resyncs.render(
            &mut o,
            "kvroute_resyncs_total",
            "how",
            "Pod resyncs after a gap.",
            "counter",
        );
        c(
            &mut o,
            "kvroute_engine_restarts_total",
            "New epochs seen (engine restarts).",
            r(&self.epochs),
        );
        c(
            &mut o,
            "kvroute_pods_refused_total",
            "Pods refused (model full, unregistered).",
            r(&self.pods_refused),
        );
        c(
            &mut o,
            "kvroute_reports_total",
            "Completion reports received.",
            r(&self.reports),
        );
        c(
            &mut o,
            "kvroute_reports_rejected_total",
            "Completion reports refused as malformed (a bad body, or one element of a batch).",
            r(&self.reports_rejected),
        );
        self.cached_tokens.render(
            &mut o,
            "kvroute_cached_tokens_total",
            "source",
            "Cached prompt tokens, as the router predicted and as engines reported.",
            "counter",
        );
        c(
            &mut o,
            "kvroute_mispredictions_total",
            "Reports with fewer cached tokens than predicted.",
            r(&self.mispredictions),
        );
        self.pods_removed.render(
            &mut o,
            "kvroute_pods_removed_total",
            "reason",
            "Pods removed.",
            "counter",
        );
        self.load_released.render(
            &mut o,
            "kvroute_load_released_total",
            "how",
            "Projected load released.",
            "counter",
        );
        self.report_decisions.render(
            &mut o,
            "kvroute_report_decisions_total",
            "outcome",
            "Completion reports by the decision they named.",
            "counter",
        );
        self.replica_deltas.render(
            &mut o,
            "kvroute_replica_deltas_total",
            "outcome",
            "Load deltas exchanged with other replicas.",
            "counter",
        );
        let _ = writeln!(o, "# HELP kvroute_event_lag_seconds Now minus the last batch's ts, per pod.\n# TYPE kvroute_event_lag_seconds gauge");
        for (pod, lag) in self.event_lag.lock().iter() {
            let _ = writeln!(
                o,
                "kvroute_event_lag_seconds{{pod=\"{}\"}} {lag}",
                escape(pod)
            );
        }
        let _ = writeln!(
            o,
            "# HELP kvroute_pods Pods by state.\n# TYPE kvroute_pods gauge"
        );
        for (state, v) in [
            ("live", g.pods_live),
            ("stale", g.pods_stale),
            ("draining", g.pods_draining),
        ] {
            let _ = writeln!(o, "kvroute_pods{{state=\"{state}\"}} {v}");
        }
        let _ = writeln!(
            o,
            "# HELP kvroute_index_entries Blocks in the index.\n# TYPE kvroute_index_entries gauge"
        );
        for (m, e, _) in &g.index {
            let _ = writeln!(o, "kvroute_index_entries{{model=\"{}\"}} {e}", escape(m));
        }
        let _ = writeln!(
            o,
            "# HELP kvroute_index_bytes Heap bytes of the index.\n# TYPE kvroute_index_bytes gauge"
        );
        for (m, _, b) in &g.index {
            let _ = writeln!(o, "kvroute_index_bytes{{model=\"{}\"}} {b}", escape(m));
        }
        gauge(
            &mut o,
            "kvroute_predicted_entries",
            "Blocks of predicted residency.",
            g.predicted_entries,
        );
        gauge(
            &mut o,
            "kvroute_inflight_decisions",
            "Decisions whose load is still projected.",
            g.inflight,
        );
        gauge(
            &mut o,
            "kvroute_nats_connected",
            "1 when the NATS connection is up.",
            r(&self.nats_connected),
        );
        c(
            &mut o,
            "kvroute_nats_messages_total",
            "Messages received from NATS.",
            r(&self.nats_messages),
        );
        gauge(
            &mut o,
            "kvroute_config_version",
            "Version of the policy in force.",
            r(&self.config_version),
        );
        c(
            &mut o,
            "kvroute_config_rejected_total",
            "Config updates refused.",
            r(&self.config_rejected),
        );
        o
    }
}
