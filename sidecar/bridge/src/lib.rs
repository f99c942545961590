//! kvroute-bridge: runs next to one vLLM or SGLang engine and turns its ZMQ KV events
//! into kvroute event batches. It depends only on `kvroute-shared` (the chain and the
//! wire types) and its own modules, because it ships with the engine, not the gateway.
//!
//! - [`vllm`]: the engines' msgpack event format, decoded defensively;
//! - [`translate`]: engine blocks → kvroute chain hashes, sequence and epoch keeping;
//! - [`sink`]: where batches go (NATS, or sidecars over HTTP); [`nats_auth`]: the NATS
//!   credentials and TLS flags every kvroute NATS client takes;
//! - [`run`]: the service (ZMQ receive, replay, engine-load poll, the ordered queue,
//!   `/dump`, `/metrics`), and [`wait_for_signal`] for both kvroute binaries.

mod metrics;
pub mod nats_auth;
pub mod run;
pub mod sink;
pub mod translate;
pub mod vllm;

pub use run::{run, BridgeArgs};

/// Logging (`KVROUTE_LOG`, default `info`, to stderr) and a multi-threaded runtime: how
/// both kvroute services start.
pub fn service_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVROUTE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

/// SIGTERM or SIGINT (the shutdown signal of kvroute's services).
pub async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
