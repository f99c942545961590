//! `kvroute-bench route`: route decisions per second against the real sidecar binary,
//! over its Unix socket (the filter's path) and over TCP, with concurrent clients on
//! keep-alive connections; then p50/p99 latency at half the measured rate. 16 pods, a
//! preloaded index, 128-block chains. Client and sidecar share the machine's two cores,
//! as a gateway and its sidecar do. Then, in process, what admission adds to a route
//! below saturation.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use kvroute_shared::protocol::{RouteRequest, Tier};
use serde_json::json;

use super::{Rng, Samples};
use crate::client::{batch, chain, Api};
use crate::services::SidecarProc;

pub struct Opts {
    pub clients: usize,
    pub seconds: f64,
    pub chain_blocks: usize,
    pub pods: usize,
}

enum Target {
    Uds(std::path::PathBuf),
    Tcp(std::net::SocketAddr),
}

async fn conn(t: &Target) -> anyhow::Result<SendRequest<Full<Bytes>>> {
    match t {
        Target::Uds(p) => {
            let s = tokio::net::UnixStream::connect(p).await?;
            let (sender, c) = hyper::client::conn::http1::handshake(TokioIo::new(s)).await?;
            tokio::spawn(async move {
                let _ = c.await;
            });
            Ok(sender)
        }
        Target::Tcp(a) => {
            let s = tokio::net::TcpStream::connect(a).await?;
            s.set_nodelay(true)?;
            let (sender, c) = hyper::client::conn::http1::handshake(TokioIo::new(s)).await?;
            tokio::spawn(async move {
                let _ = c.await;
            });
            Ok(sender)
        }
    }
}

async fn one(s: &mut SendRequest<Full<Bytes>>, host: &str, body: Bytes) -> anyhow::Result<u16> {
    let req = hyper::Request::post("/v1/route")
        .header("host", host)
        .header("content-type", "application/json")
        .body(Full::new(body))?;
    let resp = s.send_request(req).await?;
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await?;
    Ok(status)
}

