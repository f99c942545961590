//! The routing-quality guard: on every built-in workload (and the Mooncake trace), the
//! default kvroute policy must not be worse than round-robin on mean and p99 TTFT, must
//! keep max/mean pod load within bounds, and, averaged over four seeds, must have the
//! lowest mean TTFT of all nine policies. Deterministic (virtual time, seeded).

use kvroute_tests::sim::{self, Policy, SimOpts};

/// The shipped Claude Code sessions as 512-token blocks, starting 4 s apart on average
/// (when, drawn from `seed`).
fn agentic_sessions(seed: u64) -> Vec<kvroute_tests::workload::Request> {
    kvroute_tests::workload::load_agentic(
        &kvroute_tests::workload::default_agentic(),
        kvroute_tests::workload::AgenticOpts {
            block_tokens: 512,
            mean_gap_s: 4.0,
            seed,
        },
    )
    .expect("sessions")
}

/// The built-in workloads on which the strictest guards below hold. Multi-turn chat is
/// not yet among them: over seeds 1-4 (8 pods x 16,384 blocks) kvroute's mean TTFT is
/// the lowest (74 ms against SGLang's 91, session affinity's 257), but on seed 4 its p99
/// is 496 ms against SGLang's 230 (four last turns moved off a busy home to a cold pod),
/// and four gateways with replica sync are 14% slower on the mean than one.
const TUNED: [&str; 3] = ["sglang-shared-prefix", "llmd-prefix", "multiround-qa"];

fn opts(block_tokens: u32, capacity: usize) -> SimOpts {
    SimOpts::new(8, capacity, block_tokens)
}

fn check(label: &str, reqs: &[kvroute_tests::workload::Request], o: &SimOpts) {
    let r = sim::compare(label, reqs, o, &[Policy::Kvroute, Policy::RoundRobin]);
    let (kv, rr) = (&r[0], &r[1]);
    assert!(
        kv.ttft_mean_ms <= rr.ttft_mean_ms,
        "{label}: mean TTFT {} > round-robin {}",
        kv.ttft_mean_ms,
        rr.ttft_mean_ms
    );
    assert!(
        kv.ttft_p99_ms <= rr.ttft_p99_ms * 1.001,
        "{label}: p99 TTFT {} > round-robin {}",
        kv.ttft_p99_ms,
        rr.ttft_p99_ms
    );
    assert!(
        kv.hit_rate > rr.hit_rate,
        "{label}: hit rate {} <= round-robin {}",
        kv.hit_rate,
        rr.hit_rate
    );
    // The simulator itself: nothing beats one infinite shared cache without queueing.
    let bound = sim::infinite_cache_bound(reqs, o);
    for x in &r {
        assert!(
            x.ttft_mean_ms >= bound.ttft_mean_ms * 0.999 && x.hit_rate <= bound.hit_rate + 1e-9,
            "{label}: {} beats the infinite-cache bound: {x:?} vs {bound:?}",
            x.policy
        );
    }
    // The balance goal, met by the defaults on every built-in workload and the trace.
    assert!(
        kv.max_mean_load <= 1.3,
        "{label}: max/mean load {}",
        kv.max_mean_load
    );
}

#[test]
fn default_policy_beats_round_robin_on_every_builtin_workload() {
    for w in sim::WORKLOADS {
        let reqs = sim::generated(w, 16, sim::default_rate(w), 1).expect("workload");
        check(w, &reqs, &opts(16, 16384));
    }
}

/// On the group workloads every group's first request is a cold prefill for any router,
/// and those are more than 1% of the requests: the floor's p99. kvroute must stay on it
/// (a split group or a queued cold prefill would show here first).
#[test]
fn default_policy_keeps_p99_on_the_floor_of_the_group_workloads() {
    for w in ["sglang-shared-prefix", "llmd-prefix"] {
        for seed in 1..=2 {
            let reqs = sim::generated(w, 16, sim::default_rate(w), seed).expect("workload");
            let o = opts(16, 16384);
            let kv = sim::simulate(&reqs, &o, Policy::Kvroute);
            let bound = sim::infinite_cache_bound(&reqs, &o);
            assert!(
                kv.ttft_p99_ms <= bound.ttft_p99_ms * 1.01,
                "{w} seed {seed}: p99 {} ms above the floor {} ms",
                kv.ttft_p99_ms,
                bound.ttft_p99_ms
            );
        }
    }
}

