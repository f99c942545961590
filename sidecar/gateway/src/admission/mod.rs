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

pub mod fleet;
pub mod queue;
pub mod waiting;

pub use queue::{AdmissionQueue, Arrival, Entry, Limits, Queued, Refusal, Ticket};
pub use waiting::{Admitted, Shed, Verdict, Waiting};

use std::sync::Arc;
use std::time::Instant;

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
    /// Wait rather than leave the cache: when the pods with room hold fewer of the
    /// prompt's blocks than the best pod by more than this share of the prompt, none
    /// is offered (the request waits for room where its prefix is; 1: never wait for it).
    pub cache_loss: f64,
    /// In-flight slots per pod kept for the highest band: a request below it may use
    /// `max_inflight - reserve_inflight` (at least 1). Without a reserve a high request
    /// finds the pod that holds its prefix full of low ones and waits for a decode to
    /// end there.
    pub reserve_inflight: u32,
}

impl Headroom {
    /// The headroom of one request: in the highest band (`top`) or below it, its tenant
    /// passed over ([`look`]) or not.
    ///
    /// Below the top band a request leaves `reserve_inflight` slots per pod free. A
    /// request whose tenant was passed over does not wait for room where its cache is
    /// (`cache_loss` lifted) and may take the reserved slots: the reserve is what lets it
    /// find room on the pod that holds its prefix, where without it the light tenant's
    /// turns were spent recomputing prefixes elsewhere (four pods at 10:1, seeds 1-6:
    /// locality given up 0.034-0.051 of blocks, now 0.000-0.003; docs/policy.md).
    pub fn for_request(&self, top: bool, passed_over: bool) -> Headroom {
        let mut h = *self;
        if passed_over {
            h.cache_loss = 1.0;
        } else if !top && h.max_inflight > 0 {
            h.max_inflight = h.max_inflight.saturating_sub(h.reserve_inflight).max(1);
        }
        h
    }
}

/// The candidates (their positions, ascending) that stay within `h` after taking this
/// request — its own uncached prefill counted where it would run, so a pod that holds
/// the prompt has room long after a cold one has none. Empty: the model is saturated
/// for this request, or the pods with room would lose more of its cached prefix than
/// `h.cache_loss` allows (it waits for room where the prefix is: recomputing it
/// elsewhere spends the capacity a saturated fleet lacks).
pub fn room(cfg: &PolicyConfig, h: &Headroom, ask: &Ask, cands: &[Candidate]) -> Vec<usize> {
    let limit = h.max_backlog_s * cfg.prefill_tokens_per_s;
    let bs = ask.block_size.max(1) as f64;
    let ok: Vec<usize> = cands
        .iter()
        .enumerate()
        .filter(|(_, c)| h.max_waiting == 0 || c.load.queued < h.max_waiting)
        .filter(|(_, c)| h.max_inflight == 0 || c.load.inflight < h.max_inflight)
        .filter(|(_, c)| {
            let uncached = (ask.prompt_blocks as f64 - policy::hits(cfg, c)).max(0.0) * bs;
            // An idle pod takes any prompt: one larger than the whole backlog bound
            // would otherwise never leave the queue.
            let pending = c.load.pending_prefill_tokens as f64;
            pending == 0.0 || pending + uncached <= limit
        })
        .map(|(i, _)| i)
        .collect();
    let hits = |i: usize| policy::hits(cfg, &cands[i]);
    let best = (0..cands.len()).map(hits).fold(0.0, f64::max);
    let best_with_room = ok.iter().map(|&i| hits(i)).fold(0.0, f64::max);
    if best - best_with_room > h.cache_loss * ask.prompt_blocks as f64 {
        return Vec::new();
    }
    ok
}

/// Requests of a queue tried per look: past a head waiting for its cache's pod, so one
/// waiting for room where its prefix is holds back no other.
pub const LOOK_AHEAD: usize = 16;

/// What a look's router says of one queued request.
pub enum Step<R> {
    /// No room for it now: it stays.
    Wait,
    /// It leaves with this outcome.
    Leave(R),
}

/// One look at a queue (after its expired requests are taken out): the first
/// [`LOOK_AHEAD`] in dispatch order are routed again (`route`, scored as things are now),
/// and each time one leaves the look starts over, since its decision changed the loads
/// the others are scored against. The service's dispatcher and the simulator both look
/// through this.
///
/// `route`'s second argument says the request's tenant is behind
/// ([`AdmissionQueue::passed_over`]): its requests waited for room where their caches
/// are while another tenant's of the band left, and that tenant has had far more leave.
/// It then takes room wherever there is some (its headroom's `cache_loss` lifted), so
/// waiting for the cache does not cost a light tenant its turns: at 10:1 its requests,
/// waiting for their prefixes' pods while the heavy tenant's found room elsewhere, had
/// left in 27-30% of the contested turns, and now in 44-47% (docs/policy.md).
pub fn look<T, R>(
    q: &mut AdmissionQueue<T>,
    now: Instant,
    mut route: impl FnMut(&Entry<T>, bool) -> Step<R>,
) -> Vec<(Entry<T>, R)> {
    let mut out = Vec::new();
    let mut waited: Vec<(i32, Arc<str>)> = Vec::new();
    'look: loop {
        waited.clear();
        for ticket in q.order(LOOK_AHEAD) {
            let Some(e) = q.get(ticket) else { continue };
            let (priority, tenant) = (e.priority, e.tenant.clone());
            let step = if q.yields(priority, &tenant, now) {
                Step::Wait
            } else {
                let passed = q.passed_over(priority, &tenant);
                match q.get(ticket) {
                    Some(e) => route(e, passed),
                    None => continue,
                }
            };
            match step {
                Step::Leave(r) => {
                    for (p, t) in &waited {
                        if *p == priority && *t != tenant {
                            q.note_passed(*p, t);
                        }
                    }
                    if let Some(e) = q.take(ticket, now) {
                        out.push((e, r));
                    }
                    continue 'look;
                }
                Step::Wait => {
                    let key = (priority, tenant);
                    if !waited.contains(&key) {
                        waited.push(key);
                    }
                }
            }
        }
        return out;
    }
}

