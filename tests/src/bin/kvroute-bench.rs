//! `kvroute-bench`: benchmarks that print a table, then one JSON object as the last line.
//!
//! Run as `cargo run --release --bin kvroute-bench -- SUB`.

use std::path::PathBuf;

// The sidecar's own allocator, so in-process figures are the shipped binary's; counted,
// so memory figures are bytes held rather than resident-set guesses.
#[global_allocator]
static GLOBAL: bench::heap::Counting<kvroute_sidecar::Allocator> =
    bench::heap::Counting(kvroute_sidecar::Allocator);

use clap::{Parser, Subcommand};
use kvroute_tests::bench;

#[derive(Parser)]
#[command(
    name = "kvroute-bench",
    about = "kvroute benchmarks (last line of output: one JSON object)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

// A command-line parse, made once: its size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// The index on the micro-benchmark shape, against naive and radix baselines.
    Index {
        #[arg(long, default_value_t = 1 << 20)]
        blocks: usize,
        #[arg(long, default_value_t = 128)]
        depth: usize,
        #[arg(long, default_value_t = 16)]
        pods: usize,
        #[arg(long, default_value_t = 200_000)]
        lookups: usize,
    },
    /// Latency the filter and sidecar add in a real Envoy; the filter's own time in v8.
    Filter {
        #[arg(long, default_value_t = 1000)]
        requests: usize,
    },
    /// What precise chat routing costs: render + tokenize + chain + route vs the bare encode.
    Tokenize {
        /// A Hugging Face model directory (default: the fidelity test's DeepSeek one).
        #[arg(long)]
        dir: Option<PathBuf>,
        #[arg(long, default_value_t = 200)]
        iterations: usize,
    },
    /// Route decisions per second over the sidecar's Unix socket and TCP.
    Route {
        #[arg(long, default_value_t = 8)]
        clients: usize,
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        #[arg(long, default_value_t = 128)]
        chain_blocks: usize,
        #[arg(long, default_value_t = 16)]
        pods: usize,
    },
    /// Routing quality: simulate pods and every policy on a trace or a generated workload.
    Sim {
        /// A Mooncake-format trace (512-token blocks).
        #[arg(long, conflicts_with = "workload")]
        trace: Option<PathBuf>,
        /// sglang-shared-prefix | llmd-prefix | multiround-qa | multiturn-chat | all
        #[arg(long)]
        workload: Option<String>,
        /// Replay agentic sessions (kv-cache-tester format: a directory or .tar.gz; with
        /// no value or `shipped`, the 80 Claude Code sessions in tests/data/agentic) in 512-token
        /// blocks, sessions starting as a Poisson process (`--session-gap-s`).
        #[arg(long, num_args = 0..=1, default_missing_value = "shipped", conflicts_with_all = ["trace", "workload"])]
        agentic: Option<PathBuf>,
        /// Mean gap between agentic session starts, seconds.
        #[arg(long, default_value_t = 4.0)]
        session_gap_s: f64,
        #[arg(long, default_value_t = 8)]
        pods: usize,
        /// Per-pod KV cache capacity in blocks (default: 1024 for traces, 16384 generated).
        #[arg(long)]
        capacity_blocks: Option<usize>,
        /// Trace time compression factor; several (comma-separated) replay the workload at
        /// each, each its own table, then one table over them all as over seeds: an
        /// overloaded fleet's figures swing with a few decisions, so one rate is a poor
        /// judge there too.
        #[arg(long, value_delimiter = ',', default_value = "1")]
        speedup: Vec<f64>,
        /// Replay only the requests of a trace's (or the sessions') first this many
        /// seconds, before compression (`kvroute-bench peers` replays the sessions' first 900).
        #[arg(long)]
        trace_seconds: Option<f64>,
        /// Arrival rate of generated workloads, requests/s (default per workload).
        #[arg(long)]
        rate: Option<f64>,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Run this many seeds from `--seed` on, each its own table, then one table over
        /// them all: TTFT as geometric means, and on how many seeds each policy had the
        /// lowest mean. One seed of the agentic sessions is a poor judge of a policy.
        #[arg(long, default_value_t = 1)]
        seeds: u64,
        /// Comma-separated policies (default: all).
        #[arg(long)]
        policies: Option<String>,
        #[arg(long)]
        svg: Option<PathBuf>,
        #[arg(long, default_value_t = 50.0)]
        event_delay_ms: f64,
        #[arg(long, default_value_t = 0.0)]
        event_loss: f64,
        /// Gateways (sidecar replicas) in front of the pods; with more than one, kvroute
        /// is also shown with one gateway and without replica sync (herding).
        #[arg(long, default_value_t = 1)]
        gateways: usize,
        /// Data-parallel ranks per engine address: --pods counts ranks, each a pod of its
        /// own (`ip:port@rank`); the `rank-blind` policy is kvroute seeing one pod per
        /// address with the engine balancing its ranks.
        #[arg(long, default_value_t = 1)]
        dp_ranks: usize,
        /// Delay of load deltas between gateways.
        #[arg(long, default_value_t = 20.0)]
        delta_delay_ms: f64,
        /// Policy config JSON (default: the sidecar's defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// The simulated engines' prefill speed, tokens/s (default 10,000); the routers'
        /// `prefill_tokens_per_s` is set to it too, as an operator sets it to the engines'
        /// rate. Faster engines are less loaded, and load is what pulls a request off its
        /// cache: compare routers only at the same engine speed.
        #[arg(long)]
        engine_prefill_tps: Option<f64>,
        /// The simulated engines' decode step, ms (default 10).
        #[arg(long)]
        engine_decode_ms: Option<f64>,
        /// Requests the simulated engines run at once (default 16); `kvroute-bench
        /// peers` runs its engines with 8.
        #[arg(long)]
        engine_max_batch: Option<u32>,
        /// Each request's output tokens times this, at least 1 (`kvroute-bench peers`
        /// turns a trace block into 64 tokens of text and scales outputs by the same
        /// 1/8).
        #[arg(long)]
        output_scale: Option<f64>,
        /// Each request's output tokens, at most (`kvroute-bench peers` asks for 64).
        #[arg(long)]
        max_output_tokens: Option<u32>,
        /// Write the requests (after --trace-seconds and --speedup) as a Mooncake trace
        /// to this file and exit, for another router's replay of the same load.
        #[arg(long)]
        export_mooncake: Option<PathBuf>,
        /// Route text chains (predicted mode) whose blocks the pods tokenize at these
        /// bytes per token, by conversation (e.g. 4.6,3.1,2.2,1.5: prose, code, numbers,
        /// CJK); each chain block is 256 canonical bytes.
        #[arg(long, value_delimiter = ',')]
        text_bytes_per_token: Vec<f64>,
        /// With `admission.enabled` in --config: request i's priority is
        /// `priorities[i % n]` (e.g. 1,0,0,0: a quarter high) ...
        #[arg(long, value_delimiter = ',')]
        priorities: Vec<i32>,
        /// ... and its tenant `tenants[i % n]` (e.g. ten 0s and a 1: 10:1).
        #[arg(long, value_delimiter = ',')]
        tenants: Vec<u32>,
        /// Requests do not name their session to the router, as chat clients that send
        /// no session id (moves are still counted by the trace's sessions).
        #[arg(long)]
        no_session_ids: bool,
    },
    /// kvroute beside the real routers (smg, vllm-router; `make peers-deps`) on the same
    /// engines and workloads, in one run.
    Peers {
        /// Comma-separated: chat, mooncake, agentic; `none` measures only the added latency.
        #[arg(long, value_delimiter = ',', default_value = "chat,mooncake,agentic")]
        workloads: Vec<String>,
        /// Comma-separated gateway labels (default: all), e.g. "kvroute precise,smg cache_aware".
        #[arg(long, value_delimiter = ',')]
        gateways: Vec<String>,
        /// Runs of each workload through each gateway (order rotated every round).
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        /// Engine KV cache, 16-token blocks.
        #[arg(long, default_value_t = 4096)]
        capacity_blocks: u32,
        /// Seconds of each trace replayed (default: the whole Mooncake trace, the
        /// sessions' first 900 s).
        #[arg(long)]
        trace_seconds: Option<f64>,
        /// Traces arrive and engines run this many times faster than real time.
        #[arg(long, default_value_t = 8.0)]
        speedup: f64,
        /// Tokens of text one 512-token trace block becomes.
        #[arg(long, default_value_t = 64)]
        block_text: u32,
        #[arg(long, default_value_t = 24)]
        chat_users: usize,
        #[arg(long, default_value_t = 200)]
        overhead_requests: usize,
        /// JSON object merged into the sidecar's policy config, e.g. '{"eviction_weight": 2}'.
        #[arg(long)]
        policy: Option<String>,
        /// Write every trace request's outcome here, one JSON line each, per workload and
        /// gateway (`<workload>.jsonl`): when it was sent, the pod that served it, its hits
        /// and its trace chain, to replay a router's choices offline.
        #[arg(long)]
        dump: Option<std::path::PathBuf>,
    },
    /// Whether the simulator's imitations decide as the real routers did: replays a
    /// `peers --dump` file's smg and vllm-router requests through them.
    Imitate {
        /// A `peers --dump` file (`<dir>/<workload>.jsonl`).
        #[arg(long)]
        dump: std::path::PathBuf,
    },
    /// Replay a Mooncake-format trace through the index (and the radix baseline).
    Trace {
        /// Trace file (default: tests/data/mooncake_synthetic_trace.jsonl, shipped in the repository).
        file: Option<PathBuf>,
        #[arg(long, default_value_t = 16)]
        pods: usize,
        #[arg(long, default_value_t = 2048)]
        capacity_blocks: usize,
        /// Also pace the replay at rising rates to find the saturation rate.
        #[arg(long)]
        sweep: bool,
    },
}

