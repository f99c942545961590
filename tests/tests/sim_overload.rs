//! Overload with the router's admission queue, in the simulator (the sidecar's own gate
//! and queue on the virtual clock): the SGLang shared-prefix workload at 14 req/s on
//! four pods that serve about 9, a quarter of it high priority, two tenants sending
//! 10:1. Without the queue every request waits in the engines' lines in arrival order;
//! with it the high band overtakes, the light tenant takes its turns, and the low
//! band's excess is shed after its TTL instead of growing every line without bound.
//!
//! The targets for this run, asserted: high-band p99 TTFT within 1.2x of its value
//! with the high band alone, every low request served or shed after its TTL, the light
//! tenant shed no more often than the heavy one, the queue within its bounds, and a hit
//! rate at least the queue-less run's. Figures in docs/policy.md ("Admission").

use kvroute_shared::protocol::{AdmissionBand, AdmissionConfig, PolicyConfig};
use kvroute_tests::sim::{self, ClassFigures, Policy, SimAdmission, SimOpts};

const PODS: usize = 4;
const RATE: f64 = 14.0;
/// A request waits for room where its prefix is rather than lose more than half of it.
const CACHE_LOSS: f64 = 0.5;
/// Batch slots per pod kept for the high band.
const RESERVE: u32 = 4;

/// The sidecar's admission settings for this run: the low band (0) waits 10 s, the
/// high one (1) 30 s.
fn config(max_inflight: u32) -> AdmissionConfig {
    AdmissionConfig {
        enabled: true,
        max_backlog_s: 1.0,
        max_waiting: 0,
        max_inflight,
        cache_loss: CACHE_LOSS,
        reserve_inflight: RESERVE,
        max_queued: 4096,
        max_queued_bytes: 8 << 20,
        bands: vec![
            AdmissionBand {
                priority: 0,
                ttl_s: 10.0,
                sheddable: false,
            },
            AdmissionBand {
                priority: 1,
                ttl_s: 30.0,
                sheddable: false,
            },
        ],
        ..AdmissionConfig::default()
    }
}

fn admission(max_inflight: u32) -> SimAdmission {
    SimAdmission {
        config: config(max_inflight),
        // One request in four is high priority; tenant 1 sends one in eleven.
        priority: vec![1, 0, 0, 0],
        tenant: [0; 10].into_iter().chain([1]).collect(),
    }
}

fn class(r: &sim::SimResult, priority: i32, tenant: u32) -> &ClassFigures {
    r.classes
        .iter()
        .find(|c| c.priority == priority && c.tenant == tenant)
        .expect("class")
}

#[test]
fn the_high_band_overtakes_and_the_low_band_is_shed_not_lost() {
    // Seeds 4 and 6 are where the light tenant's share was thinnest (38-39% before a
    // tenant short of its turns was relaxed after one pass).
    for seed in 1..=6 {
        overload(seed);
    }
}

fn overload(seed: u64) {
    overload_with(seed, 1);
}

