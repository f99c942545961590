//! One of the 256 shards of a model's block index: `block hash → pods holding it`.
//!
//! Most blocks are held by one or two pods, so a full 32-byte bitmap per entry would be
//! mostly zeros. An entry's value is one packed u64 ([`Holders`]): up to seven slot ids
//! inline, or an index into this shard's slab of full bitmaps when more pods hold the
//! block. With the 8-byte key and hashbrown's control byte that is ~17 bytes a slot
//! instead of ~41, which is what keeps the index under 64 bytes per block at 256-pod width.
//!
//! The shard also keeps its insertion order (a ring of keys) for the memory cap: when the
//! shard is over its share of the cap it evicts with CLOCK (second chance), where a repeat
//! store of a block sets its reference bit. That approximates LRU over the engines'
//! store traffic for the price of 8 bytes a block and no work on lookups.

use std::collections::VecDeque;

use super::bitmap::HostBitmap;
use super::table::{KeyHasher, Table};

const TAG_SHIFT: u32 = 56;
const COUNT_MASK: u64 = 0x0F;
const WIDE: u64 = 0x0F;
const REF_BIT: u64 = 0x80;
const INLINE_MAX: u64 = 7;

/// Packed holders of one block: top byte = `ref:1 | 000 | count:4` (count 1..=7 inline,
/// 15 = wide), low seven bytes = inline slot ids, or the low 32 bits = slab index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holders(u64);

impl Holders {
    #[inline]
    fn tag(self) -> u64 {
        self.0 >> TAG_SHIFT
    }
    #[inline]
    fn count(self) -> u64 {
        self.tag() & COUNT_MASK
    }
    #[inline]
    fn is_wide(self) -> bool {
        self.count() == WIDE
    }
    #[inline]
    fn slab(self) -> usize {
        (self.0 & 0xFFFF_FFFF) as usize
    }
    #[inline]
    fn with_ref(self, on: bool) -> Holders {
        let r = REF_BIT << TAG_SHIFT;
        Holders(if on { self.0 | r } else { self.0 & !r })
    }
    #[inline]
    fn referenced(self) -> bool {
        self.tag() & REF_BIT != 0
    }
    fn inline_one(slot: u8) -> Holders {
        Holders((1 << TAG_SHIFT) | slot as u64)
    }
    #[inline]
    fn inline_slot(self, i: u64) -> u8 {
        (self.0 >> (8 * i)) as u8
    }
    fn wide(idx: u32, referenced: bool) -> Holders {
        Holders((WIDE << TAG_SHIFT) | idx as u64).with_ref(referenced)
    }
}

/// What a store or remove did to one pod's bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    Added,
    Removed,
    Unchanged,
}

pub struct Shard {
    map: Table,
    /// Full bitmaps of blocks held by more than seven pods.
    wide: Vec<HostBitmap>,
    free_wide: Vec<u32>,
    /// Keys in insertion order, for CLOCK eviction (may hold keys since deleted).
    ring: VecDeque<u64>,
}

