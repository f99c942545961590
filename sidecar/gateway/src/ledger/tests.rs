//! The ledger's rules, one test each.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_shared::protocol::{LoadOp, PolicyConfig};

use super::*;

/// A ledger whose deltas are published (as with NATS configured).
fn ledger(replica: &str) -> Ledger {
    let l = Ledger::new(replica.into());
    l.set_announce(true);
    l
}

fn decision(pod: &str, prefill_pod: Option<&str>, prefix: Option<u64>) -> Placement {
    Placement {
        model: "m".into(),
        pod: Arc::from(pod),
        prefill_pod: prefill_pod.map(Arc::from),
        prefill_tokens: 1000,
        blocks: 10,
        prefix,
        expected_cached: 0,
        slack_tokens: 16,
        settled_cached: 0,
        predicted: false,
        chain_blocks: 10,
        text_bytes: None,
        last_block: None,
        chain: Arc::from([]),
    }
}

#[test]
fn a_decision_is_released_once_and_leaves_nothing_behind() {
    let (l, cfg, now) = (ledger("r1"), PolicyConfig::default(), Instant::now());
    let (id, adds) = l.commit(decision("a:1", None, Some(7)), now, &cfg);
    assert_eq!(adds.len(), 1);
    let v = l.view("a:1", Some(7), now, &cfg);
    assert_eq!((v.inflight, v.decode_blocks, v.prefix_inflight), (1, 10, 1));
    assert!(v.pending_prefill_tokens > 0);
    assert!(l.release(id, now, &cfg).is_some());
    assert!(
        l.release(id, now, &cfg).is_none(),
        "a second release is refused"
    );
    let v = l.view("a:1", Some(7), now, &cfg);
    assert_eq!(
        (
            v.inflight,
            v.decode_blocks,
            v.prefix_inflight,
            v.pending_prefill_tokens
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(l.outstanding(), 0);
    assert_eq!(l.prefixes_in_flight(), 0);
}

#[test]
fn external_ids_name_only_this_replicas_decisions() {
    let l = Ledger::new("abc".into());
    assert_eq!(l.parse_id(&l.external_id(42)), Some(42));
    for other in ["", "42", "xyz-42", "abc-", "abc-x", "abc-42-1"] {
        assert_eq!(l.parse_id(other), None, "{other:?}");
    }
}

#[test]
fn remote_adds_are_idempotent_and_expire() {
    let (l, cfg, now) = (ledger("me"), PolicyConfig::default(), Instant::now());
    let pod: Arc<str> = Arc::from("a:1");
    let delta = |op, id: &str| LoadDelta {
        replica: "peer".into(),
        id: id.into(),
        pod: "a:1".into(),
        model: "m".into(),
        op,
        prefill_tokens: 100,
        blocks: 5,
        prefix: Some(3),
        inflight: true,
        session: None,
        response: None,
        bound_tokens: 0,
    };
    assert!(!l.has_peers(now));
    assert!(l.apply_remote(&pod, &delta(LoadOp::Add, "x"), now, &cfg));
    assert!(
        !l.apply_remote(&pod, &delta(LoadOp::Add, "x"), now, &cfg),
        "repeat ignored"
    );
    assert!(l.has_peers(now));
    let own = LoadDelta {
        replica: "me".into(),
        ..delta(LoadOp::Add, "y")
    };
    assert!(
        !l.apply_remote(&pod, &own, now, &cfg),
        "our own echo is ignored"
    );
    let v = l.view("a:1", Some(3), now, &cfg);
    assert_eq!((v.inflight, v.decode_blocks, v.prefix_inflight), (1, 5, 1));
    // The peer died: its share expires.
    let later = now + Duration::from_secs(cfg.load_timeout_s + 1);
    l.expire(later, Duration::from_secs(cfg.load_timeout_s), &cfg);
    assert_eq!(l.remote_count("a:1"), 0);
    assert_eq!(l.view("a:1", Some(3), later, &cfg).prefix_inflight, 0);
    assert!(!l.apply_remote(&pod, &delta(LoadOp::Release, "x"), later, &cfg));
}

/// A delta from `replica` (one block on pod a:1).
fn from_replica(replica: &str, id: &str) -> LoadDelta {
    LoadDelta {
        replica: replica.into(),
        id: id.into(),
        pod: "a:1".into(),
        model: "m".into(),
        op: LoadOp::Add,
        prefill_tokens: 0,
        blocks: 1,
        prefix: None,
        inflight: false,
        session: None,
        response: None,
        bound_tokens: 0,
    }
}

#[test]
fn a_replica_ranks_itself_among_those_it_heard_lately() {
    let (l, cfg, now) = (ledger("m"), PolicyConfig::default(), Instant::now());
    let pod: Arc<str> = Arc::from("a:1");
    assert_eq!(l.home_slot(now), None, "alone, every pod is its own");
    assert!(l.apply_remote(&pod, &from_replica("b", "1"), now, &cfg));
    assert!(l.apply_remote(&pod, &from_replica("z", "1"), now, &cfg));
    assert_eq!(l.home_slot(now), Some((1, 3)), "b < m < z");
    // z falls silent; b keeps routing.
    let t20 = now + Duration::from_secs(20);
    assert!(l.apply_remote(&pod, &from_replica("b", "2"), t20, &cfg));
    let t40 = now + Duration::from_secs(40);
    assert_eq!(l.home_slot(t40), Some((1, 2)), "z is no longer counted");
    assert_eq!(l.home_slot(now + Duration::from_secs(60)), None);
}

/// The attack: deltas under thousands of made-up replica ids. The ledger remembers at
/// most `MAX_PEERS` of them, and a real replica heard once they fall silent is counted.
#[test]
fn a_flood_of_replica_ids_is_bounded_and_ages_out() {
    let (l, cfg, now) = (ledger("m"), PolicyConfig::default(), Instant::now());
    let pod: Arc<str> = Arc::from("a:1");
    for k in 0..4 * MAX_PEERS {
        l.apply_remote(&pod, &from_replica(&format!("fake{k}"), "1"), now, &cfg);
    }
    assert_eq!(l.book.lock().peers.len(), MAX_PEERS);
    assert_eq!(l.home_slot(now).map(|s| s.1), Some(MAX_PEERS + 1));
    let later = now + PEER_FRESH + Duration::from_secs(1);
    assert!(l.apply_remote(&pod, &from_replica("a", "1"), later, &cfg));
    assert_eq!(l.home_slot(later), Some((1, 2)), "only a and m route now");
    assert_eq!(l.book.lock().peers.len(), 1, "the stale ids made room");
}

#[test]
fn a_removed_pod_takes_its_decisions_and_keeps_others_shares() {
    let (l, cfg, now) = (ledger("me"), PolicyConfig::default(), Instant::now());
    // Decoded on a, prefilled on b.
    let (split, adds) = l.commit(decision("a:1", Some("b:1"), None), now, &cfg);
    assert_eq!(adds.len(), 2, "each pod's share is announced");
    assert!(l.view("b:1", None, now, &cfg).pending_prefill_tokens > 0);
    let (on_b, _) = l.commit(decision("b:1", None, Some(9)), now, &cfg);
    let releases = l.forget_pod("b:1", now, &cfg);
    assert_eq!(
        releases.len(),
        1,
        "b's own decision is released to the peers"
    );
    assert!(l.release(on_b, now, &cfg).is_none());
    // The split decision keeps its decode share on a.
    assert_eq!(l.view("a:1", None, now, &cfg).inflight, 1);
    assert!(l.release(split, now, &cfg).is_some());
    assert_eq!(l.view("a:1", None, now, &cfg).inflight, 0);
    assert_eq!(l.prefixes_in_flight(), 0);
}

#[test]
fn unreported_decisions_expire_after_the_timeout() {
    let (l, cfg, now) = (ledger("me"), PolicyConfig::default(), Instant::now());
    l.commit(decision("a:1", None, None), now, &cfg);
    let timeout = Duration::from_secs(cfg.load_timeout_s);
    assert!(l.expire(now + timeout / 2, timeout, &cfg).0.is_empty());
    let (gone, releases) = l.expire(now + timeout * 2, timeout, &cfg);
    assert_eq!((gone.len(), releases.len()), (1, 1));
    assert_eq!(l.outstanding(), 0);
}

#[test]
fn without_replica_sync_no_deltas_are_built() {
    let (l, cfg, now) = (
        Ledger::new("me".into()),
        PolicyConfig::default(),
        Instant::now(),
    );
    let (id, adds) = l.commit(decision("a:1", Some("b:1"), None), now, &cfg);
    assert!(adds.is_empty());
    let (_, releases) = l.release(id, now, &cfg).expect("released");
    assert!(releases.is_empty());
}

/// Another replica (or whoever publishes on its subject) sends deltas no real decision
/// carries: a share near 2^64 tokens, blocks that wrap the pod's sums, and an endless
/// stream of adds. Each is clamped to one decision's worth, sums saturate, and one
/// replica's shares are capped.
#[test]
fn hostile_replica_deltas_are_clamped_saturated_and_bounded() {
    let (l, cfg, now) = (ledger("me"), PolicyConfig::default(), Instant::now());
    let pod: Arc<str> = Arc::from("a:1");
    let huge = |id: &str| LoadDelta {
        replica: "peer".into(),
        id: id.into(),
        pod: "a:1".into(),
        model: "m".into(),
        op: LoadOp::Add,
        prefill_tokens: u64::MAX - 7,
        blocks: u64::MAX - 3,
        prefix: Some(3),
        inflight: true,
        session: None,
        response: None,
        bound_tokens: 0,
    };
    assert!(l.apply_remote(&pod, &huge("x"), now, &cfg));
    assert!(l.apply_remote(&pod, &huge("y"), now, &cfg));
    let v = l.view("a:1", Some(3), now, &cfg);
    // Two decisions' worth at most, not a wrapped sum that makes the pod look idle.
    assert_eq!(v.decode_blocks, 2 * MAX_DECISION_BLOCKS, "{v:?}");
    // Each share's prefill drains within the time it may stay unreported.
    let pending_s = v.pending_prefill_tokens as f64 / cfg.prefill_tokens_per_s;
    assert!(
        pending_s <= 2.0 * cfg.load_timeout_s as f64 + 1.0,
        "{} pending tokens ({pending_s:.0} s)",
        v.pending_prefill_tokens
    );
    // A decision id no replica issues is ignored.
    assert!(!l.apply_remote(&pod, &huge(&"z".repeat(4096)), now, &cfg));
    // An endless stream of adds: one replica holds at most its cap.
    for i in 0..MAX_REMOTE_PER_REPLICA + 100 {
        l.apply_remote(&pod, &huge(&format!("n{i}")), now, &cfg);
    }
    assert_eq!(l.remote_count("a:1"), MAX_REMOTE_PER_REPLICA);
    let v = l.view("a:1", Some(3), now, &cfg);
    assert_eq!(v.inflight as usize, MAX_REMOTE_PER_REPLICA);
    // Another replica still gets its own room.
    let other = LoadDelta {
        replica: "peer2".into(),
        ..huge("q")
    };
    assert!(l.apply_remote(&pod, &other, now, &cfg));
}

#[test]
fn a_chain_in_flight_is_seen_to_its_depth_until_released() {
    let (l, cfg, now) = (ledger("r1"), PolicyConfig::default(), Instant::now());
    // 1000 tokens at the default 10,000 tokens/s: prefilling for 0.1 s.
    let system: Vec<u64> = (1..=20).collect();
    let mut first = system.clone();
    first.extend([101, 102]);
    let (id, _) = l.commit(
        Placement {
            chain: Arc::from(first.as_slice()),
            ..decision("a:1", None, None)
        },
        now,
        &cfg,
    );
    let mut second = system.clone();
    second.extend([201, 202, 203]);
    let seen = l.in_flight(&second, now);
    assert_eq!(
        seen,
        vec![InFlight {
            pod: Arc::from("a:1"),
            held: 20,
            prefilling: 20
        }]
    );
    // Its prefill is done: still held (the request runs), no longer being prefilled.
    let later = now + Duration::from_millis(200);
    assert_eq!(l.in_flight(&second, later)[0].held, 20);
    assert_eq!(l.in_flight(&second, later)[0].prefilling, 0);
    assert!(
        l.in_flight(&[999, 1], now).is_empty(),
        "another first block"
    );
    l.release(id, later, &cfg).expect("outstanding");
    assert!(l.in_flight(&second, later).is_empty());
    assert!(l.book.lock().chains.is_empty(), "nothing left behind");
}

#[test]
fn chains_in_flight_are_bounded_per_first_block() {
    let (l, cfg, now) = (ledger("r1"), PolicyConfig::default(), Instant::now());
    // Each request shares the first block; request i holds i + 2 blocks of the chain.
    let chain: Vec<u64> = (1..=100).collect();
    let ids: Vec<u64> = (0..CHAINS_PER_PREFIX + 8)
        .map(|i| {
            let pod = format!("p:{i}");
            let p = Placement {
                chain: Arc::from(&chain[..i + 2]),
                ..decision(&pod, None, None)
            };
            l.commit(p, now, &cfg).0
        })
        .collect();
    let seen = l.in_flight(&chain, now);
    assert_eq!(seen.len(), CHAINS_PER_PREFIX, "the newest only");
    assert!(seen.iter().all(|f| f.held >= 10));
    for id in ids {
        l.release(id, now, &cfg);
    }
    assert!(l.book.lock().chains.is_empty());
}
