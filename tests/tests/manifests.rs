//! The Istio and Envoy Gateway manifests users copy: valid YAML, the right kinds, and
//! the settings kvroute cannot work without (the wasm filter's
//! `allow_on_headers_stop_iteration`, FAIL_OPEN, the sidecar socket, override-host with a
//! fallback), and the embedded filter configuration is one the filter accepts.

use serde_yaml::Value;

fn docs(path: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(path),
    )
    .expect(path);
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("valid YAML"))
        .collect()
}

fn find<'a>(v: &'a Value, key: &str, out: &mut Vec<&'a Value>) {
    match v {
        Value::Mapping(m) => {
            for (k, val) in m {
                if k.as_str() == Some(key) {
                    out.push(val);
                }
                find(val, key, out);
            }
        }
        Value::Sequence(s) => s.iter().for_each(|x| find(x, key, out)),
        _ => {}
    }
}

fn all<'a>(v: &'a [Value], key: &str) -> Vec<&'a Value> {
    let mut out = Vec::new();
    v.iter().for_each(|d| find(d, key, &mut out));
    out
}

fn filter_config_ok(ds: &[Value]) {
    let values: Vec<String> = all(ds, "configuration")
        .iter()
        .filter_map(|c| c["value"].as_str().map(str::to_string))
        .collect();
    assert!(!values.is_empty());
    for v in values {
        kvroute_filter::config::FilterConfig::parse(Some(v.as_bytes()))
            .expect("filter config valid");
    }
}

#[test]
fn istio_manifests() {
    let ef = docs("envoy/istio/kvroute-envoyfilter.yaml");
    assert_eq!(ef[0]["kind"], "EnvoyFilter");
    assert_eq!(
        all(&ef, "allow_on_headers_stop_iteration")[0].as_bool(),
        Some(true)
    );
    assert_eq!(all(&ef, "failure_policy")[0].as_str(), Some("FAIL_OPEN"));
    assert_eq!(
        all(&ef, "runtime")[0].as_str(),
        Some("envoy.wasm.runtime.v8")
    );
    assert!(all(&ef, "path")
        .iter()
        .any(|p| p.as_str() == Some("/var/run/kvroute/private/sidecar.sock")));
    assert!(!all(&ef, "fallback_policy").is_empty());
    filter_config_ok(&ef);
    // The native strip of steering headers comes before the wasm filter.
    let filters: Vec<&str> = ef[0]["spec"]["configPatches"]
        .as_sequence()
        .expect("patches")
        .iter()
        .filter_map(|p| p["patch"]["value"]["name"].as_str())
        .filter(|n| n.starts_with("envoy.filters.http."))
        .collect();
    assert_eq!(
        filters,
        [
            "envoy.filters.http.header_mutation",
            "envoy.filters.http.wasm"
        ],
        "INSERT_BEFORE the router, in this order"
    );
    let patch = docs("envoy/istio/kvroute-sidecar.yaml");
    let args: Vec<&str> = all(&patch, "args")[0]
        .as_sequence()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert!(args.contains(&"--uds=/var/run/kvroute/private/sidecar.sock"));
    assert!(
        args.iter().any(|a| a.starts_with("--listen=127.0.0.1")),
        "admin API on loopback"
    );
    // kubelet probes the pod's address: every probed port must be a listener that is
    // not bound to loopback (otherwise the gateway never becomes ready).
    let listeners: Vec<(String, u16)> = args
        .iter()
        .filter_map(|a| {
            let v = a
                .strip_prefix("--listen=")
                .or_else(|| a.strip_prefix("--health-listen="))?;
            let addr: std::net::SocketAddr = v.parse().ok()?;
            Some((addr.ip().to_string(), addr.port()))
        })
        .collect();
    for probe in ["readinessProbe", "livenessProbe"] {
        let port = all(&patch, probe)[0]["httpGet"]["port"]
            .as_u64()
            .expect("probe port") as u16;
        assert!(
            listeners
                .iter()
                .any(|(ip, p)| *p == port && !ip.starts_with("127.")),
            "{probe} on port {port} reaches no listener on the pod's address: {listeners:?}"
        );
    }
}

#[test]
fn envoy_gateway_manifests() {
    let ds = docs("envoy/gateway/kvroute-envoypatchpolicy.yaml");
    let kinds: Vec<&str> = ds.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert_eq!(
        kinds,
        ["EnvoyPatchPolicy", "BackendTrafficPolicy", "EnvoyProxy"]
    );
    assert_eq!(
        all(&ds, "allow_on_headers_stop_iteration")[0].as_bool(),
        Some(true)
    );
    assert!(!all(&ds, "endpointOverride").is_empty());
    filter_config_ok(&ds);
    // JSON patches apply in order, each at index 0: the last one inserted runs first.
    let front: Vec<&str> = ds[0]["spec"]["jsonPatches"]
        .as_sequence()
        .expect("patches")
        .iter()
        .filter(|p| {
            p["operation"]["path"]
                .as_str()
                .is_some_and(|x| x.ends_with("http_filters/0"))
        })
        .filter_map(|p| p["operation"]["value"]["name"].as_str())
        .collect();
    assert_eq!(
        front.last().copied(),
        Some("envoy.filters.http.header_mutation"),
        "the native strip must end up first: {front:?}"
    );
}

