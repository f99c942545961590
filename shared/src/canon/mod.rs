//! Prompt canonicalization: from a request body (OpenAI completions, chat and Responses,
//! Anthropic Messages) to the exact units that are chained. Three parts, one way:
//! [`parse()`] reads a body (`parse.rs`: serde, the definition; `skim.rs`: a fast path for
//! token-list completions that must agree with it) into the borrowed types of
//! `format.rs`, which writes them as the canonical form (`agent.rs`: the records of the
//! Messages and Responses block and item types).

mod agent;
mod format;
mod parse;
mod skim;

pub use agent::{without_cache_control, Input, BILLING_HEADER};
pub use format::*;
pub use parse::parse;
