//! The bridge's metrics, kept with `prometheus-client` like the sidecar's: its own
//! counters, updated where things happen, and the translator's totals, brought into
//! their counters when scraped.

use parking_lot::Mutex;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::translate::Stats as TranslatorStats;

/// The bridge's own counters (`prometheus-client`, as the sidecar's metrics). The
/// translator's statistics are copied into their series at scrape time.
pub(crate) struct Counters {
    pub(crate) registry: Registry,
    pub(crate) messages: Counter,
    pub(crate) bad_frames: Counter,
    pub(crate) bad_payloads: Counter,
    pub(crate) other_rank: Counter,
    pub(crate) send_failures: Counter,
    pub(crate) replayed: Counter,
    pub(crate) replay_failures: Counter,
    pub(crate) load_polls: Counter,
    pub(crate) load_poll_failures: Counter,
    pub(crate) queue_drops: Counter,
    pub(crate) dumps_refused: Counter,
    /// Translator statistics, brought up to its totals when scraped.
    pub(crate) translated: [Counter; 6],
    pub(crate) skipped: Family<Vec<(&'static str, String)>, Counter>,
    /// Connections to the HTTP listener, by outcome (`http_server::ConnEvent`).
    pub(crate) connections: Family<Vec<(&'static str, String)>, Counter>,
    pub(crate) known_blocks: Gauge,
    /// One scrape at a time brings the counters up to the totals.
    pub(crate) scrape: Mutex<()>,
}

impl Default for Counters {
    fn default() -> Self {
        let mut registry = Registry::default();
        let c = Counters {
            registry: Registry::default(),
            messages: Counter::default(),
            bad_frames: Counter::default(),
            bad_payloads: Counter::default(),
            other_rank: Counter::default(),
            send_failures: Counter::default(),
            replayed: Counter::default(),
            replay_failures: Counter::default(),
            load_polls: Counter::default(),
            load_poll_failures: Counter::default(),
            queue_drops: Counter::default(),
            dumps_refused: Counter::default(),
            translated: Default::default(),
            skipped: Family::default(),
            connections: Family::default(),
            known_blocks: Gauge::default(),
            scrape: Mutex::new(()),
        };
        for (name, help, m) in [
            ("messages", "ZMQ messages received.", &c.messages),
            (
                "bad_frames",
                "Messages without (topic, seq, payload) frames.",
                &c.bad_frames,
            ),
            (
                "bad_payloads",
                "Payloads that are not an engine event batch.",
                &c.bad_payloads,
            ),
            (
                "other_rank_batches",
                "Batches from another data-parallel rank than --dp-rank (refused: another bridge serves it).",
                &c.other_rank,
            ),
            (
                "send_failures",
                "Batches a destination refused or did not get.",
                &c.send_failures,
            ),
            (
                "dumps_refused",
                "GET /dump requests without the dump token (or from off the host when none is set).",
                &c.dumps_refused,
            ),
            (
                "replayed",
                "Engine batches recovered from its replay socket.",
                &c.replayed,
            ),
            (
                "replay_failures",
                "Gaps the replay socket could not fill.",
                &c.replay_failures,
            ),
            (
                "queue_drops",
                "Batches dropped because the destinations fell behind (sidecars resync).",
                &c.queue_drops,
            ),
            (
                "load_polls",
                "Polls of the engine's metrics for its load.",
                &c.load_polls,
            ),
            (
                "load_poll_failures",
                "Polls that got no load (unreachable, or no known metric).",
                &c.load_poll_failures,
            ),
        ] {
            registry.register(format!("kvroute_bridge_{name}"), help, m.clone());
        }
        for ((name, help), m) in TRANSLATED.iter().zip(&c.translated) {
            registry.register(format!("kvroute_bridge_{name}"), *help, m.clone());
        }
        registry.register(
            "kvroute_bridge_blocks_skipped",
            "Blocks not translated, by reason.",
            c.skipped.clone(),
        );
        registry.register(
            "kvroute_bridge_connections",
            "Connections to the HTTP listener: accepted at once, accepted after waiting for a slot, closed for sending no request head in time, requests whose body was not whole in time, closed on an error.",
            c.connections.clone(),
        );
        registry.register(
            "kvroute_bridge_known_blocks",
            "Engine blocks with a kvroute name.",
            c.known_blocks.clone(),
        );
        Counters { registry, ..c }
    }
}

impl Counters {
    pub(crate) fn render(&self, s: &TranslatorStats, known: usize) -> String {
        let _one = self.scrape.lock();
        let g = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        // The translator keeps totals; each counter is raised to its total.
        let catch_up = |c: &Counter, total: u64| {
            c.inc_by(total.saturating_sub(c.get()));
        };
        let totals = [
            s.batches_out,
            s.duplicates,
            s.gaps,
            s.restarts,
            s.blocks_stored,
            s.blocks_removed,
        ];
        for (c, total) in self.translated.iter().zip(totals) {
            catch_up(c, total);
        }
        for (why, v) in &s.skipped {
            catch_up(
                &self
                    .skipped
                    .get_or_create(&vec![("reason", why.to_string())]),
                *v,
            );
        }
        self.known_blocks.set(g(known as u64));
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The translator's totals, in the order of `Counters::translated`.
const TRANSLATED: [(&str, &str); 6] = [
    ("batches_out", "kvroute event batches published."),
    ("duplicates", "Engine batches seen twice."),
    (
        "gaps",
        "Engine sequence gaps left open (each starts a new epoch).",
    ),
    ("restarts", "Engine restarts seen."),
    ("blocks_stored", "Blocks translated as stored."),
    ("blocks_removed", "Blocks translated as removed."),
];

pub(crate) const METRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
