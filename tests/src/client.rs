//! A small typed client of the sidecar's HTTP API, for tests, the demo and benchmarks.

use kvroute_shared::protocol::{
    Event, EventBatch, PodRegistration, RouteRequest, RouteResponse, Tier,
};
use kvroute_shared::Mode;
use serde_json::Value;

#[derive(Clone)]
pub struct Api {
    pub base: String,
    pub http: reqwest::Client,
    pub token: Option<String>,
}

/// A response's status and JSON body (`Null` when empty or not JSON).
pub struct Reply {
    pub status: u16,
    pub json: Value,
}

impl Api {
    pub fn new(addr: std::net::SocketAddr) -> Api {
        Api {
            base: format!("http://{addr}"),
            http: reqwest::Client::new(),
            token: None,
        }
    }

    pub fn with_token(mut self, t: &str) -> Api {
        self.token = Some(t.to_string());
        self
    }

    async fn send(&self, method: reqwest::Method, path: &str, body: Option<Vec<u8>>) -> Reply {
        let mut r = self.http.request(method, format!("{}{path}", self.base));
        if let Some(t) = &self.token {
            r = r.bearer_auth(t);
        }
        if let Some(b) = body {
            r = r.header("content-type", "application/json").body(b);
        }
        let resp = r.send().await.expect("sidecar reachable");
        let status = resp.status().as_u16();
        let bytes = resp.bytes().await.unwrap_or_default();
        Reply {
            status,
            json: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        }
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.send(reqwest::Method::GET, path, None).await
    }

    pub async fn post(&self, path: &str, body: impl serde::Serialize) -> Reply {
        self.send(reqwest::Method::POST, path, serde_json::to_vec(&body).ok())
            .await
    }

    pub async fn post_raw(&self, path: &str, body: &[u8]) -> Reply {
        self.send(reqwest::Method::POST, path, Some(body.to_vec()))
            .await
    }

    pub async fn put(&self, path: &str, body: impl serde::Serialize) -> Reply {
        self.send(reqwest::Method::PUT, path, serde_json::to_vec(&body).ok())
            .await
    }

    /// Sets `settings` (top-level keys of the policy config) over the sidecar's current
    /// config, as an operator's `PUT /v1/config` would.
    pub async fn merge_config(
        &self,
        settings: &serde_json::Map<String, Value>,
    ) -> anyhow::Result<()> {
        let mut cfg = self.get("/v1/config").await.json;
        for (k, v) in settings {
            cfg[k] = v.clone();
        }
        let r = self.put("/v1/config", &cfg).await;
        anyhow::ensure!(r.status == 200, "config refused: {}", r.json);
        Ok(())
    }

    pub async fn delete(&self, path: &str) -> Reply {
        self.send(reqwest::Method::DELETE, path, None).await
    }

    pub async fn register(&self, pod: &str, model: &str) -> Reply {
        self.put(
            &format!("/v1/pods/{pod}"),
            PodRegistration {
                model: model.into(),
                ..Default::default()
            },
        )
        .await
    }

    pub async fn events(&self, b: &EventBatch) -> Reply {
        self.post("/v1/events", b).await
    }

    /// Route a token-mode chain; panics on a non-200 answer.
    pub async fn route(&self, model: &str, chain: &[u64], block_size: u32) -> RouteResponse {
        let r = self
            .post("/v1/route", route_req(model, chain, block_size))
            .await;
        assert_eq!(r.status, 200, "route failed: {}", r.json);
        serde_json::from_value(r.json).expect("route response")
    }

    /// Blocks of `chain` the best-ranked pod holds (a dry-run route: nothing recorded).
    pub async fn matched(&self, model: &str, chain: &[u64], block_size: u32) -> u32 {
        let mut r = route_req(model, chain, block_size);
        r.dry_run = true;
        let resp = self.post("/v1/route", &r).await;
        resp.json["ranked"][0]["matched_blocks"]
            .as_u64()
            .unwrap_or(0) as u32
    }