/// Whether a request of `priority` arriving now must queue without being tried: requests
/// of its band or above already wait, and a newcomer does not overtake them.
pub fn must_wait<T>(q: &AdmissionQueue<T>, priority: i32) -> bool {
    q.top_priority().is_some_and(|p| p >= priority)
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
            in_flight: 0,
            prefilling: 0,
            tiers: None,
            stale: false,
            load: LoadView {
                pending_prefill_tokens: pending,
                queued,
                ..Default::default()
            },
            bound: 0.0,
            pinned: false,
            pressure: 0.0,
            peer_home: false,
        }
    }

    fn ask(prompt_blocks: u32) -> Ask {
        Ask {
            prompt_blocks,
            block_size: 16,
            ..Ask::default()
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
            cache_loss: 1.0,
            reserve_inflight: 0,
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
    fn a_prompt_waits_for_its_cache_rather_than_lose_too_much_of_it() {
        let cfg = PolicyConfig::default();
        let h = Headroom {
            max_backlog_s: 100.0,
            max_waiting: 0,
            max_inflight: 4,
            cache_loss: 0.5,
            reserve_inflight: 0,
        };
        let mut home = cand(0, 80, 0, 0);
        home.load.inflight = 4;
        let mut cold = cand(1, 0, 0, 0);
        cold.load.inflight = 1;
        // The home is full and the only pod with room holds none of the 100 blocks.
        assert!(room(&cfg, &h, &ask(100), &[home.clone(), cold.clone()]).is_empty());
        // Losing 30 of them is within the half it may lose.
        cold.matched = 50;
        assert_eq!(
            room(&cfg, &h, &ask(100), &[home.clone(), cold.clone()]),
            [1]
        );
        // Willing to lose all of it: the cold pod is offered.
        cold.matched = 0;
        let any = Headroom {
            cache_loss: 1.0,
            ..h
        };
        assert_eq!(room(&cfg, &any, &ask(100), &[home, cold]), [1]);
    }

    #[test]
    fn a_prompt_larger_than_the_backlog_bound_fits_an_idle_pod() {
        let cfg = PolicyConfig {
            prefill_tokens_per_s: 1000.0,
            ..PolicyConfig::default()
        };
        let h = Headroom {
            max_backlog_s: 1.0,
            max_waiting: 0,
            max_inflight: 0,
            cache_loss: 1.0,
            reserve_inflight: 0,
        };
        // 10,000 tokens is 10 s of prefill, ten times the bound.
        let cands = [cand(0, 0, 1, 0), cand(1, 0, 0, 0)];
        assert_eq!(room(&cfg, &h, &ask(625), &cands), [1]);
    }

    #[test]
    fn slots_kept_for_the_top_band() {
        let h = Headroom {
            max_backlog_s: 1.0,
            max_waiting: 0,
            max_inflight: 16,
            cache_loss: 1.0,
            reserve_inflight: 2,
        };
        assert_eq!(h.for_request(true, false).max_inflight, 16);
        assert_eq!(h.for_request(false, false).max_inflight, 14);
        let tiny = Headroom {
            max_inflight: 2,
            reserve_inflight: 5,
            ..h
        };
        assert_eq!(tiny.for_request(false, false).max_inflight, 1, "never zero");
        let unchecked = Headroom {
            max_inflight: 0,
            ..h
        };
        assert_eq!(unchecked.for_request(false, false).max_inflight, 0);
    }

    #[test]
    fn a_passed_over_tenant_takes_room_anywhere_and_the_reserve() {
        let h = Headroom {
            max_backlog_s: 1.0,
            max_waiting: 0,
            max_inflight: 16,
            cache_loss: 0.5,
            reserve_inflight: 2,
        };
        let low = h.for_request(false, false);
        assert_eq!((low.max_inflight, low.cache_loss), (14, 0.5));
        let passed = h.for_request(false, true);
        assert_eq!((passed.max_inflight, passed.cache_loss), (16, 1.0));
        // The pod holding the prompt has only the top band's slots left: a low request
        // waits for it; once its tenant is passed over, it takes one.
        let cfg = PolicyConfig::default();
        let mut warm = cand(0, 8, 0, 0);
        warm.load.inflight = 14;
        let cands = [warm, cand(1, 0, 0, 0)];
        assert!(room(&cfg, &low, &ask(8), &cands).is_empty());
        assert_eq!(room(&cfg, &passed, &ask(8), &cands), [0, 1]);
    }

    #[test]
    fn engines_reporting_a_full_waiting_line_have_no_room() {
        let cfg = PolicyConfig::default();
        let h = Headroom {
            max_backlog_s: 100.0,
            max_waiting: 4,
            max_inflight: 0,
            cache_loss: 1.0,
            reserve_inflight: 0,
        };
        let cands = [cand(0, 0, 0, 4), cand(1, 0, 0, 9)];
        assert!(room(&cfg, &h, &ask(1), &cands).is_empty());
        let cands = [cand(0, 0, 0, 4), cand(1, 0, 0, 3)];
        assert_eq!(room(&cfg, &h, &ask(1), &cands), [1]);
        assert!(room(&cfg, &h, &ask(1), &[]).is_empty(), "no pod, no room");
    }
}