/// Run `clients` loops for `dur`; each paced to `rate_per_client` if given. Returns
/// (requests completed, latency samples, errors).
async fn drive(
    t: Arc<Target>,
    bodies: Arc<Vec<Bytes>>,
    clients: usize,
    dur: Duration,
    rate_per_client: Option<f64>,
) -> (u64, Samples, u64) {
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for c in 0..clients {
        let (t, bodies, done, errors, stop) = (
            t.clone(),
            bodies.clone(),
            done.clone(),
            errors.clone(),
            stop.clone(),
        );
        handles.push(tokio::spawn(async move {
            let mut samples = Samples::default();
            let Ok(mut s) = conn(&t).await else {
                errors.fetch_add(1, Ordering::Relaxed);
                return samples;
            };
            // The TCP listener refuses a Host that is not an address (DNS rebinding).
            let host = match &*t {
                Target::Uds(_) => "kvroute-sidecar".to_owned(),
                Target::Tcp(a) => a.to_string(),
            };
            let mut rng = Rng(c as u64 + 1);
            let start = Instant::now();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if let Some(r) = rate_per_client.filter(|r| *r > 0.0) {
                    let due = start + Duration::from_secs_f64(i as f64 / r);
                    tokio::time::sleep_until(due.into()).await;
                }
                let body = bodies[rng.below(bodies.len())].clone();
                let t0 = Instant::now();
                match one(&mut s, &host, body).await {
                    Ok(200) => {
                        samples.push(t0.elapsed().as_nanos() as u64);
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                i += 1;
            }
            samples
        }));
    }
    tokio::time::sleep(dur).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Samples::default();
    for h in handles {
        if let Ok(s) = h.await {
            all.0.extend(s.0);
        }
    }
    (
        done.load(Ordering::Relaxed),
        all,
        errors.load(Ordering::Relaxed),
    )
}

pub async fn run(o: &Opts) -> anyhow::Result<serde_json::Value> {
    println!(
        "kvroute-bench route: {} pods, {}-block chains, {} clients, {:.0}s per phase",
        o.pods, o.chain_blocks, o.clients, o.seconds
    );
    let sc = SidecarProc::start(&[], true)?;
    let api = Api::new(sc.addr);
    let model = "bench";
    // Preload: 2,000 prompts of `chain_blocks`, each cached on one pod (plus a shorter
    // copy on the next), published as events.
    let pods: Vec<String> = (0..o.pods)
        .map(|p| format!("10.0.0.{}:8000", p + 1))
        .collect();
    for p in &pods {
        api.register(p, model).await;
    }
    let prompts: Vec<Vec<u64>> = (0..2000)
        .map(|i| chain(model, i, o.chain_blocks, 16))
        .collect();
    for (i, c) in prompts.iter().enumerate() {
        let p = &pods[i % pods.len()];
        let q = &pods[(i + 1) % pods.len()];
        let ev = kvroute_shared::protocol::Event::Stored {
            tier: Tier::Gpu,
            parent: None,
            blocks: c.clone(),
            tokens: None,
        };
        api.events(&batch(p, model, "e", i as u64, vec![ev])).await;
        let half = kvroute_shared::protocol::Event::Stored {
            tier: Tier::Gpu,
            parent: None,
            blocks: c[..c.len() / 2].to_vec(),
            tokens: None,
        };
        api.events(&batch(q, model, "e", 10_000 + i as u64, vec![half]))
            .await;
    }
    // Mostly prompts seen before (hits), some new ones (misses).
    let bodies: Vec<Bytes> = (0..4000u32)
        .map(|i| {
            let c = if i % 4 == 3 {
                chain(model, 1_000_000 + i, o.chain_blocks, 16)
            } else {
                prompts[(i as usize * 7) % prompts.len()].clone()
            };
            let r = RouteRequest {
                request_id: Some(format!("b{i}")),
                dry_run: true,
                ..RouteRequest::tokens(model, 16, c)
            };
            Bytes::from(serde_json::to_vec(&r).unwrap_or_default())
        })
        .collect();
    let body_bytes = bodies[0].len();
    let bodies = Arc::new(bodies);
    let dur = Duration::from_secs_f64(o.seconds);
    let mut out = json!({"pods": o.pods, "chain_blocks": o.chain_blocks, "clients": o.clients, "body_bytes": body_bytes});
    let uds = sc.uds.clone().ok_or_else(|| anyhow::anyhow!("no socket"))?;
    for (name, target) in [("uds", Target::Uds(uds)), ("tcp", Target::Tcp(sc.addr))] {
        let t = Arc::new(target);
        // Warm up, then saturate.
        let _ = drive(
            t.clone(),
            bodies.clone(),
            o.clients,
            Duration::from_millis(300),
            None,
        )
        .await;
        let (n, mut sat, errs) = drive(t.clone(), bodies.clone(), o.clients, dur, None).await;
        let rate = n as f64 / o.seconds;
        let half = rate / 2.0;
        let (hn, mut lat, herrs) = drive(
            t.clone(),
            bodies.clone(),
            o.clients,
            dur,
            Some(half / o.clients as f64),
        )
        .await;
        let (p50, p99) = (lat.pct(50.0), lat.pct(99.0));
        println!(
            "  {name}: {:>8.0} decisions/s saturated (p99 {} us); at half load ({:.0}/s achieved): p50 {} us, p99 {} us; errors {}",
            rate,
            sat.pct(99.0) / 1000,
            hn as f64 / o.seconds,
            p50 / 1000,
            p99 / 1000,
            errs + herrs
        );
        out[format!("{name}_decisions_per_s")] = json!(rate);
        out[format!("{name}_half_load_p50_us")] = json!(p50 as f64 / 1e3);
        out[format!("{name}_half_load_p99_us")] = json!(p99 as f64 / 1e3);
        out[format!("{name}_errors")] = json!(errs + herrs);
    }
    // Cost of decoding a long chain as JSON (the case for a binary body).
    let long = RouteRequest::tokens(model, 16, chain(model, 7, 8192, 16));
    let long_json = serde_json::to_vec(&long)?;
    let mut dec = Samples::default();
    for _ in 0..200 {
        let r = dec.time(|| serde_json::from_slice::<RouteRequest>(&long_json));
        std::hint::black_box(r.ok());
    }
    let short_json = &bodies[0];
    let mut dec_s = Samples::default();
    for _ in 0..2000 {
        let r = dec_s.time(|| serde_json::from_slice::<RouteRequest>(short_json));
        std::hint::black_box(r.ok());
    }
    println!(
        "  JSON decode: {}-block chain {:.1} us; 8192-block chain (128k tokens) {:.1} us",
        o.chain_blocks,
        dec_s.pct(50.0) as f64 / 1e3,
        dec.pct(50.0) as f64 / 1e3
    );
    out["json_decode_chain_us"] = json!(dec_s.pct(50.0) as f64 / 1e3);
    out["json_decode_8k_chain_us"] = json!(dec.pct(50.0) as f64 / 1e3);
    drop(sc);
    admission_cost(o, &prompts, &mut out)?;
    precise(o, dur, &mut out).await?;
    Ok(out)
}

/// What admission adds to a route below saturation, in process: the same requests
/// routed (and reported) by a sidecar without admission and by one with it on (the
/// queue check, the gate over the candidates), interleaved request by request so both
/// see the same machine.
fn admission_cost(
    o: &Opts,
    prompts: &[Vec<u64>],
    out: &mut serde_json::Value,
) -> anyhow::Result<()> {
    use kvroute_shared::protocol::{
        AdmissionConfig, CompletionReport, PodRegistration, PolicyConfig,
    };
    let plain = PolicyConfig::default();
    let gated = PolicyConfig {
        admission: AdmissionConfig {
            enabled: true,
            max_backlog_s: 3600.0,
            max_inflight: 1 << 20,
            ..AdmissionConfig::default()
        },
        ..PolicyConfig::default()
    };
    let mut sides = Vec::new();
    for cfg in [plain, gated] {
        let (sc, ch) = kvroute_sidecar::Sidecar::new(cfg).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let rec = kvroute_sidecar::Recovery::default();
        for p in 0..o.pods {
            let pod = format!("10.0.0.{}:8000", p + 1);
            let reg: PodRegistration = serde_json::from_value(json!({"model": "bench"}))?;
            sc.register(&pod, reg).map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        for (i, c) in prompts.iter().enumerate() {
            let pod = format!("10.0.0.{}:8000", i % o.pods + 1);
            let ev = kvroute_shared::protocol::Event::Stored {
                tier: Tier::Gpu,
                parent: None,
                blocks: c.clone(),
                tokens: None,
            };
            let b = batch(&pod, "bench", "e", (i / o.pods) as u64 + 1, vec![ev]);
            kvroute_sidecar::ingest_at(&sc, &rec, &b, Instant::now())
                .map_err(|e| anyhow::anyhow!("admission bench: events refused: {e:?}"))?;
        }
        sides.push((sc, ch));
    }
    let mut times = [Samples::default(), Samples::default()];
    for i in 0..20_000usize {
        let req = RouteRequest::tokens("bench", 16, prompts[(i * 7) % prompts.len()].clone());
        // Alternate which goes first, so neither always finds the caches warm.
        for k in [i % 2, 1 - i % 2] {
            let sc = &sides[k].0;
            let t = Instant::now();
            let answer = if k == 0 {
                match kvroute_sidecar::route_until(sc, &req, None) {
                    Ok(r) => Some(r),
                    Err(e) => anyhow::bail!("admission bench: not routed: {e}"),
                }
            } else {
                match sc.waiting.admit(sc, req.clone(), None, Instant::now()) {
                    Ok(kvroute_sidecar::admission::Admitted::Routed(r)) => Some(r),
                    other => anyhow::bail!("admission bench: not routed at once: {other:?}"),
                }
            };
            times[k].push(t.elapsed().as_nanos() as u64);
            let Some(a) = answer else {
                anyhow::bail!("admission bench: a route was not answered at once");
            };
            kvroute_sidecar::report(
                sc,
                &CompletionReport {
                    decision: a.decision.unwrap_or_default(),
                    pod: a.pod,
                    status: 200,
                    ..Default::default()
                },
            );
        }
    }
    let [mut off, mut on] = times;
    let (off50, on50) = (off.pct(50.0), on.pct(50.0));
    let ratio = on50 as f64 / off50.max(1) as f64;
    println!(
        "  admission on, unsaturated (in process, interleaved): route p50 {:.1} us vs {:.1} us off ({:.3}x); p99 {:.1} vs {:.1} us",
        on50 as f64 / 1e3,
        off50 as f64 / 1e3,
        ratio,
        on.pct(99.0) as f64 / 1e3,
        off.pct(99.0) as f64 / 1e3
    );
    out["admission_route_p50_ratio"] = json!(ratio);
    Ok(())
}

/// The same over the socket for chat requests the sidecar tokenizes (`--tokenizer`,
/// DeepSeek's tokenizer with the tools template): 8 conversations of ~8 KB history, each
/// request a new last question (the history comes from the segment cache).
async fn precise(o: &Opts, dur: Duration, out: &mut serde_json::Value) -> anyhow::Result<()> {
    let dir = crate::fixture_model_dir("deepseek-tools")?;
    let spec = format!("--tokenizer=bench={}", dir.display());
    let sc = SidecarProc::start(&[spec.as_str()], true)?;
    let api = Api::new(sc.addr);
    for p in 0..o.pods {
        api.register(&format!("10.0.0.{}:8000", p + 1), "bench")
            .await;
    }
    let mut rng = Rng(5);
    let words = [
        "cache",
        "router",
        "prefix",
        "東京",
        "latency",
        "block",
        "pod",
        "🙂",
        "fn x() {}",
    ];
    let mut text = |n: usize| {
        (0..n)
            .map(|_| words[rng.below(words.len())])
            .collect::<Vec<_>>()
            .join(" ")
    };
    let histories: Vec<Vec<serde_json::Value>> = (0..8)
        .map(|_| {
            let mut h = vec![json!({"role": "system", "content": text(300)})];
            for _ in 0..4 {
                h.push(json!({"role": "user", "content": text(60)}));
                h.push(json!({"role": "assistant", "content": text(120)}));
            }
            h
        })
        .collect();
    let bodies: Vec<Bytes> = (0..400)
        .map(|i| {
            let mut msgs = histories[i % histories.len()].clone();
            msgs.push(json!({"role": "user", "content": text(40)}));
            let r = crate::client::chat_route_req(
                "bench",
                &json!({"model": "bench", "messages": msgs}),
            );
            Bytes::from(serde_json::to_vec(&r).unwrap_or_default())
        })
        .collect();
    let uds = sc.uds.clone().ok_or_else(|| anyhow::anyhow!("no socket"))?;
    let t = Arc::new(Target::Uds(uds));
    let bodies = Arc::new(bodies);
    let _ = drive(
        t.clone(),
        bodies.clone(),
        o.clients,
        Duration::from_millis(500),
        None,
    )
    .await;
    let (n, mut sat, errs) = drive(t, bodies, o.clients, dur, None).await;
    let rate = n as f64 / o.seconds;
    let tokenized = api
        .metric("kvroute_precise_prompts_total{outcome=\"tokens\"}")
        .await;
    println!(
        "  uds, chat tokenized by the sidecar (~8 KB conversations, new last question): {rate:>8.0} decisions/s saturated (p99 {} us); errors {errs}; {tokenized} prompts tokenized",
        sat.pct(99.0) / 1000
    );
    out["uds_precise_decisions_per_s"] = json!(rate);
    out["uds_precise_p99_us"] = json!(sat.pct(99.0) as f64 / 1e3);
    out["uds_precise_errors"] = json!(errs);
    Ok(())
}
