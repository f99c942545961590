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

#[derive(Default)]
pub struct Recent {
    ring: Mutex<VecDeque<DecisionRecord>>,
}

impl Recent {
    pub fn record(&self, req: &RouteRequest, resp: &RouteResponse) {
        let at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let rec = DecisionRecord {
            at_ms,
            decision: resp.decision.clone(),
            request_id: req.request_id.clone(),
            model: req.model.clone(),
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
            explain: resp.explain.clone(),
        };
        let mut ring = self.ring.lock();
        if ring.len() == RECENT {
            ring.pop_front();
        }
        ring.push_back(rec);
    }

    /// Up to `n` records, newest first.
    pub fn latest(&self, n: usize) -> Vec<DecisionRecord> {
        self.ring.lock().iter().rev().take(n).cloned().collect()
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
}
