//! kvroute-tests: the harness that runs the real pieces together — Envoy with the built
//! filter, the sidecar, NATS and simulated engines — for end-to-end tests, the demo and
//! the benchmarks.

pub mod bench;
pub mod cache;
pub mod client;
pub mod demo;
pub mod engine;
pub mod envoy;
pub mod procs;
pub mod radix;
pub mod services;
pub mod sim;
pub mod stack;
pub mod stub;
pub mod vllm_pub;
pub mod workload;

/// Path of the filter module built for wasm32-wasip1 with the `wasm` profile.
pub fn wasm_path() -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| root.join("target"));
    target.join("wasm32-wasip1/wasm/kvroute_filter.wasm")
}
