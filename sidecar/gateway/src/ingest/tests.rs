//! Hostile batches: each is refused with its label and leaves nothing behind.
use super::*;
use crate::ingest::recovery::apply_dump;
use crate::registry::{dump_url_on_pod, Rules, MAX_MODELS, MAX_PODS};
use kvroute_shared::protocol::{Event, PolicyConfig};

fn batch(pod: &str, model: &str, epoch: &str, seq: u64, events: Vec<Event>) -> EventBatch {
    EventBatch::new(pod, model, epoch, seq, events)
}

fn reg(model: &str) -> kvroute_shared::protocol::PodRegistration {
    kvroute_shared::protocol::PodRegistration {
        model: model.into(),
        ..Default::default()
    }
}

fn stored(blocks: &[u64]) -> Event {
    Event::Stored {
        tier: Default::default(),
        parent: None,
        blocks: blocks.to_vec(),
        tokens: None,
    }
}

#[test]
fn a_pod_that_is_not_an_ip_and_port_allocates_nothing() {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let locks = Recovery::default();
    for pod in [
        "pod-a.ns.svc:8000",
        "10.0.0.1",
        "10.0.0.1:99999",
        "x\n:1",
        "",
    ] {
        let r = ingest(&sc, &locks, &batch(pod, "m", "e", 0, vec![stored(&[1])]));
        assert_eq!(r.map_err(|e| e.reason()), Err("bad_pod"), "{pod:?}");
    }
    assert!(sc.registry().all().is_empty());
    assert_eq!(locks.streams(), 0);
    assert!(sc.indexes.all().is_empty(), "no model index was created");
}

#[test]
fn a_sequence_number_pushed_to_the_end_of_the_range_cannot_freeze_a_pod() {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let locks = Recovery::default();
    let pod = "10.0.0.1:8000";
    ingest(&sc, &locks, &batch(pod, "m", "e", 0, vec![stored(&[1])])).expect("first");
    let forged = batch(pod, "m", "e", u64::MAX, vec![Event::Cleared]);
    assert_eq!(
        ingest(&sc, &locks, &forged).map_err(|e| e.reason()),
        Err("seq_jump")
    );
    // The engine's next real batch is applied, not dropped as a duplicate.
    let next = ingest(&sc, &locks, &batch(pod, "m", "e", 1, vec![stored(&[2])])).expect("next");
    assert!(!next.duplicate && next.blocks_changed == 1, "{next:?}");
    let ix = sc.indexes.get("m").expect("index");
    assert_eq!(ix.lookup(&[1]).len(), 1, "the forged batch cleared nothing");
}

#[test]
fn forged_models_and_pods_are_capped() {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let locks = Recovery::default();
    for i in 0..MAX_MODELS + 10 {
        let pod = format!("10.1.{}.{}:8000", i / 200, i % 200 + 1);
        let r = ingest(
            &sc,
            &locks,
            &batch(&pod, &format!("model-{i}"), "e", 0, vec![]),
        );
        if i < MAX_MODELS {
            r.expect("under the cap");
        } else {
            assert_eq!(r.map_err(|e| e.reason()), Err("model_cap"));
        }
    }
    assert_eq!(sc.indexes.all().len(), MAX_MODELS);
    let mut refused = 0;
    for i in 0..MAX_PODS + 10 {
        let pod = format!("10.2.{}.{}:8000", i / 250, i % 250 + 1);
        if let Err(e) = ingest(&sc, &locks, &batch(&pod, "model-0", "e", 0, vec![])) {
            // Full index slots (256 per model) or the registry cap: either way refused.
            assert!(matches!(e.reason(), "pod_cap" | "model_full"), "{e}");
            refused += 1;
        }
    }
    assert!(refused > 0);
    // Every pod in the registry holds an index slot: refused ones left nothing.
    let ix = sc.indexes.get("model-0").expect("index");
    let pods = sc.registry().all();
    assert!(pods.len() <= MAX_PODS);
    let of_model_0 = pods.iter().filter(|p| p.reg.model == "model-0").count();
    assert_eq!(of_model_0, ix.pods().len());
}

