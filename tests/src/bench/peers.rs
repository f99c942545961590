//! `kvroute-bench peers`: kvroute beside the real routers, in one run, on the same engines.
//!
//! One stack (NATS, sidecar, 4 engine simulators publishing vLLM's ZMQ events with a
//! `kvroute-bridge` beside each, tokenizing with a real model directory) and every
//! gateway over those engines: round-robin Envoy, kvroute precise and predicted (Envoy +
//! filter + the one sidecar), and the peers of [`crate::peers`] as shipped; when named,
//! also kvroute behind two gateway replicas ([`crate::stack::Stack::replica`], requests
//! spread over them one by one). Each workload runs through every gateway in turn,
//! `rounds` times with the order rotated, every run with fresh prefixes on engines whose
//! caches are full of other runs' blocks, so each router meets the steady state and the
//! machine's noise touches all alike.
//!
//! Workloads: `chat` (multi-turn chat over shared long system prompts, closed loop),
//! `mooncake` (the public Mooncake trace, on its clock) and `agentic` (the Claude Code
//! sessions, on theirs); trace blocks become text (a 512-token block → `--block-text`
//! tokens of prose derived from its id), so every router sees the prompts users send.
//! Hit rate is what the engines report (`cached_tokens`); the routers' own cost is
//! measured apart, on 4 KB prompts every engine already caches, against the same
//! requests sent straight to an engine.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::bench::{Rng, Samples};
use crate::demo::{self, Call, ChatLoad, Summary, TextKind, Timed};
use crate::envoy::{Envoy, EnvoyLayout, Fallback, SidecarAddr};
use crate::peers::{Kind, Peer};
use crate::stack::{Stack, StackOpts};
use crate::workload::{self, AgenticOpts};

/// The engines' prefill rate, tokens per simulated second.
const PREFILL_TPS: u32 = 8000;

#[derive(Clone, Debug)]
pub struct Opts {
    /// chat | mooncake | agentic, in order.
    pub workloads: Vec<String>,
    /// Gateways by label (`kvroute precise`, `smg cache_aware`, ...); empty: all.
    pub gateways: Vec<String>,
    pub rounds: usize,
    /// Engine KV cache, 16-token blocks (4096: 1,024 of a trace's 512-token blocks at the
    /// default `block_text` of 64 tokens, the capacity Dynamo's replay is quoted at).
    pub capacity_blocks: u32,
    /// Trace seconds replayed (from the start of the trace, or of the sessions); by
    /// default the whole Mooncake trace (its reuse builds over all of it: 9% of its blocks
    /// repeat in the first 150 s, 64% over the whole) and the sessions' first 900 s.
    pub trace_seconds: Option<f64>,
    /// Time compression of everything: traces arrive `speedup` times faster and the
    /// engines run as fast (their `--time-scale` is its inverse), so a run keeps the
    /// trace's load in less wall time; times reported are wall time.
    pub speedup: f64,
    /// Tokens of text a trace's 512-token block becomes.
    pub block_text: u32,
    pub chat_users: usize,
    /// Requests per gateway in the overhead measurement.
    pub overhead_requests: usize,
    /// Settings merged into the sidecar's policy config (after the prefill rate).
    pub policy: serde_json::Map<String, Value>,
    /// A directory for every trace request's outcome ([`dump_outcomes`]).
    pub dump: Option<std::path::PathBuf>,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            workloads: vec!["chat".into(), "mooncake".into(), "agentic".into()],
            gateways: vec![],
            rounds: 1,
            capacity_blocks: 4096,
            trace_seconds: None,
            speedup: 8.0,
            block_text: 64,
            chat_users: 24,
            overhead_requests: 200,
            policy: serde_json::Map::new(),
            dump: None,
        }
    }
}

/// A gateway under test: where to send requests (several replicas: each request to the
/// next) and which processes are its cost.
struct Gateway {
    label: String,
    bases: Vec<String>,
    pids: Vec<u32>,
}

/// The gateway of two kvroute replicas sharing NATS over the same engines.
const REPLICAS: &str = "kvroute precise 2 replicas";

