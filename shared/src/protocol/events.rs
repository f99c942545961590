//! Engine events: the batch an engine-side publisher sends (NATS or `POST /v1/events`),
//! its events, and the checks every batch passes before the sidecar reads it.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::hashes::{opt_u64, u64_list};

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
            if value.len() > super::MAX_NAME_BYTES {
                return Err(EventError::Value(format!(
                    "{name} of {} bytes is longer than {}",
                    value.len(),
                    super::MAX_NAME_BYTES
                )));
            }
        }
        if let Some(u) = &self.dump_url {
            if !super::http_url(u) {
                return Err(EventError::Value(format!(
                    "dump_url is not an http(s) URL of at most {} bytes",
                    super::MAX_URL_BYTES
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
    /// A batch of the current version, without send time or dump URL.
    pub fn new(pod: &str, model: &str, epoch: &str, seq: u64, events: Vec<Event>) -> EventBatch {
        EventBatch {
            v: EVENT_VERSION,
            pod: pod.into(),
            model: model.into(),
            epoch: epoch.into(),
            seq,
            ts: None,
            dump_url: None,
            events,
        }
    }

    pub fn subject(&self) -> String {
        format!(
            "kvroute.events.{}.{}",
            subject_token(&self.model),
            subject_token(&self.pod)
        )
    }

    /// What the batch says, as one hash (its events and send time, not its place in the
    /// stream): a batch delivered twice has one digest, two batches that claim the same
    /// sequence number almost never do.
    pub fn digest(&self) -> u64 {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(&self.ts.unwrap_or(-1.0).to_bits().to_le_bytes());
        let words = |h: &mut xxhash_rust::xxh3::Xxh3, v: &[u64]| {
            h.update(&(v.len() as u64).to_le_bytes());
            for x in v {
                h.update(&x.to_le_bytes());
            }
        };
        for ev in &self.events {
            match ev {
                Event::Stored {
                    tier,
                    parent,
                    blocks,
                    ..
                } => {
                    h.update(&[1, *tier as u8]);
                    h.update(&parent.map_or([0xff; 8], u64::to_le_bytes));
                    words(&mut h, blocks);
                }
                Event::Removed { tier, blocks } => {
                    h.update(&[2, *tier as u8]);
                    words(&mut h, blocks);
                }
                Event::Cleared => h.update(&[3]),
                Event::Shutdown => h.update(&[4]),
                Event::Load {
                    running,
                    waiting,
                    kv_usage,
                    ..
                } => {
                    h.update(&[5]);
                    h.update(&running.to_le_bytes());
                    h.update(&waiting.to_le_bytes());
                    h.update(&kv_usage.to_bits().to_le_bytes());
                }
            }
        }
        h.digest()
    }

    pub fn encode(&self) -> Vec<u8> {
        // Serializing plain data to a Vec cannot fail; fall back to empty rather than panic.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// One NATS subject token for `s`, injective so that a subject names exactly one model
/// or pod (NATS permissions granted on a subject then grant exactly one): letters,
/// digits and `-` stay; `.` becomes `_` and `:` becomes `~` (so the pod `10.0.3.7:8000`
/// reads `10_0_3_7~8000`); every other byte of its UTF-8 — `_`, `~` and `%` themselves
/// included — becomes `%XX`.
pub fn subject_token(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' => out.push(b as char),
            b'.' => out.push('_'),
            b':' => out.push('~'),
            b => {
                const HEX: &[u8; 16] = b"0123456789ABCDEF";
                out.push('%');
                out.push(HEX[(b >> 4) as usize] as char);
                out.push(HEX[(b & 15) as usize] as char);
            }
        }
    }
    out
}