#[test]
fn a_batch_can_only_name_a_dump_on_its_own_pod() {
    let ports = [9400];
    assert!(dump_url_on_pod(
        "http://10.0.0.7:9400/dump",
        "10.0.0.7:8000",
        &ports
    ));
    assert!(dump_url_on_pod(
        "https://[fd00::7]:9400/d",
        "[fd00::7]:8000",
        &ports
    ));
    assert!(
        dump_url_on_pod("http://10.0.0.7:8000/kvroute/dump", "10.0.0.7:8000", &ports),
        "the pod's own port"
    );
    for bad in [
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.8:9400/dump",
        "http://localhost:9400/dump",
        "file:///etc/passwd",
        "gopher://10.0.0.7:70/",
        "http://user@10.0.0.7:9400/dump",
        "not a url",
        // Any other port on the pod's own address: another service of that host.
        "http://10.0.0.7:9090/v1/config",
        "http://10.0.0.7/dump",
        "https://10.0.0.7/dump",
    ] {
        assert!(!dump_url_on_pod(bad, "10.0.0.7:8000", &ports), "{bad}");
    }
    // An unregistered pod's batch naming a dump elsewhere: the URL is not taken.
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let locks = Recovery::default();
    let mut b = batch("10.0.0.7:8000", "m", "e", 0, vec![stored(&[1])]);
    b.dump_url = Some("http://169.254.169.254/".into());
    ingest(&sc, &locks, &b).expect("the events still count");
    assert_eq!(
        sc.registry()
            .get("10.0.0.7:8000")
            .and_then(|p| p.reg.dump_url.clone()),
        None
    );
    assert_eq!(sc.metrics.events_rejected.get("dump_url_elsewhere"), 1);
}

#[test]
fn a_dump_for_a_removed_pod_does_not_bring_it_back() {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let locks = Recovery::default();
    let pod = "10.0.0.7:8000";
    ingest(&sc, &locks, &batch(pod, "m", "e", 0, vec![stored(&[1])])).expect("first");
    assert!(sc.remove_pod(pod, "api"));
    let dump = batch(pod, "m", "e", 5, vec![stored(&[1, 2, 3])]);
    assert_eq!(
        apply_dump(&sc, &locks, pod, &dump).map_err(|e| e.reason()),
        Err("removed_pod")
    );
    let ix = sc.indexes.get("m").expect("index");
    assert!(ix.handle(pod).is_none(), "no slot for the removed pod");
    assert!(ix.lookup(&[1, 2, 3]).is_empty());
}

#[test]
fn one_resync_per_pod_is_queued() {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let (rec, mut resyncs) = Recovery::new();
    let job = |pod: &str| ResyncJob {
        pod: Arc::from(pod),
        model: "m".into(),
        url: format!("http://{pod}/dump"),
    };
    for _ in 0..100 {
        rec.queue_resync(&sc, job("10.0.0.7:8000"));
    }
    rec.queue_resync(&sc, job("10.0.0.8:8000"));
    let mut queued = 0;
    while resyncs.try_recv().is_ok() {
        queued += 1;
    }
    assert_eq!(queued, 2);
    assert_eq!(sc.metrics.resyncs.get("already_queued"), 99);
    rec.resync_done("10.0.0.7:8000");
    rec.queue_resync(&sc, job("10.0.0.7:8000"));
    assert!(
        resyncs.try_recv().is_ok(),
        "after it is done, it may be asked again"
    );
}

/// Batches applied between the dump's snapshot and its application are not erased by
/// the reset: a block removed after the snapshot stays removed, one stored stays.
#[test]
fn a_resync_keeps_the_batches_that_came_after_the_dump() {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let (locks, mut resyncs) = Recovery::new();
    let pod = "10.0.0.7:8000";
    let mut first = batch(pod, "m", "e", 0, vec![stored(&[1, 2])]);
    first.dump_url = Some("http://10.0.0.7:9400/dump".into());
    ingest(&sc, &locks, &first).expect("first");
    // Seq 1 is lost: a gap, a resync is queued.
    let gap = ingest(&sc, &locks, &batch(pod, "m", "e", 2, vec![stored(&[3])])).expect("gap");
    assert!(gap.gap);
    assert!(resyncs.try_recv().is_ok(), "resync queued");
    // While the dump is fetched: block 1 is evicted, block 4 stored.
    ingest(
        &sc,
        &locks,
        &batch(pod, "m", "e", 3, vec![removed_ev(&[1])]),
    )
    .expect("3");
    ingest(&sc, &locks, &batch(pod, "m", "e", 4, vec![stored(&[4])])).expect("4");
    // The dump is the cache as of seq 2: blocks 1, 2, 3 (and 9, stored at the lost seq 1).
    let dump = batch(pod, "m", "e", 2, vec![stored(&[1, 2, 3, 9])]);
    apply_dump(&sc, &locks, pod, &dump).expect("dump");
    let ix = sc.indexes.get("m").expect("index");
    let held = |b: u64| !ix.lookup(&[b]).is_empty();
    assert!(!held(1), "removed after the snapshot: must not come back");
    assert!(held(2) && held(3) && held(9) && held(4));
    assert_eq!(sc.metrics.resyncs.get("replayed_batches"), 2);
    // The next batch continues the stream.
    let next = ingest(&sc, &locks, &batch(pod, "m", "e", 5, vec![stored(&[5])])).expect("5");
    assert!(!next.gap && !next.duplicate);
}

