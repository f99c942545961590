//! 256-bit pod sets: one bit per pod slot of a model.
//!
//! Four u64 words: membership is one bit test, candidate sets are an AND, counts are a
//! popcount, and the whole set fits in half a cache line. The alive set is the same shape
//! in atomics, so a pod is excluded from every later lookup by a single atomic AND.

use std::sync::atomic::{AtomicU64, Ordering};

/// Most pods per model (slots 0..=255).
pub const MAX_SLOTS: usize = 256;

#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct HostBitmap(pub [u64; 4]);

impl std::fmt::Debug for HostBitmap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl HostBitmap {
    pub const EMPTY: HostBitmap = HostBitmap([0; 4]);

    #[inline]
    pub fn single(slot: u8) -> HostBitmap {
        let mut b = HostBitmap::EMPTY;
        b.set(slot);
        b
    }

    #[inline]
    pub fn set(&mut self, slot: u8) {
        self.0[(slot >> 6) as usize] |= 1 << (slot & 63);
    }

    #[inline]
    pub fn clear(&mut self, slot: u8) {
        self.0[(slot >> 6) as usize] &= !(1 << (slot & 63));
    }

    #[inline]
    pub fn contains(&self, slot: u8) -> bool {
        self.0[(slot >> 6) as usize] & (1 << (slot & 63)) != 0
    }

    #[inline]
    pub fn and(self, o: HostBitmap) -> HostBitmap {
        HostBitmap([
            self.0[0] & o.0[0],
            self.0[1] & o.0[1],
            self.0[2] & o.0[2],
            self.0[3] & o.0[3],
        ])
    }

    #[inline]
    pub fn and_not(self, o: HostBitmap) -> HostBitmap {
        HostBitmap([
            self.0[0] & !o.0[0],
            self.0[1] & !o.0[1],
            self.0[2] & !o.0[2],
            self.0[3] & !o.0[3],
        ])
    }

    #[inline]
    pub fn or(self, o: HostBitmap) -> HostBitmap {
        HostBitmap([
            self.0[0] | o.0[0],
            self.0[1] | o.0[1],
            self.0[2] | o.0[2],
            self.0[3] | o.0[3],
        ])
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        (self.0[0] | self.0[1] | self.0[2] | self.0[3]) == 0
    }

    #[inline]
    pub fn count(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }

    /// Slots in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = u8> + '_ {
        self.0.iter().enumerate().flat_map(|(i, &w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                if w == 0 {
                    return None;
                }
                let b = w.trailing_zeros();
                w &= w - 1;
                Some((i as u32 * 64 + b) as u8)
            })
        })
    }
}

/// The live pods of a model. Lookups take a snapshot (four loads); pod removal's phase 1
/// is one atomic AND-NOT, visible to every lookup that starts after it.
#[derive(Default)]
pub struct AliveBitmap([AtomicU64; 4]);

impl AliveBitmap {
    #[inline]
    pub fn snapshot(&self) -> HostBitmap {
        HostBitmap([
            self.0[0].load(Ordering::Acquire),
            self.0[1].load(Ordering::Acquire),
            self.0[2].load(Ordering::Acquire),
            self.0[3].load(Ordering::Acquire),
        ])
    }

    /// Set the slot's bit (compare-and-swap loop); false if it was already set.
    pub fn insert(&self, slot: u8) -> bool {
        let word = &self.0[(slot >> 6) as usize];
        let bit = 1u64 << (slot & 63);
        let mut cur = word.load(Ordering::Acquire);
        loop {
            if cur & bit != 0 {
                return false;
            }
            match word.compare_exchange_weak(cur, cur | bit, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    /// Clear the slot's bit (compare-and-swap loop); false if it was already clear.
    pub fn remove(&self, slot: u8) -> bool {
        let word = &self.0[(slot >> 6) as usize];
        let bit = 1u64 << (slot & 63);
        let mut cur = word.load(Ordering::Acquire);
        loop {
            if cur & bit == 0 {
                return false;
            }
            match word.compare_exchange_weak(cur, cur & !bit, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }

    pub fn contains(&self, slot: u8) -> bool {
        self.0[(slot >> 6) as usize].load(Ordering::Acquire) & (1 << (slot & 63)) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_ops() {
        let mut a = HostBitmap::EMPTY;
        for s in [0u8, 63, 64, 200, 255] {
            a.set(s);
        }
        assert_eq!(a.iter().collect::<Vec<_>>(), [0, 63, 64, 200, 255]);
        assert_eq!(a.count(), 5);
        let b = HostBitmap::single(64).or(HostBitmap::single(1));
        assert_eq!(a.and(b), HostBitmap::single(64));
        assert_eq!(a.and_not(b).count(), 4);
        a.clear(255);
        assert!(!a.contains(255) && a.contains(200));
    }

    #[test]
    fn alive_cas() {
        let al = AliveBitmap::default();
        assert!(al.insert(130));
        assert!(!al.insert(130));
        assert!(al.contains(130));
        assert_eq!(al.snapshot(), HostBitmap::single(130));
        assert!(al.remove(130));
        assert!(!al.remove(130));
        assert!(al.snapshot().is_empty());
    }
}
