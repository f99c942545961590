//! The segment cache: token ids of text pieces already encoded, shared by every request
//! of a model. Bounded in bytes (key text + ids), evicted with CLOCK (second chance): a
//! hit sets the entry's reference bit, eviction clears bits until it finds an entry
//! nobody used since its last pass. One mutex: a lookup is a hash of the piece and a
//! copy of its ids, tiny next to encoding it.

use std::collections::VecDeque;
use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::Mutex;

/// Per-entry bookkeeping counted against the cap besides the text and ids.
const OVERHEAD: usize = 64;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheStats {
    pub entries: usize,
    pub bytes: usize,
    pub cap_bytes: usize,
    pub hits: u64,
    pub misses: u64,
    pub evicted: u64,
}

/// A lookup key borrowed from the request's text (no copy of a long piece to look it up);
/// hashes as the owned key does.
#[derive(Hash)]
struct Borrowed<'a>(&'a str, bool);

impl hashbrown::Equivalent<(Arc<str>, bool)> for Borrowed<'_> {
    fn equivalent(&self, k: &(Arc<str>, bool)) -> bool {
        *self.0 == *k.0 && self.1 == k.1
    }
}

struct Entry {
    ids: Arc<[u32]>,
    referenced: bool,
}

struct Inner {
    map: HashMap<(Arc<str>, bool), Entry>,
    ring: VecDeque<(Arc<str>, bool)>,
    stats: CacheStats,
}

pub struct SegmentCache {
    inner: Mutex<Inner>,
}

fn cost(text: &str, ids: usize) -> usize {
    text.len() + ids * 4 + OVERHEAD
}

impl SegmentCache {
    pub fn new(cap_bytes: usize) -> SegmentCache {
        SegmentCache {
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                ring: VecDeque::new(),
                stats: CacheStats {
                    cap_bytes,
                    ..CacheStats::default()
                },
            }),
        }
    }

    pub fn stats(&self) -> CacheStats {
        let g = self.inner.lock();
        CacheStats {
            entries: g.map.len(),
            ..g.stats
        }
    }

    /// The ids of `(text, at_start)`, encoding (outside the lock) on a miss.
    pub fn get_or_try_insert<E>(
        &self,
        text: &str,
        at_start: bool,
        encode: impl FnOnce() -> Result<Vec<u32>, E>,
    ) -> Result<Arc<[u32]>, E> {
        {
            let mut g = self.inner.lock();
            if let Some(e) = g.map.get_mut(&Borrowed(text, at_start)) {
                e.referenced = true;
                let ids = e.ids.clone();
                g.stats.hits += 1;
                return Ok(ids);
            }
            g.stats.misses += 1;
        }
        let ids: Arc<[u32]> = encode()?.into();
        let c = cost(text, ids.len());
        let mut g = self.inner.lock();
        if c > g.stats.cap_bytes {
            return Ok(ids); // larger than the whole cache: not kept
        }
        if g.map.contains_key(&Borrowed(text, at_start)) {
            return Ok(ids); // another request encoded it meanwhile
        }
        let key: (Arc<str>, bool) = (Arc::from(text), at_start);
        while g.stats.bytes + c > g.stats.cap_bytes {
            let Some(k) = g.ring.pop_front() else { break };
            let second_chance = match g.map.get_mut(&k) {
                Some(e) if e.referenced => {
                    e.referenced = false;
                    true
                }
                Some(_) => false,
                None => continue,
            };
            if second_chance {
                g.ring.push_back(k);
            } else if let Some(e) = g.map.remove(&k) {
                g.stats.bytes -= cost(&k.0, e.ids.len());
                g.stats.evicted += 1;
            }
        }
        g.stats.bytes += c;
        g.ring.push_back(key.clone());
        g.map.insert(
            key,
            Entry {
                ids: ids.clone(),
                referenced: false,
            },
        );
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_in_bytes_and_keeps_what_is_used() {
        let c = SegmentCache::new(10 * (OVERHEAD + 8 + 4));
        let enc = |n: u32| move || Ok::<_, ()>(vec![n]);
        for i in 0..10u32 {
            c.get_or_try_insert(&format!("seg{i:05}"), false, enc(i))
                .expect("ok");
        }
        // Touch seg00000: it survives the next insertions.
        c.get_or_try_insert("seg00000", false, enc(99)).expect("ok");
        for i in 10..15u32 {
            c.get_or_try_insert(&format!("seg{i:05}"), false, enc(i))
                .expect("ok");
        }
        let s = c.stats();
        assert!(s.bytes <= s.cap_bytes, "{s:?}");
        assert_eq!(s.evicted, 5);
        let kept = c.get_or_try_insert("seg00000", false, enc(99)).expect("ok");
        assert_eq!(
            &*kept,
            &[0],
            "the referenced entry was kept (not re-encoded)"
        );
        // at_start is part of the key.
        let other = c.get_or_try_insert("seg00000", true, enc(7)).expect("ok");
        assert_eq!(&*other, &[7]);
    }
}