    /// Wait (up to 5 s) until [`Api::matched`] is `blocks`; panics naming `what`.
    /// Poll `/v1/lookup` until the deepest confirmed pod matches `blocks` of `chain` (or
    /// ~5 s pass); returns the last `confirmed` list.
    pub async fn until_confirmed(&self, model: &str, chain: &[u64], blocks: u64) -> Value {
        let q = chain
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let mut confirmed = Value::Null;
        for _ in 0..200 {
            confirmed = self
                .get(&format!("/v1/lookup?model={model}&chain={q}"))
                .await
                .json["confirmed"]
                .clone();
            if confirmed[0]["matched_blocks"].as_u64() == Some(blocks) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        }
        confirmed
    }

    pub async fn until_matched(
        &self,
        model: &str,
        chain: &[u64],
        block_size: u32,
        blocks: u32,
        what: &str,
    ) {
        let mut last = 0;
        for _ in 0..200 {
            last = self.matched(model, chain, block_size).await;
            if last == blocks {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        }
        panic!("timed out waiting for: {what} ({last} blocks matched, want {blocks})");
    }

    /// The sidecar's whole OpenMetrics text.
    pub async fn metrics_text(&self) -> String {
        let resp = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .expect("metrics");
        resp.text().await.unwrap_or_default()
    }

    /// Poll a metric until it reaches `want` (at most 5 s): counters the sidecar bumps
    /// as a task ends can lag what the test already saw. Returns the last value read.
    pub async fn metric_reaching(&self, name: &str, want: f64) -> f64 {
        let mut v = 0.0;
        for _ in 0..100 {
            v = self.metric(name).await;
            if v >= want {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        v
    }

    pub async fn metric(&self, name: &str) -> f64 {
        let text = self.metrics_text().await;
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                (k == name).then(|| v.parse().ok()).flatten()
            })
            .unwrap_or(0.0)
    }
}

/// A dry-run route request for a chat `body` the sidecar tokenizes (its prompt body; the
/// text chain left empty).
pub fn chat_route_req(model: &str, body: &Value) -> RouteRequest {
    RouteRequest {
        mode: Mode::Text,
        block_size: 256,
        prompt_tokens: 0,
        dry_run: true,
        prompt_body: kvroute_shared::protocol::PromptBody::extract(
            kvroute_shared::protocol::PromptApi::Chat,
            "",
            body.to_string().as_bytes(),
        )
        .ok(),
        ..route_req(model, &[], 256)
    }
}

pub fn route_req(model: &str, chain: &[u64], block_size: u32) -> RouteRequest {
    RouteRequest::tokens(model, block_size, chain.to_vec())
}

pub fn batch(pod: &str, model: &str, epoch: &str, seq: u64, events: Vec<Event>) -> EventBatch {
    EventBatch::new(pod, model, epoch, seq, events)
}

pub fn stored(blocks: &[u64]) -> Event {
    Event::Stored {
        tier: Tier::Gpu,
        parent: None,
        blocks: blocks.to_vec(),
        tokens: None,
    }
}

pub fn removed(blocks: &[u64]) -> Event {
    Event::Removed {
        tier: Tier::Gpu,
        blocks: blocks.to_vec(),
    }
}

/// The chain engines and the filter compute for `tokens` (no adapter, no salt).
pub fn token_chain(model: &str, block_size: u32, tokens: &[u32]) -> Vec<u64> {
    kvroute_shared::Namespace {
        mode: Mode::Tokens,
        block_size,
        model,
        adapter: "",
        cache_salt: "",
    }
    .chain_tokens(tokens)
}

/// A token chain of `n` blocks, distinct per `seed`.
pub fn chain(model: &str, seed: u32, n: usize, block_size: u32) -> Vec<u64> {
    let toks: Vec<u32> = (0..n as u32 * block_size)
        .map(|t| t.wrapping_add(seed.wrapping_mul(1_000_003)))
        .collect();
    token_chain(model, block_size, &toks)
}

/// POST an OpenAI request through a gateway; returns the pod that served it (the
/// engine's `x-pod` header) and the response's JSON.
pub async fn post_openai(url: &str, body: &serde_json::Value) -> (String, serde_json::Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .expect("request");
    assert!(r.status().is_success(), "{}", r.status());
    let pod = r
        .headers()
        .get("x-pod")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let v = r.json().await.unwrap_or(serde_json::Value::Null);
    (pod, v)
}