fn removed_ev(blocks: &[u64]) -> Event {
    Event::Removed {
        tier: Default::default(),
        blocks: blocks.to_vec(),
    }
}

/// Batches racing DELETEs: whenever the pod is gone from the registry, it holds no index
/// slot either (no orphan slot counts against the model's 256).
#[test]
fn a_removal_racing_a_batch_leaves_no_orphan_slot() {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let locks = Recovery::default();
    let pod = "10.0.0.9:8000";
    for i in 0..300u64 {
        let b = batch(pod, "m", &format!("e{i}"), 0, vec![stored(&[i + 1])]);
        std::thread::scope(|s| {
            s.spawn(|| {
                let _ = ingest(&sc, &locks, &b);
            });
            s.spawn(|| {
                sc.remove_pod(pod, "api");
            });
        });
        let registered = sc.registry().contains(pod);
        let slot = sc.indexes.get("m").and_then(|ix| ix.handle(pod));
        assert_eq!(
            registered,
            slot.is_some(),
            "round {i}: registered {registered}, slot {slot:?}"
        );
    }
}

/// An engine that reports `u32::MAX` running and waiting looks as busy as it says, not
/// idle (the sum used to wrap in release builds).
#[test]
fn an_absurd_engine_load_saturates_instead_of_wrapping() {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let locks = Recovery::default();
    let pod = "10.0.0.7:8000";
    let load = Event::Load {
        running: u32::MAX,
        waiting: u32::MAX,
        kv_usage: 0.5,
        capacity_blocks: None,
    };
    ingest(&sc, &locks, &batch(pod, "m", "e", 0, vec![load])).expect("load");
    let now = std::time::Instant::now();
    let p = sc.registry().get(pod).expect("pod");
    let v = p.load_view(crate::policy::LoadView::default(), now);
    assert_eq!(v.inflight, u32::MAX);
}

/// A pod on a local address is not learned from events: its advertised dump would point
/// the sidecar's HTTP client at this host's own ports (Envoy's admin, the sidecar's API).
/// Only a registration, or the operator's `--learn-local-pods`, brings one in.
#[test]
fn pods_on_local_addresses_are_learned_only_when_allowed() {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let rec = Recovery::default();
    for pod in [
        "127.0.0.1:8000",
        "0.0.0.0:8000",
        "169.254.1.1:8000",
        "224.0.0.1:8000",
        "[::1]:8000",
        "[::]:8000",
        "[fe80::1]:8000",
        "[::ffff:127.0.0.1]:8000",
    ] {
        let mut b = batch(pod, "m", "e", 0, vec![stored(&[1])]);
        b.dump_url = Some(format!("http://{pod}/v1/config"));
        let e = ingest(&sc, &rec, &b).expect_err(pod);
        assert_eq!(e.reason(), "local_pod", "{pod}");
    }
    assert!(sc.registry().all().is_empty(), "refused pods leave nothing");
    assert!(sc.indexes.get("m").is_none(), "nor an index");
    // An admin registration brings one in.
    sc.register("127.0.0.1:8000", reg("m")).expect("register");
    ingest(
        &sc,
        &rec,
        &batch("127.0.0.1:8000", "m", "e", 0, vec![stored(&[1])]),
    )
    .expect("registered");
    // So does the operator's flag, for single-host setups.
    sc.registry().set_rules(Rules {
        learn_local_pods: true,
        ..Rules::default()
    });
    ingest(
        &sc,
        &rec,
        &batch("127.0.0.2:8000", "m", "e", 0, vec![stored(&[1])]),
    )
    .expect("allowed");
}

