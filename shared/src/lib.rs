//! kvroute-shared: everything the filter (wasm) and the sidecar (native) must agree on
//! bit for bit, compiled into both so there is exactly one definition.
//!
//! - [`chain`]: the cumulative block-hash chain (normative for kvroute v1; spec and test vectors in docs/protocol.md).
//! - [`canon`]: turning an OpenAI-style request body into the bytes or tokens that are chained.
//! - [`protocol`]: every wire type between filter, sidecar and engines.
//!
//! Nothing here does I/O or allocates more than its output, so it runs the same inside
//! Envoy's v8 as on the host.

pub mod canon;
pub mod chain;
pub mod protocol;

pub use chain::{common_prefix_blocks, ChainHasher, Mode, Namespace};
