//! The `kvroute-bridge` command: one engine's ZMQ KV events → kvroute event batches.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "kvroute-bridge",
    version,
    about = "vLLM / SGLang KV events -> kvroute event batches (run next to the engine)"
)]
struct Cli {
    #[command(flatten)]
    args: kvroute_bridge::BridgeArgs,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVROUTE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(kvroute_bridge::run(
            cli.args,
            kvroute_bridge::wait_for_signal(),
        ))
}