/// A pod speaks for one model: a batch naming another is refused before any index is
/// made for that model, so a bridge cannot fill the model slots with names of its own.
#[test]
fn a_batch_for_another_model_allocates_nothing() {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let rec = Recovery::default();
    ingest(
        &sc,
        &rec,
        &batch("10.0.0.1:8000", "m", "e", 0, vec![stored(&[1])]),
    )
    .expect("first");
    for i in 0..MAX_MODELS + 5 {
        let b = batch(
            "10.0.0.1:8000",
            &format!("m{i}"),
            "e",
            i as u64 + 1,
            vec![stored(&[1])],
        );
        let e = ingest(&sc, &rec, &b).expect_err("other model");
        assert_eq!(e.reason(), "model_mismatch");
    }
    assert_eq!(sc.indexes.all().len(), 1, "no index for the other names");
    // Other pods still get their models.
    ingest(
        &sc,
        &rec,
        &batch("10.0.0.2:8000", "other", "e", 0, vec![stored(&[1])]),
    )
    .expect("other pod");
}

/// Every per-pod string is bounded: a batch's model or epoch, a registration's lists.
#[test]
fn per_pod_strings_are_bounded() {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let long = "e".repeat(900 * 1024);
    let b = batch("10.0.0.1:8000", "m", &long, 0, vec![stored(&[1])]);
    let bytes = b.encode();
    assert!(kvroute_shared::protocol::EventBatch::decode(&bytes).is_err());
    let mut r = reg("m");
    r.labels.insert("k".into(), long.clone());
    assert_eq!(
        sc.register("10.0.0.1:8000", r).expect_err("label").reason(),
        "bad_registration"
    );
    let mut r = reg("m");
    r.adapters = (0..1000).map(|i| format!("a{i}")).collect();
    assert!(sc.register("10.0.0.1:8000", r).is_err());
    assert!(sc.registry().all().is_empty());
}

/// A jump inside the allowed window used to push the pod's high-water mark ahead, so its
/// engine's next real batches were dropped as duplicates until the stream caught up. Now
/// the skipped range is a hole: real batches filling it are applied, a repeat is still a
/// duplicate, and the real batch at the forged seq (other content) is a conflict that
/// recovers the pod instead of being dropped.
#[test]
fn a_forged_jump_cannot_make_real_batches_look_like_duplicates() {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let rec = Recovery::default();
    let pod = "10.0.0.1:8000";
    let ix = || sc.indexes.get("m").expect("index");
    ingest(&sc, &rec, &batch(pod, "m", "e", 0, vec![stored(&[1])])).expect("first");
    let jump = 1 + (1 << 15);
    let forged = batch(pod, "m", "e", jump, vec![stored(&[666])]);
    assert!(ingest(&sc, &rec, &forged).expect("inside the window").gap);
    // The engine goes on from seq 1. The first real batch finds the forged one applied
    // above it: the pod is recovered once (its blocks rebuilt), and from then on every
    // batch counts.
    let i = ingest(&sc, &rec, &batch(pod, "m", "e", 1, vec![stored(&[1001])])).expect("late");
    assert!(i.gap && i.blocks_changed == 0, "{i:?}");
    assert!(
        ix().lookup(&[666]).is_empty(),
        "the forged block went with the recovery"
    );
    for s in 2..=20u64 {
        let i = ingest(
            &sc,
            &rec,
            &batch(pod, "m", "e", s, vec![stored(&[1000 + s])]),
        )
        .expect("real");
        assert!(
            !i.duplicate && !i.gap && i.blocks_changed == 1,
            "seq {s}: {i:?}"
        );
    }
    assert_eq!(ix().lookup(&[1015]).len(), 1, "a real block is indexed");
    // A real repeat is still a duplicate.
    let again = ingest(&sc, &rec, &batch(pod, "m", "e", 7, vec![stored(&[1007])])).expect("repeat");
    assert!(again.duplicate);
    // The engine reaching the forged seq with its own content: recovered, not dropped.
    let real = batch(pod, "m", "e", jump, vec![stored(&[1])]);
    let i = ingest(&sc, &rec, &real).expect("conflict");
    assert!(!i.duplicate && i.gap, "{i:?}");
    assert_eq!(sc.metrics.events_rejected.get("seq_conflict"), 1);
    // And the stream goes on.
    let next = ingest(
        &sc,
        &rec,
        &batch(pod, "m", "e", jump + 1, vec![stored(&[2])]),
    )
    .expect("next");
    assert!(!next.duplicate && !next.gap, "{next:?}");
}

