//! Eviction pressure read off returning turns: how much of a session's last prompt its
//! pod had already evicted when the session's next turn came back.
//!
//! Token chains read it where it shows: a turn whose session is bound to a pod, against
//! what the index (the engines' events) says that pod still holds of the prompt the
//! binding says it was sent. Text chains have no index; where a session's turn goes back
//! to its pod, the engine's report says it instead (what it found cached of the last
//! prompt is what it kept). Predicted mode's own misprediction rate is no substitute: it
//! says how wrong the router's residency model was, which stays low where that model
//! follows the engines' LRU however much they evict. The policy reads the pressure as
//! `Candidate::pressure` (`policy::load_weight`): where the caches are smaller than the
//! sessions in flight, a turn moved off its pod to skip a queue is prefilled whole
//! elsewhere and evicts that pod's sessions sooner.
//!
//! Kept per pod, private, written only by [`Returns::observe`] (on the route path for
//! token chains, the report path for text chains).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

/// Weight of the newest returning turn in a pod's pressure (about the last ten count,
/// as in `predicted`).
const GAIN: f64 = 0.1;

/// The share of a returning turn's prompt that pods lose anyway, which says nothing
/// about moves: sessions grow past their pod's cache and the LRU drops their oldest
/// turns. Seeds 1–8 of the agentic sessions on caches that hold them (4 and 8 × 4,096,
/// 16 × 2,048 blocks) route the same at 0.15 as without the signal, and lose 1–5% of
/// mean TTFT at 0; on the live-shaped case (4 × 1,024) returning turns lose about half.
const FLOOR: f64 = 0.3;

/// Per pod, the moving share of returning turns' last prompts found evicted.
#[derive(Default)]
pub struct Returns {
    pods: Mutex<HashMap<Arc<str>, f64>>,
}

impl Returns {
    /// A turn came back to `pod`, which was sent `expected` blocks of its session's last
    /// prompt and holds `held` of them now. Fewer than two blocks say nothing.
    pub fn observe(&self, pod: &Arc<str>, expected: u64, held: u64) {
        if expected < 2 {
            return;
        }
        let lost = expected.saturating_sub(held) as f64 / expected as f64;
        let mut pods = self.pods.lock();
        let p = pods.entry(pod.clone()).or_insert(0.0);
        *p += GAIN * (lost - *p);
    }

    /// What the policy weighs for each pod, in the order given: its pressure past
    /// [`FLOOR`] (0 for a pod never observed).
    pub fn pressures(&self, pods: &[Arc<str>]) -> Vec<f64> {
        let map = self.pods.lock();
        pods.iter()
            .map(|p| (map.get(p).copied().unwrap_or(0.0) - FLOOR).max(0.0))
            .collect()
    }

    /// A pod's pressure as observed (for the status page).
    pub fn pressure_of(&self, pod: &str) -> Option<f64> {
        self.pods.lock().get(pod).copied()
    }

    /// Forget a pod that left the fleet or lost its cache (a restarted engine's empty
    /// cache says nothing about how it evicts).
    pub fn forget(&self, pod: &str) {
        self.pods.lock().remove(pod);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pressure_follows_returning_turns_past_the_floor() {
        let r = Returns::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let pods = [a.clone(), b.clone()];
        assert_eq!(r.pressures(&pods), vec![0.0, 0.0]);
        // Turns that find their prompt whole, or too short to say: no pressure.
        for _ in 0..50 {
            r.observe(&a, 100, 100);
            r.observe(&b, 1, 0);
        }
        assert_eq!(r.pressure_of("a"), Some(0.0));
        assert_eq!(r.pressure_of("b"), None);
        // A cache that drops a tenth of each returning prompt stays under the floor.
        for _ in 0..100 {
            r.observe(&a, 100, 90);
        }
        assert!((r.pressure_of("a").unwrap_or(0.0) - 0.1).abs() < 0.01);
        assert_eq!(r.pressures(&pods), vec![0.0, 0.0]);
        // One that drops most of it is past the floor; the other pod is untouched.
        for _ in 0..100 {
            r.observe(&a, 100, 20);
        }
        let p = r.pressures(&pods);
        assert!((p[0] - 0.5).abs() < 0.01, "{p:?}");
        assert_eq!(p[1], 0.0);
        r.forget("a");
        assert_eq!(r.pressures(&pods), vec![0.0, 0.0]);
    }
}
