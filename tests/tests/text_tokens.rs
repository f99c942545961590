//! Predicted mode on engines whose caches are full, run after run: chat without a
//! tokenizer is routed by text chains, and the engines (o200k, ChatML) report tokens.
//! Prose tokenizes at ~4.8 bytes a token, code, numbers and CJK at others; the router
//! must learn that from the reports instead of assuming four, or every held prompt reads
//! as an eviction and its picture of the caches decays run after run (at four bytes a
//! token assumed: 58-80% of prose decisions mispredicted, hit rate 0.80 then 0.72).

use kvroute_tests::demo::{ChatLoad, TextKind};
use kvroute_tests::stack::{Stack, StackOpts};
use kvroute_tests::steady;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predicted_mode_keeps_its_hits_run_after_run_at_every_bytes_per_token() {
    let capacity = 1024;
    let stack = Stack::start(StackOpts {
        engine_args: kvroute_tests::stack::engine_args(capacity, 8000, 10, 0.5),
        ..StackOpts::default()
    })
    .await
    .expect("stack");
    let engines: Vec<_> = stack.engines.iter().map(|e| e.addr).collect();
    steady::fill_caches(&engines, capacity, 16, 1.5)
        .await
        .expect("caches filled");
    let base = stack.envoy.url("");
    for (kinds, label) in [
        (&[TextKind::Prose][..], "prose"),
        (&TextKind::ALL[..], "prose, code, numbers, CJK"),
    ] {
        let load = ChatLoad {
            users: 12,
            turns: 4,
            kinds,
            seed: 11,
            ..ChatLoad::default()
        };
        let runs = steady::runs(&base, Some(&stack.api), load, 2, 6).await;
        for (i, r) in runs.iter().enumerate() {
            let (d, m) = (
                r.decisions.expect("decisions"),
                r.mispredictions.expect("mispredictions"),
            );
            eprintln!("{label}, run {}: {}", i + 1, r.json());
            assert_eq!(r.summary.failed, 0, "{label}");
            assert!(d >= 48, "{label}: {d} decisions");
            assert!(
                m * 10 <= d,
                "{label}, run {}: {m} of {d} decisions mispredicted",
                i + 1
            );
            assert!(
                r.summary.hit_rate >= 0.75,
                "{label}, run {}: hit rate {:.3}",
                i + 1,
                r.summary.hit_rate
            );
        }
        // 48 requests under a live, concurrent load move the hit rate by a few points
        // from run to run on a 2-core machine (0.806 then 0.776 seen with no
        // mispredictions); the decay this guards against was 0.08 a run and came with
        // most decisions mispredicted, which the bound above already refuses.
        assert!(
            runs[1].summary.hit_rate >= runs[0].summary.hit_rate - 0.05,
            "{label}: the second run lost hits ({:.3} -> {:.3})",
            runs[0].summary.hit_rate,
            runs[1].summary.hit_rate
        );
    }
    // What it learned, as the status page shows it.
    let status = stack.api.get("/v1/status").await.json;
    let m = status["models"]
        .as_array()
        .and_then(|ms| ms.iter().find(|m| m["model"] == "m"))
        .expect("model m");
    let t = &m["text_tokens"];
    assert_eq!(t["learned"], true, "{t}");
    let bytes_per_token = 1.0 / t["tokens_per_byte"].as_f64().unwrap_or(1.0);
    assert!(
        (1.2..4.5).contains(&bytes_per_token),
        "mixed text at {bytes_per_token:.2} bytes a token: {t}"
    );
}
