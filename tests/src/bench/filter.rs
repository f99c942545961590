//! `kvroute-bench filter`: what the filter and the sidecar add to a request, measured in
//! one run against the same upstream — plain Envoy vs Envoy + filter + sidecar (Unix
//! socket), and vs Envoy + the sidecar's endpoint picker (ext_proc over gRPC, buffered
//! and full-duplex) — for a 4 KB and a 256 KB prompt, requests alternating between them
//! so drift hits all alike; and the filter's own time inside v8 (parse + canonicalize +
//! chain) for a 128k-token prompt, read from its debug header.
//!
//! Partial set-ups in the same run split the added time: the filter loaded but not
//! matching, the body parsed without a callout, a callout to an endpoint that answers at
//! once (`null-callout`: the floor any out-of-process decision pays in this Envoy), and
//! no reports. Envoy's and the sidecar's CPU per request come from the scheduler's
//! accounting, since on a shared 2-core machine CPU, not idle waiting, sets the latency.

use std::time::Instant;

use serde_json::json;

use super::Samples;
use crate::client::Api;
use crate::envoy::{Envoy, EnvoyLayout, Fallback, PickerLayout, SidecarAddr};
use crate::services::SidecarProc;
use crate::stub::StubPod;

pub struct Opts {
    pub requests: usize,
}

