//! The write path: stored and removed blocks, grouped by shard so each shard's lock is
//! taken once per chunk of a batch.

use std::sync::atomic::Ordering;

use kvroute_shared::protocol::Tier;

use super::*;

/// How many keys ahead the write path prefetches.
const PREFETCH_AHEAD: usize = 6;
/// Ring positions a pod over its share searches for one of its own blocks to replace.
const OWN_SCAN: usize = 32;

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
                    Change::Added if shard.len() > cap && self.over_share(pd, added + 1, cap) => {
                        // Over its share of a full index: the pod replaces one of its own
                        // blocks, or its new block is not indexed; others' blocks stay.
                        if let Some(old) = shard.evict_own(h.slot, OWN_SCAN) {
                            tiers.forget(old);
                            self.evicted.fetch_add(1, Ordering::Relaxed);
                        } else {
                            shard.remove(key, h.slot);
                            tiers.forget(key);
                            self.over_share.fetch_add(1, Ordering::Relaxed);
                            out.unchanged += 1;
                        }
                    }
                    Change::Added => {
                        added += 1;
                        if shard.len() > cap {
                            self.evict_clock(&mut shard, cap);
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

    /// CLOCK over the whole shard down to `cap`, fixing the evicted holders' counts.
    fn evict_clock(&self, shard: &mut Shard, cap: usize) {
        let n = shard.evict_to(cap, |holders| {
            for s in holders.iter() {
                self.pods[s as usize].blocks.fetch_sub(1, Ordering::Relaxed);
            }
        });
        self.evicted.fetch_add(n, Ordering::Relaxed);
    }

    /// Whether a pod holding `pd.blocks + pending` entries is past its fair share of the
    /// index (the cap over the live pods) with a quarter's slack, so pods of equal
    /// caches evict by CLOCK among themselves as before.
    fn over_share(&self, pd: &PodData, pending: u64, shard_cap: usize) -> bool {
        let live = u64::from(self.alive.snapshot().count().max(1));
        let share = (shard_cap as u64 * SHARDS as u64) / live;
        pd.blocks.load(Ordering::Relaxed) + pending > share + share / 4
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
