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
        returning: None,
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
        prefill_tokens: 100,
        blocks: 5,
        prefix: Some(3),
        ..LoadDelta::new("peer", id, "a:1", "m", op)
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
        blocks: 1,
        inflight: false,
        ..LoadDelta::new(replica, id, "a:1", "m", LoadOp::Add)
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
        prefill_tokens: u64::MAX - 7,
        blocks: u64::MAX - 3,
        prefix: Some(3),
        ..LoadDelta::new("peer", id, "a:1", "m", LoadOp::Add)
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

/// Another replica's request in flight is found by a prompt that shares its chain, as
/// deep as its marks vouch for, on the pod computing it; it goes with its release, its
/// pod, or when newer ones push it past the bound; marks that no sender makes are refused
/// with the delta.
#[test]
fn other_replicas_requests_in_flight_are_found_by_their_marks() {
    let (a, cfg, now) = (ledger("a"), PolicyConfig::default(), Instant::now());
    let b = ledger("b");
    let pod: Arc<str> = Arc::from("a:1");
    let chain: Arc<[u64]> = (1..=100u64).collect::<Vec<_>>().into();
    let (id, deltas) = b.commit(
        Placement {
            chain: chain.clone(),
            ..decision("a:1", None, None)
        },
        now,
        &cfg,
    );
    assert_eq!(
        deltas[0].marks.len(),
        kvroute_shared::protocol::MAX_CHAIN_MARKS
    );
    assert!(a.apply_remote(&pod, &deltas[0], now, &cfg));
    // The same prompt and a longer one: held to its last block (never weighed as a
    // prefill to wait for: that is the other replica's projection).
    let mut longer = chain.to_vec();
    longer.extend(500..520);
    for c in [&chain[..], &longer[..]] {
        let f = a.in_flight(c, now);
        assert_eq!(f.len(), 1);
        assert_eq!((&*f[0].pod, f[0].held, f[0].prefilling), ("a:1", 100, 0));
    }
    // A prompt that leaves it at block 50: the deepest mark before that (of 8 marks over
    // 100 blocks, the one at position 42).
    let mut fork = chain[..50].to_vec();
    fork.extend(900..950);
    assert_eq!(a.in_flight(&fork, now)[0].held, 43);
    // Another first block: nothing.
    assert!(a.in_flight(&[7, 8, 9], now).is_empty());
    // Released: gone.
    let (_, rel) = b.release(id, now, &cfg).expect("outstanding");
    assert!(rel[0].marks.is_empty(), "a release carries none");
    assert!(a.apply_remote(&pod, &rel[0], now, &cfg));
    assert!(a.in_flight(&chain, now).is_empty());
    // Marks no sender makes refuse the delta.
    for marks in [
        vec![[1, 2]],
        vec![[0, 1], [5, 2], [5, 3]],
        (0..=kvroute_shared::protocol::MAX_CHAIN_MARKS as u64)
            .map(|i| [i, i])
            .collect(),
    ] {
        let bad = LoadDelta {
            id: "bad".into(),
            marks,
            ..deltas[0].clone()
        };
        assert!(!a.apply_remote(&pod, &bad, now, &cfg));
    }
    // Its pod removed: gone with it.
    let (_, d2) = b.commit(
        Placement {
            chain: chain.clone(),
            ..decision("a:1", None, None)
        },
        now,
        &cfg,
    );
    assert!(a.apply_remote(&pod, &d2[0], now, &cfg));
    assert_eq!(a.in_flight(&chain, now).len(), 1);
    a.forget_pod("a:1", now, &cfg);
    assert!(a.in_flight(&chain, now).is_empty());
}

/// Remote chains are bounded in all: past the bound the oldest lose their marks (their
/// load stays).
#[test]
fn remote_chains_are_bounded() {
    let (a, cfg, now) = (ledger("a"), PolicyConfig::default(), Instant::now());
    let pod: Arc<str> = Arc::from("a:1");
    for i in 0..=MAX_REMOTE_CHAINS as u64 {
        let d = LoadDelta {
            id: format!("x{i}"),
            marks: vec![[0, 1_000_000 + i]],
            ..from_replica("b", "")
        };
        assert!(a.apply_remote(&pod, &d, now, &cfg));
    }
    assert!(a.in_flight(&[1_000_000], now).is_empty(), "the oldest went");
    assert_eq!(a.in_flight(&[1_000_001], now).len(), 1);
    assert_eq!(
        a.book.lock().remote_chain_order.len(),
        MAX_REMOTE_CHAINS,
        "the order is bounded too"
    );
    assert_eq!(a.remote_count("a:1"), MAX_REMOTE_CHAINS + 1);
}
