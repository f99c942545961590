//! A pod's paged KV cache as the engines keep it: fixed capacity in blocks, LRU, and
//! tail-first eviction (a request touches its chain from the last block back to the
//! first, so a shared parent is always more recent than its children and goes last).
//!
//! One implementation serves the engine simulator, the routing simulator and the trace
//! benchmark, so they all evict the same way. O(1) per block: a hash map into a slab of
//! doubly linked nodes.

use std::collections::HashMap;

const NIL: u32 = u32::MAX;

struct Node {
    key: u64,
    prev: u32,
    next: u32,
}

pub struct BlockCache {
    capacity: usize,
    map: HashMap<u64, u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    /// Most recent.
    head: u32,
    /// Least recent.
    tail: u32,
}

/// What admitting a chain did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// Leading blocks that were already cached (the reusable prefix).
    pub hit_blocks: usize,
    /// Blocks newly cached, in chain order.
    pub stored: Vec<u64>,
    /// Blocks evicted to make room.
    pub removed: Vec<u64>,
}

impl BlockCache {
    pub fn new(capacity: usize) -> BlockCache {
        BlockCache {
            capacity: capacity.max(1),
            map: HashMap::with_capacity(capacity.max(1)),
            nodes: Vec::with_capacity(capacity.max(1)),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn contains(&self, key: u64) -> bool {
        self.map.contains_key(&key)
    }

    /// Leading blocks of `chain` cached now (no recency change).
    pub fn prefix_hits(&self, chain: &[u64]) -> usize {
        chain
            .iter()
            .take_while(|b| self.map.contains_key(b))
            .count()
    }

    fn unlink(&mut self, i: u32) {
        let (p, n) = (self.nodes[i as usize].prev, self.nodes[i as usize].next);
        if p != NIL {
            self.nodes[p as usize].next = n;
        } else {
            self.head = n;
        }
        if n != NIL {
            self.nodes[n as usize].prev = p;
        } else {
            self.tail = p;
        }
    }

    fn push_front(&mut self, i: u32) {
        self.nodes[i as usize].prev = NIL;
        self.nodes[i as usize].next = self.head;
        if self.head != NIL {
            self.nodes[self.head as usize].prev = i;
        }
        self.head = i;
        if self.tail == NIL {
            self.tail = i;
        }
    }

    fn touch_or_insert(&mut self, key: u64, removed: &mut Vec<u64>) -> bool {
        if let Some(&i) = self.map.get(&key) {
            self.unlink(i);
            self.push_front(i);
            return false;
        }
        if self.map.len() >= self.capacity {
            let t = self.tail;
            if t != NIL {
                self.unlink(t);
                let old = self.nodes[t as usize].key;
                self.map.remove(&old);
                self.free.push(t);
                removed.push(old);
            }
        }
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = Node {
                    key,
                    prev: NIL,
                    next: NIL,
                };
                i
            }
            None => {
                self.nodes.push(Node {
                    key,
                    prev: NIL,
                    next: NIL,
                });
                (self.nodes.len() - 1) as u32
            }
        };
        self.map.insert(key, i);
        self.push_front(i);
        true
    }

    /// Run a request's chain through the cache: its cached prefix is reused, the rest is
    /// computed and cached, evicting least-recent blocks. A chain longer than the cache
    /// keeps only its first `capacity` blocks.
    pub fn admit(&mut self, chain: &[u64]) -> Admitted {
        let mut out = Admitted {
            hit_blocks: self.prefix_hits(chain),
            ..Default::default()
        };
        let keep = chain.len().min(self.capacity);
        // From the tail back to the head, so the head ends most recent.
        let mut stored_rev = Vec::new();
        for &b in chain[..keep].iter().rev() {
            if self.touch_or_insert(b, &mut out.removed) {
                stored_rev.push(b);
            }
        }
        // keep <= capacity, so no block of this chain is evicted by its own admission.
        stored_rev.reverse();
        out.stored = stored_rev;
        out
    }

    /// Drop everything (an engine restart).
    pub fn clear(&mut self) -> Vec<u64> {
        let all: Vec<u64> = self.map.keys().copied().collect();
        *self = BlockCache::new(self.capacity);
        all
    }

    /// Every cached block (for dumps).
    pub fn blocks(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.map.keys().copied().collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuse_and_tail_first_eviction() {
        let mut c = BlockCache::new(6);
        let a = c.admit(&[1, 2, 3, 4]);
        assert_eq!(
            (a.hit_blocks, a.stored.as_slice(), a.removed.len()),
            (0, &[1, 2, 3, 4][..], 0)
        );
        let b = c.admit(&[1, 2, 5, 6]);
        assert_eq!((b.hit_blocks, b.stored.as_slice()), (2, &[5, 6][..]));
        // Full: the next chain evicts the least recent tail (4, then 3), not the shared head.
        let d = c.admit(&[1, 7, 8]);
        assert_eq!(d.hit_blocks, 1);
        assert_eq!(d.removed, [4, 3]);
        assert!(c.contains(1) && c.contains(2));
        assert_eq!(c.len(), 6);
    }

    #[test]
    fn chain_longer_than_cache() {
        let mut c = BlockCache::new(3);
        let a = c.admit(&[1, 2, 3, 4, 5]);
        assert_eq!(a.stored, [1, 2, 3]);
        assert!(a.removed.is_empty());
        assert_eq!(c.prefix_hits(&[1, 2, 3, 4, 5]), 3);
        assert_eq!(c.clear().len(), 3);
        assert!(c.is_empty());
    }
}
