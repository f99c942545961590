//! Embeds the wasm-bindgen build of kvroute-shared (`make js` writes it to
//! `shared/js/pkg/`) into the sidecar for the status page's prefix inspector. Without it
//! the page still works and says the inspector is not in this build.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    );
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    // sidecar/gateway → the repository root.
    let pkg = manifest
        .ancestors()
        .nth(2)
        .map(|root| root.join("shared").join("js").join("pkg"))
        .unwrap_or_default();
    println!("cargo:rerun-if-changed={}", pkg.display());
    for f in ["kvroute.js", "kvroute_bg.wasm"] {
        let src = pkg.join(f);
        println!("cargo:rerun-if-changed={}", src.display());
        let bytes = std::fs::read(&src).unwrap_or_default();
        std::fs::write(out.join(f), bytes).expect("write to OUT_DIR");
    }
}