/// The goal, held over seeds 1–4 (one seed is a handful of placement decisions
/// away from another: docs/policy.md, "Balance where it costs no cache"): on every built-in workload the default
/// policy's mean TTFT is the lowest of all nine policies and its p99 the lowest on every
/// seed. The thinnest margin is multiround-qa, where session affinity is itself at the
/// floor plus the per-pod system-prompt prefills every policy pays.
#[test]
fn default_policy_has_the_lowest_mean_ttft_over_four_seeds() {
    for w in TUNED {
        let mut mean = vec![0.0; Policy::ALL.len()];
        for seed in 1..=4 {
            let reqs = sim::generated(w, 16, sim::default_rate(w), seed).expect("workload");
            let o = SimOpts {
                seed,
                ..opts(16, 16384)
            };
            let r: Vec<_> = Policy::ALL
                .iter()
                .map(|&p| sim::simulate(&reqs, &o, p))
                .collect();
            let best_p99 = r[1..]
                .iter()
                .map(|x| x.ttft_p99_ms)
                .fold(f64::MAX, f64::min);
            assert!(
                r[0].ttft_p99_ms <= best_p99 * 1.001,
                "{w} seed {seed}: p99 {} ms > best baseline's {best_p99} ms",
                r[0].ttft_p99_ms
            );
            for (m, x) in mean.iter_mut().zip(&r) {
                *m += x.ttft_mean_ms / 4.0;
            }
        }
        for (p, m) in Policy::ALL.iter().zip(&mean).skip(1) {
            assert!(
                mean[0] < *m,
                "{w}: kvroute's mean TTFT over seeds 1-4 {:.2} ms >= {}'s {m:.2} ms",
                mean[0],
                p.name()
            );
        }
    }
}

/// At 1.5× the default rates the batches fill: a holder whose engine has requests waiting
/// for a slot must not keep drawing its prefix's traffic (`full_batch_guard`, docs/policy.md).
#[test]
fn under_heavy_load_the_default_policy_still_has_the_lowest_mean_ttft() {
    for w in ["sglang-shared-prefix", "llmd-prefix"] {
        let reqs = sim::generated(w, 16, sim::default_rate(w) * 1.5, 1).expect("workload");
        let o = opts(16, 16384);
        let r: Vec<_> = Policy::ALL
            .iter()
            .map(|&p| sim::simulate(&reqs, &o, p))
            .collect();
        for x in &r[1..] {
            assert!(
                r[0].ttft_mean_ms < x.ttft_mean_ms,
                "{w} at 1.5x: kvroute {:.1} ms >= {} {:.1} ms",
                r[0].ttft_mean_ms,
                x.policy,
                x.ttft_mean_ms
            );
        }
        assert!(r[0].max_mean_load <= 1.3, "{w}: {}", r[0].max_mean_load);
    }
}

#[test]
fn default_policy_beats_round_robin_on_the_mooncake_trace() {
    let path = kvroute_tests::workload::default_trace();
    let reqs = kvroute_tests::workload::load_mooncake(&path)
        .expect("tests/data/mooncake_synthetic_trace.jsonl");
    check("mooncake", &reqs, &opts(512, 1024));
}

/// The Mooncake trace at its own rate, whose conversations send no session id: followed
/// by their prompts (`affinity::Kind::Prompt`), their returning turns tell kvroute which
/// pods evict them, and it reuses more than every other policy while keeping the lowest
/// mean and p99 TTFT (0.381 / 1,107 ms / 6,088 ms against `sglang`'s 0.373 / 1,657 ms /
/// 9,613 ms and Dynamo's imitation's 0.254 / 1,278 ms / 6,236 ms; without that signal
/// kvroute reused 0.355).
#[test]
fn on_the_mooncake_trace_kvroute_reuses_the_most_and_is_fastest() {
    let path = kvroute_tests::workload::default_trace();
    let reqs = kvroute_tests::workload::load_mooncake(&path)
        .expect("tests/data/mooncake_synthetic_trace.jsonl");
    let r = sim::compare(
        "mooncake",
        &reqs,
        &opts(512, 1024),
        &[
            Policy::Kvroute,
            Policy::Sglang,
            Policy::VllmRouter,
            Policy::Dynamo,
            Policy::PrefixGreedy,
        ],
    );
    let kv = &r[0];
    for x in &r[1..] {
        assert!(
            kv.hit_rate > x.hit_rate
                && kv.ttft_mean_ms < x.ttft_mean_ms
                && kv.ttft_p99_ms < x.ttft_p99_ms,
            "kvroute {kv:?} against {x:?}"
        );
    }
}

