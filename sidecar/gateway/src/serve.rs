//! `kvroute-sidecar serve`: wire the state, the background tasks and the listeners
//! together, and shut them down in order on SIGTERM/SIGINT.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use kvroute_service::{DropGuard, Shutdown};
use kvroute_shared::protocol::{PodRegistration, PolicyConfig};

use crate::cleaner;
use crate::http::{self, Api};
use crate::ingest::{self, Recovery};
use crate::nats::{self, NatsOpts};
use crate::state::Sidecar;

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Admin + API listener (TCP). Loopback by default: expose it deliberately.
    #[arg(long, env = "KVROUTE_LISTEN", default_value = "127.0.0.1:9090")]
    pub listen: SocketAddr,
    /// A listener serving only `/healthz` and `/readyz` (for kubelet probes on the pod's
    /// address while --listen stays on loopback).
    #[arg(long, env = "KVROUTE_HEALTH_LISTEN")]
    pub health_listen: Option<SocketAddr>,
    /// Unix socket for the filter (Envoy's sidecar cluster).
    #[arg(long, env = "KVROUTE_UDS")]
    pub uds: Option<PathBuf>,
    /// Permissions of the Unix socket (octal). Never world-writable.
    #[arg(long, env = "KVROUTE_UDS_MODE", default_value = "660")]
    pub uds_mode: String,
    /// NATS server URL (optional: without it, HTTP ingestion and predicted mode only).
    #[arg(long, env = "KVROUTE_NATS")]
    pub nats: Option<String>,
    #[arg(long, env = "KVROUTE_NATS_SUBJECT", default_value = "kvroute.events.>")]
    pub nats_subject: String,
    #[command(flatten)]
    pub nats_auth: kvroute_service::NatsAuth,
    /// This replica's id: its load deltas go on `kvroute.load.<model>.<id>`, so NATS can
    /// allow it to publish only there (e.g. the pod name). Default: random per start.
    #[arg(long, env = "KVROUTE_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// When set, state-changing requests on the TCP listener need `Authorization: Bearer`.
    #[arg(long, env = "KVROUTE_ADMIN_TOKEN")]
    pub admin_token: Option<String>,
    /// Static pods: a JSON object `{"ip:port": {"model": ...}, ...}`.
    #[arg(long, env = "KVROUTE_PODS")]
    pub pods: Option<PathBuf>,
    /// Initial policy (the JSON of `GET /v1/config`).
    #[arg(long, env = "KVROUTE_CONFIG")]
    pub config: Option<PathBuf>,
    /// A model's Hugging Face directory (`tokenizer.json`, `tokenizer_config.json` or
    /// `chat_template.jinja`): its chat and text prompts are chained as the engine's
    /// token ids, so they match its KV events. `MODEL=DIR`, repeatable (env: comma-separated).
    #[arg(
        long = "tokenizer",
        env = "KVROUTE_TOKENIZERS",
        value_delimiter = ',',
        value_name = "MODEL=DIR"
    )]
    pub tokenizers: Vec<String>,
    /// A chat template file that replaces the one in a model's `--tokenizer` directory, for
    /// engines started with vLLM's `--chat-template FILE`. `MODEL=FILE`, repeatable (env:
    /// comma-separated).
    #[arg(
        long = "chat-template",
        env = "KVROUTE_CHAT_TEMPLATES",
        value_delimiter = ',',
        value_name = "MODEL=FILE"
    )]
    pub chat_templates: Vec<String>,
    /// Bound of each model's cache of encoded text pieces.
    #[arg(long, env = "KVROUTE_TOKENIZER_CACHE_MB", default_value_t = 256)]
    pub tokenizer_cache_mb: usize,
}

/// Load every `MODEL=DIR` tokenizer, each with its `MODEL=FILE` chat template when one is
/// given (a bad directory or file stops the start: silently routing by prediction would
/// hide it).
pub fn load_tokenizers(
    specs: &[String],
    templates: &[String],
    cache_mb: usize,
) -> anyhow::Result<crate::tokenize::Tokenizers> {
    fn split<'a>(flag: &str, spec: &'a str, rhs: &str) -> anyhow::Result<(&'a str, &'a str)> {
        spec.split_once('=')
            .filter(|(m, d)| !m.is_empty() && !d.is_empty())
            .with_context(|| format!("--{flag} {spec:?}: expected MODEL={rhs}"))
    }
    let mut files = BTreeMap::new();
    for spec in templates {
        let (model, file) = split("chat-template", spec, "FILE")?;
        if !specs
            .iter()
            .any(|s| s.split_once('=').map(|(m, _)| m) == Some(model))
        {
            anyhow::bail!("--chat-template {spec}: no --tokenizer for model {model:?}");
        }
        files.insert(model, file);
    }
    let mut t = crate::tokenize::Tokenizers::default();
    for spec in specs {
        let (model, dir) = split("tokenizer", spec, "DIR")?;
        let mut mt =
            crate::tokenize::ModelTokenizer::load(std::path::Path::new(dir), cache_mb << 20)
                .with_context(|| format!("--tokenizer {spec}"))?;
        if let Some(file) = files.get(model) {
            mt = mt
                .with_chat_template(std::path::Path::new(file))
                .with_context(|| format!("--chat-template {model}={file}"))?;
        }
        tracing::info!(
            model,
            dir,
            chat_template = mt.has_template(),
            chat_template_file = files.get(model).copied(),
            segment_cache = mt.caches_segments(),
            "tokenizer loaded"
        );
        t.insert(model, mt);
    }
    if !specs.is_empty() {
        // Loading parses each tokenizer.json into buffers it then frees.
        crate::release_free_memory();
    }
    Ok(t)
}

