//! Admission under overload: whether the fleet has room for a request now, and the
//! waiting room ([`queue`]) that holds it for its cache while the fleet has none.
//!
//! Kept apart from the policy because it answers a different question: the policy
//! ranks pods for a request that will be sent; admission decides whether sending it
//! now only adds to a queue inside an engine (where it waits in arrival order, with no
//! priority, no tenant fairness and a placement chosen against a state that is gone by
//! the time it runs). Holding it in the router instead lets a higher band overtake it,
//! lets tenants take turns, and scores it again when it leaves.
//!
//! [`room`] is a pure function of the candidates the route step already built, so the
//! service and the simulator decide saturation with the same code.

pub mod queue;

pub use queue::{AdmissionQueue, Arrival, Entry, Limits, Queued, Refusal, Ticket};

use kvroute_shared::protocol::PolicyConfig;

use crate::policy::{self, Ask, Candidate};

/// Where a request would leave the fleet its headroom.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Headroom {
    /// Prefill work a pod may have queued, the request's own included, in seconds at
    /// the policy's `prefill_tokens_per_s`.
    pub max_backlog_s: f64,
    /// Requests an engine may report waiting for a batch slot (0: not checked).
    pub max_waiting: u32,
    /// Requests a pod may have in flight, this one included (its batch size: a request
    /// sent beyond it waits inside the engine, where no priority applies; 0: not checked).
    pub max_inflight: u32,
}

/// The candidates (their positions, ascending) that stay within `h` after taking this
/// request — its own uncached prefill counted where it would run, so a pod that holds
/// the prompt has room long after a cold one has none. Empty: the model is saturated
/// for this request.
pub fn room(cfg: &PolicyConfig, h: &Headroom, ask: &Ask, cands: &[Candidate]) -> Vec<usize> {
    let limit = h.max_backlog_s * cfg.prefill_tokens_per_s;
    let bs = ask.block_size.max(1) as f64;
    cands
        .iter()
        .enumerate()
        .filter(|(_, c)| h.max_waiting == 0 || c.load.queued < h.max_waiting)
        .filter(|(_, c)| h.max_inflight == 0 || c.load.inflight < h.max_inflight)
        .filter(|(_, c)| {
            let uncached = (ask.prompt_blocks as f64 - policy::hits(cfg, c)).max(0.0) * bs;
            c.load.pending_prefill_tokens as f64 + uncached <= limit
        })
        .map(|(i, _)| i)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::LoadView;

    fn cand(index: usize, matched: u32, pending: u64, queued: u32) -> Candidate {
        Candidate {
            index,
            key: index as u64,
            matched,
            predicted: 0,
            tiers: None,
            stale: false,
            load: LoadView {
                pending_prefill_tokens: pending,
                queued,
                ..Default::default()
            },
            bound: 0.0,
            pinned: false,
        }
    }

    fn ask(prompt_blocks: u32) -> Ask {
        Ask {
            prompt_blocks,
            block_size: 16,
            tie_key: 0,
            seed: 0,
            load_only: false,
            spread_ties: false,
        }
    }

    #[test]
    fn a_cached_prompt_has_room_where_a_cold_one_has_none() {
        let cfg = PolicyConfig {
            prefill_tokens_per_s: 1000.0,
            ..PolicyConfig::default()
        };
        let h = Headroom {
            max_backlog_s: 4.0,
            max_waiting: 0,
            max_inflight: 0,
        };
        // 100 blocks = 1600 tokens; both pods have 3000 tokens queued (3 s of 4).
        let cands = [cand(0, 0, 3000, 0), cand(1, 95, 3000, 0)];
        assert_eq!(
            room(&cfg, &h, &ask(100), &cands),
            [1],
            "80 uncached tokens fit"
        );
        let cold = [cand(0, 0, 3000, 0), cand(1, 0, 3000, 0)];
        assert!(
            room(&cfg, &h, &ask(100), &cold).is_empty(),
            "1600 more do not"
        );
        // A small request still fits on the less loaded pod.
        let mixed = [cand(0, 0, 3500, 0), cand(1, 0, 3000, 0)];
        assert_eq!(room(&cfg, &h, &ask(10), &mixed), [0, 1]);
        let mixed = [cand(0, 0, 3900, 0), cand(1, 0, 3000, 0)];
        assert_eq!(room(&cfg, &h, &ask(10), &mixed), [1]);
    }

    #[test]
    fn engines_reporting_a_full_waiting_line_have_no_room() {
        let cfg = PolicyConfig::default();
        let h = Headroom {
            max_backlog_s: 100.0,
            max_waiting: 4,
            max_inflight: 0,
        };
        let cands = [cand(0, 0, 0, 4), cand(1, 0, 0, 9)];
        assert!(room(&cfg, &h, &ask(1), &cands).is_empty());
        let cands = [cand(0, 0, 0, 4), cand(1, 0, 0, 3)];
        assert_eq!(room(&cfg, &h, &ask(1), &cands), [1]);
        assert!(room(&cfg, &h, &ask(1), &[]).is_empty(), "no pod, no room");
    }
}
