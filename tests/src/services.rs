//! The real services as child processes: `nats-server`, `kvroute-sidecar serve` and
//! `kvroute-bridge`, each on free loopback ports, each killed when its handle
//! drops.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Context;

use crate::procs::{free_port, wait_until, workspace_bin, Child};

/// A `nats-server` on 127.0.0.1 (no JetStream needed: kvroute uses core NATS).
pub struct Nats {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// A configuration file (users, permissions), if started with one.
    config: Option<PathBuf>,
}

impl Nats {
    pub fn start() -> anyhow::Result<Nats> {
        let mut n = Nats {
            port: free_port(),
            child: None,
            dir: tempfile::tempdir()?,
            config: None,
        };
        n.restart()?;
        Ok(n)
    }

    /// Start with a configuration file's `authorization` (and any other) blocks; the
    /// listen address and port are given on the command line.
    pub fn start_with_config(conf: &str) -> anyhow::Result<Nats> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("nats.conf");
        std::fs::write(&path, conf)?;
        let mut n = Nats {
            port: free_port(),
            child: None,
            dir,
            config: Some(path),
        };
        n.restart()?;
        Ok(n)
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// (Re)start on the same port.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        let log = self.dir.path().join("nats.log");
        let mut cmd = Command::new("nats-server");
        if let Some(c) = &self.config {
            cmd.arg("-c").arg(c);
        }
        cmd.args(["-a", "127.0.0.1", "-p", &self.port.to_string()]);
        let child = Child::spawn("nats-server", &mut cmd, Some(&log))?;
        self.child = Some(child);
        let port = self.port;
        wait_until(Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).ok()
        })
        .with_context(|| {
            format!(
                "nats-server did not start: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        })?;
        Ok(())
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.pid())
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill();
        }
    }
}

/// A running `kvroute-sidecar serve`.
pub struct SidecarProc {
    pub addr: SocketAddr,
    pub uds: Option<PathBuf>,
    args: Vec<String>,
    child: Child,
    log: PathBuf,
    pub dir: tempfile::TempDir,
}

pub fn sidecar_bin() -> PathBuf {
    workspace_bin("kvroute-sidecar")
}

impl SidecarProc {
    /// Start with extra `serve` arguments; `--listen` is a free port, and `uds` a socket in
    /// a temporary directory when asked. The engines here all run on loopback, so the
    /// sidecar learns local pods from their events (`--learn-local-pods`).
    pub fn start(args: &[&str], uds: bool) -> anyhow::Result<SidecarProc> {
        let mut all = vec!["--learn-local-pods"];
        all.extend_from_slice(args);
        Self::start_strict(&all, uds)
    }

    /// [`SidecarProc::start`] with the production defaults (no local pods learned).
    pub fn start_strict(args: &[&str], uds: bool) -> anyhow::Result<SidecarProc> {
        let dir = tempfile::tempdir()?;
        let log = dir.path().join("sidecar.log");
        let sock = uds.then(|| dir.path().join("sidecar.sock"));
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let (child, addr) = Self::spawn(&args, sock.as_deref(), &log)?;
        Ok(SidecarProc {
            addr,
            uds: sock,
            args,
            child,
            log,
            dir,
        })
    }

    fn spawn(
        args: &[String],
        sock: Option<&Path>,
        log: &Path,
    ) -> anyhow::Result<(Child, SocketAddr)> {
        let bin = sidecar_bin();
        anyhow::ensure!(
            bin.exists(),
            "{} missing: build the workspace first (cargo build)",
            bin.display()
        );
        let _ = std::fs::remove_file(log);
        let mut cmd = Command::new(&bin);
        cmd.arg("serve")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .args(args)
            .env("KVROUTE_LOG", "info");
        if let Some(s) = sock {
            cmd.arg("--uds").arg(s);
        }
        let child = Child::spawn("kvroute-sidecar", &mut cmd, Some(log))?;
        let addr =
            wait_until(Duration::from_secs(10), || listening_addr(log)).with_context(|| {
                format!(
                    "sidecar did not start: {}",
                    std::fs::read_to_string(log).unwrap_or_default()
                )
            })?;
        Ok((child, addr))
    }

    /// Start again with the same arguments and the same Unix socket (Envoy's cluster
    /// keeps pointing at it); the TCP port may change.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.child.kill();
        let (child, addr) = Self::spawn(&self.args, self.uds.as_deref(), &self.log)?;
        self.child = child;
        self.addr = addr;
        Ok(())
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The endpoint picker's address (started with `--picker-listen`).
    pub fn picker_addr(&self) -> Option<SocketAddr> {
        wait_until(Duration::from_secs(10), || {
            self.log().lines().find_map(|l| {
                l.strip_prefix("kvroute-sidecar: picker listening on ")?
                    .trim()
                    .parse()
                    .ok()
            })
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// SIGTERM and wait: returns the exit code (graceful shutdown).
    pub fn terminate(&mut self) -> Option<i32> {
        self.child.terminate(Duration::from_secs(10))
    }

    pub fn kill(&mut self) {
        self.child.kill();
    }
}

fn listening_addr(log: &Path) -> Option<SocketAddr> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines().find_map(|l| {
        l.strip_prefix("kvroute-sidecar: listening on ")?
            .trim()
            .parse()
            .ok()
    })
}

/// `kvroute-bridge` for one engine, listening on a free loopback port; started
/// once it has subscribed to the engine's ZMQ stream (a PUB socket drops what it sends
/// before that).
pub struct BridgeProc {
    pub child: Child,
    /// `host:port` of its HTTP server (`/dump`, `/metrics`).
    pub listen: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl BridgeProc {
    /// `zmq` is the engine's PUB endpoint, `pod` its HTTP address; `extra` says where to
    /// publish (`--nats=URL` / `--sidecar=URL`) and any other flags.
    pub fn start(zmq: &str, pod: &str, extra: &[String]) -> anyhow::Result<BridgeProc> {
        let dir = tempfile::tempdir()?;
        let log = dir.path().join("bridge.log");
        let listen = format!("127.0.0.1:{}", free_port());
        let mut cmd = Command::new(workspace_bin("kvroute-bridge"));
        cmd.args(["--zmq", zmq, "--pod", pod, "--model", "m"])
            .args(["--block-size", "16", "--listen", &listen])
            .args(extra)
            .env("KVROUTE_LOG", "info");
        let child = Child::spawn("kvroute-bridge", &mut cmd, Some(&log))?;
        let b = BridgeProc {
            child,
            listen,
            log,
            _dir: dir,
        };
        wait_until(Duration::from_secs(10), || {
            std::fs::read_to_string(&b.log)
                .ok()
                .filter(|l| l.contains("subscribed to engine KV events"))
        })
        .with_context(|| format!("bridge did not subscribe: {}", b.log()))?;
        Ok(b)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// GET a path of its HTTP server, as text.
    pub async fn get(&self, path: &str) -> String {
        match reqwest::get(format!("http://{}{path}", self.listen)).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }
}
