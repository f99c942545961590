//! The depth memo: for a chain's first block, the depths at which the last lookup of a
//! chain starting there found its pods' prefixes ending.
//!
//! Requests that share a first block (a conversation's next turn, a system prompt) tend
//! to end at the same depths as the last one did. A k-ary search spends three or four
//! dependent rounds of probes — each a memory latency — to find them; with the memo the
//! first round probes exactly `d` and `d+1` for each remembered depth `d`, together with
//! the first block, and is usually the only round. A memo entry is only a guess about
//! where to probe: the answer always comes from the probes, so a stale or colliding entry
//! (the slot is chosen by the first block's hash, which a client controls) costs probes,
//! never correctness. The oracle tests run every lookup cold and memoized.
//!
//! One array of atomic words per model, 8-way set-associative (a set is one cache line,
//! so a lookup reads one line), written only when a lookup's depths differ from what it
//! read: no locks, and no writes in the steady state.

use std::sync::atomic::{AtomicU64, Ordering};

/// Entries per model (128 KiB).
const SLOTS_LOG2: u32 = 14;
/// Entries per set (one 64-byte line).
const WAYS: usize = 8;
const SETS_LOG2: u32 = SLOTS_LOG2 - 3;
/// Remembered depths per entry.
pub const DEPTHS: usize = 3;
const FIB: u64 = 0x9E37_79B9_7F4A_7C15;

#[repr(align(64))]
struct Set([AtomicU64; WAYS]);

pub struct DepthMemo {
    sets: Box<[Set]>,
}

/// What the memo knows of a first block: up to [`DEPTHS`] depths, deepest first, each
/// in 1..=65535.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Depths([u16; DEPTHS]);

impl Depths {
    pub fn iter(self) -> impl Iterator<Item = u32> {
        self.0.into_iter().filter(|&d| d > 0).map(u32::from)
    }

    /// The deepest distinct depths among `depths` (in any order; 0 and depths beyond
    /// u16 are skipped rather than truncated into wrong guesses).
    pub fn deepest(depths: impl Iterator<Item = u32>) -> Depths {
        let mut out = [0u16; DEPTHS];
        for d in depths {
            let Ok(mut d) = u16::try_from(d) else {
                continue;
            };
            if d == 0 || out.contains(&d) {
                continue;
            }
            // Insert into the descending top-DEPTHS, dropping the shallowest.
            for o in out.iter_mut() {
                if d > *o {
                    std::mem::swap(o, &mut d);
                }
            }
        }
        Depths(out)
    }

    fn is_empty(self) -> bool {
        self.0[0] == 0
    }
}

impl Default for DepthMemo {
    fn default() -> Self {
        DepthMemo {
            sets: (0..1usize << SETS_LOG2)
                .map(|_| Set(std::array::from_fn(|_| AtomicU64::new(0))))
                .collect(),
        }
    }
}

impl DepthMemo {
    #[inline]
    fn place(first: u64) -> (usize, u64) {
        let h = first.wrapping_mul(FIB);
        // Set from the top bits, tag from the next 16 (never 0, so 0 means empty).
        let set = (h >> (64 - SETS_LOG2)) as usize;
        let tag = ((h >> (64 - SETS_LOG2 - 16)) & 0xFFFF) | 1;
        (set, tag)
    }

    /// The remembered depths for chains starting with `first`, if any.
    #[inline]
    pub fn get(&self, first: u64) -> Option<Depths> {
        let (set, tag) = Self::place(first);
        let w = self.sets[set]
            .0
            .iter()
            .map(|e| e.load(Ordering::Relaxed))
            .find(|w| w & 0xFFFF == tag)?;
        let d = Depths([(w >> 16) as u16, (w >> 32) as u16, (w >> 48) as u16]);
        (!d.is_empty()).then_some(d)
    }

    /// Remember `depths` for `first` (a no-op when they are what `seen` was): in the
    /// entry already tagged for it, else an empty one, else one chosen by the tag.
    #[inline]
    pub fn put(&self, first: u64, seen: Option<Depths>, depths: Depths) {
        if seen == Some(depths) || (seen.is_none() && depths.is_empty()) {
            return;
        }
        let (set, tag) = Self::place(first);
        let set = &self.sets[set].0;
        let words: [u64; WAYS] = std::array::from_fn(|i| set[i].load(Ordering::Relaxed));
        let way = words
            .iter()
            .position(|w| w & 0xFFFF == tag)
            .or_else(|| words.iter().position(|&w| w == 0))
            .unwrap_or((tag >> 1) as usize % WAYS);
        let [a, b, c] = depths.0;
        let w = tag | (a as u64) << 16 | (b as u64) << 32 | (c as u64) << 48;
        set[way].store(if depths.is_empty() { 0 } else { w }, Ordering::Relaxed);
    }

    pub fn heap_bytes(&self) -> usize {
        self.sets.len() * std::mem::size_of::<Set>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_the_deepest_distinct_depths() {
        let m = DepthMemo::default();
        assert_eq!(m.get(7), None);
        let d = Depths::deepest([9, 128, 3, 128, 40, 40].into_iter());
        assert_eq!(d.iter().collect::<Vec<_>>(), vec![128, 40, 9]);
        m.put(7, None, d);
        assert_eq!(m.get(7), Some(d));
        // Depths beyond u16 are skipped rather than truncated into wrong guesses.
        let big = Depths::deepest([70_000, 5].into_iter());
        assert_eq!(big.iter().collect::<Vec<_>>(), vec![5]);
        // Emptying forgets the entry.
        m.put(7, Some(d), Depths::default());
        assert_eq!(m.get(7), None);
    }

    #[test]
    fn a_set_holds_eight_first_blocks() {
        let m = DepthMemo::default();
        let set = |k: u64| DepthMemo::place(k).0;
        let same: Vec<u64> = (1..).filter(|&k| set(k) == set(1)).take(WAYS).collect();
        for (i, &k) in same.iter().enumerate() {
            m.put(k, None, Depths::deepest([i as u32 + 1].into_iter()));
        }
        for (i, &k) in same.iter().enumerate() {
            assert_eq!(m.get(k).map(|d| d.iter().next()), Some(Some(i as u32 + 1)));
        }
    }
}
