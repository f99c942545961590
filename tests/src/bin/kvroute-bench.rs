//! `kvroute-bench`: benchmarks that print a table, then one JSON object as the last line.
//!
//! Run as `cargo run --release --bin kvroute-bench -- SUB`.

use std::path::PathBuf;

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
    /// Replay a Mooncake-format trace through the index (and the radix baseline).
    Trace {
        /// Trace file (default: ../shared/data/mooncake_synthetic_trace.jsonl).
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

fn main() -> anyhow::Result<()> {
    let v = match Cli::parse().cmd {
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
        Cmd::Route {
            clients,
            seconds,
            chain_blocks,
            pods,
        } => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            rt.block_on(bench::route::run(&bench::route::Opts {
                clients,
                seconds,
                chain_blocks,
                pods,
            }))?
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
