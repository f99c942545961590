//! Event ingestion over a real nats-server: events reach the index, restarts and gaps are
//! handled (resync from a pod's dump), duplicates are no-ops, and a NATS outage degrades
//! readiness without stopping the service, which reconnects and keeps ingesting; a long
//! outage under load blocks nothing and grows nothing.

use std::time::Duration;

use kvroute_shared::protocol::EventBatch;
use kvroute_tests::client::{batch, chain, stored, Api};
use kvroute_tests::services::{Nats, SidecarProc};

const M: &str = "m";

async fn publish(nc: &async_nats::Client, b: &EventBatch) {
    nc.publish(b.subject(), b.encode().into())
        .await
        .expect("publish");
    nc.flush().await.expect("flush");
}

async fn until_connected(api: &Api) {
    until_metric(api, "kvroute_nats_connected", 1.0, "nats connected").await;
}

/// Wait until the sidecar's metric `name` reads `value`.
async fn until_metric(api: &Api, name: &'static str, value: f64, what: &str) {
    let api = api.clone();
    eventually(
        move || {
            let a = api.clone();
            Box::pin(async move { a.metric(name).await == value })
        },
        what,
    )
    .await;
}

async fn until_ready(api: &Api, status: u16, what: &str) {
    let api = api.clone();
    eventually(
        move || {
            let a = api.clone();
            Box::pin(async move { a.get("/readyz").await.status == status })
        },
        what,
    )
    .await;
}

