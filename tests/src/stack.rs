//! The whole stack on loopback: nats-server, the sidecar (Unix socket + NATS), N engine
//! simulators, Envoy with the kvroute filter, and a plain round-robin Envoy over the same
//! engines for comparison; [`Stack::replica`] adds a second gateway replica. Every process
//! is killed when the [`Stack`] drops, also when a test panics; [`crate::procs::Child`]
//! runs each in its own process group.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::Context;
use serde_json::{json, Value};

use crate::client::Api;
use crate::envoy::{Envoy, EnvoyLayout, Fallback, SidecarAddr};
use crate::procs::{free_port, wait_until, workspace_bin, Child};
use crate::services::{BridgeProc, Nats, SidecarProc};

pub struct EngineProc {
    pub addr: SocketAddr,
    child: Child,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl EngineProc {
    pub fn start(args: &[String]) -> anyhow::Result<EngineProc> {
        let bin = workspace_bin("kvroute-engine-sim");
        anyhow::ensure!(
            bin.exists(),
            "{} missing: build the workspace first",
            bin.display()
        );
        let dir = tempfile::tempdir()?;
        let log = dir.path().join("engine.log");
        let child = Child::spawn(
            "kvroute-engine-sim",
            Command::new(&bin).args(args),
            Some(&log),
        )?;
        let addr = wait_until(Duration::from_secs(20), || {
            let text = std::fs::read_to_string(&log).ok()?;
            text.lines().find_map(|l| {
                l.strip_prefix("kvroute-engine-sim: listening on ")?
                    .trim()
                    .parse()
                    .ok()
            })
        })
        .with_context(|| {
            format!(
                "engine did not start: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        })?;
        Ok(EngineProc {
            addr,
            child,
            log,
            _dir: dir,
        })
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn kill(&mut self) {
        self.child.kill();
    }

    pub fn pid(&self) -> u32 {
        self.child.pid()
    }
}

/// Engine simulator flags: cache capacity (blocks), prefill throughput (tokens/s), decode
/// step (ms), batch 8, and the time scale.
pub fn engine_args(
    capacity_blocks: u32,
    prefill_tps: u32,
    decode_ms: u32,
    time_scale: f64,
) -> Vec<String> {
    [
        "--capacity-blocks".to_string(),
        capacity_blocks.to_string(),
        "--prefill-tps".into(),
        prefill_tps.to_string(),
        "--decode-ms".into(),
        decode_ms.to_string(),
        "--max-batch".into(),
        "8".into(),
        "--time-scale".into(),
        time_scale.to_string(),
    ]
    .to_vec()
}

#[derive(Clone, Debug)]
pub struct StackOpts {
    pub engines: usize,
    pub nats: bool,
    /// Engines publish KV events (false: predicted mode only).
    pub engine_events: bool,
    pub engine_args: Vec<String>,
    pub filter_config: Value,
    pub sidecar_args: Vec<String>,
    /// Register pods with their dump URL (for resyncs).
    pub register_dumps: bool,
    /// Engines speak vLLM's event protocol (ZMQ, salted hashes) and a
    /// `kvroute-bridge` beside each translates it (needs `nats`).
    pub vllm_events: bool,
    /// A Hugging Face model directory for model "m": the engines tokenize with it, the
    /// sidecar loads it (`--tokenizer`), and the filter hands chat/text requests over
    /// (`sidecar_tokenizes`), so chat is routed from the engines' events.
    pub model_dir: Option<std::path::PathBuf>,
}

impl Default for StackOpts {
    fn default() -> Self {
        StackOpts {
            engines: 4,
            nats: true,
            engine_events: true,
            engine_args: vec![],
            filter_config: json!({"timeout_ms": 50, "default_model": {"block_size": 16}}),
            sidecar_args: vec![],
            register_dumps: true,
            vllm_events: false,
            model_dir: None,
        }
    }
}

pub struct Stack {
    pub nats: Option<Nats>,
    pub sidecar: SidecarProc,
    pub engines: Vec<EngineProc>,
    /// One per engine with `vllm_events`.
    pub bridges: Vec<BridgeProc>,
    /// The engines' ZMQ event endpoints, in engine order, with `vllm_events`.
    pub zmq: Vec<String>,
    pub envoy: Envoy,
    pub plain: Envoy,
    pub api: Api,
    pub opts: StackOpts,
    /// The sidecar's command line, for [`Stack::replica`].
    sidecar_args: Vec<String>,
}

/// A second gateway replica over the same engines: its own sidecar (sharing the stack's
/// NATS, so it hears the same engine events and the first replica's decisions) and its
/// own Envoy with the filter.
pub struct Replica {
    pub sidecar: SidecarProc,
    pub envoy: Envoy,
    pub api: Api,
}

/// Register the engines as pods of model "m" with a sidecar (with the URL it resyncs
/// each from: its bridge's dump, or the engine's own).
async fn register(
    api: &Api,
    engines: &[EngineProc],
    bridges: &[BridgeProc],
    dumps: bool,
) -> anyhow::Result<()> {
    for (i, e) in engines.iter().enumerate() {
        let mut reg = json!({"model": "m"});
        if dumps {
            reg["dump_url"] = match bridges.get(i) {
                Some(b) => json!(format!("http://{}/dump", b.listen)),
                None => json!(format!("http://{}/kvroute/dump", e.addr)),
            };
        }
        let r = api.put(&format!("/v1/pods/{}", e.addr), &reg).await;
        anyhow::ensure!(r.status == 200, "registering {}: {}", e.addr, r.json);
    }
    Ok(())
}

impl Stack {
    pub async fn start(o: StackOpts) -> anyhow::Result<Stack> {
        let nats = if o.nats { Some(Nats::start()?) } else { None };
        let mut o = o;
        let mut sargs: Vec<String> = o.sidecar_args.clone();
        if let Some(d) = &o.model_dir {
            sargs.push(format!("--tokenizer=m={}", d.display()));
            o.engine_args
                .extend(["--model-dir".into(), d.display().to_string()]);
            // The sidecar tokenizes every chat here, in a debug build, on a machine the
            // engines, bridges, NATS and Envoy share: 50 ms is too short for that, and a
            // route past the filter's deadline is (rightly) neither committed nor recorded.
            // These tests are about where requests go, not how fast a debug build decides.
            if o.filter_config["timeout_ms"].as_u64().unwrap_or(0) < 2000 {
                o.filter_config["timeout_ms"] = json!(2000);
            }
            let bs = o.filter_config["default_model"]["block_size"].clone();
            o.filter_config["models"]["m"] = json!({"block_size": bs, "sidecar_tokenizes": true});
        }
        if let Some(n) = &nats {
            sargs.extend(["--nats".into(), n.url()]);
        }
        let sref: Vec<&str> = sargs.iter().map(String::as_str).collect();
        let sidecar = SidecarProc::start(&sref, true)?;
        let api = Api::new(sidecar.addr);
        anyhow::ensure!(
            !o.vllm_events || (o.engine_events && nats.is_some()),
            "vllm_events needs engine_events and nats"
        );
        let mut engines = Vec::new();
        let mut zmq = Vec::new();
        for i in 0..o.engines {
            let mut a: Vec<String> = vec!["--seed".into(), (i + 1).to_string()];
            a.extend(o.engine_args.iter().cloned());
            if !o.engine_events {
                a.push("--no-events".into());
            } else if o.vllm_events {
                let ep = format!("tcp://127.0.0.1:{}", free_port());
                a.extend(["--zmq-events".into(), ep.clone()]);
                zmq.push(ep);
            } else if let Some(n) = &nats {
                a.extend(["--nats".into(), n.url()]);
            } else {
                a.extend(["--sidecar".into(), format!("http://{}", sidecar.addr)]);
            }
            engines.push(EngineProc::start(&a)?);
        }
        let mut bridges = Vec::new();
        if let Some(n) = nats.as_ref().filter(|_| o.vllm_events) {
            for (e, ep) in engines.iter().zip(&zmq) {
                let pod = e.addr.to_string();
                bridges.push(BridgeProc::start(
                    ep,
                    &pod,
                    &[format!("--nats={}", n.url())],
                )?);
            }
        }
        register(&api, &engines, &bridges, o.register_dumps).await?;
        let wasm = crate::wasm_path();
        anyhow::ensure!(
            wasm.exists(),
            "build the filter first: make wasm ({} missing)",
            wasm.display()
        );
        let layout = |with_filter: bool| EnvoyLayout {
            listen_port: 0,
            sidecar: SidecarAddr::Uds(sidecar.uds.clone().unwrap_or_default()),
            engines: engines.iter().map(|e| e.addr).collect(),
            wasm_path: wasm.clone(),
            filter_config: o.filter_config.clone(),
            with_filter,
            fallback: Fallback::RoundRobin,
            access_log: false,
        };
        let (l1, l2) = (layout(true), layout(false));
        let envoy = tokio::task::spawn_blocking(move || Envoy::start(&l1)).await??;
        let plain = tokio::task::spawn_blocking(move || Envoy::start(&l2)).await??;
        // Wait until NATS subscriptions are up, so no early event is lost.
        if nats.is_some() {
            for _ in 0..200 {
                if api.metric("kvroute_nats_connected").await == 1.0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(Stack {
            nats,
            sidecar,
            engines,
            bridges,
            zmq,
            envoy,
            plain,
            api,
            opts: o,
            sidecar_args: sargs,
        })
    }

    /// Start another gateway replica ([`Replica`]) with the stack's settings and pods.
    pub async fn replica(&self) -> anyhow::Result<Replica> {
        let sref: Vec<&str> = self.sidecar_args.iter().map(String::as_str).collect();
        let sidecar = SidecarProc::start(&sref, true)?;
        let api = Api::new(sidecar.addr);
        register(&api, &self.engines, &self.bridges, self.opts.register_dumps).await?;
        let layout = EnvoyLayout {
            listen_port: 0,
            sidecar: SidecarAddr::Uds(sidecar.uds.clone().unwrap_or_default()),
            engines: self.engines.iter().map(|e| e.addr).collect(),
            wasm_path: crate::wasm_path(),
            filter_config: self.opts.filter_config.clone(),
            with_filter: true,
            fallback: Fallback::RoundRobin,
            access_log: false,
        };
        let envoy = tokio::task::spawn_blocking(move || Envoy::start(&layout)).await??;
        if self.nats.is_some() {
            for _ in 0..200 {
                if api.metric("kvroute_nats_connected").await == 1.0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
        Ok(Replica {
            sidecar,
            envoy,
            api,
        })
    }

    /// The engines as a router is given them (with their event endpoints, if any).
    pub fn workers(&self) -> Vec<crate::peers::Worker> {
        self.engines
            .iter()
            .enumerate()
            .map(|(i, e)| crate::peers::Worker {
                http: e.addr,
                zmq: self.zmq.get(i).cloned(),
            })
            .collect()
    }

    /// Empty every engine's cache (a simulated restart: new epoch), e.g. between runs.
    pub async fn restart_engines(&self) {
        let http = reqwest::Client::new();
        for e in &self.engines {
            let _ = http
                .post(format!("http://{}/admin/restart", e.addr))
                .send()
                .await;
        }
        // Let the `cleared` events reach the sidecar.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    /// PIDs of every process of the stack (to check none outlives it).
    pub fn pids(&self) -> Vec<u32> {
        let mut v = vec![
            self.sidecar.pid(),
            self.envoy.child.pid(),
            self.plain.child.pid(),
        ];
        v.extend(self.engines.iter().map(|e| e.pid()));
        v.extend(self.bridges.iter().map(|b| b.child.pid()));
        if let Some(n) = &self.nats {
            v.extend(n.pid());
        }
        v
    }
}

/// Is this PID still a live process (not a zombie)?
pub fn pid_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next())
        })
        .is_some_and(|state| state != 'Z')
}