/// The Mooncake trace replayed at 1.6-2.4 times its rate on its 8 pods of 1,024 blocks,
/// which overloads them (mean TTFT 2-43 s). One rate is a poor judge there: a few
/// decisions set the course of a run, and at twice the rate `sglang`'s imitation has the
/// lower mean (9.7 s against 10.4). Over the seven rates (geometric means, as over seeds)
/// kvroute's mean and p99 TTFT are the lowest of the imitations of the real routers and
/// of consistent hashing (9.6 s and 33.7 s against `sglang`'s 11.2 s and 42.4 s, 2026-12-07),
/// and its hit rate within 1.5 points of theirs (0.370 against `vllm-router`'s 0.371,
/// whose tail is the longest: 54.6 s).
#[test]
fn on_the_mooncake_trace_overloaded_kvroute_has_the_lowest_mean_and_p99_over_rates() {
    let path = kvroute_tests::workload::default_trace();
    let reqs = kvroute_tests::workload::load_mooncake(&path)
        .expect("tests/data/mooncake_synthetic_trace.jsonl");
    let policies = [
        Policy::Kvroute,
        Policy::Sglang,
        Policy::VllmRouter,
        Policy::ConsistentHash,
    ];
    let runs: Vec<Vec<sim::SimResult>> = [1.6, 1.8, 1.9, 2.0, 2.1, 2.2, 2.4]
        .iter()
        .map(|&x| {
            let mut r = reqs.clone();
            for q in &mut r {
                q.ts_ms /= x;
            }
            sim::compare(&format!("mooncake x{x}"), &r, &opts(512, 1024), &policies)
        })
        .collect();
    let rows = sim::summarize_seeds(&runs);
    let kv = &rows[0];
    assert!(kv.ttft_mean_ms > 2_000.0, "not overloaded: {kv:?}");
    for x in &rows[1..] {
        assert!(
            kv.ttft_mean_ms < x.ttft_mean_ms && kv.ttft_p99_ms < x.ttft_p99_ms,
            "kvroute {kv:?} against {x:?}"
        );
        assert!(
            kv.hit_rate >= x.hit_rate - 0.015,
            "kvroute {kv:?} against {x:?}"
        );
    }
}

/// The imitation of Dynamo's KV router, with engines as fast as Dynamo's mocker (their
/// round-robin TTFT and latency matched: docs/benchmarks.md), reuses what Dynamo's own
/// replay (`ai-dynamo` 1.6.1, `make peers-dynamo`) reuses on the same requests: within 2
/// points of the real router's range, or the comparisons that use it flatter or wrong
/// kvroute. On the Mooncake trace (8 workers x 1,024 blocks) the real router reused
/// 0.334-0.352 over five runs; on the Claude Code sessions exported as a Mooncake trace
/// (8 x 4,096), 0.893-0.899 over three. kvroute stays ahead of the imitation on both, on
/// reuse and on mean TTFT.
#[test]
fn the_dynamo_imitation_reuses_what_dynamos_own_replay_does() {
    let mooncake =
        kvroute_tests::workload::load_mooncake(&kvroute_tests::workload::default_trace())
            .expect("tests/data/mooncake_synthetic_trace.jsonl");
    // What `kvroute-bench sim --agentic --export-mooncake` hands Dynamo's replay.
    let dir = tempfile::tempdir().expect("tempdir");
    let exported = dir.path().join("agentic.jsonl");
    kvroute_tests::workload::write_mooncake(&agentic_sessions(1), &exported).expect("export");
    let agentic = kvroute_tests::workload::load_mooncake(&exported).expect("exported trace");
    for (label, reqs, capacity, real) in [
        ("mooncake", mooncake, 1024, (0.334, 0.352)),
        ("agentic", agentic, 4096, (0.893, 0.899)),
    ] {
        let mut o = opts(512, capacity);
        o.cost.prefill_tps = 45_000.0;
        o.cost.decode_ms = 6.0;
        o.config.prefill_tokens_per_s = 45_000.0;
        let r = sim::compare(label, &reqs, &o, &[Policy::Dynamo, Policy::Kvroute]);
        let (dynamo, kv) = (&r[0], &r[1]);
        assert!(
            (real.0 - 0.02..=real.1 + 0.02).contains(&dynamo.hit_rate),
            "{label}: imitation {dynamo:?} vs the real router's {real:?}"
        );
        assert!(kv.hit_rate > dynamo.hit_rate, "{label}: kvroute {kv:?}");
        assert!(
            kv.ttft_mean_ms < dynamo.ttft_mean_ms,
            "{label}: kvroute {kv:?}"
        );
    }
}

#[test]
fn the_simulation_is_deterministic() {
    let reqs = sim::generated("multiround-qa", 16, 10.0, 5).expect("workload");
    let a = sim::simulate(&reqs, &opts(16, 4096), Policy::Kvroute);
    let b = sim::simulate(&reqs, &opts(16, 4096), Policy::Kvroute);
    assert_eq!(a.json(), b.json());
}

