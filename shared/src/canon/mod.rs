//! Prompt canonicalization: from an OpenAI-style request body to the exact units that
//! are chained. Three parts, one way: [`parse()`] reads a body (`parse.rs`: serde, the
//! definition; `skim.rs`: a fast path for token-list completions that must agree with
//! it) into the borrowed types of `format.rs`, which writes them as the canonical form.

mod format;
mod parse;
mod skim;

pub use format::*;
pub use parse::parse;
