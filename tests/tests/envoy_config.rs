//! The shipped envoy/envoy.yaml is the renderer's output and Envoy accepts it.

use kvroute_tests::envoy::{envoy_bin, EnvoyLayout, PickerLayout};

fn shipped_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../envoy/envoy.yaml")
}

#[test]
fn shipped_config_is_current() {
    let shipped = std::fs::read_to_string(shipped_path()).expect("envoy/envoy.yaml");
    assert_eq!(
        shipped,
        EnvoyLayout::shipped().render(),
        "envoy/envoy.yaml is stale: regenerate with `cargo run -p kvroute-tests --bin kvroute-stack -- render-envoy > envoy/envoy.yaml`"
    );
}

#[test]
fn envoy_validates_shipped_config() {
    let wasm = kvroute_tests::wasm_path();
    assert!(wasm.exists(), "build the filter first: make wasm");
    // Validate with the wasm path made absolute (the shipped one is relative to the repo).
    let mut layout = EnvoyLayout::shipped();
    layout.wasm_path = wasm;
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("envoy.yaml");
    std::fs::write(&cfg, layout.render()).expect("write");
    let out = std::process::Command::new(envoy_bin())
        .args(["--mode", "validate", "-c"])
        .arg(&cfg)
        .output()
        .expect("run envoy --mode validate");
    assert!(
        out.status.success(),
        "envoy rejected the config: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn shipped_picker_config_is_current_and_envoy_accepts_it() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../envoy/envoy-picker.yaml");
    let shipped = std::fs::read_to_string(&path).expect("envoy/envoy-picker.yaml");
    assert_eq!(
        shipped,
        PickerLayout::shipped().render(),
        "envoy/envoy-picker.yaml is stale: regenerate with `cargo run -p kvroute-tests --bin kvroute-stack -- render-envoy --picker > envoy/envoy-picker.yaml`"
    );
    let out = std::process::Command::new(envoy_bin())
        .args(["--mode", "validate", "-c"])
        .arg(&path)
        .output()
        .expect("run envoy --mode validate");
    assert!(
        out.status.success(),
        "envoy rejected the picker config: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
