//! `kvroute-engine-sim`: a simulated vLLM-like engine pod (see kvroute_tests::engine).

use clap::Parser;

fn main() -> anyhow::Result<()> {
    let args = kvroute_tests::engine::EngineArgs::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(kvroute_tests::engine::run(args))
}