/// The vLLM engine with the bridge beside it: the engine publishes where the bridge
/// listens, with the same block size, and the bridge's arguments are ones it accepts.
#[test]
fn vllm_bridge_manifest() {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: kvroute_bridge::BridgeArgs,
    }
    let ds = docs("docs/examples/vllm-bridge.yaml");
    // The engines' ports are closed to all but the gateways, and the dump takes a token.
    let policy = ds
        .iter()
        .find(|d| d["kind"].as_str() == Some("NetworkPolicy"))
        .expect("a NetworkPolicy");
    let ports: Vec<u64> = all(std::slice::from_ref(policy), "port")
        .iter()
        .filter_map(|p| p.as_u64())
        .collect();
    assert!(ports.contains(&8000) && ports.contains(&9400), "{ports:?}");
    assert!(all(&ds, "name")
        .iter()
        .any(|n| n.as_str() == Some("KVROUTE_BRIDGE_DUMP_TOKEN")));
    let containers = all(&ds, "containers");
    let list = containers[0].as_sequence().expect("containers");
    let args = |name: &str| -> Vec<String> {
        list.iter()
            .find(|c| c["name"].as_str() == Some(name))
            .and_then(|c| c["args"].as_sequence())
            .expect(name)
            .iter()
            .filter_map(|a| a.as_str().map(str::to_owned))
            .collect()
    };
    let engine = args("vllm");
    let events = engine
        .iter()
        .position(|a| a == "--kv-events-config")
        .and_then(|i| engine.get(i + 1))
        .expect("--kv-events-config");
    let events: serde_json::Value = serde_json::from_str(events).expect("events config JSON");
    assert_eq!(events["enable_kv_cache_events"], true);
    assert_eq!(events["publisher"], "zmq");
    let port = |ep: &str| ep.rsplit(':').next().map(str::to_owned);
    let image = list
        .iter()
        .find(|c| c["name"].as_str() == Some("kvroute-bridge"))
        .and_then(|c| c["image"].as_str())
        .unwrap_or("");
    assert!(image.contains("/kvroute-bridge:"), "{image}");
    let bridge: Vec<String> = std::iter::once("kvroute-bridge".to_string())
        .chain(
            args("kvroute-bridge")
                .iter()
                .map(|a| a.replace("$(POD_IP)", "10.0.0.7")),
        )
        .collect();
    let cli = <Cli as clap::Parser>::try_parse_from(&bridge).expect("bridge arguments");
    cli.a.validate().expect("valid bridge arguments");
    assert_eq!(
        port(&cli.a.zmq),
        port(events["endpoint"].as_str().expect("endpoint"))
    );
    assert!(engine.contains(&format!("--block-size={}", cli.a.block_size)));
    assert_eq!(cli.a.pod, "10.0.0.7:8000");
    // vLLM's events carry token ids: its ZMQ sockets must not be reachable from other
    // pods, only from the bridge beside it.
    for key in ["endpoint", "replay_endpoint"] {
        let ep = events[key].as_str().unwrap_or("");
        assert!(
            ep.starts_with("tcp://127.0.0.1:"),
            "{key} {ep:?} is not loopback"
        );
    }
}

/// kvroute as a GIE endpoint picker: the Deployment runs the picker on GIE's port with
/// gRPC probes, its configuration is one the picker accepts, the InferencePool points at
/// it failing open, and the Envoy Gateway policy fails open with buffered requests.
#[test]
fn endpoint_picker_manifests() {
    let ds = docs("envoy/gie/kvroute-picker.yaml");
    let kinds: Vec<&str> = ds.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert_eq!(
        kinds,
        ["ConfigMap", "Deployment", "Service", "NetworkPolicy"]
    );
    let picker_json = ds[0]["data"]["picker.json"].as_str().expect("picker.json");
    kvroute_filter::config::FilterConfig::parse(Some(picker_json.as_bytes()))
        .expect("the picker accepts its configuration");
    let args: Vec<&str> = all(&ds, "args")[0]
        .as_sequence()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert!(args.contains(&"--picker-listen=0.0.0.0:9002"));
    assert!(args.contains(&"--picker-config=/etc/kvroute/picker.json"));
    assert!(args.iter().any(|a| a.starts_with("--listen=127.0.0.1")));
    for (probe, service) in [
        ("livenessProbe", "liveness"),
        ("readinessProbe", "readiness"),
    ] {
        let p = all(&ds, probe)[0];
        assert_eq!(p["grpc"]["port"].as_u64(), Some(9002), "{probe}");
        assert_eq!(p["grpc"]["service"].as_str(), Some(service), "{probe}");
    }
    assert_eq!(all(&ds, "appProtocol")[0].as_str(), Some("http2"));

    let pool = docs("envoy/gie/inferencepool.yaml");
    assert_eq!(pool[0]["apiVersion"], "inference.networking.k8s.io/v1");
    assert_eq!(pool[0]["kind"], "InferencePool");
    let epp = &pool[0]["spec"]["endpointPickerRef"];
    assert_eq!(epp["name"], "kvroute-picker");
    assert_eq!(epp["port"]["number"].as_u64(), Some(9002));
    assert_eq!(epp["failureMode"], "FailOpen");
    assert_eq!(
        all(&pool, "kind")
            .iter()
            .filter(|k| k.as_str() == Some("InferencePool"))
            .count(),
        2
    );

    let istio = docs("envoy/gie/istio-gateway.yaml");
    assert_eq!(istio[0]["spec"]["gatewayClassName"], "istio");

    let eg = docs("envoy/gie/envoy-gateway.yaml");
    let kinds: Vec<&str> = eg.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert_eq!(
        kinds,
        [
            "Gateway",
            "EnvoyExtensionPolicy",
            "BackendTrafficPolicy",
            "HTTPRoute"
        ]
    );
    let ext = &eg[1]["spec"]["extProc"][0];
    assert_eq!(ext["failOpen"].as_bool(), Some(true));
    assert_eq!(ext["processingMode"]["request"]["body"], "Buffered");
    assert_eq!(ext["backendRefs"][0]["port"].as_u64(), Some(9002));
    assert!(!all(&eg, "endpointOverride").is_empty());
}
