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

/// Write `reqs` as a Mooncake trace (one JSON line each, in arrival order), so another
/// router's replay can run exactly what the simulator runs. Blocks are renumbered in
/// order of first appearance: a block's id names it and its whole prefix, as it does in
/// Mooncake's own traces.
pub fn write_mooncake(reqs: &[Request], path: &Path) -> anyhow::Result<()> {
    use std::io::Write;
    let mut order: Vec<&Request> = reqs.iter().collect();
    order.sort_by(|a, b| a.ts_ms.total_cmp(&b.ts_ms));
    let mut ids: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
    let mut tail = 0u64;
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    for r in order {
        let mut hash_ids: Vec<u64> = r
            .chain
            .iter()
            .map(|h| {
                let next = ids.len() as u64;
                *ids.entry(*h).or_insert(next)
            })
            .collect();
        // A Mooncake line names every block its input touches, the partial last one
        // too (a chain holds full blocks only): that one is the request's own.
        let covered = hash_ids.len() as u64 * u64::from(MOONCAKE_BLOCK_TOKENS);
        if u64::from(r.input_tokens) > covered {
            hash_ids.push(u64::MAX - tail);
            tail += 1;
        }
        let line = serde_json::json!({
            "timestamp": r.ts_ms.round().max(0.0) as u64,
            "input_length": r.input_tokens,
            "output_length": r.output_tokens,
            "hash_ids": hash_ids,
        });
        writeln!(out, "{line}")?;
    }
    out.flush()?;
    Ok(())
}

/// The Mooncake trace shipped in the repository (tests/data, with its attribution).
pub fn default_trace() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mooncake_synthetic_trace.jsonl")
}

/// The agentic sessions shipped in the repository (tests/data/agentic, with their
/// attribution and licence).
pub fn default_agentic() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data/agentic/kv-cache-tester-traces.tar.gz")
}

/// How agentic sessions are replayed.
#[derive(Clone, Copy, Debug)]
pub struct AgenticOpts {
    /// Tokens per block of the replay (a multiple of the traces' 64).
    pub block_tokens: u32,
    /// Mean gap between session starts, seconds (Poisson arrivals).
    pub mean_gap_s: f64,
    pub seed: u64,
}

#[derive(Deserialize)]
struct Session {
    #[serde(default = "sixty_four")]
    block_size: u32,
    requests: Vec<Entry>,
}

fn sixty_four() -> u32 {
    64
}

#[derive(Deserialize)]
struct Entry {
    t: f64,
    #[serde(default, rename = "type")]
    kind: String,
    #[serde(default, rename = "in")]
    input: u32,
    #[serde(default)]
    out: u32,
    #[serde(default)]
    hash_ids: Vec<u64>,
    /// A sub-agent's own requests, timed from its `t`.
    #[serde(default)]
    requests: Vec<Entry>,
}

