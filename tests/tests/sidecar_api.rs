//! The sidecar's HTTP API against the real binary: routing follows events, bad input is
//! refused with a reason and changes nothing, config is validated and versioned, pods
//! come and go two-phase, and state-changing calls need the admin token when set.

use kvroute_shared::protocol::{Event, PolicyConfig, Tier};
use kvroute_tests::client::{batch, chain, removed, route_req, stored, Api};
use kvroute_tests::services::SidecarProc;
use serde_json::json;

const M: &str = "m";

async fn up(args: &[&str]) -> (SidecarProc, Api) {
    let sc = SidecarProc::start(args, false).expect("sidecar starts");
    let api = Api::new(sc.addr);
    (sc, api)
}

#[tokio::test]
async fn routing_follows_events_and_load() {
    let (_sc, api) = up(&[]).await;
    for p in ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"] {
        assert_eq!(api.register(p, M).await.status, 200);
    }
    let c = chain(M, 1, 32, 16);
    assert_eq!(
        api.events(&batch("127.0.0.1:8002", M, "e1", 0, vec![stored(&c[..24])]))
            .await
            .status,
        200
    );
    assert_eq!(
        api.events(&batch("127.0.0.1:8003", M, "e1", 0, vec![stored(&c[..4])]))
            .await
            .status,
        200
    );
    let r = api.route(M, &c, 16).await;
    assert_eq!(r.pod, "127.0.0.1:8002");
    assert_eq!(r.ranked[0].matched_blocks, 24);
    assert!(
        r.explain.is_none(),
        "explain (which reveals cache state) is off by default"
    );
    assert_eq!(r.tier_hint.map(|t| t.gpu), Some(24));
    assert!(r.policy_version >= 1);
    // Dry runs change nothing; the lookup endpoint shows the facts.
    let mut dry = route_req(M, &c, 16);
    dry.dry_run = true;
    assert_eq!(api.post("/v1/route", &dry).await.status, 200);
    let l = api
        .get(&format!(
            "/v1/lookup?model={M}&chain={}",
            c.iter()
                .map(|h| h.to_string())
                .collect::<Vec<_>>()
                .join(",")
        ))
        .await;
    assert_eq!(l.json["confirmed"][0]["pod"], "127.0.0.1:8002");
    assert_eq!(l.json["confirmed"][0]["matched_blocks"], 24);
    // The routed request finishes (while it ran, its prefix counted as held on its pod
    // whatever the events said: a running request's blocks are in use) ...
    let done = serde_json::json!({"decision": r.decision, "request_id": "r1",
        "pod": "127.0.0.1:8002", "status": 200});
    assert_eq!(api.post("/v1/report", done).await.status, 204);
    // ... and then removal events take effect.
    api.events(&batch(
        "127.0.0.1:8002",
        M,
        "e1",
        1,
        vec![removed(&c[2..24])],
    ))
    .await;
    let r = api.route(M, &c, 16).await;
    assert_eq!(
        r.pod, "127.0.0.1:8003",
        "8003 now holds the longer prefix (4 vs 2)"
    );
    // A cold prompt goes somewhere, and the same cold prompt to the same place (ties
    // follow the first block, so replicas agree).
    let cold = chain(M, 99, 8, 16);
    let mut d = route_req(M, &cold, 16);
    d.dry_run = true;
    let a = api.post("/v1/route", &d).await.json["pod"].clone();
    let b = api.post("/v1/route", &d).await.json["pod"].clone();
    assert_eq!(a, b);
}

