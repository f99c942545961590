//! The last decisions this sidecar made, for the status page's "recent decisions" table:
//! a bounded ring (newest last), written once per routed request by [`crate::route::route`]
//! after the decision is made and read only by the admin API. Nothing routes from it.
//!
//! A record holds what an operator needs to answer "why did this request go there": the
//! candidates with their matched blocks and policy cost, and the breakdown when the
//! policy's explain switch is on. It reveals which prompts were cached where, so the API
//! serving it is guarded like lookups.

use std::collections::VecDeque;

use kvroute_shared::protocol::{RouteRequest, RouteResponse};
use parking_lot::Mutex;
use serde::Serialize;

/// Records kept.
pub const RECENT: usize = 200;
/// Bytes the records may hold together: a client's strings (its request id, a long
/// model name, an explain breakdown) cannot make the ring large.
pub const RECENT_BYTES: usize = 2 << 20;
/// A request id longer than this is cut (at a character boundary).
const REQUEST_ID_BYTES: usize = 128;
/// An explain breakdown larger than this (serialized) is not kept.
const EXPLAIN_BYTES: usize = 16 << 10;
/// Candidates kept per record (the ranking's head).
const CANDIDATES: usize = 8;

#[derive(Clone, Debug, Serialize)]
pub struct Candidate {
    pub pod: String,
    pub matched_blocks: u32,
    pub cost: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct DecisionRecord {
    /// Unix time, milliseconds.
    pub at_ms: u64,
    pub decision: Option<String>,
    pub request_id: Option<String>,
    pub model: String,
    pub mode: &'static str,
    pub chain_blocks: usize,
    pub prompt_tokens: u32,
    pub pod: String,
    pub prefill_pod: Option<String>,
    pub candidates: Vec<Candidate>,
    pub explain: Option<serde_json::Value>,
}

impl DecisionRecord {
    /// Heap and inline bytes, as the ring accounts them, given the explain breakdown's
    /// serialized length (its tree takes about twice that).
    fn bytes(&self, explain_len: usize) -> usize {
        let opt = |s: &Option<String>| s.as_ref().map_or(0, String::len);
        std::mem::size_of::<Self>()
            + opt(&self.decision)
            + opt(&self.request_id)
            + self.model.len()
            + self.pod.len()
            + opt(&self.prefill_pod)
            + self
                .candidates
                .iter()
                .map(|c| std::mem::size_of::<Candidate>() + c.pod.len())
                .sum::<usize>()
            + explain_len * 2
    }
}

#[derive(Default)]
pub struct Recent {
    ring: Mutex<Ring>,
}

#[derive(Default)]
struct Ring {
    records: VecDeque<(DecisionRecord, usize)>,
    bytes: usize,
}

fn cut(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

impl Recent {
    pub fn record(&self, req: &RouteRequest, resp: &RouteResponse) {
        let at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let mut rec = DecisionRecord {
            at_ms,
            decision: resp.decision.clone(),
            request_id: req.request_id.as_deref().map(|r| cut(r, REQUEST_ID_BYTES)),
            model: cut(&req.model, kvroute_shared::protocol::MAX_NAME_BYTES),
            mode: req.mode.as_str(),
            chain_blocks: req.chain.len(),
            prompt_tokens: req.prompt_tokens,
            pod: resp.pod.clone(),
            prefill_pod: resp.prefill_pod.clone(),
            candidates: resp
                .ranked
                .iter()
                .take(CANDIDATES)
                .map(|r| Candidate {
                    pod: r.pod.clone(),
                    matched_blocks: r.matched_blocks,
                    cost: r.score,
                })
                .collect(),
            explain: None,
        };
        // Serialized once: for its bound and for the ring's accounting.
        let explain_len = resp.explain.as_ref().map_or(0, |e| e.to_string().len());
        if explain_len <= EXPLAIN_BYTES {
            rec.explain = resp.explain.clone();
        }
        let bytes = rec.bytes(if rec.explain.is_some() {
            explain_len
        } else {
            0
        });
        let mut ring = self.ring.lock();
        while ring.records.len() >= RECENT
            || (ring.bytes + bytes > RECENT_BYTES && !ring.records.is_empty())
        {
            if let Some((_, b)) = ring.records.pop_front() {
                ring.bytes -= b;
            }
        }
        ring.bytes += bytes;
        ring.records.push_back((rec, bytes));
    }

    /// Bytes the ring holds (as accounted).
    pub fn bytes(&self) -> usize {
        self.ring.lock().bytes
    }

    /// Up to `n` records, newest first.
    pub fn latest(&self, n: usize) -> Vec<DecisionRecord> {
        let ring = self.ring.lock();
        ring.records
            .iter()
            .rev()
            .take(n)
            .map(|(r, _)| r.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_shared::protocol::Ranked;
    use kvroute_shared::Mode;

    fn req(id: usize) -> RouteRequest {
        serde_json::from_value(serde_json::json!({
            "model": "m", "mode": "tokens", "block_size": 16, "chain": [1, 2],
            "request_id": format!("r{id}"),
        }))
        .expect("request")
    }

    #[test]
    fn keeps_the_newest_and_is_bounded() {
        let r = Recent::default();
        let resp = RouteResponse {
            pod: "10.0.0.1:8000".into(),
            decision: Some("a-1".into()),
            ranked: (0..12)
                .map(|i| Ranked {
                    pod: format!("10.0.0.{i}:8000"),
                    matched_blocks: i,
                    score: Some(i as f64),
                })
                .collect(),
            tier_hint: None,
            prefill_pod: None,
            policy_version: 1,
            explain: None,
        };
        for i in 0..RECENT + 5 {
            r.record(&req(i), &resp);
        }
        let l = r.latest(usize::MAX);
        assert_eq!(l.len(), RECENT);
        assert_eq!(
            l[0].request_id.as_deref(),
            Some(&*format!("r{}", RECENT + 4))
        );
        assert_eq!(l[0].candidates.len(), CANDIDATES);
        assert_eq!(l[0].mode, Mode::Tokens.as_str());
        assert_eq!(r.latest(3).len(), 3);
    }

    /// A client's strings used to be kept whole, 200 times over.
    #[test]
    fn is_bounded_in_bytes_whatever_the_client_sends() {
        let r = Recent::default();
        let mut q = req(0);
        q.request_id = Some("x".repeat(1 << 20));
        q.model = "m".repeat(1 << 20);
        let resp = RouteResponse {
            pod: "10.0.0.1:8000".into(),
            decision: None,
            ranked: Vec::new(),
            tier_hint: None,
            prefill_pod: None,
            policy_version: 1,
            explain: Some(serde_json::json!({"why": "y".repeat(8 << 10)})),
        };
        for _ in 0..RECENT {
            r.record(&q, &resp);
        }
        assert!(r.bytes() <= RECENT_BYTES, "{}", r.bytes());
        let l = r.latest(1);
        assert_eq!(
            l[0].request_id.as_ref().map(String::len),
            Some(REQUEST_ID_BYTES)
        );
        assert!(l[0].explain.is_some(), "an explain of 8 KiB is kept");
    }
}