/// Four gateways whose load deltas reach each other after 20 ms route as well as one
/// (mean and p99 TTFT within 5%, seeds 1-4 averaged), where gateways without replica sync
/// herd: multi-round conversations pile onto few pods and group prompts queue.
#[test]
fn four_gateways_with_replica_sync_route_as_well_as_one_and_without_it_herd() {
    for w in TUNED {
        let (mut one, mut four, mut nosync) = ([0.0; 3], [0.0; 3], [0.0; 3]);
        for seed in 1..=4 {
            let reqs = sim::generated(w, 16, sim::default_rate(w), seed).expect("workload");
            let o = SimOpts {
                seed,
                gateways: 4,
                delta_delay_s: 0.02,
                ..opts(16, 16384)
            };
            let runs = [
                (
                    &mut one,
                    SimOpts {
                        gateways: 1,
                        ..o.clone()
                    },
                ),
                (&mut four, o.clone()),
                (
                    &mut nosync,
                    SimOpts {
                        replica_sync: false,
                        ..o.clone()
                    },
                ),
            ];
            for (acc, o) in runs {
                let r = sim::simulate(&reqs, &o, Policy::Kvroute);
                acc[0] += r.ttft_mean_ms / 4.0;
                acc[1] += r.ttft_p99_ms / 4.0;
                acc[2] += r.max_mean_load / 4.0;
            }
        }
        eprintln!(
            "{w}: (mean, p99, max/mean) 1 gateway {one:?}, 4 {four:?}, 4 without sync {nosync:?}"
        );
        assert!(
            four[0] <= one[0] * 1.05,
            "{w}: mean {} vs {}",
            four[0],
            one[0]
        );
        assert!(
            four[1] <= one[1] * 1.05,
            "{w}: p99 {} vs {}",
            four[1],
            one[1]
        );
        assert!(four[2] <= 1.3, "{w}: max/mean {}", four[2]);
        let herded = nosync[2] > 1.5 || nosync[1] > four[1] * 1.1;
        assert!(herded, "{w}: without replica sync {nosync:?} vs {four:?}");
    }
}

/// Chat without a tokenizer is routed by text chains and predicted residency, and the
/// engines cache tokens: prose, code, numbers and CJK conversations (4.6, 3.1, 2.2, 1.5
/// bytes a token) on pods whose caches fill. The router must translate blocks into the
/// engines' tokens as the reports teach it: at four bytes a token assumed, held prompts
/// counted as mispredictions (up to 64% of decisions at 10 req/s), each cut a pod's
/// predicted capacity by 30%, and kvroute fell to 0.62 hit rate against session
/// affinity's 0.84 (TTFT mean 3.5 s against 0.5 s). At 6 req/s the pods are busy, not
/// saturated (trading cache for balance on a saturated fleet is the overload work's).
#[test]
fn text_chains_at_every_bytes_per_token_keep_their_homes_on_full_caches() {
    for seed in 1..=2 {
        let reqs = sim::generated("multiround-qa", 16, 6.0, seed).expect("workload");
        let o = SimOpts {
            seed,
            text: Some(sim::TextChains {
                block_bytes: 256,
                bytes_per_token: vec![4.6, 3.1, 2.2, 1.5],
            }),
            ..SimOpts::new(4, 2048, 16)
        };
        let kv = sim::simulate(&reqs, &o, Policy::Kvroute);
        let session = sim::simulate(&reqs, &o, Policy::parse("session").expect("policy"));
        let rr = sim::simulate(&reqs, &o, Policy::RoundRobin);
        assert!(
            kv.hit_rate >= 0.95 * session.hit_rate && kv.hit_rate > rr.hit_rate,
            "seed {seed}: hit rate {:.3}, session {:.3}, round-robin {:.3}",
            kv.hit_rate,
            session.hit_rate,
            rr.hit_rate
        );
        assert!(
            kv.ttft_mean_ms <= session.ttft_mean_ms,
            "seed {seed}: TTFT mean {:.0} ms > session's {:.0} ms",
            kv.ttft_mean_ms,
            session.ttft_mean_ms
        );
        // What remains are prefixes routed to a pod before its engine had them (queued
        // behind their first request), which session affinity shows as often; at four
        // bytes a token assumed it was 52-64% of decisions on seeds 2 and 3 at 10 req/s.
        assert!(
            kv.mispredictions * 12 <= kv.decisions,
            "seed {seed}: {} of {} decisions mispredicted",
            kv.mispredictions,
            kv.decisions
        );
    }
}

