//! The status page: static files embedded in the binary (no CDN, no files to ship),
//! served at `/ui/`. The files hold no data; the page reads the admin API (`/v1/status`,
//! `/v1/decisions`, `/v1/lookup`, dry-run `/v1/route`), which keeps its access rules —
//! loopback by default, the admin token when exposed (the page asks for it).
//!
//! A Content-Security-Policy confines the page to its own origin: it can load nothing
//! and reach nothing but the sidecar, and the wasm module is the only code it compiles.

use axum::extract::Path;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

/// (name, content type, bytes) of every file the page loads.
pub const ASSETS: [(&str, &str, &[u8]); 6] = [
    (
        "index.html",
        "text/html; charset=utf-8",
        include_bytes!("../ui/index.html"),
    ),
    (
        "app.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../ui/app.js"),
    ),
    (
        "style.css",
        "text/css; charset=utf-8",
        include_bytes!("../ui/style.css"),
    ),
    (
        "favicon.svg",
        "image/svg+xml",
        include_bytes!("../ui/favicon.svg"),
    ),
    (
        "kvroute.js",
        "text/javascript; charset=utf-8",
        include_bytes!(concat!(env!("OUT_DIR"), "/kvroute.js")),
    ),
    (
        "kvroute_bg.wasm",
        "application/wasm",
        include_bytes!(concat!(env!("OUT_DIR"), "/kvroute_bg.wasm")),
    ),
];

const CSP: &str = "default-src 'none'; script-src 'self' 'wasm-unsafe-eval'; style-src 'self'; \
                   connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

/// Whether the prefix inspector's wasm package was embedded at build time.
#[cfg(test)]
fn has_wasm() -> bool {
    ASSETS.iter().all(|(_, _, b)| !b.is_empty())
}

/// Bytes of the whole page, wasm included.
#[cfg(test)]
fn total_bytes() -> usize {
    ASSETS.iter().map(|(_, _, b)| b.len()).sum()
}

fn asset(name: &str) -> Response {
    match ASSETS.iter().find(|(n, _, b)| *n == name && !b.is_empty()) {
        Some((_, ct, bytes)) => (
            [
                (header::CONTENT_TYPE, *ct),
                (header::CONTENT_SECURITY_POLICY, CSP),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            *bytes,
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "no such file\n").into_response(),
    }
}

pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
        .route("/ui/", get(|| async { asset("index.html") }))
        .route(
            "/ui/{file}",
            get(|Path(f): Path<String>| async move { asset(&f) }),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_is_small() {
        // Under 1 MB with the wasm module; the figure is printed for the record.
        println!(
            "status page: {} bytes (wasm embedded: {})",
            total_bytes(),
            has_wasm()
        );
        assert!(total_bytes() < 1 << 20, "{} bytes", total_bytes());
    }
}
