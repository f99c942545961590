//! One pod against all the others, on its own subject: whatever its batches carry
//! (floods of `cleared`, a million blocks at a time), another pod's events are applied
//! within 100 ms (p99). Measured side by side with the shape it replaces — one consumer
//! applying every batch in arrival order — whose figure is printed, not asserted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_shared::protocol::{Event, EventBatch, PolicyConfig};
use kvroute_sidecar::{ingest, run_workers, IngestQueue, Recovery, Sidecar};

const ATTACKER: &str = "10.0.0.66:8000";
const VICTIMS: [&str; 3] = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];

fn stored(blocks: impl Iterator<Item = u64>) -> Event {
    Event::Stored {
        tier: Default::default(),
        parent: None,
        blocks: blocks.collect(),
        tokens: None,
    }
}

/// The attacker's batches: resets between stores, and whole-cache stores.
fn hostile(seq: u64) -> EventBatch {
    let base = seq << 24;
    let events = if seq.is_multiple_of(2) {
        (0..400)
            .flat_map(|i| [stored(base + i * 50..base + i * 50 + 50), Event::Cleared])
            .chain([stored(base..base + 20_000)])
            .collect()
    } else {
        vec![stored(base..base + 60_000)]
    };
    EventBatch::new(ATTACKER, "m", "e", seq, events)
}

fn victim(pod: &str, seq: u64) -> (EventBatch, u64) {
    let block = 1 << 60 | (seq << 8) | pod.as_bytes()[7] as u64;
    (
        EventBatch::new(pod, "m", "e", seq, vec![stored(std::iter::once(block))]),
        block,
    )
}

fn p99(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

async fn visible(sc: &Sidecar, block: u64, since: Instant) -> Duration {
    let ix = sc.index("m").expect("index");
    while ix.lookup(&[block]).is_empty() {
        if since.elapsed() > Duration::from_secs(30) {
            break;
        }
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    since.elapsed()
}

/// Victims' event delay while the attacker floods, through the per-pod queue.
async fn through_the_queue(probes: u64) -> Vec<Duration> {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let rec = Arc::new(Recovery::default());
    let queue = Arc::new(IngestQueue::default());
    let (stop, shutdown) = kvroute_service::Shutdown::new();
    let workers = tokio::spawn(run_workers(
        sc.clone(),
        rec.clone(),
        queue.clone(),
        2,
        shutdown,
    ));
    let flood = {
        let q = queue.clone();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let mut seq = 0;
            while t0.elapsed() < Duration::from_secs(4) {
                // Kept full: what does not fit is dropped and counted, as on the wire.
                let _ = q.submit(hostile(seq), 1 << 20);
                seq += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut delays = Vec::new();
    for s in 0..probes {
        let pod = VICTIMS[s as usize % VICTIMS.len()];
        let (b, block) = victim(pod, s / VICTIMS.len() as u64);
        let t = Instant::now();
        queue.submit(b, 200).expect("a victim's batch fits");
        delays.push(visible(&sc, block, t).await);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = flood.join();
    stop.stop();
    let _ = workers.await;
    delays
}

/// The same, as the consume loop used to do it: every batch applied in arrival order
/// by one consumer.
async fn one_consumer(probes: u64) -> Vec<Duration> {
    let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
    let rec = Arc::new(Recovery::default());
    let (tx, rx) = std::sync::mpsc::sync_channel::<EventBatch>(256);
    let consumer = {
        let (sc, rec) = (sc.clone(), rec.clone());
        std::thread::spawn(move || {
            while let Ok(b) = rx.recv() {
                let _ = ingest(&sc, &rec, &b);
            }
        })
    };
    let flood = {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for seq in 0..40 {
                if tx.try_send(hostile(seq)).is_err() {
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut delays = Vec::new();
    for s in 0..probes {
        let pod = VICTIMS[s as usize % VICTIMS.len()];
        let (b, block) = victim(pod, s / VICTIMS.len() as u64);
        let t = Instant::now();
        let _ = tx.send(b);
        delays.push(visible(&sc, block, t).await);
    }
    let _ = flood.join();
    drop(tx);
    let _ = consumer.join();
    delays
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_pods_batches_do_not_delay_anothers_events() {
    let before = one_consumer(6).await;
    let after = through_the_queue(120).await;
    let (b, a) = (p99(before.clone()), p99(after.clone()));
    eprintln!(
        "victims' event delay under a flood of resets and 60k-block stores: one consumer p99 {:.0} ms (max {:.0}); per-pod queues p99 {:.1} ms (max {:.1}), {} probes",
        b.as_secs_f64() * 1e3,
        before.iter().max().unwrap_or(&Duration::ZERO).as_secs_f64() * 1e3,
        a.as_secs_f64() * 1e3,
        after.iter().max().unwrap_or(&Duration::ZERO).as_secs_f64() * 1e3,
        after.len()
    );
    assert!(a <= Duration::from_millis(100), "p99 {a:?}");
}