/// The 80 real Claude Code sessions (tests/data/agentic), on fleets whose caches must
/// evict (8 × 4,096 and 16 × 2,048 blocks of 512 tokens): kvroute's default has the
/// lowest mean and p99 TTFT of every policy, plain session affinity included, within the
/// infinite-cache ceiling's hit rate. (Saturated fleets are the overload issue's; the
/// balance target there, max/mean ≤ 1.5, is not met yet: 1.74 and 2.19.)
#[test]
fn agentic_sessions_beat_every_baseline() {
    let reqs = agentic_sessions(1);
    assert_eq!(
        reqs.len(),
        3600,
        "the shipped sessions, sub-agents included"
    );
    assert!(reqs.windows(2).all(|w| w[0].ts_ms <= w[1].ts_ms));
    for (pods, capacity) in [(8, 4096), (16, 2048)] {
        let o = SimOpts::new(pods, capacity, 512);
        let r = sim::compare("agentic", &reqs, &o, &Policy::ALL);
        let kv = r
            .iter()
            .find(|x| x.policy == "kvroute")
            .expect("kvroute")
            .clone();
        for x in r.iter().filter(|x| x.policy != "kvroute") {
            assert!(
                kv.ttft_mean_ms < x.ttft_mean_ms && kv.ttft_p99_ms < x.ttft_p99_ms,
                "{pods}x{capacity}: kvroute {kv:?} behind {x:?}"
            );
        }
        let bound = sim::infinite_cache_bound(&reqs, &o);
        assert!(kv.hit_rate >= bound.hit_rate - 0.01, "{kv:?} vs {bound:?}");
        println!(
            "{pods}x{capacity}: kvroute hit {:.3} TTFT mean {:.0} ms ({:.2}x the floor) p99 {:.0} ms, max/mean {:.2}",
            kv.hit_rate,
            kv.ttft_mean_ms,
            kv.ttft_mean_ms / bound.ttft_mean_ms,
            kv.ttft_p99_ms,
            kv.max_mean_load
        );
    }
}

/// A fleet far behind on small caches (the sessions on 4 pods of 2,048 blocks: minutes of
/// backlog, each pod's cache turning over while a turn waits there): the saturation
/// weight counts at most `saturation_max_prompts` prompts of backlog, so a turn leaves a
/// pod whose queue has drifted far past the others'. Uncapped, no turn moved whatever the
/// gap (seed 2: mean TTFT 415 s against 85 s). On seed 1 the sessions whose prompts aged
/// out of a pod that keeps returning prompts now choose a home again by load (the
/// binding lapses, `route::bound_blocks`), which relieves the drift as well: 87 s
/// uncapped against 81 s (before that rule: 170 s against 103 s).
#[test]
fn a_fleet_far_behind_lets_turns_leave_a_drifting_queue() {
    for seed in [1, 2] {
        let reqs = agentic_sessions(seed);
        let run = |config: kvroute_shared::protocol::PolicyConfig| {
            let o = SimOpts {
                seed,
                config,
                ..SimOpts::new(4, 2048, 512)
            };
            sim::simulate(&reqs, &o, Policy::Kvroute)
        };
        let capped = run(Default::default());
        let uncapped = run(kvroute_shared::protocol::PolicyConfig {
            saturation_max_prompts: f64::MAX,
            ..Default::default()
        });
        println!(
            "seed {seed}: capped {:.0} s (hit {:.3}), uncapped {:.0} s (hit {:.3})",
            capped.ttft_mean_ms / 1e3,
            capped.hit_rate,
            uncapped.ttft_mean_ms / 1e3,
            uncapped.hit_rate
        );
        let bound = if seed == 2 { 0.85 } else { 1.0 };
        assert!(
            capped.ttft_mean_ms < bound * uncapped.ttft_mean_ms,
            "seed {seed}: {capped:?} against {uncapped:?}"
        );
        // Still a cache-first policy: the moves cost at most 1.5 points of hit rate.
        assert!(
            capped.hit_rate > uncapped.hit_rate - 0.015,
            "seed {seed}: {capped:?} against {uncapped:?}"
        );
    }
}

