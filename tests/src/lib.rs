//! kvroute-tests: the harness that runs the real pieces together — Envoy with the built
//! filter, the sidecar, NATS and simulated engines — for end-to-end tests, the demo and
//! the benchmarks.

pub mod bench;
pub mod cache;
pub mod client;
pub mod demo;
pub mod engine;
pub mod engine_api;
pub mod envoy;
pub mod peers;
pub mod procs;
pub mod radix;
pub mod services;
pub mod sim;
pub mod stack;
pub mod steady;
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

/// A model directory made by `tests/tokenizer/make_fixtures.py` (`deepseek-tools`,
/// `deepseek-chatml`, `trained-chatml`) under `target/tokenizer-fixtures`, created when
/// missing (the directories only; the fidelity test writes the reference ids itself).
pub fn fixture_model_dir(name: &str) -> anyhow::Result<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = root.join("../target/tokenizer-fixtures");
    let dir = out.join(name);
    if !dir.join("tokenizer_config.json").exists() {
        let st = std::process::Command::new("python3")
            .arg(root.join("tokenizer/make_fixtures.py"))
            .arg(&out)
            .arg("0")
            .status()?;
        anyhow::ensure!(
            st.success(),
            "tests/tokenizer/make_fixtures.py failed (make tokenizer-deps installs what it needs)"
        );
    }
    Ok(dir)
}
