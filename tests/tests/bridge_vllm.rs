//! The vLLM / SGLang bridge end to end: a ZMQ publisher speaking vLLM's wire format (both
//! the positional and the map encodings, integer and byte hashes), the real
//! `kvroute-bridge` process, and a real sidecar. What the engine says it cached
//! must show up under the chain hashes the filter computes for the same tokens; a bad
//! payload is counted and skipped; an engine restart drops the pod's blocks; the
//! bridge's dump is the engine's cache.

use std::time::Duration;

use kvroute_tests::client::{token_chain, Api};
use kvroute_tests::services::{BridgeProc, SidecarProc};
use rmpv::Value;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const M: &str = "m";
const BS: u32 = 16;
const POD: &str = "127.0.0.1:8001";

fn msgpack(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("encode");
    out
}

fn ints<T: Copy + Into<Value>>(x: &[T]) -> Value {
    Value::Array(x.iter().map(|&i| i.into()).collect())
}

/// vLLM before mid-2026: `array_like` structs, events tagged by a leading name.
fn stored_positional(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Value {
    Value::Array(vec![
        "BlockStored".into(),
        ints(hashes),
        parent.map_or(Value::Nil, Value::from),
        ints(tokens),
        BS.into(),
        Value::Nil,
        "GPU".into(),
    ])
}

/// vLLM since mid-2026: maps tagged by `type`, SHA-256 hashes as bytes.
fn sha(i: u8) -> Value {
    Value::Binary(vec![i; 32])
}

fn batch_positional(events: Vec<Value>) -> Vec<u8> {
    msgpack(&Value::Array(vec![1.0.into(), Value::Array(events)]))
}

fn batch_map(events: Vec<Value>) -> Vec<u8> {
    msgpack(&Value::Map(vec![
        ("ts".into(), 2.0.into()),
        ("events".into(), Value::Array(events)),
        ("data_parallel_rank".into(), 0.into()),
    ]))
}

struct Engine {
    sock: zeromq::PubSocket,
}

impl Engine {
    async fn bind() -> (Engine, u16) {
        let mut sock = zeromq::PubSocket::new();
        let ep = sock.bind("tcp://127.0.0.1:0").await.expect("bind");
        let port = match ep {
            zeromq::Endpoint::Tcp(_, port) => port,
            other => panic!("unexpected endpoint {other}"),
        };
        (Engine { sock }, port)
    }

    async fn send(&mut self, seq: u64, payload: Vec<u8>) {
        let mut m = ZmqMessage::from(Vec::<u8>::new());
        m.push_back(seq.to_be_bytes().to_vec().into());
        m.push_back(payload.into());
        self.sock.send(m).await.expect("publish");
    }
}

fn bridge(zmq_port: u16, sink: &[String]) -> BridgeProc {
    BridgeProc::start(&format!("tcp://127.0.0.1:{zmq_port}"), POD, sink).expect("bridge")
}

/// PUB/SUB drops what is sent before the subscription is live: send until it shows.
async fn send_until(
    engine: &mut Engine,
    api: &Api,
    seq: u64,
    payload: Vec<u8>,
    chain: &[u64],
    want: u32,
) {
    for _ in 0..100 {
        engine.send(seq, payload.clone()).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if api.matched(M, chain, BS).await == want {
            return;
        }
    }
    panic!("engine batch {seq} never showed up ({want} blocks)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_events_reach_the_index_under_the_filters_hashes() {
    let sc = SidecarProc::start(&[], false).expect("sidecar");
    let api = Api::new(sc.addr);
    let (mut engine, port) = Engine::bind().await;
    let bridge = bridge(port, &[format!("--sidecar=http://{}", sc.addr)]);

    let tokens: Vec<u32> = (0..6 * BS).map(|i| 1000 + i * 7).collect();
    let chain = token_chain(M, BS, &tokens);
    let b = BS as usize;

    // Old format: two events, the second continuing from the first's last block.
    let first = batch_positional(vec![
        stored_positional(&[101, 102], None, &tokens[..2 * b]),
        stored_positional(&[103], Some(102), &tokens[2 * b..3 * b]),
    ]);
    send_until(&mut engine, &api, 0, first, &chain, 3).await;

    // New format: byte hashes, a parent from the old format's numbering.
    let ev = Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        (
            "block_hashes".into(),
            Value::Array(vec![sha(4), sha(5), sha(6)]),
        ),
        ("parent_block_hash".into(), 103u64.into()),
        ("token_ids".into(), ints(&tokens[3 * b..])),
        ("block_size".into(), BS.into()),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), Value::Nil),
    ]);
    engine.send(1, batch_map(vec![ev])).await;
    api.until_matched(M, &chain, BS, 6, "the map-form batch")
        .await;

    // Eviction of the last two blocks, by engine hash.
    let removed = Value::Map(vec![
        ("type".into(), "BlockRemoved".into()),
        ("block_hashes".into(), Value::Array(vec![sha(5), sha(6)])),
        ("medium".into(), "GPU".into()),
    ]);
    engine.send(2, batch_map(vec![removed])).await;
    api.until_matched(M, &chain, BS, 4, "the removal").await;

    // The dump is what the engine still holds, under kvroute's names.
    let dump: kvroute_shared::protocol::EventBatch =
        serde_json::from_str(&bridge.get("/dump").await).expect("dump json");
    let mut held: Vec<u64> = dump
        .events
        .iter()
        .flat_map(|e| match e {
            kvroute_shared::protocol::Event::Stored { blocks, .. } => blocks.clone(),
            _ => vec![],
        })
        .collect();
    held.sort_unstable();
    let mut want = chain[..4].to_vec();
    want.sort_unstable();
    assert_eq!(held, want);

    // A payload that is not an event batch is counted and skipped. What it held is
    // lost (removals, maybe), so the next batch finds a gap: a new epoch, in which the
    // sidecar drops what it knew of the pod rather than keep stale blocks.
    engine.send(3, b"\xc1garbage".to_vec()).await;
    let one_chain = unrecovered_gap(
        &mut engine,
        &api,
        &bridge,
        4,
        &chain,
        &[
            "kvroute_bridge_bad_payloads_total 1",
            "kvroute_bridge_gaps_total 1",
        ],
    )
    .await;

    // The engine restarts (its sequence starts over): the pod's blocks go at once.
    let two: Vec<u32> = (0..BS).map(|i| 9 + i).collect();
    let two_chain = token_chain(M, BS, &two);
    engine
        .send(
            0,
            batch_positional(vec![stored_positional(&[2], None, &two)]),
        )
        .await;
    api.until_matched(M, &two_chain, BS, 1, "the restarted engine's block")
        .await;
    assert_eq!(
        api.matched(M, &one_chain, BS).await,
        0,
        "old blocks dropped"
    );
    assert!(bridge
        .get("/metrics")
        .await
        .contains("kvroute_bridge_restarts_total 1"));
    // SIGTERM: the bridge stops its tasks, sends what is queued and exits cleanly.
    let mut bridge = bridge;
    let t = std::time::Instant::now();
    assert_eq!(
        bridge.child.terminate(Duration::from_secs(10)),
        Some(0),
        "{}",
        bridge.log()
    );
    assert!(
        t.elapsed() < Duration::from_secs(6),
        "shutdown took {:?}",
        t.elapsed()
    );
}

