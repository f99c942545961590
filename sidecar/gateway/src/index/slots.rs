//! Slot lifecycle: a pod joins (gets a slot and an alive bit), is retired (phase 1:
//! its alive bit goes, O(1)), cleaned (phase 2: its bits are scrubbed from every
//! shard, in slices, off the request path) or reset (a fresh slot, the old one retired).

use std::sync::atomic::Ordering;

use super::*;

impl ModelIndex {
    /// The pod's handle, giving it a slot if it has none. Idempotent.
    pub fn join(&self, pod: &str) -> Result<PodHandle, IndexError> {
        if let Some(h) = self.handle(pod) {
            return Ok(h);
        }
        let mut t = self.slots.write();
        if let Some(&slot) = t.by_name.get(pod) {
            return Ok(PodHandle {
                slot,
                gen: t.gen[slot as usize],
            });
        }
        let slot = t
            .state
            .iter()
            .position(|s| matches!(s, SlotState::Free))
            .ok_or_else(|| IndexError::Full {
                pod: pod.to_string(),
            })?;
        let name: Arc<str> = Arc::from(pod);
        t.gen[slot] = t.gen[slot].wrapping_add(1);
        t.state[slot] = SlotState::Live(name.clone());
        t.by_name.insert(name, slot as u8);
        // Owner changes are published under the write lock, before the pod can be found.
        self.owners_epoch.fetch_add(1, Ordering::AcqRel);
        self.alive.insert(slot as u8);
        Ok(PodHandle {
            slot: slot as u8,
            gen: t.gen[slot],
        })
    }

    pub fn handle(&self, pod: &str) -> Option<PodHandle> {
        let t = self.slots.read();
        t.by_name.get(pod).map(|&slot| PodHandle {
            slot,
            gen: t.gen[slot as usize],
        })
    }

    /// The O(1) heart of phase 1: clear the pod's alive bit (a CAS), under the slot
    /// table's read lock only, so it never waits for writers or readers to drain. Every
    /// lookup that starts afterwards excludes the pod. `retire` calls this first.
    pub fn flip(&self, pod: &str) -> Option<u8> {
        let t = self.slots.read();
        let slot = *t.by_name.get(pod)?;
        self.alive.remove(slot);
        Some(slot)
    }

    /// Phase 1 of removal: the pod vanishes from every lookup that starts after this
    /// returns. Its slot stays reserved until [`ModelIndex::cleanup`].
    pub fn retire(&self, pod: &str) -> Option<Retired> {
        self.flip(pod)?;
        let mut t = self.slots.write();
        let slot = t.by_name.remove(pod)?;
        self.alive.remove(slot);
        let SlotState::Live(name) =
            std::mem::replace(&mut t.state[slot as usize], SlotState::Draining)
        else {
            return None;
        };
        Some(Retired {
            slot,
            gen: t.gen[slot as usize],
            pod: name,
        })
    }

    /// Phase 2: clear the slot's bit in every shard, one shard lock at a time, drop its
    /// tier data, then free the slot. Returns the entries that held it.
    pub fn cleanup(&self, r: Retired) -> u64 {
        let mut cleared = 0;
        let mut emptied = Vec::new();
        for s in self.shards.iter() {
            // Bounded lock holds: clear bits a slice of the table at a time, then delete the
            // emptied entries a batch at a time. A resize between slices moves entries, so
            // the scan restarts (clearing is idempotent).
            let mut pos = Some(0);
            let mut layout = s.0.read().layout_gen();
            while let Some(from) = pos {
                let mut g = s.0.write();
                if g.layout_gen() != layout {
                    layout = g.layout_gen();
                    pos = Some(0);
                    continue;
                }
                let (c, next) = g.clear_slot_part(r.slot, from, CLEANUP_SLICE, &mut emptied);
                cleared += c;
                pos = next;
                drop(g);
                std::thread::yield_now();
            }
            for batch in emptied.chunks(CLEANUP_SLICE / 4) {
                let mut g = s.0.write();
                for &k in batch {
                    g.remove_if_empty(k);
                }
            }
            emptied.clear();
        }
        let pd = &self.pods[r.slot as usize];
        pd.writer.lock().clear();
        pd.blocks.store(0, Ordering::Relaxed);
        let mut t = self.slots.write();
        if t.gen[r.slot as usize] == r.gen {
            t.state[r.slot as usize] = SlotState::Free;
        }
        cleared
    }

    /// The engine restarted or dropped its cache: the pod keeps its name but its blocks
    /// are gone at once. A slot holding nothing stays as it is (free: a flood of resets
    /// of an empty pod costs nothing); otherwise the pod moves to a fresh slot and the
    /// old one is retired, to be cleaned in the background. When no slot is free the pod
    /// is retired and left without one (`Full`): it is out of every lookup until a slot
    /// frees and its next batch joins again. Nothing here scrubs synchronously, so a
    /// reset never costs its caller a walk of the index.
    pub fn reset(&self, pod: &str) -> Result<(PodHandle, Option<Retired>), Unslotted> {
        if let Some(h) = self.handle(pod) {
            if self.pod_blocks(h) == 0 && self.pods[h.slot as usize].writer.lock().is_empty() {
                return Ok((h, None));
            }
        }
        let retired = self.retire(pod);
        match self.join(pod) {
            Ok(h) => Ok((h, retired)),
            Err(_) => Err(Unslotted { retired }),
        }
    }

    pub fn is_alive(&self, slot: u8) -> bool {
        self.alive.contains(slot)
    }

    pub fn pods(&self) -> Vec<(Arc<str>, PodHandle, u64)> {
        let t = self.slots.read();
        let mut v: Vec<_> = t
            .by_name
            .iter()
            .map(|(n, &s)| {
                let h = PodHandle {
                    slot: s,
                    gen: t.gen[s as usize],
                };
                (
                    n.clone(),
                    h,
                    self.pods[s as usize].blocks.load(Ordering::Relaxed),
                )
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Entries holding this pod's bit.
    pub fn pod_blocks(&self, h: PodHandle) -> u64 {
        self.pods[h.slot as usize].blocks.load(Ordering::Relaxed)
    }

    // ---- events -----------------------------------------------------------------------
}
