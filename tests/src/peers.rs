//! The real routers kvroute is measured against, run as shipped: SGLang's model gateway
//! (`smg`) and vLLM's router (`vllm-router`), from their PyPI packages, on loopback, over
//! the same engine simulators as kvroute.
//!
//! `make peers-deps` installs the pinned versions into `target/peers/venv`; a binary is
//! looked up there first, then in `$KVROUTE_PEERS_BIN`, then on `PATH`. Each router gets
//! its documented defaults plus what the engines need matched (the block size, and for
//! vLLM's `kv_aware` the engines' ZMQ event endpoints), and its own Prometheus port (two
//! instances on the default port: the second panics at start).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::json;

use crate::procs::{free_port, Child};

/// The versions `make peers-deps` installs (docs/benchmarks.md reports figures for these).
pub const SMG_VERSION: &str = "1.13.0";
pub const VLLM_ROUTER_VERSION: &str = "0.1.17";

/// A peer router and the policy it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `smg --policy cache_aware`: a radix tree of the text it routed, per worker, with
    /// a shortest-queue fallback when the pool is imbalanced.
    SmgCacheAware,
    /// `smg --policy prefix_hash`: a consistent-hash ring over the prompt's head.
    SmgPrefixHash,
    /// `vllm-router --policy cache_aware`: SGLang's tree policy, as vLLM ships it.
    VllmCacheAware,
    /// `vllm-router --policy kv_aware`: the engines' own KV events (ZMQ) and token ids
    /// from the engines' render API.
    VllmKvAware,
}

impl Kind {
    pub const ALL: [Kind; 4] = [
        Kind::SmgCacheAware,
        Kind::SmgPrefixHash,
        Kind::VllmCacheAware,
        Kind::VllmKvAware,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Kind::SmgCacheAware => "smg cache_aware",
            Kind::SmgPrefixHash => "smg prefix_hash",
            Kind::VllmCacheAware => "vllm-router cache_aware",
            Kind::VllmKvAware => "vllm-router kv_aware",
        }
    }

    pub fn binary(self) -> &'static str {
        match self {
            Kind::SmgCacheAware | Kind::SmgPrefixHash => "smg",
            Kind::VllmCacheAware | Kind::VllmKvAware => "vllm-router",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL
            .into_iter()
            .find(|k| k.label() == s || k.label().replace(' ', ":") == s)
    }
}

/// An engine as a router sees it: its HTTP address and, when it publishes vLLM's events,
/// their ZMQ endpoint.
#[derive(Clone, Debug)]
pub struct Worker {
    pub http: SocketAddr,
    pub zmq: Option<String>,
}

/// Where a peer's binary is: the pinned venv, then `$KVROUTE_PEERS_BIN`, then `PATH`.
pub fn peer_bin(name: &str) -> PathBuf {
    let venv = crate::procs::workspace_bin("")
        .parent()
        .map(|target| target.join("peers/venv/bin").join(name));
    if let Some(p) = venv.filter(|p| p.exists()) {
        return p;
    }
    if let Some(dir) = std::env::var_os("KVROUTE_PEERS_BIN") {
        let p = Path::new(&dir).join(name);
        if p.exists() {
            return p;
        }
    }
    PathBuf::from(name)
}

/// A running peer router.
pub struct Peer {
    pub url: String,
    child: Child,
}

impl Peer {
    /// Launch `kind` over `workers` (engines' block size `block_size`), its output in
    /// `log`, and wait until it routes a request (30 s at most).
    pub async fn start(
        kind: Kind,
        workers: &[Worker],
        block_size: u32,
        log: &Path,
    ) -> anyhow::Result<Peer> {
        let port = free_port();
        let urls = workers.iter().map(|w| format!("http://{}", w.http));
        let mut cmd = Command::new(peer_bin(kind.binary()));
        match kind {
            Kind::SmgCacheAware | Kind::SmgPrefixHash => {
                let policy = if kind == Kind::SmgCacheAware {
                    "cache_aware"
                } else {
                    "prefix_hash"
                };
                cmd.arg("launch")
                    .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                    .arg("--worker-urls")
                    .args(urls)
                    .args(["--policy", policy, "--log-level", "warn"])
                    .args(["--block-size", &block_size.to_string()])
                    .args(["--prometheus-port", &free_port().to_string()])
                    .arg("--disable-tokenizer-autoload");
            }
            Kind::VllmCacheAware | Kind::VllmKvAware => {
                let policy = if kind == Kind::VllmCacheAware {
                    "cache_aware"
                } else {
                    "kv_aware"
                };
                cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()])
                    .arg("--worker-urls")
                    .args(urls)
                    .args(["--policy", policy, "--log-level", "warning"])
                    .args(["--prometheus-port", &free_port().to_string()])
                    // Its default waits a minute between worker health checks before
                    // the first; the engines are up already.
                    .args(["--worker-startup-check-interval", "1"]);
                if kind == Kind::VllmKvAware {
                    for w in workers {
                        let ep = w.zmq.as_deref().ok_or_else(|| {
                            anyhow::anyhow!("kv_aware needs engines publishing vLLM events")
                        })?;
                        cmd.arg("--kv-event-source")
                            .arg(format!("http://{}={ep}", w.http));
                    }
                    cmd.args(["--kv-event-block-size", &block_size.to_string()])
                        .args(["--kv-event-model", "m"]);
                }
            }
        }
        let child = Child::spawn(kind.label(), &mut cmd, Some(log))?;
        let url = format!("http://127.0.0.1:{port}");
        let mut peer = Peer { url, child };
        let http = reqwest::Client::new();
        for _ in 0..300 {
            let probe = json!({"model": "m", "prompt": "ready?", "max_tokens": 1});
            if let Ok(r) = http
                .post(format!("{}/v1/completions", peer.url))
                .json(&probe)
                .send()
                .await
            {
                if r.status().is_success() {
                    return Ok(peer);
                }
            }
            if !peer.child.alive() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let tail = std::fs::read_to_string(log).unwrap_or_default();
        let tail: String = tail.lines().rev().take(8).collect::<Vec<_>>().join("\n");
        anyhow::bail!(
            "{} did not route a request within 30 s (is it installed? `make peers-deps`); log {}:\n{tail}",
            kind.label(),
            log.display()
        )
    }

    pub fn pid(&self) -> u32 {
        self.child.pid()
    }
}
