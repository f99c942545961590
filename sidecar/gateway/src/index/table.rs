//! The open-addressing table inside a shard: `u64 key → u64 value`, linear probing over
//! 16-byte slots with backward-shift deletion, and beside the slots one tag byte per
//! slot (7 bits of the key's hash, high bit set; 0 = empty).
//!
//! The tags are what make a miss cheap: they are 1/16 of the table, so across all shards
//! they stay in the last-level cache when the slots do not, and a key that is absent is
//! almost always rejected by its tags alone (measured: a miss on a 1M-block index went
//! from ~210 ns, one DRAM access, to the tag array's cache latency). A hit reads its tag
//! and then its slot; [`Table::prefetch`] requests both lines, so a lookup can ask for
//! many chain positions before reading any of them and their misses overlap — which
//! hashbrown (the same tag idea, with groups) offers no way to do. Key 0 marks an empty
//! slot; a real key 0 lives in its own field.

use std::hash::BuildHasher;

/// The in-shard hasher: `ahash`, keyed per process. Keys are already xxh3 outputs, but
/// text-mode chains come from client prompts, so the bucket function must be keyed: an
/// attacker who knows the chain function must not be able to aim many keys at one
/// bucket. `kvroute-bench index` measures it beside a hand-written seeded
/// multiply-xorshift, foldhash and SipHash (`hashers`): ahash is within noise of the
/// fastest (9-17 ns per probe across runs), so the library does the job.
#[derive(Clone)]
pub struct KeyHasher(ahash::RandomState);

impl KeyHasher {
    pub fn new(seed: u64) -> KeyHasher {
        KeyHasher(ahash::RandomState::with_seeds(
            seed,
            seed.rotate_left(17) ^ 0x243F_6A88_85A3_08D3,
            seed.rotate_left(31) ^ 0x1319_8A2E_0370_7344,
            seed.rotate_left(47) ^ 0xA409_3822_299F_31D0,
        ))
    }
}

impl BuildHasher for KeyHasher {
    type Hasher = ahash::AHasher;
    #[inline]
    fn build_hasher(&self) -> ahash::AHasher {
        self.0.build_hasher()
    }
}

const MIN_CAP: usize = 16;

/// A slot's tag: the hash's top 7 bits (the home position uses the low bits), with the
/// high bit set so no tag is 0.
#[inline]
fn tag(h: u64) -> u8 {
    (h >> 57) as u8 | 0x80
}

/// Bytes per slot, tags included (for memory accounting).
pub const SLOT_BYTES: usize = 17;

pub struct Table {
    /// Bumped on every resize, so a scan in pieces can tell that positions moved.
    pub gen: u64,
    slots: Vec<[u64; 2]>,
    /// `tags[i]` is 0 when `slots[i]` is empty, else [`tag`] of its key's hash.
    tags: Vec<u8>,
    mask: usize,
    len: usize,
    zero: Option<u64>,
    hasher: KeyHasher,
}

impl Table {
    pub fn new(hasher: KeyHasher) -> Table {
        Table {
            gen: 0,
            slots: vec![[0, 0]; MIN_CAP],
            tags: vec![0; MIN_CAP],
            mask: MIN_CAP - 1,
            len: 0,
            zero: None,
            hasher,
        }
    }

    #[inline]
    fn hash(&self, key: u64) -> u64 {
        self.hasher.hash_one(key)
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        (self.hash(key) as usize) & self.mask
    }

