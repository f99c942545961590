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
    kvroute_service::service_runtime()?.block_on(kvroute_bridge::run(
        cli.args,
        kvroute_service::wait_for_signal(),
    ))
}
