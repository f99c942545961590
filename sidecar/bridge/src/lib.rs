//! kvroute-bridge: runs next to one vLLM or SGLang engine and turns its ZMQ KV events
//! into kvroute event batches. It depends on `kvroute-shared` (the chain and the wire
//! types) and `kvroute-service` (NATS credentials, shutdown, the runtime), never on the
//! gateway's sidecar: it ships with the engine, not the gateway.
//!
//! - [`vllm`]: the engines' msgpack event format, decoded defensively;
//! - [`translate`]: engine blocks → kvroute chain hashes, sequence and epoch keeping;
//! - [`sink`]: where batches go (NATS, or sidecars over HTTP);
//! - [`run`]: the service (ZMQ receive, replay, engine-load poll, the ordered queue,
//!   `/dump`, `/metrics`).

mod metrics;
pub mod run;
pub mod sink;
pub mod translate;
pub mod vllm;

pub use run::{run, BridgeArgs};

pub use kvroute_service::NatsAuth;
