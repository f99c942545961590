//! The steady state users live in: engines whose caches are already full, and the same
//! kind of load run after run with fresh prefixes. A router that only looks good on
//! fresh engines (or whose picture of the caches decays as they fill) shows it here.
//!
//! - [`fill_caches`] writes unique prompts straight to every engine until its cache has
//!   turned over once;
//! - [`runs`] replays a [`ChatLoad`] through a gateway `n` times (seed per run), with
//!   the sidecar's decision and misprediction counts per run when there is one;
//!
//! The real routers run over the same engines through [`crate::peers`].

use std::net::SocketAddr;

use serde_json::{json, Value};

use crate::bench::Rng;
use crate::client::Api;
use crate::demo::{self, ChatLoad, Summary};

/// Send every engine unique token prompts of `prompt_tokens` until it has been asked to
/// cache `turnover` times its capacity, so its cache is full of blocks no later request
/// shares.
pub async fn fill_caches(
    engines: &[SocketAddr],
    capacity_blocks: u32,
    block_tokens: u32,
    turnover: f64,
) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let prompt_tokens = 2048usize;
    let per_engine = ((capacity_blocks as f64 * block_tokens as f64 * turnover)
        / prompt_tokens as f64)
        .ceil() as usize;
    let mut tasks = tokio::task::JoinSet::new();
    for (e, addr) in engines.iter().enumerate() {
        let (http, url) = (http.clone(), format!("http://{addr}/v1/completions"));
        tasks.spawn(async move {
            let mut rng = Rng(0xF111 + e as u64);
            for _ in 0..per_engine {
                let p: Vec<u32> = (0..prompt_tokens)
                    .map(|_| rng.below(100_000) as u32)
                    .collect();
                let body = json!({"model": "m", "prompt": p, "max_tokens": 1});
                let r = http.post(&url).json(&body).send().await?;
                anyhow::ensure!(r.status().is_success(), "engine {url}: {}", r.status());
                let _ = r.bytes().await;
            }
            Ok::<_, anyhow::Error>(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}

/// One measured replay.
pub struct Run {
    pub summary: Summary,
    /// The sidecar's decisions and mispredictions during the run (kvroute only).
    pub decisions: Option<u64>,
    pub mispredictions: Option<u64>,
    /// Reports short only on guesses still being prefilled when routed (kvroute only).
    pub predicted_in_flight: Option<u64>,
}

impl Run {
    pub fn json(&self) -> Value {
        let mut v = self.summary.json();
        v["decisions"] = json!(self.decisions);
        v["mispredictions"] = json!(self.mispredictions);
        v["predicted_in_flight"] = json!(self.predicted_in_flight);
        v
    }
}

async fn counters(api: &Api) -> [u64; 3] {
    let s = api.get("/v1/status").await.json;
    let c = &s["counters"];
    ["decisions", "mispredictions", "predicted_in_flight"].map(|k| c[k].as_u64().unwrap_or(0))
}

/// Replay `load` through `base` `n` times, the seed advanced every run (fresh prefixes).
pub async fn runs(
    base: &str,
    sidecar: Option<&Api>,
    load: ChatLoad,
    n: usize,
    concurrency: usize,
) -> Vec<Run> {
    let mut out = Vec::new();
    for i in 0..n {
        let sessions = demo::chat_load(ChatLoad {
            seed: load.seed + i as u64,
            ..load
        });
        let before = match sidecar {
            Some(api) => Some(counters(api).await),
            None => None,
        };
        let outcomes = demo::run(base, &sessions, concurrency, |_, _| {}).await;
        let after = match sidecar {
            Some(api) => Some(counters(api).await),
            None => None,
        };
        let delta = before
            .zip(after)
            .map(|(b, a)| [0, 1, 2].map(|i| a[i].saturating_sub(b[i])));
        out.push(Run {
            summary: demo::summarize(&outcomes),
            decisions: delta.map(|d| d[0]),
            mispredictions: delta.map(|d| d[1]),
            predicted_in_flight: delta.map(|d| d[2]),
        });
    }
    out
}
