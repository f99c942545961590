//! `kvroute-sidecar serve`: wire the state, the background tasks and the listeners
//! together, and shut them down in order on SIGTERM/SIGINT.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use kvroute_service::http_server::{self, ConnEvent, ConnLimits};
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
    /// Connections each TCP listener serves at once; more wait in the kernel's queue
    /// until one closes (`kvroute_api_connections_total{outcome="waited"}`). The Unix
    /// socket, which only Envoy can reach, is not bounded here.
    #[arg(long, env = "KVROUTE_MAX_CONNECTIONS", default_value_t = 512)]
    pub max_connections: usize,
    /// A TCP connection that sends no whole request head for this long after it is
    /// accepted or answered (idle, or dribbling its head) is closed.
    #[arg(long, env = "KVROUTE_HEADER_TIMEOUT_MS", default_value_t = 30_000)]
    pub header_timeout_ms: u64,
    /// A request on a TCP listener whose body has not arrived whole this long after its
    /// head is answered 400 and its connection closed.
    #[arg(long, env = "KVROUTE_BODY_TIMEOUT_MS", default_value_t = 60_000)]
    pub body_timeout_ms: u64,
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
    #[arg(long, env = "KVROUTE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Host names the TCP listener answers to besides IP literals and `localhost`
    /// (requests naming another host, as a DNS-rebinding page would, are refused).
    /// Repeatable (env: comma-separated).
    #[arg(
        long = "allowed-host",
        env = "KVROUTE_ALLOWED_HOSTS",
        value_delimiter = ',',
        value_name = "NAME"
    )]
    pub allowed_hosts: Vec<String>,
    /// Learn pods on loopback, unspecified, link-local or multicast addresses from their
    /// events (single-host setups). Off: only a registration brings such a pod in, since
    /// its dump fetch would reach this host's own ports.
    #[arg(long, env = "KVROUTE_LEARN_LOCAL_PODS")]
    pub learn_local_pods: bool,
    /// Ports on a pod's own address where a batch may say the pod's dump is served,
    /// besides the pod's own port (a registration may name any URL). Repeatable (env:
    /// comma-separated).
    #[arg(
        long = "dump-port",
        env = "KVROUTE_DUMP_PORTS",
        value_delimiter = ',',
        default_value = "9400"
    )]
    pub dump_ports: Vec<u16>,
    /// Bearer token presented when fetching a pod's dump (the bridges' `--dump-token`).
    #[arg(long, env = "KVROUTE_DUMP_TOKEN", hide_env_values = true)]
    pub dump_token: Option<String>,
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
    /// Client text tokenizing at once, across every request, in MiB: tokenizing holds
    /// many times its input while it runs, so this bounds the sidecar's peak (the largest
    /// field tokenized is the smaller of this and 2 MiB). Text past it is routed by its
    /// text chain (`kvroute_precise_prompts_total{outcome="busy"}`).
    #[arg(long, env = "KVROUTE_TOKENIZE_BUDGET_MB", default_value_t = crate::tokenize::DEFAULT_BUDGET_BYTES >> 20)]
    pub tokenize_budget_mb: usize,
    /// Memory all block indexes together may hold, in MiB: three quarters for the
    /// engines' events, a quarter for predicted residency; each model gets an equal share
    /// (and at most its policy `max_blocks`), and a pod past its share of a full index
    /// replaces its own blocks. Shown in `/v1/status` (`memory`).
    #[arg(long, env = "KVROUTE_MAX_INDEX_MB", default_value_t = 384)]
    pub max_index_mb: u64,
    /// The endpoint picker's gRPC listener (Envoy ext_proc, the Gateway API Inference
    /// Extension's protocol, with gRPC health). Off unless set.
    #[arg(long, env = "KVROUTE_PICKER_LISTEN")]
    pub picker_listen: Option<SocketAddr>,
    /// The picker's request settings: a JSON file with the filter's configuration keys
    /// (paths, session and tenant headers, per-model route_text / sidecar_tokenizes,
    /// adapters, max_body_bytes). Block sizes come from the policy (`--config`).
    #[arg(long, env = "KVROUTE_PICKER_CONFIG")]
    pub picker_config: Option<PathBuf>,
    /// A picker decision later than this after the request body is whole is not
    /// committed; set the data plane's ext_proc message timeout a little above it.
    #[arg(long, env = "KVROUTE_PICKER_DEADLINE_MS", default_value_t = 90)]
    pub picker_deadline_ms: u64,
    /// Route calls over 64 KiB (chats for the sidecar to tokenize) decoded and routed at
    /// once; more wait, up to their deadline. Default: one fewer than the cores.
    #[arg(long, env = "KVROUTE_LARGE_ROUTES")]
    pub large_routes: Option<usize>,
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
    tasks.spawn(crate::admission::waiting::run(sc.clone(), stop.clone()));
    tasks.spawn(ingest::fetch_dumps(
        sc.clone(),
        recovery.clone(),
        resyncs,
        a.dump_token.clone().filter(|t| !t.is_empty()),
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
        browser: Some(http::BrowserGuard::new(&a.allowed_hosts)),
        large_routes: http::LargeRoutes::new(a.large_routes),
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
    sc.tokenize_budget
        .set_cap(a.tokenize_budget_mb.max(1) << 20);
    sc.set_index_budget(a.max_index_mb.max(1) << 20);
    sc.registry().set_rules(crate::registry::Rules {
        learn_local_pods: a.learn_local_pods,
        dump_ports: a.dump_ports.clone(),
    });
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
    let limits = ConnLimits {
        max_connections: a.max_connections,
        header_timeout: std::time::Duration::from_millis(a.header_timeout_ms.max(1)),
        body_timeout: std::time::Duration::from_millis(a.body_timeout_ms.max(1)),
    };
    let mut servers = Servers::new();
    // Only the TCP listener checks the admin token: probes change nothing, and the Unix
    // socket is authorized by its file permissions.
    let local = Api {
        admin_token: None,
        browser: None,
        ..api.clone()
    };
    let counted = api.sc.metrics.api_connections.clone();
    let count = move |e: ConnEvent| counted.inc(e.label(), 1);
    servers.spawn(http_server::serve(
        listener,
        http::router(api),
        limits,
        count.clone(),
        guard.subscribe(),
    ));
    if let Some(addr) = a.health_listen {
        let health = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let app = http::health_router(local.clone());
        servers.spawn(http_server::serve(
            health,
            app,
            limits,
            count,
            guard.subscribe(),
        ));
    }
    if let Some(path) = &a.uds {
        let uds = bind_uds(path, &a.uds_mode)?;
        spawn_server(
            &mut servers,
            uds,
            http::router(local.clone()),
            guard.subscribe(),
        );
    }
    if let Some(addr) = a.picker_listen {
        let cfg = match &a.picker_config {
            Some(p) => {
                let bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
                kvroute_filter::config::FilterConfig::parse(Some(&bytes)).map_err(|errs| {
                    anyhow::anyhow!("picker config {}:\n  {}", p.display(), errs.join("\n  "))
                })?
            }
            None => kvroute_filter::config::FilterConfig::default(),
        };
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let bound = listener.local_addr()?;
        let settings = crate::picker::PickerSettings {
            cfg,
            deadline: std::time::Duration::from_millis(a.picker_deadline_ms.max(1)),
        };
        servers.spawn(crate::picker::serve(
            local.sc.clone(),
            settings,
            listener,
            guard.subscribe(),
        ));
        eprintln!("kvroute-sidecar: picker listening on {bound}");
    }
    // Tests and scripts read this line to learn the bound port.
    eprintln!("kvroute-sidecar: listening on {bound}");
    Ok(servers)
}

/// The filter's Unix socket, with `mode` (octal, never world-writable), in a directory
/// only this user can write: anyone who can write the directory can replace the socket
/// with their own and receive the filter's route calls.
fn bind_uds(path: &std::path::Path, mode: &str) -> anyhow::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let mode = u32::from_str_radix(mode, 8).context("--uds-mode must be octal")?;
    if mode & 0o002 != 0 {
        anyhow::bail!("--uds-mode {:o} is world-writable; refusing", mode);
    }
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o750)
            .create(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
    }
    let _ = std::fs::remove_file(path);
    let uds = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("binding {}", path.display()))?;
    // The socket just made is ours: its owner is this process's user.
    let me = std::fs::metadata(path)?.uid();
    let d = std::fs::metadata(dir)?;
    let refusal = if d.uid() != me {
        Some(format!("is owned by uid {}, not this user ({me})", d.uid()))
    } else if d.mode() & 0o022 != 0 {
        Some(format!(
            "is group- or world-writable (mode {:o})",
            d.mode() & 0o7777
        ))
    } else {
        None
    };
    if let Some(why) = refusal {
        let _ = std::fs::remove_file(path);
        anyhow::bail!(
            "--uds directory {} {why}: another user could replace the socket; use a private directory",
            dir.display()
        );
    }
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
