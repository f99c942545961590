//! kvroute-sidecar: the native service next to each gateway pod.
//!
//! Cache facts and decisions are kept apart, and data flows one way:
//! - `index`: which pods hold which blocks (pure, no I/O);
//! - `registry`: the pods — registrations, stream positions, tombstones, breakers;
//! - `ingest`: engine events → registry and index, and recovery after missed events;
//! - `policy`: Filter → Score → Pick over facts and load views (pure);
//! - `route`: lookup → candidates → selector → decision; reports release it;
//! - `ledger`: the one owner of projected load (decisions, other replicas' deltas,
//!   per-prefix in-flight counts, prefill horizons, recent work);
//! - `predicted`: residency guessed from decisions, for engines without events, and
//!   `text_tokens`: the tokens a text chain's bytes stand for, learned from reports;
//! - `tokenize`: the model's chat template and tokenizer, for precise routing;
//! - `state`, `http`, `nats`, `cleaner`, `serve`: the service around them;
//! - `picker`: the Gateway API Inference Extension's endpoint picker (Envoy ext_proc),
//!   a second front door over the same route;
//! - `hashcli`: the operator's chain printer.
//!
//! Only what the binary, the benchmarks, the simulator and the tests need is exported,
//! by name; the modules stay private. The engine-side bridge is its own crate,
//! `kvroute-bridge`, and the two share only `kvroute-service`.

pub mod admission;
mod affinity;
mod agreement;
mod cleaner;
pub mod hashcli;
mod http;
/// The block index, public for its benchmarks and oracle tests.
pub mod index;
mod ingest;
mod ledger;
mod metrics;
mod nats;
mod picker;
/// The policy's pure functions, public for the simulator's baselines.
pub mod policy;
mod predicted;
mod recent;
mod registry;
mod returns;
mod route;
mod serve;
mod state;
mod status;
mod text_tokens;
mod tokenize;
mod ui;

pub use ingest::{
    fetch_dumps, ingest, ingest_at, run_workers, IngestError, IngestQueue, Ingested, QueueFull,
    Recovery, ResyncJob,
};
pub use ledger::{clock_origin, Ledger};
pub use registry::{Pod, Registry, Rules};
pub use route::{
    precise::precise, report, report_at, route, route_gated_with, route_until, route_with,
    route_within, PolicySelector, RouteError, Selector,
};
pub use serve::{load_tokenizers, run as serve, wait_for_signal, ServeArgs};
pub use state::{Channels, Sidecar};
pub use tokenize::template::render_source as render_template;
pub use tokenize::{
    Budget as TokenizeBudget, ContentFormat, ModelTokenizer, Tokenizers, DEFAULT_BUDGET_BYTES,
    MAX_FIELDS_BYTES,
};

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