/// A batch delivered late, after later ones were applied, is not applied out of order
/// (it could bring back a block they removed): the pod is recovered as after a gap.
#[test]
fn a_late_batch_cannot_bring_back_a_removed_block() {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let rec = Recovery::default();
    let pod = "10.0.0.1:8000";
    let ix = || sc.indexes.get("m").expect("index");
    ingest(&sc, &rec, &batch(pod, "m", "e", 0, vec![stored(&[1])])).expect("0");
    // Seq 1 (stores 7) is delayed; seq 2 removes 7 and stores 8.
    let removed = Event::Removed {
        tier: Default::default(),
        blocks: vec![7],
    };
    assert!(
        ingest(
            &sc,
            &rec,
            &batch(pod, "m", "e", 2, vec![removed, stored(&[8])])
        )
        .expect("2")
        .gap
    );
    let late = ingest(&sc, &rec, &batch(pod, "m", "e", 1, vec![stored(&[7])])).expect("1");
    assert!(late.gap && late.blocks_changed == 0, "{late:?}");
    assert!(ix().lookup(&[7]).is_empty(), "no false hit on 7");
    assert_eq!(sc.metrics.events_rejected.get("late"), 1);
    let next = ingest(&sc, &rec, &batch(pod, "m", "e", 3, vec![stored(&[9])])).expect("3");
    assert!(!next.gap && next.blocks_changed == 1);
}

/// A pod pointing its dump at a server that never answers kept every batch since its
/// gap (load events and token ids included, bounded by count only): hundreds of MiB per
/// pod, again after every fetch timeout. A replay keeps block lists only, bounded in
/// bytes per pod and in total.
#[test]
fn replay_buffers_are_bounded_in_bytes() {
    use super::recovery::{MAX_REPLAY_BYTES, MAX_REPLAY_TOTAL_BYTES};
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let (locks, _resyncs) = Recovery::new();
    let pods: Vec<String> = (0..12).map(|p| format!("10.0.0.{p}:8000")).collect();
    for p in &pods {
        let mut first = batch(p, "m", "e", 0, vec![stored(&[1])]);
        first.dump_url = Some(format!("http://{}/dump", p));
        ingest(&sc, &locks, &first).expect("first");
        // Seq 1 is lost: a resync is pending, and nobody ever answers it.
        ingest(&sc, &locks, &batch(p, "m", "e", 2, vec![stored(&[2])])).expect("gap");
    }
    // Each pod then sends 2 MiB of blocks per batch, with token ids and load events.
    let blocks: Vec<u64> = (1..=(256 << 10)).collect();
    let big = || {
        let mut ev = vec![Event::Stored {
            tier: Default::default(),
            parent: None,
            blocks: blocks.clone(),
            tokens: Some(vec![7; 1 << 20]),
        }];
        ev.extend((0..1000).map(|_| Event::Load {
            running: 1,
            waiting: 0,
            kv_usage: 0.5,
            capacity_blocks: None,
        }));
        ev
    };
    let mut peak = 0;
    for seq in 3..16 {
        for p in &pods {
            ingest(&sc, &locks, &batch(p, "m", "e", seq, big())).expect("batch");
            peak = peak.max(locks.replay_bytes());
        }
    }
    assert!(peak <= MAX_REPLAY_TOTAL_BYTES, "{peak}");
    assert!(
        peak > MAX_REPLAY_BYTES,
        "several pods replay at once: {peak}"
    );
    assert_eq!(
        locks.replay_bytes(),
        0,
        "every overflowed replay gave its bytes back"
    );
    assert!(sc.metrics.resyncs.get("replay_overflow") >= pods.len() as u64);
}

/// A batch lost to a full ingest queue leaves its pod stale (its hits discounted) until
/// the gap its next batch shows is repaired, never silently kept as if current.
#[test]
fn a_pod_whose_batch_was_dropped_is_stale_until_repaired() {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let locks = Recovery::default();
    let pod = "10.0.0.7:8000";
    ingest(&sc, &locks, &batch(pod, "m", "e", 0, vec![stored(&[1, 2])])).expect("0");
    // Seq 1 was dropped by the NATS consumer (queue full).
    sc.registry().mark_stale(pod);
    assert_eq!(sc.registry().counts(std::time::Instant::now()).0, 1);
    let next = ingest(&sc, &locks, &batch(pod, "m", "e", 2, vec![stored(&[3])])).expect("2");
    assert!(next.gap, "the lost batch shows as a gap");
    assert_eq!(
        sc.registry().counts(std::time::Instant::now()).0,
        0,
        "rebuilt"
    );
}