/// Data-parallel ranks, each a pod of its own (`ip:port@rank`), route as well as
/// separate pods (within 2 points of hit rate), and far better than the same router
/// seeing one pod per address while the engine balances its ranks (`rank-blind`): on the
/// 80 Claude Code sessions over 2 addresses x 4 ranks, 0.951 against 0.754 (1.26x; mean
/// TTFT 0.82 s against 18.7 s); on a shared-prefix workload 3.6x. On multi-turn chat,
/// where a later turn's prompt is mostly its own conversation (64 users x 8 turns, full
/// caches), 0.635 against 0.220 (2.9x), the 1.5x; on multi-round QA, whose
/// 1,000-token system prompt every rank holds anyway, 1.36x (there the cache ceiling is
/// 0.850 and the system prompt alone gives any router over half of it).
#[test]
fn data_parallel_ranks_route_as_separate_pods() {
    let agentic = agentic_sessions(1);
    let cases = [
        ("agentic", agentic, SimOpts::new(8, 4096, 512), 1.2),
        (
            "sglang-shared-prefix",
            sim::generated("sglang-shared-prefix", 16, 4.0, 1).expect("workload"),
            SimOpts::new(4, 2048, 16),
            3.0,
        ),
        (
            "multiround-qa",
            sim::generated("multiround-qa", 16, 4.0, 1).expect("workload"),
            SimOpts::new(4, 2048, 16),
            1.3,
        ),
        (
            "multiturn-chat",
            sim::generated("multiturn-chat", 16, 4.0, 1).expect("workload"),
            SimOpts::new(4, 4096, 16),
            1.5,
        ),
    ];
    for (w, reqs, pods, min_ratio) in cases {
        let ranks = SimOpts {
            dp_ranks: 4,
            ..pods.clone()
        };
        let separate = sim::simulate(&reqs, &pods, Policy::Kvroute);
        let as_pods = sim::simulate(&reqs, &ranks, Policy::Kvroute);
        let blind = sim::simulate(&reqs, &ranks, Policy::RankBlind);
        eprintln!(
            "{w}: pods {:.3}, ranks as pods {:.3}, rank-blind {:.3}",
            separate.hit_rate, as_pods.hit_rate, blind.hit_rate
        );
        assert!(
            (as_pods.hit_rate - separate.hit_rate).abs() <= 0.02,
            "{w}: ranks {} vs pods {}",
            as_pods.hit_rate,
            separate.hit_rate
        );
        assert!(
            as_pods.hit_rate >= min_ratio * blind.hit_rate,
            "{w}: ranks as pods {} vs rank-blind {}",
            as_pods.hit_rate,
            blind.hit_rate
        );
    }
}

/// kvroute's mean TTFT below each of `on_mean`'s, its p99 below each of `on_p99`'s.
fn leads(kv: &sim::SimResult, on_mean: &[sim::SimResult], on_p99: &[sim::SimResult]) {
    for x in on_mean {
        assert!(
            kv.ttft_mean_ms < x.ttft_mean_ms,
            "kvroute {kv:?} behind {x:?}"
        );
    }
    for x in on_p99 {
        assert!(
            kv.ttft_p99_ms < x.ttft_p99_ms,
            "kvroute {kv:?} behind {x:?}"
        );
    }
}

/// The live comparison's agentic case (`kvroute-bench peers --workloads agentic`: 4
/// engines of 1,024 trace blocks, the sessions' first 900 s as text) beside the
/// simulator's imitation of SGLang's gateway, which reads the same there as the real
/// `smg` 1.13 does live (docs/benchmarks.md: 0.39 hit rate simulated, 0.39–0.41 live;
/// round-robin 0.12 and 0.13). kvroute's default waits for a session's home where the
/// caches evict (`eviction_load_cut`), and trades a little of the hits for balance: its
/// mean TTFT must stay the lowest, its p99 below the cache-keeping policies' (round-robin,
/// which never queues behind a home, is within 2% of it), its hit rate within 3 points of
/// smg's (0.376 against 0.392; 0.350 with the cut off).
#[test]
fn on_the_live_agentic_case_kvroute_keeps_the_lowest_ttft_beside_smg() {
    let mut reqs = agentic_sessions(1);
    reqs.retain(|r| r.ts_ms <= 900_000.0);
    assert_eq!(reqs.len(), 1379, "what the live comparison replays");
    let o = SimOpts {
        text: Some(sim::TextChains {
            block_bytes: 256,
            bytes_per_token: vec![4.5],
        }),
        ..SimOpts::new(4, 1024, 512)
    };
    let r = sim::compare(
        "agentic, live-shaped",
        &reqs,
        &o,
        &[
            Policy::Kvroute,
            Policy::Sglang,
            Policy::Session,
            Policy::RoundRobin,
        ],
    );
    let (kv, smg) = (&r[0], &r[1]);
    leads(kv, &r[1..], &r[1..3]);
    assert!(
        kv.ttft_p99_ms < 1.05 * r[3].ttft_p99_ms,
        "{kv:?} vs {:?}",
        r[3]
    );
    assert!(
        (0.35..0.45).contains(&smg.hit_rate) && r[3].hit_rate < 0.15,
        "the imitation no longer reads as smg and round-robin do live: {:.3}, {:.3}",
        smg.hit_rate,
        r[3].hit_rate
    );
    assert!(
        kv.hit_rate >= smg.hit_rate - 0.03,
        "hit rate {:.3} against smg's {:.3}",
        kv.hit_rate,
        smg.hit_rate
    );
}