/// vLLM's replay socket: a ROUTER that answers a start sequence with every buffered
/// batch from there on, then sequence −1.
async fn serve_replay(buffer: Vec<(u64, Vec<u8>)>) -> u16 {
    let mut sock = zeromq::RouterSocket::new();
    let port = match sock.bind("tcp://127.0.0.1:0").await.expect("bind") {
        zeromq::Endpoint::Tcp(_, port) => port,
        other => panic!("unexpected endpoint {other}"),
    };
    tokio::spawn(async move {
        while let Ok(req) = sock.recv().await {
            let frames = req.into_vec();
            let (Some(id), Some(start)) = (frames.first(), frames.get(2)) else {
                continue;
            };
            let start = u64::from_be_bytes(start.as_ref().try_into().unwrap_or([0; 8]));
            let reply = |seq: Vec<u8>, payload: Vec<u8>| {
                let mut m = ZmqMessage::from(id.clone());
                m.push_back(Vec::<u8>::new().into());
                m.push_back(seq.into());
                m.push_back(payload.into());
                m
            };
            for (seq, p) in buffer.iter().filter(|(s, _)| *s >= start) {
                let _ = sock
                    .send(reply(seq.to_be_bytes().to_vec(), p.clone()))
                    .await;
            }
            let _ = sock
                .send(reply((-1i64).to_be_bytes().to_vec(), vec![]))
                .await;
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_filled_from_the_engines_replay_socket() {
    let sc = SidecarProc::start(&[], false).expect("sidecar");
    let api = Api::new(sc.addr);
    let tokens: Vec<u32> = (0..4 * BS).map(|i| 3000 + i).collect();
    let chain = token_chain(M, BS, &tokens);
    let block = |i: usize, parent: Option<u64>| block_batch(&tokens, i, parent);
    // Batches 1 and 2 never reach the bridge; the engine still buffers them.
    let replay_port = serve_replay(vec![(1, block(1, Some(1))), (2, block(2, Some(2)))]).await;
    let (mut engine, port) = Engine::bind().await;
    let bridge = bridge(
        port,
        &[
            format!("--sidecar=http://{}", sc.addr),
            format!("--replay=tcp://127.0.0.1:{replay_port}"),
        ],
    );
    send_until(&mut engine, &api, 0, block(0, None), &chain, 1).await;
    engine.send(3, block(3, Some(3))).await;
    api.until_matched(M, &chain, BS, 4, "blocks 1-2 replayed, 3 applied")
        .await;
    let m = bridge.get("/metrics").await;
    for want in [
        "kvroute_bridge_replayed_total 2",
        "kvroute_bridge_gaps_total 0",
        "kvroute_bridge_replay_failures_total 0",
    ] {
        assert!(m.contains(want), "{want} in {m}");
    }
    // A gap the buffer no longer covers: a new epoch after all.
    unrecovered_gap(
        &mut engine,
        &api,
        &bridge,
        9,
        &chain,
        &[
            "kvroute_bridge_replay_failures_total 1",
            "kvroute_bridge_gaps_total 1",
        ],
    )
    .await;
}

/// Send batch `seq` (one fresh block) after a gap nothing filled: it must land in a new
/// epoch, the blocks of `before` must be gone, and the bridge's metrics must show
/// `metrics`. Returns the fresh block's chain.
async fn unrecovered_gap(
    engine: &mut Engine,
    api: &Api,
    bridge: &BridgeProc,
    seq: u64,
    before: &[u64],
    metrics: &[&str],
) -> Vec<u64> {
    let toks: Vec<u32> = (0..BS).map(|i| 40_000 + 100 * seq as u32 + i).collect();
    let fresh = token_chain(M, BS, &toks);
    let b = batch_positional(vec![stored_positional(&[1000 + seq], None, &toks)]);
    engine.send(seq, b).await;
    api.until_matched(M, &fresh, BS, 1, "the batch after the gap")
        .await;
    assert_eq!(
        api.matched(M, before, BS).await,
        0,
        "pre-gap blocks dropped"
    );
    let m = bridge.get("/metrics").await;
    for want in metrics {
        assert!(m.contains(want), "{want} in {m}");
    }
    fresh
}

/// The bridge advertises its dump in every batch: a gateway sidecar that restarts (and
/// so missed everything before) rebuilds the pod's blocks from it at the next batch,
/// with no registration anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_sidecar_resyncs_from_the_bridges_dump() {
    let nats = kvroute_tests::services::Nats::start().expect("nats");
    let (mut engine, port) = Engine::bind().await;
    let bridge = bridge(port, &[format!("--nats={}", nats.url())]);
    // The bridge's dump port is one the sidecar takes from batches.
    let dump_port = bridge.listen.rsplit(':').next().unwrap_or("").to_string();
    let mut sc = SidecarProc::start(&["--nats", &nats.url(), "--dump-port", &dump_port], false)
        .expect("sidecar");
    let tokens: Vec<u32> = (0..4 * BS).map(|i| 500 + i).collect();
    let chain = token_chain(M, BS, &tokens);
    let block = |i: usize, parent: Option<u64>| block_batch(&tokens, i, parent);
    let api = Api::new(sc.addr);
    until_subscribed(&api).await;
    for i in 0..3usize {
        let parent = i.checked_sub(1).map(|p| p as u64 + 1);
        send_until(
            &mut engine,
            &api,
            i as u64,
            block(i, parent),
            &chain,
            i as u32 + 1,
        )
        .await;
    }
    sc.restart().expect("sidecar restart");
    let api = Api::new(sc.addr);
    until_subscribed(&api).await;
    assert_eq!(
        api.matched(M, &chain, BS).await,
        0,
        "a new sidecar knows nothing"
    );
    // The next batch is the first this sidecar sees, and not the first of its epoch: it
    // fetches the dump named in the batch, then applies the batch.
    send_until(&mut engine, &api, 3, block(3, Some(3)), &chain, 4).await;
    let pod = api.get(&format!("/v1/pods/{POD}")).await;
    assert_eq!(
        pod.json["dump_url"],
        format!(
            "http://127.0.0.1:{}/dump",
            bridge.listen.rsplit(':').next().unwrap_or("")
        ),
        "{}",
        pod.json
    );
    assert_eq!(api.metric("kvroute_resyncs_total{how=\"dump\"}").await, 1.0);
}

/// Core NATS has no replay, and the bridge forwards each engine batch once: publish only
/// once the sidecar's subscription is live.
async fn until_subscribed(api: &Api) {
    for _ in 0..200 {
        if api.metric("kvroute_nats_connected").await == 1.0 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("sidecar never connected to NATS");
}

/// A batch storing block `i` of `tokens` (engine hash `i + 1`) under `parent`.
fn block_batch(tokens: &[u32], i: usize, parent: Option<u64>) -> Vec<u8> {
    let b = BS as usize;
    batch_positional(vec![stored_positional(
        &[i as u64 + 1],
        parent,
        &tokens[i * b..(i + 1) * b],
    )])
}

/// A bridge following one data-parallel rank (`--dp-rank`): its blocks belong to the pod
/// `ip:port@rank`, and a batch of another rank (a mis-wired ZMQ port) is refused and
/// counted, never credited to this rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ranks_bridge_names_the_rank_and_refuses_other_ranks() {
    let sc = SidecarProc::start(&[], false).expect("sidecar");
    let api = Api::new(sc.addr);
    let (mut engine, port) = Engine::bind().await;
    let bridge = BridgeProc::start(
        &format!("tcp://127.0.0.1:{port}"),
        POD,
        &[
            format!("--sidecar=http://{}", sc.addr),
            "--dp-rank=1".into(),
        ],
    )
    .expect("bridge");
    let tokens: Vec<u32> = (0..2 * BS).map(|i| 5000 + i).collect();
    let chain = token_chain(M, BS, &tokens);
    let of_rank = |rank: i64| {
        msgpack(&Value::Array(vec![
            1.0.into(),
            Value::Array(vec![stored_positional(&[701, 702], None, &tokens)]),
            rank.into(),
        ]))
    };
    // Rank 0's batch first, until the subscription is surely live: never indexed.
    for seq in 0..20 {
        engine.send(seq, of_rank(0)).await;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(api.matched(M, &chain, BS).await, 0, "another rank's blocks");
    let m = bridge.get("/metrics").await;
    assert!(
        m.lines()
            .any(|l| l.starts_with("kvroute_bridge_other_rank_batches_total") && !l.ends_with(" 0")),
        "{m}"
    );
    send_until(&mut engine, &api, 20, of_rank(1), &chain, 2).await;
    let confirmed = api.until_confirmed(M, &chain, 2).await;
    assert!(
        confirmed.to_string().contains(&format!("{POD}@1")),
        "the rank's pod holds them: {confirmed}"
    );
}