impl Shard {
    pub fn new(hasher: KeyHasher) -> Shard {
        Shard {
            map: Table::new(hasher),
            wide: Vec::new(),
            free_wide: Vec::new(),
            ring: VecDeque::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Pods holding `key` (empty if none).
    #[inline]
    pub fn get(&self, key: u64) -> HostBitmap {
        match self.map.get(key) {
            Some(h) => self.expand(Holders(h)),
            None => HostBitmap::EMPTY,
        }
    }

    #[inline]
    pub fn prefetch(&self, key: u64) {
        self.map.prefetch(key);
    }

    #[inline]
    fn expand(&self, h: Holders) -> HostBitmap {
        if h.is_wide() {
            return self.wide.get(h.slab()).copied().unwrap_or_default();
        }
        let mut b = HostBitmap::EMPTY;
        for i in 0..h.count() {
            b.set(h.inline_slot(i));
        }
        b
    }

    fn alloc_wide(&mut self, b: HostBitmap) -> u32 {
        match self.free_wide.pop() {
            Some(i) => {
                self.wide[i as usize] = b;
                i
            }
            None => {
                self.wide.push(b);
                (self.wide.len() - 1) as u32
            }
        }
    }

    /// Pack a bitmap, reusing `old`'s slab entry when it stays wide.
    fn pack(&mut self, b: HostBitmap, old: Option<Holders>, referenced: bool) -> Holders {
        let n = b.count() as u64;
        if n <= INLINE_MAX {
            if let Some(o) = old.filter(|o| o.is_wide()) {
                self.free_wide.push(o.slab() as u32);
            }
            let mut v = n << TAG_SHIFT;
            for (i, s) in b.iter().enumerate() {
                v |= (s as u64) << (8 * i);
            }
            return Holders(v).with_ref(referenced);
        }
        match old.filter(|o| o.is_wide()) {
            Some(o) => {
                self.wide[o.slab()] = b;
                o.with_ref(referenced)
            }
            None => Holders::wide(self.alloc_wide(b), referenced),
        }
    }

    /// Set `slot` on `key`.
    pub fn store(&mut self, key: u64, slot: u8) -> Change {
        match self.map.get(key).map(Holders) {
            None => {
                self.map.insert(key, Holders::inline_one(slot).0);
                self.ring.push_back(key);
                Change::Added
            }
            Some(h) => {
                let mut b = self.expand(h);
                if b.contains(slot) {
                    // A repeat store is the only recency signal engines give: mark it.
                    if !h.referenced() {
                        self.map.insert(key, h.with_ref(true).0);
                    }
                    return Change::Unchanged;
                }
                b.set(slot);
                let packed = self.pack(b, Some(h), true);
                self.map.insert(key, packed.0);
                Change::Added
            }
        }
    }

    /// Clear `slot` on `key`; the entry goes when no pod is left.
    pub fn remove(&mut self, key: u64, slot: u8) -> Change {
        let Some(h) = self.map.get(key).map(Holders) else {
            return Change::Unchanged;
        };
        let mut b = self.expand(h);
        if !b.contains(slot) {
            return Change::Unchanged;
        }
        b.clear(slot);
        if b.is_empty() {
            self.delete(key, h);
        } else {
            let packed = self.pack(b, Some(h), h.referenced());
            self.map.insert(key, packed.0);
        }
        Change::Removed
    }

    fn delete(&mut self, key: u64, h: Holders) {
        if h.is_wide() {
            self.free_wide.push(h.slab() as u32);
        }
        self.map.remove(key);
        self.compact_ring_if_stale();
    }

    fn compact_ring_if_stale(&mut self) {
        // Deleted keys stay in the ring until eviction passes them; rebuild when they
        // dominate so the ring stays O(entries).
        if self.ring.len() > 64 && self.ring.len() > 2 * self.map.len() {
            self.compact_ring();
        }
    }

    /// Keep each live key once in the ring, in order.
    fn compact_ring(&mut self) {
        let map = &self.map;
        let mut seen = std::collections::HashSet::with_capacity(map.len());
        self.ring
            .retain(|k| map.get(*k).is_some() && seen.insert(*k));
    }

    #[cfg(test)]
    /// Clear `slot` everywhere in this shard; returns how many entries held it.
    pub fn clear_slot(&mut self, slot: u8) -> u64 {
        let mut cleared = 0u64;
        let mut freed = Vec::new();
        let wide = &mut self.wide;
        self.map.retain(|_, raw| {
            let mut hv = Holders(*raw);
            let h = &mut hv;
            let keep = Self::clear_in(h, slot, wide, &mut freed, &mut cleared);
            *raw = hv.0;
            keep
        });
        self.free_wide.extend(freed);
        self.compact_ring_if_stale();
        cleared
    }

    fn clear_in(
        h: &mut Holders,
        slot: u8,
        wide: &mut [HostBitmap],
        freed: &mut Vec<u32>,
        cleared: &mut u64,
    ) -> bool {
        {
            if h.is_wide() {
                let Some(b) = wide.get_mut(h.slab()) else {
                    return false;
                };
                if !b.contains(slot) {
                    return true;
                }
                b.clear(slot);
                *cleared += 1;
                if b.count() as u64 <= INLINE_MAX {
                    let mut v = (b.count() as u64) << TAG_SHIFT;
                    for (i, s) in b.iter().enumerate() {
                        v |= (s as u64) << (8 * i);
                    }
                    freed.push(h.slab() as u32);
                    *h = Holders(v).with_ref(h.referenced());
                }
                return true;
            }
            let n = h.count();
            let Some(pos) = (0..n).find(|&i| h.inline_slot(i) == slot) else {
                return true;
            };
            *cleared += 1;
            if n == 1 {
                return false;
            }
            // Move the last inline slot into the hole.
            let last = h.inline_slot(n - 1);
            let mut v = h.0 & !(0xFFu64 << (8 * pos)) & !(0xFFu64 << (8 * (n - 1)));
            v |= (last as u64) << (8 * pos);
            v = (v & !(COUNT_MASK << TAG_SHIFT)) | ((n - 1) << TAG_SHIFT);
            *h = Holders(v);
            true
        }
    }

    /// Incremental form of [`Shard::clear_slot`] for bounded lock hold times: clears the
    /// slot's bit in table positions `[from, from + n)` without deleting anything (entries
    /// left with no holder stay, empty, and are collected into `emptied` for
    /// [`Shard::remove_if_empty`]). Returns the cleared count and where to continue.
    pub fn clear_slot_part(
        &mut self,
        slot: u8,
        from: usize,
        n: usize,
        emptied: &mut Vec<u64>,
    ) -> (u64, Option<usize>) {
        let mut cleared = 0u64;
        let mut freed = Vec::new();
        let wide = &mut self.wide;
        let next = self.map.scan(from, n, |key, raw| {
            let mut h = Holders(*raw);
            let had = h.count();
            if !Self::clear_in(&mut h, slot, wide, &mut freed, &mut cleared) {
                // Last holder gone: keep an empty inline entry for now.
                h = Holders(0);
                emptied.push(key);
            } else if had == 0 {
                return;
            }
            *raw = h.0;
        });
        self.free_wide.extend(freed);
        (cleared, next)
    }

    /// Delete `key` if it has no holder (a writer may have stored it again meanwhile).
    pub fn remove_if_empty(&mut self, key: u64) {
        if let Some(h) = self.map.get(key).map(Holders) {
            if !h.is_wide() && h.count() == 0 {
                self.map.remove(key);
            }
        }
    }

    /// Changes whenever table positions move (see [`Shard::clear_slot_part`]).
    pub fn layout_gen(&self) -> u64 {
        self.map.gen
    }

    /// CLOCK eviction until the shard holds at most `cap` entries. Returns the evicted
    /// entries' holders, so the caller can fix per-pod counts.
    pub fn evict_to(&mut self, cap: usize, mut on_evict: impl FnMut(HostBitmap)) -> u64 {
        let mut evicted = 0;
        // Each live key is passed at most twice (once to clear its bit, once to evict).
        let mut budget = 2 * self.ring.len() + 1;
        while self.map.len() > cap && budget > 0 {
            budget -= 1;
            let Some(key) = self.ring.pop_front() else {
                break;
            };
            let Some(h) = self.map.get(key).map(Holders) else {
                continue;
            };
            if h.referenced() {
                self.map.insert(key, h.with_ref(false).0);
                self.ring.push_back(key);
                continue;
            }
            on_evict(self.expand(h));
            if h.is_wide() {
                self.free_wide.push(h.slab() as u32);
            }
            self.map.remove(key);
            evicted += 1;
        }
        evicted
    }

    /// Evict one entry held by `slot` alone, among the `scan` oldest of the ring (a pod
    /// over its share replaces its own blocks, not others'). The evicted key, if one went.
    pub fn evict_own(&mut self, slot: u8, scan: usize) -> Option<u64> {
        let found = self.ring.iter().take(scan).position(|&k| {
            self.map
                .get(k)
                .map(Holders)
                .is_some_and(|h| !h.is_wide() && h.count() == 1 && h.inline_slot(0) == slot)
        });
        let key = self.ring.remove(found?)?;
        self.map.remove(key);
        Some(key)
    }

    /// Give back memory beyond what `cap` entries need: the table's slots and the ring's
    /// stale keys and slack.
    pub fn shrink_to(&mut self, cap: usize) {
        self.map.shrink_for(cap);
        self.compact_ring();
        self.ring.shrink_to_fit();
    }

    /// Heap bytes this shard holds (table, slab, ring).
    pub fn heap_bytes(&self) -> usize {
        self.map.capacity() * super::table::SLOT_BYTES
            + self.wide.capacity() * std::mem::size_of::<HostBitmap>()
            + self.free_wide.capacity() * 4
            + self.ring.capacity() * 8
    }

    /// Every (key, holders) pair, for dumps and tests.
    pub fn for_each(&self, mut f: impl FnMut(u64, HostBitmap)) {
        self.map.for_each(|k, h| f(k, self.expand(Holders(h))));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard() -> Shard {
        Shard::new(KeyHasher::new(7))
    }

    #[test]
    fn inline_to_wide_and_back() {
        let mut s = shard();
        let mut want = HostBitmap::EMPTY;
        for slot in (0u8..=255).step_by(13) {
            assert_eq!(s.store(42, slot), Change::Added);
            assert_eq!(s.store(42, slot), Change::Unchanged);
            want.set(slot);
            assert_eq!(s.get(42), want);
        }
        assert_eq!(s.wide.len(), 1);
        for slot in (0u8..=255).step_by(13) {
            assert_eq!(s.remove(42, slot), Change::Removed);
            want.clear(slot);
            assert_eq!(s.get(42), want);
        }
        assert!(s.is_empty());
        assert_eq!(s.free_wide.len(), 1, "slab entry recycled");
        assert_eq!(s.remove(42, 3), Change::Unchanged);
    }

    #[test]
    fn clear_slot_everywhere() {
        let mut s = shard();
        for k in 0..100u64 {
            for slot in 0..(k % 12) as u8 + 1 {
                s.store(k, slot);
            }
        }
        let before = s.len();
        let n = s.clear_slot(0);
        assert_eq!(n, 100);
        assert_eq!(s.len(), before - (0..100).filter(|k| k % 12 == 0).count());
        s.for_each(|_, b| assert!(!b.contains(0) && !b.is_empty()));
        for k in 0..100u64 {
            let want: HostBitmap = (1..(k % 12) as u8 + 1).fold(HostBitmap::EMPTY, |mut b, s| {
                b.set(s);
                b
            });
            assert_eq!(s.get(k), want, "key {k}");
        }
    }

    #[test]
    fn clock_evicts_unreferenced_first() {
        let mut s = shard();
        for k in 0..10u64 {
            s.store(k, 1);
        }
        // Touch 0..5 (repeat stores), so 5..10 go first.
        for k in 0..5u64 {
            s.store(k, 1);
        }
        let mut n = 0;
        s.evict_to(5, |b| {
            assert_eq!(b, HostBitmap::single(1));
            n += 1;
        });
        assert_eq!(n, 5);
        for k in 0..5u64 {
            assert!(!s.get(k).is_empty(), "referenced key {k} kept");
        }
    }
}