/// A trace's first `seconds` (all of it without), then its clock `speedup` times faster.
/// The workloads `kvroute-bench sim` was asked for: agentic sessions, a Mooncake trace or
/// generated workloads (the first of those given).
struct SimWorkloads<'a> {
    agentic: Option<&'a std::path::Path>,
    session_gap_s: f64,
    trace: Option<&'a std::path::Path>,
    workload: Option<&'a str>,
    rate: Option<f64>,
    trace_seconds: Option<f64>,
    speedup: f64,
}

impl SimWorkloads<'_> {
    /// Each workload's label, requests (those that depend on the seed drawn with it) and
    /// block size in tokens.
    fn load(
        &self,
        seed: u64,
    ) -> anyhow::Result<Vec<(String, Vec<kvroute_tests::workload::Request>, u32)>> {
        use kvroute_tests::{sim, workload};
        if let Some(p) = self.agentic {
            let path = if p.as_os_str() == "shipped" {
                workload::default_agentic()
            } else {
                p.to_path_buf()
            };
            let bt = workload::MOONCAKE_BLOCK_TOKENS;
            let mut reqs = workload::load_agentic(
                &path,
                workload::AgenticOpts {
                    block_tokens: bt,
                    mean_gap_s: self.session_gap_s,
                    seed,
                },
            )?;
            cut_and_compress(&mut reqs, self.trace_seconds, self.speedup);
            let label = format!(
                "agentic sessions ({}), {} s mean start gap",
                path.display(),
                self.session_gap_s
            );
            return Ok(vec![(label, reqs, bt)]);
        }
        match (self.trace, self.workload) {
            (Some(path), _) => {
                let mut reqs = workload::load_mooncake(path)?;
                cut_and_compress(&mut reqs, self.trace_seconds, self.speedup);
                Ok(vec![(
                    path.display().to_string(),
                    reqs,
                    workload::MOONCAKE_BLOCK_TOKENS,
                )])
            }
            (None, Some(w)) => {
                let names: Vec<&str> = if w == "all" {
                    sim::WORKLOADS.to_vec()
                } else {
                    vec![w]
                };
                names
                    .into_iter()
                    .map(|n| {
                        let rate = self.rate.unwrap_or(sim::default_rate(n));
                        let reqs = sim::generated(n, 16, rate, seed)
                            .ok_or_else(|| anyhow::anyhow!("unknown workload {n:?}"))?;
                        Ok((format!("{n} @ {rate} req/s"), reqs, 16))
                    })
                    .collect()
            }
            (None, None) => anyhow::bail!("give --trace FILE or --workload NAME"),
        }
    }
}

