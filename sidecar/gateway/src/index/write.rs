//! The write path: stored and removed blocks, grouped by shard so each shard's lock is
//! taken once per chunk of a batch.

use std::sync::atomic::Ordering;

use kvroute_shared::protocol::Tier;

use super::*;

/// How many keys ahead the write path prefetches.
const PREFETCH_AHEAD: usize = 6;

impl ModelIndex {
    /// Blocks now held on `tier`. Idempotent.
    pub fn store(&self, h: PodHandle, tier: Tier, blocks: &[u64]) -> Result<Applied, IndexError> {
        self.write(h, blocks, |shard, tiers, key, slot| {
            let tb = tiers::bit(tier);
            match shard.store(key, slot) {
                Change::Added => {
                    tiers.set(key, tb);
                    Change::Added
                }
                Change::Unchanged => {
                    if tier != Tier::Gpu || !tiers.is_empty() {
                        let cur = tiers.of(key);
                        tiers.set(key, cur | tb);
                    }
                    Change::Unchanged
                }
                Change::Removed => Change::Unchanged,
            }
        })
    }

    /// Blocks evicted from `tier`; a block leaves the index when no tier holds it. Idempotent.
    pub fn remove(&self, h: PodHandle, tier: Tier, blocks: &[u64]) -> Result<Applied, IndexError> {
        self.write(h, blocks, |shard, tiers, key, slot| {
            let tb = tiers::bit(tier);
            if tiers.is_empty() {
                return if tier == Tier::Gpu {
                    shard.remove(key, slot)
                } else {
                    Change::Unchanged
                };
            }
            let cur = tiers.of(key);
            if cur & tb == 0 {
                return Change::Unchanged;
            }
            let left = cur & !tb;
            if left == 0 {
                tiers.forget(key);
                shard.remove(key, slot)
            } else {
                tiers.set(key, left);
                Change::Unchanged
            }
        })
    }

    fn write(
        &self,
        h: PodHandle,
        blocks: &[u64],
        mut op: impl FnMut(&mut Shard, &mut Tiers, u64, u8) -> Change,
    ) -> Result<Applied, IndexError> {
        let pd = &self.pods[h.slot as usize];
        let mut tiers = pd.writer.lock();
        let cap = self.shard_cap.load(Ordering::Relaxed);
        let mut out = Applied::default();
        for chunk in blocks.chunks(CHUNK) {
            let t = self.slots.read();
            if t.gen[h.slot as usize] != h.gen
                || !matches!(t.state[h.slot as usize], SlotState::Live(_))
            {
                return Err(IndexError::Stale);
            }
            // The pod's block count is settled once per chunk, not per block.
            let (mut added, mut removed) = (0u64, 0u64);
            for (i, &key) in chunk.iter().enumerate() {
                // Ask for a later key's table lines now, so its cache miss overlaps this
                // key's work instead of stalling when its turn comes.
                if let Some(&ahead) = chunk.get(i + PREFETCH_AHEAD) {
                    self.shard(ahead).read().prefetch(ahead);
                }
                let mut shard = self.shard(key).write();
                match op(&mut shard, &mut tiers, key, h.slot) {
                    Change::Added => {
                        added += 1;
                        if shard.len() > cap {
                            let n = shard.evict_to(cap, |holders| {
                                for s in holders.iter() {
                                    self.pods[s as usize].blocks.fetch_sub(1, Ordering::Relaxed);
                                }
                            });
                            self.evicted.fetch_add(n, Ordering::Relaxed);
                        }
                    }
                    Change::Removed => removed += 1,
                    Change::Unchanged => out.unchanged += 1,
                }
            }
            out.changed += added + removed;
            if added >= removed {
                pd.blocks.fetch_add(added - removed, Ordering::Relaxed);
            } else {
                pd.blocks.fetch_sub(removed - added, Ordering::Relaxed);
            }
        }
        Ok(out)
    }

    // ---- lookups ----------------------------------------------------------------------

    /// Every block held by the pod (for dumps, resync checks and tests). O(index size).
    pub fn blocks_of(&self, h: PodHandle) -> Vec<u64> {
        let mut v = Vec::new();
        for sh in self.shards.iter() {
            sh.0.read().for_each(|k, b| {
                if b.contains(h.slot) {
                    v.push(k);
                }
            });
        }
        v.sort_unstable();
        v
    }
}