/// Hit rate, the high band's p99 TTFT, low-band requests served, the light tenant's
/// mean TTFT.
fn overload_with(seed: u64, gateways: usize) -> (f64, f64, u64, f64) {
    let o = SimOpts {
        seed,
        gateways,
        delta_delay_s: 0.02,
        ..SimOpts::new(PODS, 16384, 16)
    };
    let reqs = sim::generated("sglang-shared-prefix", 16, RATE, seed).expect("workload");
    // The high band's traffic alone: its floor.
    let high: Vec<_> = reqs.iter().step_by(4).cloned().collect();
    let floor = sim::simulate(&high, &o, Policy::Kvroute);
    // A gate that never closes: every request goes straight to the engines.
    let open = SimOpts {
        admission: Some(SimAdmission {
            config: AdmissionConfig {
                max_backlog_s: f64::MAX,
                max_inflight: 0,
                cache_loss: 1.0,
                reserve_inflight: 0,
                ..config(0)
            },
            ..admission(0)
        }),
        ..o.clone()
    };
    let open = sim::simulate(&reqs, &open, Policy::Kvroute);
    let a = admission(o.cost.max_batch as u32);
    let max_bytes = a.config.max_queued_bytes as usize;
    let gated = sim::simulate(
        &reqs,
        &SimOpts {
            admission: Some(a),
            ..o.clone()
        },
        Policy::Kvroute,
    );
    eprintln!(
        "seed {seed}, {gateways} gateway(s): high band alone: p99 {:.0} ms | no queue: hit {:.3}, high p99 {:.0} ms | queue: hit {:.3}, high p99 {:.0} ms, {} queued, {} shed, peak {} bytes",
        floor.ttft_p99_ms,
        open.hit_rate,
        class(&open, 1, 0).ttft_p99_ms,
        gated.hit_rate,
        class(&gated, 1, 0).ttft_p99_ms,
        gated.queued,
        gated.shed,
        gated.queue_peak_bytes
    );
    for c in &gated.classes {
        eprintln!(
            "  priority {} tenant {}: {} requests, {} served, {} shed, {} left the queue ({} with the other tenant waiting), TTFT mean {:.0} p99 {:.0} ms",
            c.priority, c.tenant, c.requests, c.served, c.shed, c.dispatched_saturated, c.dispatched_contested, c.ttft_mean_ms, c.ttft_p99_ms
        );
    }
    assert_eq!(open.shed, 0, "an open gate queues nothing");
    assert!(gated.queued > 0 && gated.shed > 0, "the workload overloads");
    for c in &gated.classes {
        assert_eq!(c.served + c.shed, c.requests, "none lost: {c:?}");
    }
    for t in [0, 1] {
        let (h, o) = (class(&gated, 1, t), class(&open, 1, t));
        assert_eq!(h.shed, 0, "the high band is never shed: {h:?}");
        // One gateway's target; replicas are judged against one gateway below.
        assert!(
            gateways > 1 || h.ttft_p99_ms <= 1.2 * floor.ttft_p99_ms,
            "high band p99 {:.0} ms (no queue {:.0}, alone {:.0})",
            h.ttft_p99_ms,
            o.ttft_p99_ms,
            floor.ttft_p99_ms
        );
    }
    // The light tenant takes its turns: it is shed no more often than the heavy one, and
    // of what leaves the low band while both wait there it gets the 40% (44-47% on
    // seeds 1-6 with one gateway; with four, counted replica by replica, 46-50%).
    let (heavy, light) = (class(&gated, 0, 0), class(&gated, 0, 1));
    assert!(
        light.shed as f64 / light.requests as f64 <= heavy.shed as f64 / heavy.requests as f64,
        "light tenant {light:?} vs heavy {heavy:?}"
    );
    let contested = (heavy.dispatched_contested + light.dispatched_contested) as f64;
    let share = light.requests as f64 / (light.requests + heavy.requests) as f64;
    eprintln!(
        "  while both tenants waited: the light one left the queue {} of {contested} times ({:.0}%; {:.0}% of the requests)",
        light.dispatched_contested,
        100.0 * light.dispatched_contested as f64 / contested.max(1.0),
        100.0 * share
    );
    assert!(
        contested >= 20.0,
        "both tenants waited together: {contested}"
    );
    assert!(
        light.dispatched_contested as f64 >= 0.4 * contested,
        "light tenant {light:?} vs heavy {heavy:?}"
    );
    assert!(gated.queue_peak_bytes <= max_bytes);
    // Waiting for the cache keeps it: more hits than sending everything at once on the
    // same requests, and fewer blocks that a pod held when their request was routed
    // computed again. The two runs' whole hit rates compare different mixes: the queue
    // sheds requests that wait for their prefix's pod, and the queue-less run, whose
    // requests wait in the engines' lines (`saturation_waiting_over`), serves them all
    // warm (0.865-0.879 against the queue's 0.849-0.858 on seeds 1-6).
    let same = open.hit_rate_over(&reqs, |i| gated.request_hits[i].is_some());
    eprintln!(
        "  hit rate over the requests the queue served: {:.3} under the queue, {same:.3} without (all of them: {:.3}); locality lost (blocks a pod held, computed again): {:.3} under the queue, {:.3} without",
        gated.hit_rate, open.hit_rate, gated.locality_lost, open.locality_lost
    );
    assert!(
        gated.hit_rate >= same - 0.005,
        "hit {:.3} under the queue vs {same:.3} without, on the same requests",
        gated.hit_rate
    );
    assert!(
        gated.locality_lost <= open.locality_lost,
        "locality lost {:.3} under the queue vs {:.3} without",
        gated.locality_lost,
        open.locality_lost
    );
    let high_p99 = [0, 1]
        .map(|t| class(&gated, 1, t).ttft_p99_ms)
        .into_iter()
        .fold(0.0, f64::max);
    let low_served = class(&gated, 0, 0).served + class(&gated, 0, 1).served;
    (gated.hit_rate, high_p99, low_served, light.ttft_mean_ms)
}

