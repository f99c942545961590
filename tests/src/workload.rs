//! Request workloads for the benchmarks and simulations: Mooncake-format traces.
//!
//! A Mooncake trace line is `{"timestamp": ms, "input_length": tokens, "output_length":
//! tokens, "hash_ids": [...]}` with one id per 512-token block, prefix-chained (an id
//! always has the same parent). Ids become u64 block hashes through a fixed mix, so the
//! index sees well-spread keys as it would from real chains.

use std::io::BufRead;
use std::path::Path;

use anyhow::Context;
use serde::Deserialize;

/// One request of a workload: when, how long, and its block chain.
#[derive(Clone, Debug)]
pub struct Request {
    pub ts_ms: f64,
    pub input_tokens: u32,
    pub output_tokens: u32,
    pub chain: Vec<u64>,
    /// A session key where the workload has one (multi-turn); else None.
    pub session: Option<u64>,
}

#[derive(Deserialize)]
struct Line {
    timestamp: f64,
    input_length: u32,
    output_length: u32,
    hash_ids: Vec<u64>,
}

/// The block hash of a trace id.
pub fn id_hash(id: u64) -> u64 {
    let mut z = id.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Tokens per block in Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

pub fn load_mooncake(path: &Path) -> anyhow::Result<Vec<Request>> {
    let f =
        std::fs::File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let l: Line = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not a trace line", path.display(), n + 1))?;
        out.push(Request {
            ts_ms: l.timestamp,
            input_tokens: l.input_length,
            output_tokens: l.output_length,
            chain: l.hash_ids.into_iter().map(id_hash).collect(),
            session: None,
        });
    }
    Ok(out)
}

/// The Mooncake trace shipped in the repository (tests/data, with its attribution).
pub fn default_trace() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mooncake_synthetic_trace.jsonl")
}