fn cut_and_compress(
    reqs: &mut Vec<kvroute_tests::workload::Request>,
    seconds: Option<f64>,
    speedup: f64,
) {
    if let Some(s) = seconds {
        reqs.retain(|r| r.ts_ms <= s * 1000.0);
    }
    for r in reqs {
        r.ts_ms /= speedup.max(1e-9);
    }
}

fn main() -> anyhow::Result<()> {
    // Printed tables are often piped into `head` or `grep -m`: a closed pipe ends the
    // process as it ends other command-line tools, instead of a panic in `println!`.
    // SAFETY: setting a signal's disposition to the default, before any thread starts.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let v = match Cli::parse().cmd {
        Cmd::Tokenize { dir, iterations } => {
            bench::tokenize::run(&bench::tokenize::Opts { dir, iterations })?
        }
        Cmd::Index {
            blocks,
            depth,
            pods,
            lookups,
        } => bench::index::run(&bench::index::Opts {
            blocks,
            depth,
            pods,
            lookups,
            seed: 7,
        }),
        Cmd::Filter { requests } => {
            runtime()?.block_on(bench::filter::run(&bench::filter::Opts { requests }))?
        }
        Cmd::Peers {
            workloads,
            gateways,
            rounds,
            capacity_blocks,
            trace_seconds,
            speedup,
            block_text,
            chat_users,
            overhead_requests,
            policy,
            dump,
        } => runtime()?.block_on(bench::peers::run(&bench::peers::Opts {
            // `none`: only the added-latency measurement.
            workloads: workloads.into_iter().filter(|w| w != "none").collect(),
            gateways,
            rounds,
            capacity_blocks,
            trace_seconds,
            speedup,
            block_text,
            chat_users,
            overhead_requests,
            policy: match policy.as_deref().map(serde_json::from_str) {
                None => serde_json::Map::new(),
                Some(Ok(serde_json::Value::Object(m))) => m,
                Some(_) => anyhow::bail!("--policy takes a JSON object"),
            },
            dump,
        }))?,
        Cmd::Route {
            clients,
            seconds,
            chain_blocks,
            pods,
        } => runtime()?.block_on(bench::route::run(&bench::route::Opts {
            clients,
            seconds,
            chain_blocks,
            pods,
        }))?,
        Cmd::Sim {
            trace,
            workload,
            agentic,
            session_gap_s,
            pods,
            capacity_blocks,
            speedup,
            trace_seconds,
            rate,
            seed,
            seeds,
            policies,
            svg,
            event_delay_ms,
            event_loss,
            gateways,
            dp_ranks,
            delta_delay_ms,
            config,
            engine_prefill_tps,
            engine_decode_ms,
            engine_max_batch,
            output_scale,
            max_output_tokens,
            export_mooncake,
            text_bytes_per_token,
            priorities,
            tenants,
            no_session_ids,
        } => {
            use kvroute_tests::sim::{self, Policy, SimOpts};
            let policies: Vec<Policy> = match policies {
                Some(p) => p
                    .split(',')
                    .map(|s| {
                        Policy::parse(s.trim())
                            .ok_or_else(|| anyhow::anyhow!("unknown policy {s:?}"))
                    })
                    .collect::<anyhow::Result<_>>()?,
                None => Policy::ALL.to_vec(),
            };
            let mut config: kvroute_shared::protocol::PolicyConfig = match config {
                Some(p) => serde_json::from_slice(&std::fs::read(p)?)?,
                None => kvroute_shared::protocol::PolicyConfig::default(),
            };
            let mut cost = kvroute_tests::sim::default_cost();
            if let Some(tps) = engine_prefill_tps {
                anyhow::ensure!(tps.is_finite() && tps >= 1.0, "--engine-prefill-tps {tps}");
                cost.prefill_tps = tps;
                config.prefill_tokens_per_s = tps;
            }
            if let Some(ms) = engine_decode_ms {
                anyhow::ensure!(ms.is_finite() && ms > 0.0, "--engine-decode-ms {ms}");
                cost.decode_ms = ms;
            }
            if let Some(b) = engine_max_batch {
                anyhow::ensure!(b >= 1, "--engine-max-batch {b}");
                cost.max_batch = b as usize;
            }
            if let Some(x) = output_scale {
                anyhow::ensure!(x.is_finite() && x > 0.0, "--output-scale {x}");
            }
            anyhow::ensure!(seeds >= 1, "--seeds {seeds}");
            anyhow::ensure!(
                !speedup.is_empty() && speedup.iter().all(|x| x.is_finite() && *x > 0.0),
                "--speedup {speedup:?}"
            );
            let speedups = speedup;
            let mut last = Vec::new();
            // Workload label → each seed's results, for the table over seeds.
            let mut per_seed: std::collections::BTreeMap<String, Vec<Vec<sim::SimResult>>> =
                Default::default();
            let mut w = SimWorkloads {
                agentic: agentic.as_deref(),
                session_gap_s,
                trace: trace.as_deref(),
                workload: workload.as_deref(),
                rate,
                trace_seconds,
                speedup: speedups[0],
            };
            if let Some(out) = export_mooncake {
                let runs = w.load(seed)?;
                let [(label, reqs, bt)] = runs.as_slice() else {
                    anyhow::bail!("--export-mooncake writes one workload at a time");
                };
                anyhow::ensure!(
                    *bt == kvroute_tests::workload::MOONCAKE_BLOCK_TOKENS,
                    "Mooncake traces are in {}-token blocks, {label} in {bt}",
                    kvroute_tests::workload::MOONCAKE_BLOCK_TOKENS
                );
                kvroute_tests::workload::write_mooncake(reqs, &out)?;
                println!(
                    "{label}: {} requests written to {}",
                    reqs.len(),
                    out.display()
                );
                return Ok(());
            }
            let runs_of = (seed..seed + seeds)
                .flat_map(|s| speedups.iter().map(move |&x| (s, x)))
                .collect::<Vec<_>>();
            for &(seed, speedup) in &runs_of {
                w.speedup = speedup;
                let runs = w.load(seed)?;
                for (label, reqs, bt) in &runs {
                    if speedups.len() > 1 {
                        println!("speedup {speedup}:");
                    }
                    let scaled;
                    let reqs = if output_scale.is_some() || max_output_tokens.is_some() {
                        scaled = kvroute_tests::workload::scale_outputs(
                            reqs,
                            output_scale.unwrap_or(1.0),
                            max_output_tokens.unwrap_or(u32::MAX),
                        );
                        &scaled
                    } else {
                        reqs
                    };
                    let o = SimOpts {
                        pods,
                        capacity_blocks: capacity_blocks.unwrap_or(if *bt == 512 {
                            1024
                        } else {
                            16384
                        }),
                        block_tokens: *bt,
                        cost,
                        event_delay_s: event_delay_ms / 1e3,
                        event_loss,
                        seed,
                        config: config.clone(),
                        gateways,
                        delta_delay_s: delta_delay_ms / 1e3,
                        replica_sync: true,
                        text: (!text_bytes_per_token.is_empty()).then(|| sim::TextChains {
                            block_bytes: 256,
                            bytes_per_token: text_bytes_per_token.clone(),
                        }),
                        dp_ranks: dp_ranks.max(1),
                        // The router's queue while saturated, as the config describes it.
                        admission: config.admission.enabled.then(|| sim::SimAdmission {
                            config: config.admission.clone(),
                            priority: priorities.clone(),
                            tenant: tenants.clone(),
                        }),
                        session_ids: !no_session_ids,
                    };
                    let res = sim::compare(label, reqs, &o, &policies);
                    per_seed.entry(label.clone()).or_default().push(res.clone());
                    if let Some(p) = &svg {
                        std::fs::write(
                            p,
                            sim::svg_bars(&format!("TTFT by policy: {label}"), &res),
                        )?;
                    }
                    last.extend(res);
                }
            }
            if runs_of.len() > 1 {
                let mut over = Vec::new();
                if seeds > 1 {
                    over.push(format!("seeds {seed}-{}", seed + seeds - 1));
                }
                if speedups.len() > 1 {
                    let x: Vec<String> = speedups.iter().map(|x| x.to_string()).collect();
                    over.push(format!("speedups {}", x.join(",")));
                }
                let over = over.join(" x ");
                for (label, runs) in &per_seed {
                    let rows = sim::summarize_seeds(runs);
                    print!("{}", sim::seed_table(label, &over, &rows));
                    for r in &rows {
                        println!("{}", r.json());
                    }
                }
            }
            for r in &last[..last.len().saturating_sub(1)] {
                println!("{}", r.json());
            }
            last.last().map(|r| r.json()).unwrap_or_default()
        }
        Cmd::Imitate { dump } => {
            let text = std::fs::read_to_string(&dump)
                .map_err(|e| anyhow::anyhow!("{}: {e}", dump.display()))?;
            let rows = text
                .lines()
                .enumerate()
                .map(|(i, l)| {
                    serde_json::from_str::<kvroute_tests::sim::Dumped>(l)
                        .map_err(|e| anyhow::anyhow!("{} line {}: {e}", dump.display(), i + 1))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let runs = kvroute_tests::sim::replay_dump(&rows);
            anyhow::ensure!(
                !runs.is_empty(),
                "no smg or vllm-router run in {}",
                dump.display()
            );
            println!(
                "{:<24} {:>5} {:>9} {:>8} {:>12}  by case (agreed up to ties)",
                "gateway", "round", "decisions", "same pod", "up to ties"
            );
            let mut out = Vec::new();
            for (g, round, a) in &runs {
                let pct = |n: u64| 100.0 * n as f64 / a.decisions.max(1) as f64;
                let cases: Vec<String> = a
                    .by_case
                    .iter()
                    .map(|(c, (n, ok))| format!("{c} {ok}/{n}"))
                    .collect();
                println!(
                    "{g:<24} {:>5} {:>9} {:>7.1}% {:>11.1}%  {}",
                    round + 1,
                    a.decisions,
                    pct(a.agreed),
                    pct(a.within_ties),
                    cases.join(", ")
                );
                out.push(serde_json::json!({"gateway": g, "round": round + 1,
                    "decisions": a.decisions, "agreed": a.agreed, "within_ties": a.within_ties,
                    "failed": a.failed,
                    "by_case": a.by_case.iter().map(|(c, (n, ok))| (c.to_string(), serde_json::json!([n, ok])))
                        .collect::<serde_json::Map<_, _>>()}));
            }
            serde_json::Value::Array(out)
        }
        Cmd::Trace {
            file,
            pods,
            capacity_blocks,
            sweep,
        } => {
            let path = file.unwrap_or_else(kvroute_tests::workload::default_trace);
            let reqs = kvroute_tests::workload::load_mooncake(&path)?;
            bench::trace::run(
                &reqs,
                &bench::trace::Opts {
                    pods,
                    capacity_blocks,
                    sweep,
                },
            )
        }
    };
    println!("{v}");
    Ok(())
}

/// The runtime the network benchmarks run on: two workers, as many as the machine they
/// are quoted for has cores.
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}