pub async fn run(o: &Opts) -> anyhow::Result<serde_json::Value> {
    let wasm = crate::wasm_path();
    anyhow::ensure!(wasm.exists(), "build the filter first: make wasm");
    let wasm_bytes = std::fs::metadata(&wasm)?.len();
    let pod = StubPod::start("a").await?;
    let sc = SidecarProc::start(&["--picker-listen", "127.0.0.1:0"], true)?;
    let picker = sc
        .picker_addr()
        .ok_or_else(|| anyhow::anyhow!("the sidecar's picker did not start"))?;
    let api = Api::new(sc.addr);
    api.register(&pod.addr.to_string(), "m").await;
    let base = json!({"timeout_ms": 100, "default_model": {"block_size": 16}, "debug_headers": true,
                      "max_body_bytes": 16 << 20});
    let with = |patch: serde_json::Value| {
        let mut c = base.clone();
        for (k, v) in patch.as_object().into_iter().flatten() {
            c[k] = v.clone();
        }
        Some(c)
    };
    // Besides plain and full, three partial set-ups show where the added time goes: the
    // filter loaded but not matching the path, the body buffered and chained without a
    // callout, and the callout without the completion report.
    let variants: Vec<(&str, Option<serde_json::Value>)> = vec![
        ("plain", None),
        (
            "wasm-nomatch",
            with(json!({"paths": ["/v1/chat/completions"]})),
        ),
        (
            "body-only",
            with(json!({"default_model": {"block_size": 16, "route_text": false}})),
        ),
        (
            "null-callout",
            with(json!({"report": false, "route_path": "/healthz"})),
        ),
        ("no-report", with(json!({"report": false}))),
        ("kvroute", with(json!({}))),
    ];
    let mut envoys = Vec::new();
    for (name, cfg) in &variants {
        let layout = EnvoyLayout {
            listen_port: 0,
            sidecar: SidecarAddr::Uds(sc.uds.clone().unwrap_or_default()),
            engines: vec![pod.addr],
            wasm_path: wasm.clone(),
            filter_config: cfg.clone().unwrap_or_default(),
            with_filter: cfg.is_some(),
            fallback: Fallback::RoundRobin,
            access_log: false,
        };
        let e = tokio::task::spawn_blocking(move || Envoy::start(&layout)).await??;
        envoys.push((*name, e));
    }
    // The other front door, the endpoint picker (ext_proc), as shipped (buffered requests,
    // streamed responses) and in GIE's full-duplex mode; the wasm path stays last.
    let wasm_kv = envoys.pop();
    for (name, req_mode, resp_mode) in [
        ("picker", "BUFFERED", "STREAMED"),
        (
            "picker-full-duplex",
            "FULL_DUPLEX_STREAMED",
            "FULL_DUPLEX_STREAMED",
        ),
    ] {
        let layout = PickerLayout {
            listen_port: 0,
            pickers: vec![picker],
            engines: vec![pod.addr],
            request_body_mode: req_mode,
            response_body_mode: resp_mode,
            subset: None,
            message_timeout_ms: 200,
            access_log: false,
        };
        let e = tokio::task::spawn_blocking(move || Envoy::start_picker(&layout)).await??;
        envoys.push((name, e));
    }
    envoys.extend(wasm_kv);
    // Set-ups whose requests reach the sidecar (its CPU is shared among them).
    let via_sidecar = envoys
        .iter()
        .filter(|(n, _)| {
            matches!(*n, "null-callout" | "no-report" | "kvroute") || n.starts_with("picker")
        })
        .count();
    let kv = &envoys[envoys.len() - 1].1;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(4)
        .build()?;
    println!("kvroute-bench filter: plain Envoy vs Envoy + kvroute filter + sidecar (UDS), same upstream; wasm {wasm_bytes} bytes");
    let mut out = json!({"wasm_bytes": wasm_bytes});
    for (label, bytes, n) in [
        ("4k", 4 << 10, o.requests),
        ("256k", 256 << 10, (o.requests / 5).max(50)),
    ] {
        let text: String = "The quick brown fox jumps over the lazy dog. ".repeat(bytes / 45 + 1)
            [..bytes]
            .to_string();
        let body = serde_json::to_vec(&json!({"model": "m", "prompt": text, "max_tokens": 1}))?;
        let mut samples: Vec<Samples> = envoys.iter().map(|_| Samples::default()).collect();
        let mut callout = Samples::default();
        let cpu0: Vec<u64> = envoys.iter().map(|(_, e)| cpu_ns(e.child.pid())).collect();
        let sc0 = cpu_ns(sc.pid());
        for i in 0..n + 20 {
            for (k, (_, e)) in envoys.iter().enumerate() {
                let t = Instant::now();
                let r = http
                    .post(e.url("/v1/completions"))
                    .body(body.clone())
                    .send()
                    .await?;
                anyhow::ensure!(r.status().is_success(), "status {}", r.status());
                let c: Option<u64> = r
                    .headers()
                    .get("x-kvroute-callout-us")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok());
                let _ = r.bytes().await?;
                if i >= 20 {
                    samples[k].push(t.elapsed().as_nanos() as u64);
                    if k == envoys.len() - 1 {
                        if let Some(c) = c {
                            callout.push(c);
                        }
                    }
                }
            }
        }
        let cpu: Vec<String> = envoys
            .iter()
            .zip(&cpu0)
            .map(|((name, e), c0)| {
                format!(
                    "{name} {:.0}",
                    cpu_ns(e.child.pid()).saturating_sub(*c0) as f64 / 1e3 / (n + 20) as f64
                )
            })
            .collect();
        println!(
            "  {label:>4} prompt: Envoy CPU per request (us): {}; sidecar CPU per request {:.0} us (route + report, wasm and picker alike)",
            cpu.join(", "),
            cpu_ns(sc.pid()).saturating_sub(sc0) as f64 / 1e3 / (n + 20) as f64 / via_sidecar as f64
        );
        let p50s: Vec<u64> = samples.iter_mut().map(|s| s.pct(50.0)).collect();
        for ((name, _), p) in envoys.iter().zip(&p50s).skip(1) {
            out[format!("added_p50_us_{label}_{}", name.replace('-', "_"))] =
                json!(p.saturating_sub(p50s[0]) as f64 / 1e3);
        }
        let parts: Vec<String> = envoys
            .iter()
            .zip(&p50s)
            .skip(1)
            .map(|((name, _), p)| format!("{name} +{:.0}", p.saturating_sub(p50s[0]) as f64 / 1e3))
            .collect();
        println!(
            "  {label:>4} prompt: added p50 by set-up (us): {}; callout as the filter sees it p50 {} us",
            parts.join(", "),
            callout.pct(50.0)
        );
        out[format!("callout_p50_us_{label}")] = json!(callout.pct(50.0));
        // The two front doors side by side: what each adds over plain Envoy.
        let (plain50, plain99) = (samples[0].pct(50.0), samples[0].pct(99.0));
        for (k, (name, _)) in envoys.iter().enumerate() {
            if !(name.starts_with("picker") || *name == "kvroute") {
                continue;
            }
            let (p50, p99) = (samples[k].pct(50.0), samples[k].pct(99.0));
            let key = if *name == "kvroute" {
                "wasm"
            } else {
                &name.replace('-', "_")
            };
            println!(
                "  {label:>4} prompt: {:<20} added p50 {:>5.0} us, p99 {:>6.0} us",
                if *name == "kvroute" {
                    "wasm filter"
                } else {
                    name
                },
                p50.saturating_sub(plain50) as f64 / 1e3,
                p99.saturating_sub(plain99) as f64 / 1e3,
            );
            out[format!("front_{key}_added_p99_us_{label}")] =
                json!(p99.saturating_sub(plain99) as f64 / 1e3);
        }
        let last = samples.len() - 1;
        let (a, b) = samples.split_at_mut(last);
        let (a, b) = (&mut a[0], &mut b[0]);
        let (a50, a99, b50, b99) = (a.pct(50.0), a.pct(99.0), b.pct(50.0), b.pct(99.0));
        let added50 = b50.saturating_sub(a50) as f64 / 1e3;
        let added99 = b99.saturating_sub(a99) as f64 / 1e3;
        println!(
            "  {label:>4} prompt: plain p50 {:.0} us p99 {:.0} us; with kvroute p50 {:.0} us p99 {:.0} us; added p50 {added50:.0} us, p99 {added99:.0} us",
            a50 as f64 / 1e3,
            a99 as f64 / 1e3,
            b50 as f64 / 1e3,
            b99 as f64 / 1e3
        );
        out[format!("plain_p50_us_{label}")] = json!(a50 as f64 / 1e3);
        out[format!("kvroute_p50_us_{label}")] = json!(b50 as f64 / 1e3);
        out[format!("added_p50_us_{label}")] = json!(added50);
        out[format!("added_p99_us_{label}")] = json!(added99);
    }
    // Where the added time goes: the callout round trip as the filter sees it, and the
    // sidecar's own route time.
    let stats = crate::envoy::http_get(&format!(
        "http://{}/stats?filter=kvroute_callout_us",
        kv.admin
    ))
    .unwrap_or_default();
    let callout = stats
        .lines()
        .find(|l| l.contains("kvroute_callout_us:"))
        .unwrap_or("")
        .trim()
        .to_string();
    println!("  callout histogram (us): {callout}");
    let cx = crate::envoy::http_get(&format!(
        "http://{}/stats?filter=kvroute_sidecar.upstream_(cx_total|rq_total|cx_destroy.*)",
        kv.admin
    ))
    .unwrap_or_default();
    println!(
        "  sidecar cluster: {}",
        cx.split_whitespace().collect::<Vec<_>>().join(" ")
    );
    let route_sum = api.metric("kvroute_route_seconds_sum").await;
    let route_n = api.metric("kvroute_route_seconds_count").await;
    println!(
        "  sidecar route time: mean {:.1} us over {route_n} decisions",
        route_sum / route_n.max(1.0) * 1e6
    );
    out["sidecar_route_mean_us"] = json!(route_sum / route_n.max(1.0) * 1e6);
    // The filter's own work for a 128k-token prompt (token ids: ~700 KB of JSON).
    let toks: Vec<u32> = (0..131_072u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 200_000)
        .collect();
    let body = serde_json::to_vec(&json!({"model": "m", "prompt": toks, "max_tokens": 1}))?;
    let (mut prep, mut parse, mut hash) =
        (Samples::default(), Samples::default(), Samples::default());
    let us = |r: &reqwest::Response, name: &str| -> Option<u64> {
        r.headers().get(name)?.to_str().ok()?.parse().ok()
    };
    for _ in 0..60 {
        let r = http
            .post(kv.url("/v1/completions"))
            .body(body.clone())
            .send()
            .await?;
        if let (Some(all), Some(p)) = (us(&r, "x-kvroute-prepare-us"), us(&r, "x-kvroute-parse-us"))
        {
            prep.push(all);
            parse.push(p);
            hash.push(all.saturating_sub(p));
        }
        let _ = r.bytes().await?;
    }
    let chain_us = prep.pct(50.0);
    println!(
        "  filter time in v8 for a 128k-token prompt ({} KB JSON): parse + chain p50 {chain_us} us, min {} us, p90 {} us; of which parse p50 {} us, chain (8,192 xxh3 blocks) + route body p50 {} us",
        body.len() >> 10,
        prep.pct(0.0),
        prep.pct(90.0),
        parse.pct(50.0),
        hash.pct(50.0),
    );
    out["chain_128k_tokens_us"] = json!(chain_us);
    out["parse_128k_tokens_us"] = json!(parse.pct(50.0));
    out["hash_128k_tokens_us"] = json!(hash.pct(50.0));
    out["prompt_128k_json_bytes"] = json!(body.len());
    Ok(out)
}

/// CPU time (ns) of all threads of a process, from the scheduler's own accounting.
fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}