    pub fn len(&self) -> usize {
        self.len + self.zero.is_some() as usize
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Ask the CPU to start loading `key`'s home tag and slot.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let i = self.home(key);
            let s = self.slots.as_ptr().wrapping_add(i) as *const i8;
            let t = self.tags.as_ptr().wrapping_add(i) as *const i8;
            // SAFETY: prefetch never faults and `home` is within both allocations.
            unsafe {
                std::arch::x86_64::_mm_prefetch(t, std::arch::x86_64::_MM_HINT_T0);
                std::arch::x86_64::_mm_prefetch(s, std::arch::x86_64::_MM_HINT_T0);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = key;
    }

    #[inline]
    pub fn get(&self, key: u64) -> Option<u64> {
        if key == 0 {
            return self.zero;
        }
        let h = self.hash(key);
        let t = tag(h);
        let mut i = h as usize & self.mask;
        loop {
            let g = self.tags[i];
            if g == 0 {
                return None;
            }
            if g == t {
                let [k, v] = self.slots[i];
                if k == key {
                    return Some(v);
                }
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Insert or overwrite; returns the previous value.
    pub fn insert(&mut self, key: u64, value: u64) -> Option<u64> {
        if key == 0 {
            return self.zero.replace(value);
        }
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.resize(self.slots.len() * 2);
        }
        let h = self.hash(key);
        let mut i = h as usize & self.mask;
        loop {
            let [k, v] = self.slots[i];
            if k == key {
                self.slots[i][1] = value;
                return Some(v);
            }
            if k == 0 {
                self.slots[i] = [key, value];
                self.tags[i] = tag(h);
                self.len += 1;
                return None;
            }
            i = (i + 1) & self.mask;
        }
    }

    pub fn remove(&mut self, key: u64) -> Option<u64> {
        if key == 0 {
            return self.zero.take();
        }
        let mut i = self.home(key);
        loop {
            let [k, v] = self.slots[i];
            if k == 0 {
                return None;
            }
            if k == key {
                self.delete_at(i);
                self.maybe_shrink();
                return Some(v);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Backward-shift deletion: pull later members of the probe run into the hole so no
    /// tombstones accumulate.
    fn delete_at(&mut self, mut hole: usize) {
        self.len -= 1;
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask;
            let [k, _] = self.slots[j];
            if k == 0 {
                break;
            }
            let h = self.home(k);
            // Move j into the hole if its home is not within (hole, j] cyclically.
            let between = if hole <= j {
                hole < h && h <= j
            } else {
                hole < h || h <= j
            };
            if !between {
                self.slots[hole] = self.slots[j];
                self.tags[hole] = self.tags[j];
                hole = j;
            }
        }
        self.slots[hole] = [0, 0];
        self.tags[hole] = 0;
    }

    /// Give back capacity beyond what `n` entries need (after a trim to a lower cap).
    pub fn shrink_for(&mut self, n: usize) {
        let mut want = MIN_CAP;
        while (n.max(self.len) + 1) * 4 > want * 3 {
            want *= 2;
        }
        if want < self.slots.len() {
            self.resize(want);
        }
    }

    fn maybe_shrink(&mut self) {
        if self.slots.len() > MIN_CAP && self.len * 8 < self.slots.len() {
            self.resize((self.slots.len() / 2).max(MIN_CAP));
        }
    }

    fn resize(&mut self, cap: usize) {
        self.gen += 1;
        let old = std::mem::replace(&mut self.slots, vec![[0, 0]; cap]);
        self.tags = vec![0; cap];
        self.mask = cap - 1;
        for [k, v] in old {
            if k != 0 {
                let h = self.hash(k);
                let mut i = h as usize & self.mask;
                while self.slots[i][0] != 0 {
                    i = (i + 1) & self.mask;
                }
                self.slots[i] = [k, v];
                self.tags[i] = tag(h);
            }
        }
    }

    #[cfg(test)]
    /// Keep entries for which `f` returns true; `f` may rewrite the value.
    pub fn retain(&mut self, mut f: impl FnMut(u64, &mut u64) -> bool) {
        if let Some(mut v) = self.zero {
            self.zero = if f(0, &mut v) { Some(v) } else { None };
        }
        // Collect first: deleting shifts entries, which would confuse a single pass.
        let mut dead = Vec::new();
        for slot in self.slots.iter_mut() {
            if slot[0] != 0 && !f(slot[0], &mut slot[1]) {
                dead.push(slot[0]);
            }
        }
        for k in dead {
            self.remove(k);
        }
    }

    /// Visit slots `[from, from + n)` (and the zero key when `from == 0`) without deleting;
    /// returns where to continue, or None at the end.
    pub fn scan(
        &mut self,
        from: usize,
        n: usize,
        mut f: impl FnMut(u64, &mut u64),
    ) -> Option<usize> {
        if from == 0 {
            if let Some(v) = self.zero.as_mut() {
                f(0, v);
            }
        }
        let end = (from + n).min(self.slots.len());
        for slot in self.slots.get_mut(from..end).into_iter().flatten() {
            if slot[0] != 0 {
                f(slot[0], &mut slot[1]);
            }
        }
        (end < self.slots.len()).then_some(end)
    }

    pub fn for_each(&self, mut f: impl FnMut(u64, u64)) {
        if let Some(v) = self.zero {
            f(0, v);
        }
        for &[k, v] in &self.slots {
            if k != 0 {
                f(k, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn agrees_with_a_hashmap() {
        let mut t = Table::new(KeyHasher::new(3));
        let mut m = HashMap::new();
        let mut x = 1u64;
        for i in 0..200_000u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let k = (x >> 40) % 5000; // small key space: many collisions, zero included
            match i % 3 {
                0 | 1 => assert_eq!(t.insert(k, i), m.insert(k, i)),
                _ => assert_eq!(t.remove(k), m.remove(&k)),
            }
            if i % 1000 == 0 {
                for k in 0..5000 {
                    assert_eq!(t.get(k), m.get(&k).copied(), "key {k}");
                }
            }
        }
        assert_eq!(t.len(), m.len());
        t.retain(|k, v| {
            *v += 1;
            k % 2 == 0
        });
        m.retain(|k, _| k % 2 == 0);
        for (k, v) in &m {
            assert_eq!(t.get(*k), Some(v + 1));
        }
        assert_eq!(t.len(), m.len());
        for k in m.keys().copied().collect::<Vec<_>>() {
            t.remove(k);
        }
        assert!(t.is_empty());
        assert_eq!(t.capacity(), MIN_CAP, "shrinks when emptied");
    }
}
