//! Where a pod's blocks live (GPU, CPU, disk, remote), kept off the lookup path.
//!
//! Routing only needs "does the pod hold the block"; the tier matters for the winner's
//! cache hint and the cost of its hit. Nearly every block is GPU-only, so only the
//! exceptions are stored: a block absent from this map but present in the index is
//! GPU-resident. A pod whose blocks are all on GPU costs nothing here.

use hashbrown::HashMap;
use kvroute_shared::protocol::{Tier, TierHint};

use super::table::KeyHasher;

/// A set of tiers as bits (gpu = 1, cpu = 2, disk = 4, remote = 8).
pub type TierSet = u8;
pub const GPU: TierSet = 1;

pub fn bit(t: Tier) -> TierSet {
    match t {
        Tier::Gpu => 1,
        Tier::Cpu => 2,
        Tier::Disk => 4,
        Tier::Remote => 8,
    }
}

/// The fastest tier in a set (what a hit is worth).
pub fn best(set: TierSet) -> Tier {
    Tier::ALL
        .into_iter()
        .find(|t| set & bit(*t) != 0)
        .unwrap_or(Tier::Gpu)
}

/// Per-pod exceptions to "GPU only".
pub struct Tiers {
    map: HashMap<u64, TierSet, KeyHasher>,
}

impl Tiers {
    pub fn new(hasher: KeyHasher) -> Tiers {
        Tiers {
            map: HashMap::with_hasher(hasher),
        }
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The tiers of a block the index says the pod holds.
    #[inline]
    pub fn of(&self, key: u64) -> TierSet {
        if self.map.is_empty() {
            return GPU;
        }
        self.map.get(&key).copied().unwrap_or(GPU)
    }

    /// Record the tier set of a held block (GPU-only sets are implicit).
    #[inline]
    pub fn set(&mut self, key: u64, set: TierSet) {
        if set == GPU {
            if !self.map.is_empty() {
                self.map.remove(&key);
            }
        } else {
            self.map.insert(key, set);
        }
    }

    #[inline]
    /// Keep only the exceptions of keys `held` says the pod still holds.
    pub fn retain(&mut self, mut held: impl FnMut(u64) -> bool) {
        self.map.retain(|k, _| held(*k));
        if self.map.capacity() > 2 * self.map.len() + 64 {
            self.map.shrink_to_fit();
        }
    }

    pub fn forget(&mut self, key: u64) {
        if !self.map.is_empty() {
            self.map.remove(&key);
        }
    }

    pub fn clear(&mut self) {
        self.map = HashMap::with_hasher(self.map.hasher().clone());
    }

    pub fn heap_bytes(&self) -> usize {
        self.map.capacity() * (std::mem::size_of::<(u64, TierSet)>() + 1)
    }

    /// How many of the pod's `held` blocks are on each tier (a block may be on several).
    pub fn counts(&self, held: u64) -> TierHint {
        let mut h = TierHint::default();
        let mut off_gpu = 0u64;
        for &set in self.map.values() {
            for t in Tier::ALL {
                if set & bit(t) != 0 {
                    h.add(t, 1);
                }
            }
            off_gpu += (set & GPU == 0) as u64;
        }
        h.gpu = u32::try_from(held.saturating_sub(off_gpu)).unwrap_or(u32::MAX);
        h
    }

    /// Count the best tier of each of `blocks` (all held by the pod).
    pub fn hint(&self, blocks: &[u64]) -> TierHint {
        let mut h = TierHint::default();
        if self.map.is_empty() {
            h.gpu = blocks.len() as u32;
            return h;
        }
        for b in blocks {
            h.add(best(self.of(*b)), 1);
        }
        h
    }
}