fn read_json<T: serde::de::DeserializeOwned>(path: &PathBuf, what: &str) -> anyhow::Result<T> {
    let text = std::fs::read(path).with_context(|| format!("reading {what} {}", path.display()))?;
    serde_json::from_slice(&text).with_context(|| format!("{what} {} is not valid", path.display()))
}

/// Serve until `shutdown` resolves (the binary passes [`wait_for_signal`]; tests pass
/// their own), then stop the listeners and every background task, and wait for them.
pub async fn run(
    a: ServeArgs,
    shutdown_signal: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let (sc, ch) = state(&a)?;
    let (recovery, resyncs) = Recovery::new();
    let recovery = Arc::new(recovery);
    let (guard, stop) = Shutdown::new();

    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(cleaner::run(sc.clone(), ch.cleanup, stop.clone()));
    tasks.spawn(ingest::fetch_dumps(
        sc.clone(),
        recovery.clone(),
        resyncs,
        stop.clone(),
    ));
    if let Some(url) = &a.nats {
        let o = NatsOpts {
            url: url.clone(),
            subject: a.nats_subject.clone(),
            auth: a.nats_auth.clone(),
        };
        tasks.spawn(nats::run(
            sc.clone(),
            recovery.clone(),
            o,
            ch.outbox,
            stop.clone(),
        ));
    }
    let api = Api {
        sc: sc.clone(),
        recovery,
        admin_token: a.admin_token.as_deref().map(Arc::from),
    };
    let servers = listeners(&a, api, &guard).await?;

    shutdown_signal.await;
    eprintln!("kvroute-sidecar: shutting down");
    drop(guard); // stops the background tasks and starts the graceful HTTP shutdown
    let mut servers = servers;
    while let Some(r) = servers.join_next().await {
        if let Ok(Err(e)) = r {
            tracing::warn!("listener ended with {e}");
        }
    }
    while tasks.join_next().await.is_some() {}
    if let Some(path) = &a.uds {
        let _ = std::fs::remove_file(path);
    }
    Ok(())
}

/// The sidecar's state as the flags describe it: the policy, the tokenizers, the static
/// pods.
fn state(a: &ServeArgs) -> anyhow::Result<(Arc<Sidecar>, crate::state::Channels)> {
    let cfg: PolicyConfig = match &a.config {
        Some(p) => read_json(p, "config file")?,
        None => PolicyConfig::default(),
    };
    let tokenizers = load_tokenizers(&a.tokenizers, &a.chat_templates, a.tokenizer_cache_mb)?;
    let (sc, ch) = Sidecar::with_replica(cfg, a.replica_id.clone())
        .map_err(|errs| anyhow::anyhow!("invalid config:\n  {}", errs.join("\n  ")))?;
    sc.set_tokenizers(tokenizers);
    if let Some(p) = &a.pods {
        let pods: BTreeMap<String, PodRegistration> = read_json(p, "pods file")?;
        for (id, reg) in pods {
            sc.register(&id, reg)
                .map_err(|e| anyhow::anyhow!("pods file: {id}: {e}"))?;
        }
    }
    Ok((sc, ch))
}

type Servers = tokio::task::JoinSet<std::io::Result<()>>;

/// Bind and start every listener the flags ask for: the API on TCP, the health probes,
/// the filter's Unix socket. Each stops when `guard` does.
async fn listeners(a: &ServeArgs, api: Api, guard: &DropGuard) -> anyhow::Result<Servers> {
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("binding {}", a.listen))?;
    let bound = listener.local_addr()?;
    let listener = axum::serve::ListenerExt::tap_io(listener, |s| {
        let _ = s.set_nodelay(true);
    });
    let mut servers = Servers::new();
    // Only the TCP listener checks the admin token: probes change nothing, and the Unix
    // socket is authorized by its file permissions.
    let local = Api {
        admin_token: None,
        ..api.clone()
    };
    spawn_server(&mut servers, listener, http::router(api), guard.subscribe());
    if let Some(addr) = a.health_listen {
        let health = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let app = http::health_router(local.clone());
        spawn_server(&mut servers, health, app, guard.subscribe());
    }
    if let Some(path) = &a.uds {
        let uds = bind_uds(path, &a.uds_mode)?;
        spawn_server(&mut servers, uds, http::router(local), guard.subscribe());
    }
    // Tests and scripts read this line to learn the bound port.
    eprintln!("kvroute-sidecar: listening on {bound}");
    Ok(servers)
}

/// The filter's Unix socket, with `mode` (octal, never world-writable).
fn bind_uds(path: &std::path::Path, mode: &str) -> anyhow::Result<tokio::net::UnixListener> {
    let _ = std::fs::remove_file(path);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).ok();
    }
    let uds = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("binding {}", path.display()))?;
    let mode = u32::from_str_radix(mode, 8).context("--uds-mode must be octal")?;
    if mode & 0o002 != 0 {
        anyhow::bail!("--uds-mode {:o} is world-writable; refusing", mode);
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    eprintln!(
        "kvroute-sidecar: unix socket {} (mode {:o})",
        path.display(),
        mode
    );
    Ok(uds)
}

pub use kvroute_service::wait_for_signal;

/// Serve `app` on `listener` until `stop` fires, as one of `servers`.
fn spawn_server<L>(servers: &mut Servers, listener: L, app: axum::Router, mut stop: Shutdown)
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    servers.spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.wait().await })
            .await
    });
}
