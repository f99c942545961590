//! Every wire type between the filter, the sidecar and the engines, in one place.
//!
//! All types are JSON with serde. Field names are a contract with tools outside the
//! project (docs/protocol.md documents each with an example that a test parses), so
//! they change only with a new `v`. Unknown fields are ignored everywhere, so newer
//! senders can talk to older receivers; unknown event types are rejected, because an
//! event we do not understand could be one that removes blocks.
//!
//! Hashes are u64. JSON numbers are the canonical form; decimal strings are accepted
//! too, because JavaScript and jq silently round integers above 2^53 and a rounded
//! hash is a silent miss.

mod api;
#[cfg(feature = "config")]
mod config;
mod events;
mod hashes;
mod replicas;
mod route_codec;

pub use api::*;
#[cfg(feature = "config")]
pub use config::*;
pub use events::*;
pub use replicas::*;
pub use route_codec::*;

/// The longest model name, epoch, adapter, label key or value a batch or registration
/// may carry, in bytes: every string the sidecar keeps per pod is bounded, so the
/// registry's memory is (docs/security.md).
pub const MAX_NAME_BYTES: usize = 256;
/// The longest dump URL.
pub const MAX_URL_BYTES: usize = 2048;
/// Adapters and labels one registration may list.
pub const MAX_REGISTRATION_ITEMS: usize = 64;

/// An http(s) URL of at most [`MAX_URL_BYTES`] (the only dump URLs taken).
pub fn http_url(u: &str) -> bool {
    (u.starts_with("http://") || u.starts_with("https://")) && u.len() <= MAX_URL_BYTES
}

/// The block-size rules the filter's and the sidecar's configs share: a token block of
/// 1..=2^20 tokens, a text block of 16..=2^20 bytes.
pub fn check_block_sizes(
    name: &str,
    block_size: u32,
    text_block_bytes: u32,
    errs: &mut Vec<String>,
) {
    if block_size == 0 || block_size > 1 << 20 {
        errs.push(format!(
            "{name}: block_size must be in 1..=1048576 (got {block_size})"
        ));
    }
    if !(16..=1 << 20).contains(&text_block_bytes) {
        errs.push(format!(
            "{name}: text_block_bytes must be in 16..=1048576 (got {text_block_bytes})"
        ));
    }
}
