//! Lookups racing writers, a pod removal and slot reuse: a retired pod is never returned
//! by a lookup that started after phase 1, and a pod that took over a recycled slot never
//! inherits the previous owner's blocks.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_shared::protocol::Tier;
use kvroute_shared::{Mode, Namespace};
use kvroute_sidecar::index::{ModelIndex, Strategy};

fn chain(seed: u32, n: usize) -> Vec<u64> {
    let ns = Namespace {
        mode: Mode::Tokens,
        block_size: 4,
        model: "m",
        adapter: "",
        cache_salt: "",
    };
    ns.chain_tokens(
        &(0..n as u32 * 4)
            .map(|t| t ^ (seed << 20))
            .collect::<Vec<_>>(),
    )
}

#[test]
fn removed_pods_vanish_and_recycled_slots_start_empty() {
    let ix = Arc::new(ModelIndex::new(1 << 22));
    let chains: Arc<Vec<Vec<u64>>> = Arc::new((0..64).map(|s| chain(s, 128)).collect());
    let victim = ix.join("victim").expect("join");
    for c in chains.iter() {
        ix.store(victim, Tier::Gpu, c).expect("store");
    }
    let writers: Vec<_> = (0..4)
        .map(|i| ix.join(&format!("w{i}")).expect("join"))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let retired = Arc::new(AtomicBool::new(false));
    let fresh_joined = Arc::new(AtomicBool::new(false));
    let lookups = Arc::new(AtomicU64::new(0));

    let writer = {
        let (ix, chains, stop) = (ix.clone(), chains.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let h = writers[i % writers.len()];
                let c = &chains[i % chains.len()];
                ix.store(h, Tier::Gpu, c).expect("store");
                ix.remove(h, Tier::Gpu, &c[64..]).expect("remove");
                i += 1;
            }
        })
    };
    let readers: Vec<_> = (0..2)
        .map(|r| {
            let (ix, chains, stop, retired, fresh, n) = (
                ix.clone(),
                chains.clone(),
                stop.clone(),
                retired.clone(),
                fresh_joined.clone(),
                lookups.clone(),
            );
            std::thread::spawn(move || {
                ix.set_strategy(if r == 0 {
                    Strategy::Binary
                } else {
                    Strategy::Linear
                });
                let mut i = r;
                while !stop.load(Ordering::Relaxed) {
                    let was_retired = retired.load(Ordering::SeqCst);
                    let fresh_there = fresh.load(Ordering::SeqCst);
                    let c = &chains[i % chains.len()];
                    for m in ix.lookup(c) {
                        assert!(m.depth as usize <= c.len());
                        if was_retired {
                            assert_ne!(&*m.pod, "victim", "returned after phase 1");
                        }
                        if fresh_there {
                            assert_ne!(&*m.pod, "fresh", "a recycled slot inherited blocks");
                        }
                    }
                    n.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();

    std::thread::sleep(Duration::from_millis(200));
    let r = ix.retire("victim").expect("victim");
    retired.store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    let cleared = ix.cleanup(r);
    println!(
        "cleanup of {cleared} entries under load took {:?}",
        t0.elapsed()
    );
    let fresh = ix.join("fresh").expect("slot reused");
    assert_eq!(
        fresh.slot, victim.slot,
        "the victim's slot is the one recycled"
    );
    fresh_joined.store(true, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    writer.join().expect("writer");
    for r in readers {
        r.join().expect("reader");
    }
    assert!(ix.blocks_of(fresh).is_empty());
    assert!(lookups.load(Ordering::Relaxed) > 100);
}
