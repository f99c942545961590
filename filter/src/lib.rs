//! kvroute-filter: the proxy-wasm filter users load into Envoy or Istio.
//!
//! It reads an OpenAI request body, chains its prompt with `kvroute-shared`, asks the
//! co-located sidecar which pod to use, and sets Envoy's override-host header. It must
//! never break or hang a request, so every failure continues unsteered (fail open) and
//! the crate forbids the panicking shortcuts outright. The decisions live in plain,
//! natively tested modules; [`glue`] (wasm only) just moves bytes.
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )
)]

pub mod config;
pub mod logic;
pub mod usage;

#[cfg(target_arch = "wasm32")]
mod glue;
