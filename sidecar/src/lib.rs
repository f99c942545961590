//! kvroute-sidecar: the native service next to each gateway pod.
//!
//! Cache facts and decisions are kept apart, and data flows one way:
//! - [`index`]: which pods hold which blocks (pure, no I/O);
//! - [`ingest`]: engine events → index and [`pods`] registry;
//! - [`policy`]: Filter → Score → Pick over facts and load views (pure);
//! - [`route`]: lookup → candidates → selector → decision; reports release it;
//! - [`ledger`]: the one owner of projected load (decisions, other replicas' deltas,
//!   per-prefix in-flight counts, prefill horizons, recent work);
//! - [`predicted`]: residency guessed from decisions, for engines without events;
//! - [`state`], [`http`], [`nats`], [`cleaner`], [`serve`]: the service around them;
//! - [`hashcli`]: the operator's chain printer;
//!
//! The engine-side bridge (vLLM/SGLang ZMQ events → kvroute batches) is its own crate,
//! `kvroute-bridge` (`sidecar/bridge/`); `kvroute-sidecar bridge` runs it too.

pub mod agreement;
pub mod cleaner;
pub mod hashcli;
pub mod http;
pub mod index;
pub mod ingest;
pub mod ledger;
pub mod metrics;
pub mod nats;
pub mod pods;
pub mod policy;
pub mod predicted;
pub mod recent;
pub mod route;
pub mod serve;
pub mod state;
pub mod status;
pub mod tokenize;
pub mod ui;

/// The allocator every binary that runs the sidecar's code installs
/// (`#[global_allocator] static A: Allocator = Allocator;`): the `tokenizers` library
/// allocates per token and the route path per request, and glibc's malloc spent a
/// quarter of an encode in its own bookkeeping. mimalloc against glibc, two builds of
/// the same code run alternately on one machine (`kvroute-bench tokenize` and `route`):
/// a cold 4 KB chat 1016 → 815 µs, the 21st turn of a 100 KB conversation 427 → 378 µs,
/// route decisions over the Unix socket 45.7k → 51.0k/s on two cores.
pub use mimalloc::MiMalloc as Allocator;

/// Hand the allocator's free pages back to the operating system. Loading a tokenizer
/// parses its `tokenizer.json` into buffers several times the size of what it keeps, and
/// mimalloc keeps freed pages for reuse: a DeepSeek tokenizer left the process 89 MB larger
/// after loading, 45 MB after this (it holds 25 MB). Called once tokenizers are loaded; cheap
/// elsewhere too, and a no-op for a binary on another allocator.
pub fn release_free_memory() {
    // SAFETY: mi_collect has no preconditions and is safe from any thread; it only returns
    // memory mimalloc holds free.
    unsafe { libmimalloc_sys::mi_collect(true) }
}