/// CPU seconds (user + system) of a process so far.
fn cpu_s(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at ") ".
    let rest = stat.rsplit_once(") ").map_or("", |r| r.1);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after ") ".
    (ticks(11) + ticks(12)) / 100.0
}

fn cpu_of(pids: &[u32]) -> f64 {
    pids.iter().map(|&p| cpu_s(p)).sum()
}

fn rss_mib(pids: &[u32]) -> f64 {
    pids.iter()
        .map(|&p| crate::procs::status_kib(p, "VmRSS:") as f64 / 1024.0)
        .sum()
}

/// Prose standing for one trace block: the same id (in the same run) gives the same text.
fn block_text(id: u64, salt: u64, tokens: u32) -> String {
    let mut rng = Rng(id ^ salt.rotate_left(17) ^ 0x5EED);
    // o200k reads this prose at ~4.5 bytes a token; a newline ends every block, so no
    // token spans two blocks.
    let mut t = TextKind::Prose.text(&mut rng, (tokens as usize * 9) / 2);
    t.push('\n');
    t
}

/// The requests of a trace replayed for its first `seconds`, in order.
fn replayed(reqs: &[workload::Request], seconds: f64) -> impl Iterator<Item = &workload::Request> {
    reqs.iter().filter(move |r| r.ts_ms <= seconds * 1000.0)
}

/// A trace's requests as timed text completions.
fn timed(reqs: &[workload::Request], seconds: f64, salt: u64, o: &Opts) -> Vec<Timed> {
    replayed(reqs, seconds)
        .map(|r| {
            let prompt: String = r
                .chain
                .iter()
                .map(|&b| block_text(b, salt, o.block_text))
                .collect();
            let scale = o.block_text as f64 / workload::MOONCAKE_BLOCK_TOKENS as f64;
            let max_tokens = ((r.output_tokens as f64 * scale).round() as u64).clamp(1, 64);
            let mut body = json!({"model": "m", "prompt": prompt,
                "max_tokens": max_tokens, "stream": true,
                "stream_options": {"include_usage": true}});
            // A session's requests carry its id, as agent clients send one (OpenAI's
            // `user`; Claude Code's session header): a router may use it, the peers
            // ignore it. Salted like the text, so no run sees another's sessions.
            if let Some(s) = r.session {
                body["user"] = json!(format!("session-{:x}", s ^ salt.rotate_left(29)));
            }
            Timed {
                at: Duration::from_secs_f64(r.ts_ms / 1000.0 / o.speedup),
                session: r.session,
                call: Call::Completion(body),
            }
        })
        .collect()
}

/// One workload, ready to run with a seed (fresh prefixes per seed).
enum Load {
    Chat(ChatLoad),
    /// A trace and the seconds of it replayed.
    Trace(Vec<workload::Request>, f64),
}

impl Load {
    async fn run(&self, bases: &[String], seed: u64, o: &Opts) -> Vec<demo::Outcome> {
        match self {
            Load::Chat(c) => {
                let s = demo::chat_load(ChatLoad { seed, ..*c });
                demo::run_via(bases, &s, 8, |_, _| {}).await
            }
            Load::Trace(reqs, secs) => {
                demo::run_timed_via(bases, &timed(reqs, *secs, seed, o), 64).await
            }
        }
    }

    /// The trace requests, in the order [`Load::run`] returns their outcomes (none for
    /// the chat load).
    fn requests(&self) -> Vec<&workload::Request> {
        match self {
            Load::Chat(_) => vec![],
            Load::Trace(reqs, secs) => replayed(reqs, *secs).collect(),
        }
    }

    /// Each request's session, in the order [`Load::run`] returns their outcomes (none
    /// for the chat load, whose users are not sessions of the traces).
    fn sessions(&self) -> Vec<Option<u64>> {
        self.requests().iter().map(|r| r.session).collect()
    }
}