/// Agentic sessions in the kv-cache-tester format (a directory of JSON files, or a
/// `.tar.gz` of one), as requests: sessions start as a seeded Poisson process, each keeps
/// its recorded timing (think and tool gaps included; sub-agents at their offsets), and
/// its 64-token ids are regrouped into `block_tokens` blocks, each hashed with the
/// block before it and the session (ids are local to a session), so equal prefixes within
/// a session share blocks and different sessions share none. A sub-agent shares its
/// parent's ids and so its prefix blocks, and is a session of its own for affinity.
pub fn load_agentic(path: &Path, o: AgenticOpts) -> anyhow::Result<Vec<Request>> {
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    if path.is_dir() {
        for e in std::fs::read_dir(path)? {
            let p = e?.path();
            if p.extension().is_some_and(|x| x == "json") {
                files.push((p.display().to_string(), std::fs::read(&p)?));
            }
        }
    } else {
        let f = std::fs::File::open(path)
            .with_context(|| format!("opening sessions {}", path.display()))?;
        let mut ar = tar::Archive::new(flate2::read::GzDecoder::new(f));
        for e in ar.entries()? {
            let mut e = e?;
            let name = e.path()?.display().to_string();
            if name.ends_with(".json") {
                let mut buf = Vec::new();
                std::io::Read::read_to_end(&mut e, &mut buf)?;
                files.push((name, buf));
            }
        }
    }
    // Sorted by name, so a seed always gives the same replay.
    files.sort();
    anyhow::ensure!(!files.is_empty(), "no session files in {}", path.display());
    let mut rng = crate::bench::Rng(o.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut start = 0.0f64;
    let mut out = Vec::new();
    for (n, (name, bytes)) in files.iter().enumerate() {
        let s: Session =
            serde_json::from_slice(bytes).with_context(|| format!("{name}: not a session"))?;
        anyhow::ensure!(
            s.block_size > 0 && o.block_tokens.is_multiple_of(s.block_size),
            "{name}: block size {} does not divide {}",
            s.block_size,
            o.block_tokens
        );
        let group = (o.block_tokens / s.block_size) as usize;
        // Exponential gaps: -ln(U) × mean.
        start += -(1.0 - rng.f64()).max(1e-12).ln() * o.mean_gap_s;
        let mut sub = 0u64;
        push_entries(
            &s.requests,
            start,
            n as u64,
            n as u64,
            group,
            &mut sub,
            &mut out,
        );
    }
    out.sort_by(|a, b| a.ts_ms.total_cmp(&b.ts_ms));
    Ok(out)
}

fn push_entries(
    entries: &[Entry],
    t0: f64,
    session: u64,
    key: u64,
    group: usize,
    sub: &mut u64,
    out: &mut Vec<Request>,
) {
    for e in entries {
        let t = t0 + e.t.max(0.0);
        if e.kind == "subagent" {
            *sub += 1;
            // Its own affinity key; its parent's id space.
            let k = key ^ (*sub << 40) ^ 0x5u64 << 60;
            push_entries(&e.requests, t, session, k, group, sub, out);
            continue;
        }
        let mut chain = Vec::with_capacity(e.hash_ids.len() / group);
        let mut prev = id_hash(session ^ 0xA6E7_1C00_0000_0000);
        for ids in e.hash_ids.chunks_exact(group) {
            let mut h = prev;
            for id in ids {
                h = id_hash(h ^ id_hash(*id));
            }
            chain.push(h);
            prev = h;
        }
        out.push(Request {
            ts_ms: t * 1e3,
            input_tokens: e.input,
            output_tokens: e.out.max(1),
            chain,
            session: Some(key),
        });
    }
}

/// `reqs` with each output scaled by `scale` and capped at `max` tokens, at least one:
/// the outputs `kvroute-bench peers` asks the live engines for (it turns a trace block
/// into 64 tokens of text, scales outputs by the same 1/8 and asks for at most 64), so
/// the simulator can run the live load's decode.
pub fn scale_outputs(reqs: &[Request], scale: f64, max: u32) -> Vec<Request> {
    reqs.iter()
        .map(|r| Request {
            output_tokens: ((r.output_tokens as f64 * scale).round() as u32).clamp(1, max.max(1)),
            ..r.clone()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_scale_like_the_live_load() {
        let req = |out| Request {
            ts_ms: 0.0,
            input_tokens: 1024,
            output_tokens: out,
            chain: vec![1, 2],
            session: None,
        };
        let reqs = [req(1), req(80), req(400), req(10_000)];
        let got: Vec<u32> = scale_outputs(&reqs, 0.125, 64)
            .iter()
            .map(|r| r.output_tokens)
            .collect();
        assert_eq!(got, vec![1, 10, 50, 64]);
        // Nothing else changes.
        let one = scale_outputs(&reqs[1..2], 1.0, u32::MAX);
        assert_eq!((one[0].output_tokens, &one[0].chain), (80, &reqs[1].chain));
    }
}