/// The same case routed by token chains (precise mode: the sidecar tokenizes and the
/// engines' events fill the index), with engines as fast as the live comparison's
/// relative to its prompts (8,000 tokens a second for a 64-token trace block, so 64,000
/// for the simulator's 512), over seeds 1–12 (geometric means: one seed's tail is a poor
/// judge here, and six seeds' p99 still swings by a tenth). Token chains carry no
/// guesses, so the pressure that keeps a session home where caches evict is read off its
/// returning turns (the sidecar's `returns`): with it kvroute has the lowest mean and p99
/// TTFT (2,075 ms and 18.7 s against smg's imitation's 2,551 ms and 19.4 s) and the
/// highest hit rate (0.420 against smg's 0.400, vLLM router's 0.406 and session
/// affinity's 0.413, at 3,407 and 3,637 ms); without it kvroute moves a fifth of the
/// turns to skip a queue and reuses 0.373.
#[test]
fn on_the_live_agentic_case_in_tokens_sessions_keep_their_homes() {
    let mut reqs = agentic_sessions(1);
    reqs.retain(|r| r.ts_ms <= 900_000.0);
    let policies = [
        Policy::Kvroute,
        Policy::Sglang,
        Policy::VllmRouter,
        Policy::Session,
        Policy::RoundRobin,
    ];
    let opts = |seed: u64, cut: f64| {
        let mut o = SimOpts::new(4, 1024, 512);
        o.seed = seed;
        o.cost.prefill_tps = 64_000.0;
        o.config.prefill_tokens_per_s = 64_000.0;
        o.config.eviction_load_cut = cut;
        o
    };
    let seeded = |seed: u64| {
        let mut reqs = agentic_sessions(seed);
        reqs.retain(|r| r.ts_ms <= 900_000.0);
        reqs
    };
    assert_eq!(reqs.len(), 1379, "what the live comparison replays");
    let cut = kvroute_shared::protocol::PolicyConfig::default().eviction_load_cut;
    let runs: Vec<Vec<sim::SimResult>> = (1..=12)
        .map(|seed| {
            sim::compare(
                "live-shaped, tokens",
                &seeded(seed),
                &opts(seed, cut),
                &policies,
            )
        })
        .collect();
    let rows = sim::summarize_seeds(&runs);
    let (kv, smg) = (&rows[0], &rows[1]);
    for x in &rows[1..] {
        assert!(
            kv.ttft_mean_ms < x.ttft_mean_ms,
            "kvroute {kv:?} behind {x:?}"
        );
    }
    for x in &rows[1..4] {
        assert!(
            kv.ttft_p99_ms < x.ttft_p99_ms,
            "kvroute {kv:?} behind {x:?}"
        );
        assert!(kv.hit_rate > x.hit_rate, "kvroute {kv:?} behind {x:?}");
    }
    assert!(kv.session_moves < 0.08, "{kv:?}");
    // Without the cut the turns leave their homes again.
    let off: Vec<Vec<sim::SimResult>> = (1..=12)
        .map(|seed| {
            sim::compare(
                "cut off",
                &seeded(seed),
                &opts(seed, 0.0),
                &[Policy::Kvroute],
            )
        })
        .collect();
    let cut_off = &sim::summarize_seeds(&off)[0];
    assert!(
        cut_off.session_moves > 2.0 * kv.session_moves && cut_off.hit_rate < smg.hit_rate,
        "{cut_off:?} vs {kv:?}"
    );
}