/// Appends one JSON line per trace request to `<dir>/<workload>.jsonl`: the gateway and
/// round, the request's session and trace chain, when it was sent and what it got (pod,
/// hits, TTFT, end). With it a router's choices can be replayed offline against what
/// each pod had in flight at the moment it chose (how the simulator's imitations are
/// checked against the real routers).
fn dump_outcomes(
    dir: &std::path::Path,
    workload: &str,
    gateway: &str,
    round: usize,
    block_tokens: u32,
    reqs: &[&workload::Request],
    outcomes: &[demo::Outcome],
) -> anyhow::Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("{workload}.jsonl"));
    let mut f = std::io::BufWriter::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?,
    );
    let ms = |d: Duration| (d.as_secs_f64() * 1e6).round() / 1e3;
    for (i, (r, o)) in reqs.iter().zip(outcomes).enumerate() {
        let line = json!({"gateway": gateway, "round": round, "i": i, "session": r.session,
            "sent_ms": ms(o.sent), "ttft_ms": ms(o.ttft), "e2e_ms": ms(o.e2e), "ok": o.ok,
            "pod": o.pod, "prompt_tokens": o.prompt_tokens, "cached_tokens": o.cached_tokens,
            "chain": r.chain, "block_tokens": block_tokens});
        writeln!(f, "{line}")?;
    }
    f.flush()?;
    Ok(())
}

/// Of the served requests that continue a session (not its first), how many a router
/// sent to another pod than the session's previous turn: (moved, returning). Measured
/// at the client, so every router is counted alike. `outcomes` are in request order.
fn moved_turns(outcomes: &[demo::Outcome], sessions: &[Option<u64>]) -> (u64, u64) {
    let mut last: std::collections::HashMap<u64, &str> = Default::default();
    let (mut moved, mut returning) = (0, 0);
    for (o, s) in outcomes.iter().zip(sessions) {
        let (Some(s), true) = (s, o.ok) else {
            continue;
        };
        if let Some(prev) = last.insert(*s, o.pod.as_str()) {
            returning += 1;
            moved += u64::from(prev != o.pod);
        }
    }
    (moved, returning)
}

/// A trace workload's requests (`mooncake`, `agentic`) as `peers` replays them, in the
/// order of its outcomes and of `--dump`'s `i`: what a recorded run is replayed against.
pub fn trace_requests(name: &str, o: &Opts) -> anyhow::Result<Vec<workload::Request>> {
    match load(name, o)? {
        Load::Trace(reqs, secs) => Ok(replayed(&reqs, secs).cloned().collect()),
        Load::Chat(_) => anyhow::bail!("{name} is not a trace workload"),
    }
}

fn load(name: &str, o: &Opts) -> anyhow::Result<Load> {
    Ok(match name {
        "chat" => Load::Chat(ChatLoad {
            users: o.chat_users,
            ..ChatLoad::default()
        }),
        "mooncake" => Load::Trace(
            workload::load_mooncake(&workload::default_trace())?,
            o.trace_seconds.unwrap_or(f64::INFINITY),
        ),
        "agentic" => Load::Trace(
            workload::load_agentic(
                &workload::default_agentic(),
                AgenticOpts {
                    block_tokens: workload::MOONCAKE_BLOCK_TOKENS,
                    mean_gap_s: 4.0,
                    seed: 1,
                },
            )?,
            o.trace_seconds.unwrap_or(900.0),
        ),
        other => anyhow::bail!("unknown workload {other:?} (chat | mooncake | agentic)"),
    })
}

/// A gateway's figures over its runs of one workload.
struct Row {
    summary: Summary,
    cpu_s: f64,
    rss_mib: f64,
}

fn merged(runs: &[(Vec<demo::Outcome>, f64, f64)]) -> Row {
    let all: Vec<demo::Outcome> = runs.iter().flat_map(|r| r.0.iter().cloned()).collect();
    Row {
        summary: demo::summarize(&all),
        cpu_s: runs.iter().map(|r| r.1).sum(),
        rss_mib: runs.iter().map(|r| r.2).fold(0.0, f64::max),
    }
}