/// Four gateway replicas, each with its own queue, exchanging load deltas 20 ms late:
/// the hit rate and the low band's requests served stay within 5% of one gateway's (seeds
/// 1-6: hit 0.846-0.855 against 0.849-0.858, served 96.5-98.7% of one gateway's; four
/// gateways shed 2-5% more of the low band than one). The high band's p99 does
/// not quite (298 vs 249 ms on seed 1, 218 vs 218 on seed 2; printed, not asserted): a
/// high request still now and then lands where another replica had just sent a low
/// prefill it had not heard of. Without replicas keeping new prompts apart it was 421
/// and 418 ms (the next test; docs/policy.md).
#[test]
fn four_gateways_queue_as_well_as_one() {
    for seed in 1..=2 {
        let (hit1, p99_1, served1, light1) = overload_with(seed, 1);
        let (hit4, p99_4, served4, light4) = overload_with(seed, 4);
        eprintln!(
            "seed {seed}: 1 gateway hit {hit1:.3} high p99 {p99_1:.0} ms low band served {served1} light tenant {light1:.0} ms | 4 gateways hit {hit4:.3} high p99 {p99_4:.0} ms low band served {served4} light tenant {light4:.0} ms"
        );
        assert!(hit4 >= 0.95 * hit1, "hit {hit4:.3} vs {hit1:.3}");
        assert!(
            served4 as f64 >= 0.95 * served1 as f64,
            "low band served {served4} vs {served1}"
        );
        // The light tenant's wait: each replica holds its own requests, so without the
        // queues' states shared it waited for room its own replica freed (1.7 / 1.6 s
        // against 0.48 / 0.60 s with one gateway).
        assert!(
            light4 <= 1.5 * light1,
            "light tenant {light4:.0} ms vs {light1:.0} with one gateway"
        );
    }
}

/// With `peer_home_weight` (the default, and always behind the admission gate, where
/// backlogs stay short) each replica places new prompts on its own share of the pods,
/// so two replicas that place cold prompts within the deltas' delay stop queueing one
/// behind the other: the four-replica high band's tail (421 / 418 ms on seeds 1 / 2)
/// comes back toward one gateway's (249 / 218 ms), at the same hit rate.
#[test]
fn replicas_that_place_new_prompts_apart_keep_the_high_bands_tail() {
    for seed in 1..=2 {
        let o = SimOpts {
            seed,
            gateways: 4,
            delta_delay_s: 0.02,
            admission: Some(admission(16)),
            config: PolicyConfig {
                peer_home_weight: 0.0,
                ..PolicyConfig::default()
            },
            ..SimOpts::new(PODS, 16384, 16)
        };
        // The default: behind the admission gate, apart whatever the backlog.
        let apart = SimOpts {
            config: PolicyConfig::default(),
            ..o.clone()
        };
        let reqs = sim::generated("sglang-shared-prefix", 16, RATE, seed).expect("workload");
        let off = sim::simulate(&reqs, &o, Policy::Kvroute);
        let on = sim::simulate(&reqs, &apart, Policy::Kvroute);
        let (p_off, p_on) = (class(&off, 1, 0).ttft_p99_ms, class(&on, 1, 0).ttft_p99_ms);
        eprintln!(
            "seed {seed}, 4 gateways: high p99 {p_off:.0} ms, hit {:.3} | apart: {p_on:.0} ms, hit {:.3}",
            off.hit_rate, on.hit_rate
        );
        assert!(p_on <= 0.8 * p_off, "{p_on:.0} vs {p_off:.0} ms");
        assert!(on.hit_rate >= 0.98 * off.hit_rate);
    }
}