/// Four gateways route the live-shaped agentic case as one does: each replica learns
/// the others' sessions with their prompts' tips (`LoadDelta::tip`), so whichever routes
/// a session's next turn can tell what its pod evicted. Without the tips (seeds 1-6)
/// four gateways moved 21% of the turns and reused 0.394 against one gateway's 0.424
/// (7% less), each replica's eviction pressure read off a quarter of the returning
/// turns and staying near nothing, so bindings lapsed; with them 9% and 0.411.
#[test]
fn on_the_live_agentic_case_four_gateways_keep_sessions_home_as_one_does() {
    let run = |seed: u64, gateways: usize| {
        let mut reqs = agentic_sessions(seed);
        reqs.retain(|r| r.ts_ms <= 900_000.0);
        let mut o = SimOpts::new(4, 1024, 512);
        o.seed = seed;
        o.gateways = gateways;
        o.delta_delay_s = 0.02;
        o.cost.prefill_tps = 64_000.0;
        o.config.prefill_tokens_per_s = 64_000.0;
        sim::simulate(&reqs, &o, Policy::Kvroute)
    };
    let (one, four): (Vec<_>, Vec<_>) = (1..=6).map(|s| (vec![run(s, 1)], vec![run(s, 4)])).unzip();
    let (one, four) = (
        &sim::summarize_seeds(&one)[0],
        &sim::summarize_seeds(&four)[0],
    );
    eprintln!("one gateway {one:?}\nfour gateways {four:?}");
    assert!(four.hit_rate >= 0.96 * one.hit_rate, "{four:?} vs {one:?}");
    assert!(four.session_moves < 0.12, "{four:?}");
    assert!(
        four.ttft_mean_ms <= 1.05 * one.ttft_mean_ms,
        "{four:?} vs {one:?}"
    );
    assert!(
        four.ttft_p99_ms <= 1.05 * one.ttft_p99_ms,
        "{four:?} vs {one:?}"
    );
}

/// The imitations the simulator compares kvroute with decide as the real routers did:
/// one round of each real router on the agentic sessions and one on the Mooncake trace,
/// recorded live by `kvroute-bench peers --dump` (`tests/data/peers/`, the chains left
/// out and filled in from the shipped traces), are replayed through the simulator's own
/// `sglang` and `vllm-router` selectors with each pod's requests in flight at the moment
/// the real router chose. A change to either imitation that stops it deciding as its
/// router does fails here.
#[test]
fn the_imitations_decide_as_the_real_routers_did() {
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/peers");
    // (workload, recording, gateway, the share of decisions agreed up to ties, the
    // fewest decisions of each branch). On the Mooncake trace vLLM's router sends about
    // one new prompt in fifteen to a pod with one more request in flight than the
    // fewest, as the client saw them; shifting when requests end does not explain it
    // (docs/benchmarks.md), so its floor there is 95%.
    let runs = [
        (
            "agentic",
            "agentic-smg-1.13.0.jsonl",
            "smg cache_aware",
            0.99,
            1000,
            50,
        ),
        (
            "agentic",
            "agentic-vllm-router-0.1.17.jsonl",
            "vllm-router cache_aware",
            0.99,
            1000,
            50,
        ),
        (
            "mooncake",
            "mooncake-smg-1.13.0.jsonl.gz",
            "smg cache_aware",
            0.99,
            1500,
            1500,
        ),
        (
            "mooncake",
            "mooncake-vllm-router-0.1.17.jsonl.gz",
            "vllm-router cache_aware",
            0.95,
            1500,
            1500,
        ),
    ];
    let mut traces = std::collections::HashMap::new();
    for (workload, file, gateway, floor, matched, new) in runs {
        let reqs = traces.entry(workload).or_insert_with(|| {
            kvroute_tests::bench::peers::trace_requests(
                workload,
                &kvroute_tests::bench::peers::Opts::default(),
            )
            .expect("the trace as peers replays it")
        });
        let raw = std::fs::read(data.join(file)).expect("a recorded run");
        let text = if file.ends_with(".gz") {
            let mut out = String::new();
            std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&raw[..]), &mut out)
                .expect("gzip");
            out
        } else {
            String::from_utf8(raw).expect("utf-8")
        };
        let mut rows: Vec<sim::Dumped> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("a dump line"))
            .collect();
        sim::with_chains(&mut rows, reqs).expect("chains");
        let runs = sim::replay_dump(&rows);
        assert_eq!(runs.len(), 1, "{file}");
        let (g, _, a) = &runs[0];
        assert_eq!(g, gateway);
        assert_eq!(a.decisions, reqs.len() as u64, "{file}: {a:?}");
        // Up to ties: which of equally loaded pods a router takes is not its policy.
        // The client's view of what was in flight is a few requests off at most.
        assert!(
            a.within_ties as f64 >= floor * a.decisions as f64,
            "{gateway}'s imitation agrees with it on {} of {} decisions ({file}): {a:?}",
            a.within_ties,
            a.decisions
        );
        // Both branches of the rule were exercised: prompts it had routed, and new ones.
        assert!(
            a.by_case.get("match").is_some_and(|m| m.0 > matched)
                && a.by_case.get("new").is_some_and(|n| n.0 > new),
            "{file}: {a:?}"
        );
    }
}