fn table(title: &str, rows: &[(String, Row)], engines: usize) -> String {
    let mut s = format!(
        "\n{title}\n{:<24} {:>8} {:>6} {:>9} {:>10} {:>10} {:>10} {:>10} {:>9} {:>8} {:>8}\n",
        "gateway",
        "requests",
        "failed",
        "hit rate",
        "TTFT mean",
        "TTFT p50",
        "TTFT p99",
        "E2E p50",
        "max/mean",
        "CPU s",
        "RSS MiB"
    );
    for (name, r) in rows {
        let x = &r.summary;
        s += &format!(
            "{:<24} {:>8} {:>6} {:>8.1}% {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>9.2} {:>8.1} {:>8.1}\n",
            name,
            x.requests,
            x.failed,
            x.hit_rate * 100.0,
            x.ttft_mean_ms,
            x.ttft_p50_ms,
            x.ttft_p99_ms,
            x.e2e_p50_ms,
            x.max_load_share * engines as f64,
            r.cpu_s,
            r.rss_mib
        );
    }
    s
}

fn row_json(r: &Row, engines: usize) -> Value {
    let mut v = r.summary.json();
    v["max_mean_load"] =
        json!((r.summary.max_load_share * engines as f64 * 1000.0).round() / 1000.0);
    v["cpu_s"] = json!((r.cpu_s * 100.0).round() / 100.0);
    v["rss_mib"] = json!((r.rss_mib * 10.0).round() / 10.0);
    v
}

/// Added latency of each gateway over sending the same request straight to an engine:
/// 4 KB text prompts every engine has cached, one token out, sent one at a time with
/// the gateways interleaved request by request.
async fn overhead(
    gws: &[Gateway],
    engines: &[std::net::SocketAddr],
    n: usize,
) -> anyhow::Result<Vec<(String, f64, f64)>> {
    let http = reqwest::Client::new();
    let mut rng = Rng(0x0E4D);
    let prompts: Vec<String> = (0..16)
        .map(|_| TextKind::Prose.text(&mut rng, 4096))
        .collect();
    // One request, answered in full; how long it took.
    let send = |base: String, p: &String| {
        let req = http
            .post(format!("{base}/v1/completions"))
            .json(&json!({"model": "m", "prompt": p, "max_tokens": 1}));
        async move {
            let t = Instant::now();
            req.send().await?.bytes().await?;
            Ok::<u64, anyhow::Error>(t.elapsed().as_nanos() as u64)
        }
    };
    for p in &prompts {
        for e in engines {
            send(format!("http://{e}"), p).await?;
        }
    }
    let mut direct = Samples::with_capacity(n);
    let mut per: Vec<Samples> = gws.iter().map(|_| Samples::with_capacity(n)).collect();
    for i in 0..n {
        let p = &prompts[i % prompts.len()];
        let e = engines[i % engines.len()];
        direct.push(send(format!("http://{e}"), p).await?);
        for (g, s) in gws.iter().zip(per.iter_mut()) {
            s.push(send(g.bases[i % g.bases.len()].clone(), p).await?);
        }
    }
    let (d50, d99) = (direct.pct(50.0) as f64, direct.pct(99.0) as f64);
    Ok(gws
        .iter()
        .zip(per.iter_mut())
        .map(|(g, s)| {
            (
                g.label.clone(),
                (s.pct(50.0) as f64 - d50) / 1e6,
                (s.pct(99.0) as f64 - d99) / 1e6,
            )
        })
        .collect())
}