#[tokio::test]
async fn bad_input_is_refused_with_a_reason_and_changes_nothing() {
    let (_sc, api) = up(&[]).await;
    api.register("127.0.0.1:8001", M).await;
    let c = chain(M, 2, 8, 16);
    api.events(&batch("127.0.0.1:8001", M, "e", 0, vec![stored(&c)]))
        .await;
    for body in [&b"{"[..], br#"{"v":1}"#, br#"{"v":1,"pod":"127.0.0.1:8001","model":"m","epoch":"e","seq":1,"events":[{"type":"removed","blocks":[1,"x"]}]}"#] {
        let r = api.post_raw("/v1/events", body).await;
        assert_eq!(r.status, 400, "{}", r.json);
        assert!(r.json["error"].as_str().is_some_and(|e| !e.is_empty()));
    }
    let r = api.post_raw("/v1/events", br#"{"v":1,"pod":"127.0.0.1:8001","model":"m","epoch":"e","seq":1,"events":[{"type":"removed","blocks":[1]},{"type":"teleported"}]}"#).await;
    assert_eq!(
        r.status, 400,
        "an unknown event type refuses the whole batch"
    );
    assert_eq!(
        api.route(M, &c, 16).await.ranked[0].matched_blocks,
        8,
        "index intact"
    );
    assert!(
        api.metric("kvroute_event_batches_rejected_total{reason=\"bad_json\"}")
            .await
            >= 4.0
    );
    // Route input.
    let r = api.post("/v1/route", route_req(M, &c, 32)).await;
    assert_eq!(
        (r.status, r.json["reason"].as_str()),
        (400, Some("block_size_mismatch")),
        "{}",
        r.json
    );
    assert!(r.json["error"].as_str().unwrap_or("").contains("16"));
    let r = api
        .post("/v1/route", route_req("unknown-model", &c, 16))
        .await;
    assert_eq!(r.status, 503, "{}", r.json);
    assert_eq!(api.post_raw("/v1/route", b"[1,2]").await.status, 400);
    // Registration input.
    assert_eq!(
        api.put("/v1/pods/not-an-endpoint", json!({"model": M}))
            .await
            .status,
        400
    );
    assert_eq!(
        api.put("/v1/pods/127.0.0.1:9", json!({"model": ""}))
            .await
            .status,
        400
    );
}

#[tokio::test]
async fn config_is_validated_versioned_and_round_trips() {
    let (_sc, api) = up(&[]).await;
    let cur = api.get("/v1/config").await;
    assert_eq!(cur.status, 200);
    let v0 = cur.json["version"].as_u64().expect("version");
    // Round trip: what GET serves, PUT accepts.
    let r = api.put("/v1/config", &cur.json).await;
    assert_eq!(r.status, 200, "{}", r.json);
    assert_eq!(r.json["version"].as_u64(), Some(v0 + 1));
    // Every problem listed; the old config keeps serving.
    let r = api
        .put(
            "/v1/config",
            json!({"prefill_weight": -1, "stale_factor": 0, "default_model": {"block_size": 0}}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(
        r.json["problems"].as_array().map(|a| a.len()),
        Some(3),
        "{}",
        r.json
    );
    let r = api.put("/v1/config", json!({"load_wieght": 1})).await;
    assert_eq!(r.status, 400, "typos are refused: {}", r.json);
    assert_eq!(
        api.get("/v1/config").await.json["version"].as_u64(),
        Some(v0 + 1)
    );
    // A stale version is a conflict.
    let mut stale: PolicyConfig = serde_json::from_value(cur.json.clone()).expect("config");
    stale.explain = true;
    assert_eq!(api.put("/v1/config", &stale).await.status, 409);
    stale.version = v0 + 1;
    let r = api.put("/v1/config", &stale).await;
    assert_eq!(r.status, 200);
    // Explain is now on: route answers carry the breakdown.
    api.register("127.0.0.1:8001", M).await;
    let r = api
        .post("/v1/route", route_req(M, &chain(M, 3, 4, 16), 16))
        .await;
    assert!(r.json["explain"].is_array(), "{}", r.json);
    // The same prompt again while that request is in flight: its pod holds it, which the
    // breakdown shows beside what the engine confirmed (nothing yet).
    let r = api
        .post("/v1/route", route_req(M, &chain(M, 3, 4, 16), 16))
        .await;
    let first = &r.json["explain"][0];
    assert_eq!(first["pod"], "127.0.0.1:8001", "{}", r.json);
    assert_eq!(first["matched"], 0);
    assert_eq!(first["in_flight"], 4, "{}", r.json);
    assert_eq!(first["hits"], 4.0);
    assert_eq!(api.metric("kvroute_config_version").await as u64, v0 + 2);
    assert!(api.metric("kvroute_config_rejected_total").await >= 3.0);
}

#[tokio::test]
async fn removed_pods_are_never_chosen_and_the_257th_is_refused() {
    let (_sc, api) = up(&[]).await;
    api.register("127.0.0.1:8001", M).await;
    api.register("127.0.0.1:8002", M).await;
    let c = chain(M, 4, 16, 16);
    api.events(&batch("127.0.0.1:8001", M, "e", 0, vec![stored(&c)]))
        .await;
    assert_eq!(api.route(M, &c, 16).await.pod, "127.0.0.1:8001");
    assert_eq!(api.delete("/v1/pods/127.0.0.1:8001").await.status, 204);
    for _ in 0..20 {
        let r = api.route(M, &c, 16).await;
        assert_eq!(r.pod, "127.0.0.1:8002");
        assert!(r.ranked.iter().all(|x| x.pod != "127.0.0.1:8001"));
    }
    assert_eq!(api.delete("/v1/pods/127.0.0.1:8001").await.status, 404);
    // Shutdown events remove too.
    api.events(&batch("127.0.0.1:8002", M, "e", 0, vec![Event::Shutdown]))
        .await;
    assert_eq!(
        api.post("/v1/route", route_req(M, &c, 16)).await.status,
        503
    );
    // 256 pods fit; the 257th gets a clear error.
    for i in 0..256 {
        let r = api
            .register(&format!("10.1.{}.{}:8000", i / 200, i % 200), "big")
            .await;
        assert_eq!(r.status, 200, "pod {i}: {}", r.json);
    }
    let r = api.register("10.9.9.9:8000", "big").await;
    assert_eq!(r.status, 409, "{}", r.json);
    assert!(r.json["error"].as_str().unwrap_or("").contains("256"));
    let r = api
        .events(&batch("10.9.9.8:8000", "big", "e", 0, vec![stored(&[1])]))
        .await;
    assert_eq!(r.status, 422, "{}", r.json);
    assert!(api.metric("kvroute_pods_refused_total").await >= 2.0);
}

#[tokio::test]
async fn epochs_duplicates_gaps_and_tiers() {
    let (_sc, api) = up(&[]).await;
    let pod = "127.0.0.1:8001";
    let c = chain(M, 5, 16, 16);
    assert_eq!(
        api.events(&batch(pod, M, "a", 0, vec![stored(&c)]))
            .await
            .status,
        200,
        "first sight registers the pod"
    );
    // A redelivered batch (same seq, same content) is a duplicate; the same seq with
    // other content is a conflict (sidecar/gateway/src/ingest/tests.rs).
    let dup = api.events(&batch(pod, M, "a", 0, vec![stored(&c)])).await;
    assert_eq!(dup.json["duplicate"], true, "a replayed seq is ignored");
    assert_eq!(api.route(M, &c, 16).await.ranked[0].matched_blocks, 16);
    // Engine restart: new epoch, old blocks gone at once.
    let r = api
        .events(&batch(pod, M, "b", 0, vec![stored(&c[..3])]))
        .await;
    assert_eq!(r.json["restarted"], true);
    assert_eq!(api.route(M, &c, 16).await.ranked[0].matched_blocks, 3);
    // A gap without a dump URL: blocks dropped, rebuilt from live events.
    let r = api
        .events(&batch(pod, M, "b", 5, vec![stored(&c[..2])]))
        .await;
    assert_eq!(r.json["gap"], true);
    let routed = api.route(M, &c, 16).await;
    assert_eq!(
        routed.ranked[0].matched_blocks, 2,
        "only what came after the gap"
    );
    // Tiers: offloaded copies keep a block routable after GPU eviction.
    api.events(&batch(
        pod,
        M,
        "b",
        6,
        vec![
            Event::Stored {
                tier: Tier::Cpu,
                parent: None,
                blocks: c[..2].to_vec(),
                tokens: None,
            },
            removed(&c[1..2]),
        ],
    ))
    .await;
    let r = api.route(M, &c, 16).await;
    assert_eq!(r.ranked[0].matched_blocks, 2);
    let t = r.tier_hint.expect("hint");
    assert_eq!((t.gpu, t.cpu), (1, 1));
    assert_eq!(api.metric("kvroute_engine_restarts_total").await, 1.0);
    assert_eq!(api.metric("kvroute_event_seq_gaps_total").await, 1.0);
    assert_eq!(api.metric("kvroute_event_duplicates_total").await, 1.0);
}

#[tokio::test]
async fn reports_release_load_and_bounded_load_spreads_a_hot_prefix() {
    let (_sc, api) = up(&[]).await;
    let pods = [
        "127.0.0.1:8001",
        "127.0.0.1:8002",
        "127.0.0.1:8003",
        "127.0.0.1:8004",
    ];
    for p in pods {
        api.register(p, M).await;
    }
    // Every pod's engine reports events (so nothing is predicted); one holds the prefix.
    let sys = chain(M, 6, 64, 16);
    for (i, p) in pods.iter().enumerate() {
        let ev = if i == 0 {
            vec![stored(&sys)]
        } else {
            vec![stored(&chain(M, 100 + i as u32, 1, 16))]
        };
        api.events(&batch(p, M, "e", 0, ev)).await;
    }
    // 40 concurrent requests share the prefix and nobody reports back yet.
    let mut counts = std::collections::HashMap::new();
    let mut decisions = Vec::new();
    for i in 0..40 {
        let mut r = route_req(M, &sys, 16);
        r.request_id = Some(format!("r{i}"));
        let resp = api.post("/v1/route", &r).await;
        decisions.push(resp.json["decision"].as_str().unwrap_or("").to_string());
        *counts
            .entry(resp.json["pod"].as_str().unwrap_or("").to_string())
            .or_insert(0) += 1;
    }
    let max = *counts.values().max().unwrap_or(&0);
    assert!(
        max <= 14,
        "bounded load keeps the hot pod near its share: {counts:?}"
    );
    assert_eq!(counts.len(), 4, "{counts:?}");
    assert_eq!(api.metric("kvroute_inflight_decisions").await, 40.0);
    // Reports release it: half one by one, half in a batch (as the filter sends them)
    // that also carries one malformed element, which is refused alone.
    let report = |i: usize| json!({"decision": decisions[i], "request_id": format!("r{i}"), "pod": "127.0.0.1:8001", "status": 200, "cached_tokens": 1024});
    for i in 0..20 {
        assert_eq!(api.post("/v1/report", report(i)).await.status, 204);
    }
    let mut batch: Vec<serde_json::Value> = (20..40).map(report).collect();
    batch.insert(3, json!({"request_id": "bad", "pod": 7}));
    let r = api.post("/v1/report", &batch).await;
    assert_eq!(r.status, 400, "{}", r.json);
    assert!(
        r.json["error"]
            .as_str()
            .unwrap_or("")
            .contains("1 of 21 reports rejected"),
        "{}",
        r.json
    );
    assert_eq!(api.metric("kvroute_reports_rejected_total").await, 1.0);
    assert_eq!(api.metric("kvroute_reports_total").await, 40.0);
    assert_eq!(api.post_raw("/v1/report", b"[{").await.status, 400);
    assert_eq!(api.metric("kvroute_reports_rejected_total").await, 2.0);
    assert_eq!(api.metric("kvroute_inflight_decisions").await, 0.0);
    let p = api.get("/v1/pods/127.0.0.1:8001").await;
    assert_eq!(p.json["load"]["inflight"], 0, "{}", p.json);
    // With no load, the prefix holder wins again.
    assert_eq!(api.route(M, &sys, 16).await.pod, "127.0.0.1:8001");
}

#[tokio::test]
async fn the_admin_token_guards_state_changes_on_tcp() {
    let (_sc, api) = up(&["--admin-token", "s3cret"]).await;
    assert_eq!(api.register("127.0.0.1:8001", M).await.status, 401);
    assert_eq!(api.put("/v1/config", json!({})).await.status, 401);
    assert_eq!(api.get("/v1/config").await.status, 200, "reads stay open");
    assert_eq!(api.get("/metrics").await.status, 200);
    let authed = api.clone().with_token("s3cret");
    assert_eq!(authed.register("127.0.0.1:8001", M).await.status, 200);
    let wrong = api.clone().with_token("s3cret!");
    assert_eq!(wrong.delete("/v1/pods/127.0.0.1:8001").await.status, 401);
    // Whether a prompt is cached is what users asked: lookups need the token, GET too.
    assert_eq!(api.get("/v1/lookup?model=m&chain=1,2").await.status, 401);
    assert_eq!(authed.get("/v1/lookup?model=m&chain=1,2").await.status, 200);
    // So do the status page's data; its files hold none and are served to anyone.
    for path in ["/v1/status", "/v1/decisions"] {
        assert_eq!(api.get(path).await.status, 401, "{path}");
        assert_eq!(authed.get(path).await.status, 200, "{path}");
    }
    assert_eq!(
        authed.get("/v1/status").await.json["pods"][0]["pod"],
        "127.0.0.1:8001"
    );
    let page = reqwest::get(format!("http://{}/ui/", _sc.addr))
        .await
        .expect("page");
    assert_eq!(page.status(), 200);
    let csp = page
        .headers()
        .get("content-security-policy")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    assert!(
        csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"),
        "{csp}"
    );
    assert!(page
        .text()
        .await
        .unwrap_or_default()
        .contains("Prefix inspector"));
    for f in ["Cargo.toml", "..%2Fbuild.rs", "%2E%2E%2Fsrc%2Fui.rs"] {
        let r = reqwest::get(format!("http://{}/ui/{f}", _sc.addr))
            .await
            .expect("get");
        assert_eq!(r.status(), 404, "only the page's own files are served: {f}");
    }
}

/// The health listener answers probes on the pod's address and nothing else.
#[tokio::test]
async fn the_health_listener_serves_only_probes() {
    let port = kvroute_tests::procs::free_port();
    let addr = format!("127.0.0.1:{port}");
    let (_sc, _api) = up(&["--health-listen", &addr]).await;
    let health = Api::new(addr.parse().expect("addr"));
    assert_eq!(health.get("/healthz").await.status, 200);
    assert_eq!(health.get("/readyz").await.status, 200);
    assert_eq!(health.get("/v1/pods").await.status, 404);
    assert_eq!(health.post("/v1/route", json!({})).await.status, 404);
}

#[tokio::test]
async fn the_unix_socket_is_not_world_writable_and_serves_routes() {
    use std::os::unix::fs::PermissionsExt;
    let sc = SidecarProc::start(&["--admin-token", "t"], true).expect("sidecar");
    let sock = sc.uds.clone().expect("socket");
    let mode = std::fs::metadata(&sock)
        .expect("socket exists")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode & 0o002, 0, "mode {mode:o}");
    // Plain HTTP/1.1 over the socket, no token needed there.
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(&sock).expect("connect");
    let body = r#"{"model":"m","mode":"tokens","block_size":16,"chain":[1,2],"prompt_tokens":32}"#;
    write!(s, "POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    assert!(
        out.starts_with("HTTP/1.1 503"),
        "no pod yet, but authorized: {out}"
    );
    // A world-writable mode is refused at start.
    assert!(SidecarProc::start(&["--uds-mode", "666"], true).is_err());
}

#[tokio::test]
async fn sigterm_shuts_down_gracefully() {
    let (mut sc, api) = up(&[]).await;
    assert_eq!(api.get("/healthz").await.status, 200);
    assert_eq!(
        sc.terminate(),
        Some(0),
        "clean exit on SIGTERM: {}",
        sc.log()
    );
    assert!(sc.log().contains("shutting down"));
}

#[tokio::test]
async fn unregistered_pods_can_be_refused() {
    let (_sc, api) = up(&[]).await;
    let mut cfg = api.get("/v1/config").await.json;
    cfg["require_registration"] = json!(true);
    assert_eq!(api.put("/v1/config", &cfg).await.status, 200);
    let c = chain(M, 8, 4, 16);
    let r = api
        .events(&batch("127.0.0.1:8009", M, "e", 0, vec![stored(&c)]))
        .await;
    assert_eq!(
        (r.status, r.json["reason"].as_str()),
        (422, Some("unregistered_pod")),
        "{}",
        r.json
    );
    api.register("127.0.0.1:8009", M).await;
    assert_eq!(
        api.events(&batch("127.0.0.1:8009", M, "e", 0, vec![stored(&c)]))
            .await
            .status,
        200
    );
    // A pod registered for one model cannot publish for another.
    let r = api
        .events(&batch("127.0.0.1:8009", "other", "e", 1, vec![stored(&c)]))
        .await;
    assert_eq!(r.json["reason"].as_str(), Some("model_mismatch"));
}

#[tokio::test]
async fn disaggregated_models_get_a_prefill_and_a_decode_pod() {
    let (_sc, api) = up(&[]).await;
    for (p, role) in [
        ("127.0.0.1:8101", "prefill"),
        ("127.0.0.1:8102", "prefill"),
        ("127.0.0.1:8201", "decode"),
        ("127.0.0.1:8202", "decode"),
    ] {
        assert_eq!(
            api.put(&format!("/v1/pods/{p}"), json!({"model": M, "role": role}))
                .await
                .status,
            200
        );
    }
    let c = chain(M, 9, 16, 16);
    api.events(&batch("127.0.0.1:8102", M, "e", 0, vec![stored(&c)]))
        .await;
    let r = api.route(M, &c, 16).await;
    assert_eq!(
        r.prefill_pod.as_deref(),
        Some("127.0.0.1:8102"),
        "prefill where the cache is"
    );
    assert!(
        r.pod.starts_with("127.0.0.1:82"),
        "decode on a decode pod: {}",
        r.pod
    );
    // Decode pods are chosen by load: a second request goes to the other one.
    let r2 = api.route(M, &chain(M, 10, 16, 16), 16).await;
    assert_ne!(r2.pod, r.pod);
    // Asking for a role restricts the candidates.
    let mut only = kvroute_tests::client::route_req(M, &c, 16);
    only.role = Some(kvroute_shared::protocol::Role::Prefill);
    let r3 = api.post("/v1/route", &only).await;
    assert!(
        r3.json["pod"]
            .as_str()
            .is_some_and(|p| p.starts_with("127.0.0.1:81")),
        "{}",
        r3.json
    );
    assert!(r3.json["prefill_pod"].is_null());
}
