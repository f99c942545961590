//! Dump fetches are server-side requests that a batch can trigger: they follow no
//! redirects and read a bounded body. A refused dump drops the pod's blocks (to be
//! rebuilt from live events) instead of applying anything.

use std::sync::Arc;
use std::time::Duration;

use axum::response::{IntoResponse, Redirect};
use axum::routing::get;
use kvroute_shared::protocol::{Event, EventBatch, PolicyConfig};
use kvroute_sidecar::Sidecar;
use kvroute_sidecar::{ingest, Recovery};

fn batch(pod: &str, seq: u64, dump_url: Option<String>, blocks: &[u64]) -> EventBatch {
    let stored = Event::Stored {
        tier: Default::default(),
        parent: None,
        blocks: blocks.to_vec(),
        tokens: None,
    };
    EventBatch {
        dump_url,
        ..EventBatch::new(pod, "m", "e", seq, vec![stored])
    }
}

/// A server on 127.0.0.1 with a good dump, a redirect to it, and an oversized one.
async fn server(pod: &'static str) -> std::net::SocketAddr {
    let good = serde_json::to_string(&batch(pod, 5, None, &[7, 8, 9])).expect("json");
    let app = axum::Router::new()
        .route("/good", get(move || async move { good.clone() }))
        .route(
            "/redirect",
            get(|| async { Redirect::temporary("/good").into_response() }),
        )
        .route(
            "/huge",
            get(|| async {
                // Past the 64 MiB cap, sent without a length up front.
                let chunk = axum::body::Bytes::from(vec![b' '; 1 << 20]);
                let s = futures::stream::iter(
                    (0..80).map(move |_| Ok::<_, std::io::Error>(chunk.clone())),
                );
                axum::body::Body::from_stream(s)
            }),
        );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    addr
}

async fn resync_via(path: &str) -> (u64, u64, bool) {
    const POD: &str = "127.0.0.1:8000";
    let srv = server(POD).await;
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    // The dump server runs on loopback, as does the pod it stands for.
    sc.registry().set_rules(kvroute_sidecar::Rules {
        learn_local_pods: true,
        dump_ports: vec![srv.port()],
    });
    let (locks, resyncs) = Recovery::new();
    let locks = Arc::new(locks);
    let (stop_tx, stop) = kvroute_service::Shutdown::new();
    let task = tokio::spawn(kvroute_sidecar::fetch_dumps(
        sc.clone(),
        locks.clone(),
        resyncs,
        None,
        stop,
    ));
    let url = Some(format!("http://127.0.0.1:{}{path}", srv.port()));
    ingest(&sc, &locks, &batch(POD, 0, url.clone(), &[1])).expect("first");
    // A gap: the resync fetches `url`.
    ingest(&sc, &locks, &batch(POD, 3, url, &[2])).expect("gap");
    let mut outcome = (0, 0);
    for _ in 0..200 {
        outcome = (
            sc.metrics.resyncs.get("dump"),
            sc.metrics.resyncs.get("drop_after_failed_dump"),
        );
        if outcome != (0, 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let ix = sc.index("m").expect("index");
    let dump_applied = !ix.lookup(&[7]).is_empty();
    stop_tx.stop();
    let _ = task.await;
    (outcome.0, outcome.1, dump_applied)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_good_dump_is_applied() {
    assert_eq!(resync_via("/good").await, (1, 0, true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_not_followed() {
    assert_eq!(resync_via("/redirect").await, (0, 1, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_dump_is_not_read_past_its_cap() {
    assert_eq!(resync_via("/huge").await, (0, 1, false));
}