pub async fn run(o: &Opts) -> anyhow::Result<Value> {
    let dir = crate::fixture_model_dir("deepseek-tools")?;
    let engine_args = crate::stack::engine_args(
        o.capacity_blocks,
        PREFILL_TPS,
        20,
        1.0 / o.speedup.max(1e-3),
    );
    eprintln!(
        "== stack: 4 engine sims ({} blocks of 16 tokens each, vLLM ZMQ events + kvroute-bridge, tokenizer {})",
        o.capacity_blocks,
        dir.display()
    );
    let stack = Stack::start(StackOpts {
        engine_args,
        vllm_events: true,
        model_dir: Some(dir),
        ..StackOpts::default()
    })
    .await?;
    // kvroute's one engine-speed setting, as an operator sets it: the engines' prefill rate
    // in wall time (8,000 tokens/s simulated, run `speedup` times faster).
    let mut settings = serde_json::Map::new();
    settings.insert(
        "prefill_tokens_per_s".into(),
        json!(PREFILL_TPS as f64 * o.speedup),
    );
    settings.extend(o.policy.clone());
    stack.api.merge_config(&settings).await?;
    let engines: Vec<_> = stack.engines.iter().map(|e| e.addr).collect();
    let n_engines = engines.len();
    let wasm = crate::wasm_path();
    let predicted_layout = EnvoyLayout {
        listen_port: 0,
        sidecar: SidecarAddr::Uds(stack.sidecar.uds.clone().unwrap_or_default()),
        engines: engines.clone(),
        wasm_path: wasm,
        filter_config: json!({"timeout_ms": 50, "default_model": {"block_size": 16}}),
        with_filter: true,
        fallback: Fallback::RoundRobin,
        access_log: false,
    };
    let predicted: Envoy =
        tokio::task::spawn_blocking(move || Envoy::start(&predicted_layout)).await??;
    let mut kvroute_pids = vec![stack.sidecar.pid()];
    kvroute_pids.extend(stack.bridges.iter().map(|b| b.child.pid()));
    let want = |l: &str| o.gateways.is_empty() || o.gateways.iter().any(|g| g == l);
    // A second replica only when asked for by name: it is kvroute behind a load balancer
    // that spreads every session's turns over two gateways, not another router.
    let replica = if o.gateways.iter().any(|g| g == REPLICAS) {
        let r = stack.replica().await?;
        r.api.merge_config(&settings).await?;
        Some(r)
    } else {
        None
    };
    let mut gws = vec![
        Gateway {
            label: "round-robin Envoy".into(),
            bases: vec![stack.plain.url("")],
            pids: vec![stack.plain.child.pid()],
        },
        Gateway {
            label: "kvroute precise".into(),
            bases: vec![stack.envoy.url("")],
            pids: [vec![stack.envoy.child.pid()], kvroute_pids.clone()].concat(),
        },
        Gateway {
            label: "kvroute predicted".into(),
            bases: vec![predicted.url("")],
            pids: [vec![predicted.child.pid()], kvroute_pids.clone()].concat(),
        },
    ];
    if let Some(r) = &replica {
        gws.push(Gateway {
            label: REPLICAS.into(),
            bases: vec![stack.envoy.url(""), r.envoy.url("")],
            pids: [
                vec![
                    stack.envoy.child.pid(),
                    r.envoy.child.pid(),
                    r.sidecar.pid(),
                ],
                kvroute_pids,
            ]
            .concat(),
        });
    }
    let mut peers = Vec::new();
    for k in Kind::ALL.into_iter().filter(|k| want(k.label())) {
        let log = std::env::temp_dir().join(format!(
            "kvroute-peers-{}-{}.log",
            k.label().replace(' ', "-"),
            std::process::id()
        ));
        eprintln!("== starting {} (log {})", k.label(), log.display());
        let p = Peer::start(k, &stack.workers(), 16, &log).await?;
        gws.push(Gateway {
            label: k.label().into(),
            bases: vec![p.url.clone()],
            pids: vec![p.pid()],
        });
        peers.push(p);
    }
    gws.retain(|g| want(&g.label));
    anyhow::ensure!(!gws.is_empty(), "no gateway selected");

    eprintln!("== the routers' added latency: 4 KB prompts, cached everywhere, one at a time");
    let ov = overhead(&gws, &engines, o.overhead_requests).await?;

    if !o.workloads.is_empty() {
        eprintln!("== filling the engines' caches");
        crate::steady::fill_caches(&engines, o.capacity_blocks, 16, 1.5).await?;
    }
    let mut out = json!({"engines": n_engines, "capacity_blocks": o.capacity_blocks,
        "rounds": o.rounds, "policy": o.policy, "versions": {"smg": crate::peers::SMG_VERSION,
        "vllm-router": crate::peers::VLLM_ROUTER_VERSION}, "workloads": {}});
    let mut printed = String::new();
    for (wi, name) in o.workloads.iter().enumerate() {
        let l = load(name, o)?;
        let mut runs: Vec<Vec<(Vec<demo::Outcome>, f64, f64)>> =
            gws.iter().map(|_| vec![]).collect();
        let mut turns: Vec<(u64, u64)> = vec![(0, 0); gws.len()];
        let sessions = l.sessions();
        let reqs = l.requests();
        for round in 0..o.rounds {
            for k in 0..gws.len() {
                let gi = (k + round) % gws.len();
                let g = &gws[gi];
                let seed = 1000 * (wi as u64 + 1) + 100 * round as u64 + gi as u64;
                let cpu0 = cpu_of(&g.pids);
                let t = Instant::now();
                let outcomes = l.run(&g.bases, seed, o).await;
                let cpu = cpu_of(&g.pids) - cpu0;
                if let Some(dir) = &o.dump {
                    dump_outcomes(dir, name, &g.label, round, o.block_text, &reqs, &outcomes)?;
                }
                let (moved, returning) = moved_turns(&outcomes, &sessions);
                turns[gi].0 += moved;
                turns[gi].1 += returning;
                let s = demo::summarize(&outcomes);
                eprintln!(
                    "   {name} round {} {:<24} {:>5} requests in {:>5.1} s: hit {:.3}, TTFT mean {:.1} ms",
                    round + 1,
                    g.label,
                    outcomes.len(),
                    t.elapsed().as_secs_f64(),
                    s.hit_rate,
                    s.ttft_mean_ms
                );
                runs[gi].push((outcomes, cpu, rss_mib(&g.pids)));
            }
        }
        let rows: Vec<(String, Row)> = gws
            .iter()
            .zip(&runs)
            .map(|(g, r)| (g.label.clone(), merged(r)))
            .collect();
        let t = table(
            &format!(
                "{name}: {} rounds, every gateway on the same full engines",
                o.rounds
            ),
            &rows,
            n_engines,
        );
        // Where the hits go: a session's turn served by another pod than its previous
        // turn prefills its whole prompt there.
        let mut t = t;
        for (g, &(moved, returning)) in gws.iter().zip(&turns) {
            if returning > 0 {
                t += &format!(
                    "{}: {:.1}% of returning session turns on another pod than the session's last ({moved} of {returning})\n",
                    g.label,
                    100.0 * moved as f64 / returning as f64,
                );
            }
        }
        print!("{t}");
        printed += &t;
        out["workloads"][name] = rows
            .iter()
            .zip(&turns)
            .map(|((l, r), &(moved, returning))| {
                let mut v = row_json(r, n_engines);
                if returning > 0 {
                    v["session_turns_moved"] = json!(moved);
                    v["session_turns_returning"] = json!(returning);
                }
                (l.clone(), v)
            })
            .collect::<serde_json::Map<_, _>>()
            .into();
    }
    let mut t = format!(
        "\nadded latency over a direct request (4 KB prompt, {} requests each)\n{:<24} {:>10} {:>10}\n",
        o.overhead_requests, "gateway", "p50", "p99"
    );
    for (l, p50, p99) in &ov {
        t += &format!("{l:<24} {p50:>8.2}ms {p99:>8.2}ms\n");
    }
    print!("{t}");
    out["added_latency_ms"] = ov
        .iter()
        .map(|(l, a, b)| {
            (
                l.clone(),
                json!({"p50": (a * 1000.0).round() / 1000.0, "p99": (b * 1000.0).round() / 1000.0}),
            )
        })
        .collect::<serde_json::Map<_, _>>()
        .into();
    drop(peers);
    drop(replica);
    drop(predicted);
    drop(stack);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_are_moved_against_their_sessions_previous_pod() {
        let at = |pod: &str, ok| demo::Outcome {
            ok,
            pod: pod.into(),
            ..Default::default()
        };
        // Session 1: a, a, b (moved), b. Session 2: b, then a failure (not counted),
        // then a (moved from b). A request without a session counts for nothing.
        let outcomes = [
            at("a", true),
            at("b", true),
            at("a", true),
            at("b", true),
            at("x", false),
            at("b", true),
            at("a", true),
            at("c", true),
        ];
        let sessions = [
            Some(1),
            Some(2),
            Some(1),
            Some(1),
            Some(2),
            Some(1),
            Some(2),
            None,
        ];
        assert_eq!(moved_turns(&outcomes, &sessions), (2, 4));
    }
}