async fn eventually(mut f: impl FnMut() -> futures::future::BoxFuture<'static, bool>, what: &str) {
    for _ in 0..200 {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting for: {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_over_nats_drive_the_index() {
    let nats = Nats::start().expect("nats");
    let sc = SidecarProc::start(&["--nats", &nats.url()], false).expect("sidecar");
    let api = Api::new(sc.addr);
    let nc = async_nats::connect(nats.url()).await.expect("client");
    let pod = "127.0.0.1:8001";
    let c = chain(M, 1, 20, 16);
    until_connected(&api).await;
    // Core NATS has no replay: wait for the subscription before the first publish.
    tokio::time::sleep(Duration::from_millis(200)).await;
    publish(&nc, &batch(pod, M, "e1", 0, vec![stored(&c[..12])])).await;
    api.until_matched(M, &c, 16, 12, "12 blocks indexed").await;
    // A duplicate (the same batch again): no-op. (The same seq with other content is a
    // conflict, recovered as a gap: ingest::tests.)
    publish(&nc, &batch(pod, M, "e1", 0, vec![stored(&c[..12])])).await;
    publish(&nc, &batch(pod, M, "e1", 1, vec![stored(&c[12..14])])).await;
    api.until_matched(M, &c, 16, 14, "duplicate ignored, next applied")
        .await;
    // Malformed messages are counted and do not stall the subscription.
    nc.publish("kvroute.events.m.x", "{garbage".into())
        .await
        .expect("publish");
    // Restart: a new epoch drops the old blocks at once.
    publish(&nc, &batch(pod, M, "e2", 0, vec![stored(&c[..1])])).await;
    api.until_matched(M, &c, 16, 1, "restart dropped old blocks")
        .await;
    assert!(
        api.metric("kvroute_event_batches_rejected_total{reason=\"bad_json\"}")
            .await
            >= 1.0
    );
    assert_eq!(api.metric("kvroute_event_duplicates_total").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_marks_stale_and_resyncs_from_the_dump() {
    let nats = Nats::start().expect("nats");
    let sc = SidecarProc::start(&["--nats", &nats.url()], false).expect("sidecar");
    let api = Api::new(sc.addr);
    let nc = async_nats::connect(nats.url()).await.expect("client");
    let c = chain(M, 2, 16, 16);
    // A pod that serves its whole cache as a dump.
    let dump = batch("127.0.0.1:8001", M, "e1", 9, vec![stored(&c)]);
    let body = dump.encode();
    let app = axum::Router::new().route(
        "/dump",
        axum::routing::get(move || {
            let b = body.clone();
            async move { b }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let dump_addr = l.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(l, app).await });
    let r = api
        .put(
            "/v1/pods/127.0.0.1:8001",
            serde_json::json!({"model": M, "dump_url": format!("http://{dump_addr}/dump")}),
        )
        .await;
    assert_eq!(r.status, 200);
    until_connected(&api).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    publish(
        &nc,
        &batch("127.0.0.1:8001", M, "e1", 0, vec![stored(&c[..2])]),
    )
    .await;
    // Batches 1..8 are lost; 9 arrives: gap → stale → dump fetched → full state, stale cleared.
    publish(&nc, &batch("127.0.0.1:8001", M, "e1", 9, vec![])).await;
    api.until_matched(M, &c, 16, 16, "resynced from dump").await;
    let p = api.get("/v1/pods/127.0.0.1:8001").await;
    assert_eq!(p.json["stale"], false, "{}", p.json);
    assert_eq!(api.metric("kvroute_resyncs_total{how=\"dump\"}").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_down_degrades_then_recovers() {
    let mut nats = Nats::start().expect("nats");
    let sc = SidecarProc::start(&["--nats", &nats.url()], false).expect("sidecar");
    let api = Api::new(sc.addr);
    until_ready(&api, 200, "ready").await;
    nats.stop();
    until_ready(&api, 503, "degraded").await;
    // Still serving: HTTP ingestion and routing work while NATS is down.
    let c = chain(M, 3, 4, 16);
    assert_eq!(
        api.events(&batch("127.0.0.1:8001", M, "e", 0, vec![stored(&c)]))
            .await
            .status,
        200
    );
    assert_eq!(api.matched(M, &c, 16).await, 4);
    nats.restart().expect("nats back");
    until_ready(&api, 200, "reconnected").await;
    let nc = async_nats::connect(nats.url()).await.expect("client");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let c2 = chain(M, 4, 6, 16);
    publish(&nc, &batch("127.0.0.1:8002", M, "e", 0, vec![stored(&c2)])).await;
    api.until_matched(M, &c2, 16, 6, "ingesting after reconnect")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_down_at_start_is_not_fatal() {
    let port = kvroute_tests::procs::free_port();
    let sc = SidecarProc::start(&["--nats", &format!("nats://127.0.0.1:{port}")], false)
        .expect("starts without nats");
    let api = Api::new(sc.addr);
    assert_eq!(api.get("/healthz").await.status, 200);
    assert_eq!(api.get("/readyz").await.status, 503);
    let reason = api.get("/readyz").await.json;
    assert_eq!(reason["degraded"], "nats disconnected");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_pods_are_removed_after_the_liveness_timeout() {
    let (_sc, api) = {
        let sc = SidecarProc::start(&[], false).expect("sidecar");
        let api = Api::new(sc.addr);
        (sc, api)
    };
    let mut cfg = api.get("/v1/config").await.json;
    cfg["liveness_timeout_s"] = serde_json::json!(1);
    assert_eq!(api.put("/v1/config", &cfg).await.status, 200);
    let c = chain(M, 5, 4, 16);
    api.events(&batch("127.0.0.1:8001", M, "e", 0, vec![stored(&c)]))
        .await;
    api.register("127.0.0.1:8002", M).await; // never speaks: predicted-mode pod, kept
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let pods = api.get("/v1/pods").await.json;
    let names: Vec<&str> = pods["pods"]
        .as_array()
        .map(|a| a.iter().filter_map(|p| p["pod"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(
        names,
        ["127.0.0.1:8002"],
        "the silent event-publishing pod is gone"
    );
    assert_eq!(
        api.metric("kvroute_pods_removed_total{reason=\"liveness\"}")
            .await,
        1.0
    );
    for _ in 0..10 {
        assert_eq!(api.route(M, &c, 16).await.pod, "127.0.0.1:8002");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_see_each_others_decisions() {
    let nats = Nats::start().expect("nats");
    let a = SidecarProc::start(&["--nats", &nats.url()], false).expect("sidecar a");
    let b = SidecarProc::start(&["--nats", &nats.url()], false).expect("sidecar b");
    let (ra, rb) = (Api::new(a.addr), Api::new(b.addr));
    for api in [&ra, &rb] {
        for p in ["127.0.0.1:8001", "127.0.0.1:8002"] {
            api.register(p, M).await;
        }
        until_connected(api).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (mut decisions, mut placed) = (Vec::new(), Vec::new());
    for i in 0..10 {
        let mut r = kvroute_tests::client::route_req(M, &chain(M, 40 + i, 4, 16), 16);
        r.request_id = Some(format!("a{i}"));
        let resp = ra.post("/v1/route", &r).await;
        assert_eq!(resp.status, 200);
        decisions.push(resp.json["decision"].as_str().unwrap_or("").to_string());
        placed.push(resp.json["pod"].as_str().unwrap_or("").to_string());
    }
    let inflight = |api: Api| async move {
        let pods = api.get("/v1/pods").await.json;
        pods["pods"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|p| p["load"]["inflight"].as_u64().unwrap_or(0))
                    .sum::<u64>()
            })
            .unwrap_or(0)
    };
    let b2 = rb.clone();
    eventually(
        move || {
            let b = b2.clone();
            Box::pin(async move { inflight(b).await == 10 })
        },
        "replica b sees a's 10 decisions",
    )
    .await;
    // And their prompts: a follower of each (the same four blocks and two more), routed
    // at b before any engine reported a block, goes where a's request is computing it.
    for (i, pod) in placed.iter().enumerate() {
        let mut follower = chain(M, 40 + i as u32, 4, 16);
        follower.extend(chain(M, 900 + i as u32, 2, 16));
        let mut r = kvroute_tests::client::route_req(M, &follower, 16);
        r.dry_run = true;
        r.explain = true;
        let resp = rb.post("/v1/route", &r).await;
        assert_eq!(resp.status, 200);
        assert_eq!(
            resp.json["pod"].as_str(),
            Some(pod.as_str()),
            "follower {i}: {}",
            resp.json
        );
        // Held there as deep as a's prompt (the marks of four blocks are every block).
        let held: Vec<(String, u64)> = resp.json["explain"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                let pod = c["pod"].as_str().unwrap_or("").to_string();
                (pod, c["in_flight"].as_u64().unwrap_or(0))
            })
            .collect();
        for (p, n) in held {
            assert_eq!(n, if p == *pod { 4 } else { 0 }, "follower {i} on {p}");
        }
    }
    // b has heard a (a has heard nothing of b, which decided nothing): its status shows
    // the two-replica set and its rank in it, by id.
    let (sa, sb) = (
        ra.get("/v1/status").await.json,
        rb.get("/v1/status").await.json,
    );
    let (ida, idb) = (
        sa["replica"].as_str().unwrap_or(""),
        sb["replica"].as_str().unwrap_or(""),
    );
    assert_eq!(sb["replica_set"]["size"], 2, "{}", sb["replica_set"]);
    assert_eq!(sb["replica_set"]["rank"], u64::from(idb > ida));
    assert_eq!(sa["replica_set"]["size"], 1);
    for (i, d) in decisions.iter().enumerate() {
        ra.post("/v1/report", serde_json::json!({"decision": d, "request_id": format!("a{i}"), "pod": "127.0.0.1:8001", "status": 200})).await;
    }
    let b2 = rb.clone();
    eventually(
        move || {
            let b = b2.clone();
            Box::pin(async move { inflight(b).await == 0 })
        },
        "and their releases",
    )
    .await;
}

/// Replicas with admission on share their queues' states over NATS (so tenants take
/// turns across them): a replica holding a queue for the model takes another's state,
/// one holding none ignores it, and a state on another replica's subject or not a state
/// at all is counted and dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_their_queues_and_forgeries_are_counted() {
    let nats = Nats::start().expect("nats");
    let a = SidecarProc::start(&["--nats", &nats.url()], false).expect("sidecar a");
    let b = SidecarProc::start(&["--nats", &nats.url()], false).expect("sidecar b");
    let (ra, rb) = (Api::new(a.addr), Api::new(b.addr));
    let mut settings = serde_json::Map::new();
    settings.insert(
        "admission".into(),
        serde_json::json!({"enabled": true, "max_inflight": 1, "max_backlog_s": 1000.0,
            "cache_loss": 1.0, "claim_timeout_ms": 60000}),
    );
    for api in [&ra, &rb] {
        api.register("127.0.0.1:8001", M).await;
        api.merge_config(&settings).await.expect("admission on");
        until_connected(api).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let count = |api: &Api, outcome: &str| {
        let (api, name) = (
            api.clone(),
            format!("kvroute_replica_queues_total{{outcome=\"{outcome}\"}}"),
        );
        async move { api.metric(&name).await }
    };
    // Until replica a has counted at least one queue state with `outcome`.
    let counted = |outcome: &'static str, what: &'static str| {
        let ra = ra.clone();
        eventually(
            move || {
                let a = ra.clone();
                Box::pin(async move { count(&a, outcome).await >= 1.0 })
            },
            what,
        )
    };
    // b fills its one slot and queues a light tenant's request: a holds no queue yet.
    let light = |n: u32| {
        let mut r = kvroute_tests::client::route_req(M, &chain(M, 90 + n, 4, 16), 16);
        r.admission.tenant = Some("light".into());
        r
    };
    assert_eq!(rb.post("/v1/route", light(0)).await.status, 200);
    assert_eq!(rb.post("/v1/route", light(1)).await.status, 202);
    counted("no_room", "a hears b's queue, holding none itself").await;
    // Once a queues too (the pod is full with b's request, which a heard of), it takes
    // b's states (sent again while the light one waits).
    assert_eq!(ra.post("/v1/route", light(2)).await.status, 202);
    counted("applied", "a takes b's queue state").await;
    assert!(count(&rb, "published").await >= 1.0);
    let status = ra.get("/v1/status").await.json;
    assert_eq!(status["admission"]["peers"], 1, "{}", status["admission"]);
    // Forged and malformed states.
    let nc = async_nats::connect(nats.url()).await.expect("client");
    let forged = serde_json::json!({"replica": "gw-c", "model": M, "bands": []});
    nc.publish("kvroute.queue.m.gw-d", forged.to_string().into())
        .await
        .expect("publish");
    nc.publish("kvroute.queue.m.gw-d", "not json".into())
        .await
        .expect("publish");
    nc.flush().await.expect("flush");
    for (outcome, what) in [
        ("subject_mismatch", "a state on another replica's subject"),
        ("malformed", "a payload that is no state"),
    ] {
        counted(outcome, what).await;
    }
}

/// Resident memory of a process, bytes.
fn rss_bytes(pid: u32) -> u64 {
    kvroute_tests::procs::status_kib(pid, "VmRSS:") * 1024
}

/// NATS down for 60 s while the gateway keeps routing: routes, reports and events over
/// HTTP go on (the index keeps changing), the load deltas that cannot be published are
/// dropped and counted instead of queueing without bound, memory stays flat, and SIGTERM
/// still ends the sidecar within 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_nats_outage_under_load_blocks_nothing_and_grows_nothing() {
    let mut nats = Nats::start().expect("nats");
    let mut sc = SidecarProc::start(&["--nats", &nats.url()], false).expect("sidecar");
    let api = Api::new(sc.addr);
    let pods = ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"];
    for p in pods {
        api.register(p, M).await;
    }
    until_connected(&api).await;
    nats.stop();
    until_metric(&api, "kvroute_nats_connected", 0.0, "nats disconnected").await;

    let outage = Duration::from_secs(60);
    let t0 = std::time::Instant::now();
    // Two clients route and report as fast as the sidecar answers.
    let clients: Vec<_> = (0..2u32)
        .map(|c| {
            let api = api.clone();
            tokio::spawn(async move {
                let mut n = 0u64;
                while t0.elapsed() < outage {
                    let ch = chain(M, c * 1000 + (n % 64) as u32, 8, 16);
                    let r = api.post("/v1/route", kvroute_tests::client::route_req(M, &ch, 16)).await;
                    assert_eq!(r.status, 200, "{}", r.json);
                    let report = serde_json::json!({"decision": r.json["decision"], "pod": r.json["pod"], "status": 200});
                    assert_eq!(api.post("/v1/report", report).await.status, 204);
                    n += 1;
                    // Bounded: a few hundred decisions a second, enough to fill every
                    // queue on the way to NATS many times over.
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                n
            })
        })
        .collect();
    // Meanwhile engines' events arrive over HTTP and change the index.
    let mut seq = 0u64;
    let mut rss = Vec::new();
    while t0.elapsed() < outage {
        let blocks = chain(M, 50_000 + seq as u32, 4, 16);
        let r = api
            .events(&batch(
                pods[(seq % 3) as usize],
                M,
                "e",
                seq / 3,
                vec![stored(&blocks)],
            ))
            .await;
        assert_eq!(r.status, 200, "{}", r.json);
        let held = api
            .post(
                "/v1/lookup",
                serde_json::json!({"model": M, "chain": blocks}),
            )
            .await
            .json;
        assert_eq!(
            held["confirmed"][0]["matched_blocks"], 4,
            "event {seq} reached the index: {held}"
        );
        seq += 1;
        if seq.is_multiple_of(20) {
            rss.push((t0.elapsed().as_secs_f64(), rss_bytes(sc.pid())));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut routed = 0;
    for c in clients {
        routed += c.await.expect("client");
    }
    let deltas = |o: &'static str| {
        let api = api.clone();
        async move {
            api.metric(&format!("kvroute_replica_deltas_total{{outcome=\"{o}\"}}"))
                .await
        }
    };
    let (queued, dropped, failed) = (
        deltas("queued").await,
        deltas("dropped_full").await,
        deltas("publish_failed").await,
    );
    eprintln!(
        "outage: {routed} routes, {seq} event batches, deltas queued {queued} dropped {dropped} publish_failed {failed}, rss (s, bytes) {rss:?}"
    );
    assert!(routed > 2000, "routing went on: {routed}");
    assert!(seq > 400, "events went on: {seq}");
    assert_eq!(api.metric("kvroute_inflight_decisions").await, 0.0);
    // After warm-up (the first 10 s) resident memory stays within 8 MiB.
    let warm = rss.iter().find(|(t, _)| *t >= 10.0).map_or(0, |x| x.1);
    let peak = rss.iter().map(|x| x.1).max().unwrap_or(0);
    assert!(
        warm > 0 && peak <= warm + (8 << 20),
        "memory grew during the outage: {rss:?}"
    );
    let t = std::time::Instant::now();
    let code = sc.terminate();
    let exit = t.elapsed();
    // A row of docs/reliability.md (`make reliability` collects it).
    println!(
        "RELIABILITY|NATS down for 60 s under load|nats-server stopped for 60 s while 2 clients route and report and engines post events over HTTP|{routed} decisions, {seq} event batches applied; {dropped} load deltas dropped and counted, {failed} publishes timed out; RSS {:.1} → {:.1} MiB after warm-up; SIGTERM exit in {} ms|pass",
        warm as f64 / 1048576.0,
        peak as f64 / 1048576.0,
        exit.as_millis()
    );
    assert!(exit < Duration::from_secs(2), "SIGTERM took {exit:?}");
    assert_eq!(code, Some(0), "{}", sc.log());
}

/// The event plane with the NATS permissions docs/security.md describes: one user per
/// bridge, allowed to publish only its own pod's subject; one user per sidecar replica,
/// allowed to publish only its own load deltas. Anonymous clients are refused by NATS, a
/// bridge's publish on another pod's subject is refused by NATS, a batch that names
/// another pod on the bridge's own subject is refused by the sidecar, and the replicas'
/// deltas flow while a replica cannot speak for another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_permissions_confine_each_bridge_to_its_pod() {
    let conf = r#"
authorization {
  users = [
    { user: gw-a, password: gw-a-pass,
      permissions: { publish: ["kvroute.load.*.gw-a", "kvroute.queue.*.gw-a"],
                     subscribe: ["kvroute.events.>", "kvroute.load.>", "kvroute.queue.>", "_INBOX.>"] } }
    { user: gw-b, password: gw-b-pass,
      permissions: { publish: ["kvroute.load.*.gw-b", "kvroute.queue.*.gw-b"],
                     subscribe: ["kvroute.events.>", "kvroute.load.>", "kvroute.queue.>", "_INBOX.>"] } }
    { user: bridge-a, password: bridge-a-pass,
      permissions: { publish: ["kvroute.events.m.127_0_0_1~8001"], subscribe: [] } }
  ]
}
"#;
    let nats = Nats::start_with_config(conf).expect("nats");
    let replica = |name: &str| {
        let pass = format!("{name}-pass");
        SidecarProc::start(
            &[
                "--nats",
                &nats.url(),
                "--nats-user",
                name,
                "--nats-password",
                &pass,
                "--replica-id",
                name,
            ],
            false,
        )
        .expect("sidecar")
    };
    let (sc, sc_b) = (replica("gw-a"), replica("gw-b"));
    let (api, api_b) = (Api::new(sc.addr), Api::new(sc_b.addr));
    until_connected(&api).await;
    until_connected(&api_b).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The replicas' own deltas flow: a decision on gw-a is load on gw-b.
    for a in [&api, &api_b] {
        a.register("127.0.0.1:8009", M).await;
    }
    api.route(M, &chain(M, 9, 2, 16), 16).await;
    until_metric(
        &api_b,
        "kvroute_replica_deltas_total{outcome=\"applied\"}",
        1.0,
        "gw-a's delta reaches gw-b",
    )
    .await;
    // gw-a cannot speak for another replica: NATS refuses the other subject, and on its
    // own subject gw-b refuses a payload that names another replica.
    let gw_a =
        async_nats::ConnectOptions::with_user_and_password("gw-a".into(), "gw-a-pass".into())
            .connect(nats.url())
            .await
            .expect("gw-a connects");
    let forged = serde_json::json!({"replica": "gw-c", "id": "x", "pod": "127.0.0.1:8009", "model": M, "op": "add", "blocks": 1000});
    let bytes = serde_json::to_vec(&forged).expect("json");
    let _ = gw_a
        .publish("kvroute.load.m.gw-c", bytes.clone().into())
        .await;
    let _ = gw_a.publish("kvroute.load.m.gw-a", bytes.into()).await;
    let _ = gw_a.flush().await;
    until_metric(
        &api_b,
        "kvroute_replica_deltas_total{outcome=\"subject_mismatch\"}",
        1.0,
        "the forged delta is refused",
    )
    .await;
    assert_eq!(
        api_b
            .metric("kvroute_replica_deltas_total{outcome=\"applied\"}")
            .await,
        1.0,
        "nothing forged was applied"
    );

    // Nobody without credentials gets in.
    assert!(
        async_nats::connect(nats.url()).await.is_err(),
        "an anonymous client was admitted"
    );
    let bridge_a = async_nats::ConnectOptions::with_user_and_password(
        "bridge-a".into(),
        "bridge-a-pass".into(),
    )
    .connect(nats.url())
    .await
    .expect("bridge-a connects");

    // Its own pod: delivered and applied.
    let own = chain(M, 1, 4, 16);
    publish(
        &bridge_a,
        &batch("127.0.0.1:8001", M, "e", 0, vec![stored(&own)]),
    )
    .await;
    api.until_matched(M, &own, 16, 4, "bridge-a's own pod")
        .await;

    // Another pod's subject: NATS refuses the publish.
    let other = chain(M, 2, 4, 16);
    let forged = batch("127.0.0.1:8002", M, "e", 0, vec![stored(&other)]);
    let _ = bridge_a
        .publish(forged.subject(), forged.encode().into())
        .await;
    let _ = bridge_a.flush().await;
    // Another pod on its own subject: NATS lets it through, the sidecar refuses it.
    let _ = bridge_a
        .publish("kvroute.events.m.127_0_0_1~8001", forged.encode().into())
        .await;
    let _ = bridge_a.flush().await;
    until_metric(
        &api,
        "kvroute_event_batches_rejected_total{reason=\"subject_mismatch\"}",
        1.0,
        "the mismatched batch is refused",
    )
    .await;
    let held = api
        .post(
            "/v1/lookup",
            serde_json::json!({"model": M, "chain": other}),
        )
        .await
        .json;
    assert_eq!(held["confirmed"], serde_json::json!([]), "{held}");
    assert_eq!(api.get("/v1/pods/127.0.0.1:8002").await.status, 404);
}
