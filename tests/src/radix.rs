//! The comparison baseline for `kvroute-bench`: an honest radix-tree index in the style of
//! Dynamo's RadixTree — one node per block, children by block hash, a pod set per node,
//! and a per-pod `block → node` table for removals. Lookups walk from the root scoring
//! every pod on each matched node, as Dynamo's `find_matches` does.

use std::collections::{HashMap, HashSet};

struct Node {
    children: HashMap<u64, u32>,
    pods: HashSet<u16>,
    parent: u32,
    hash: u64,
}

pub struct RadixIndex {
    nodes: Vec<Node>,
    free: Vec<u32>,
    /// Per pod: block hash → node.
    lookup: HashMap<u16, HashMap<u64, u32>>,
}

const ROOT: u32 = 0;

impl Default for RadixIndex {
    fn default() -> Self {
        RadixIndex {
            nodes: vec![Node {
                children: HashMap::new(),
                pods: HashSet::new(),
                parent: u32::MAX,
                hash: 0,
            }],
            free: Vec::new(),
            lookup: HashMap::new(),
        }
    }
}

impl RadixIndex {
    /// `blocks` are stored on `pod` after `parent` (None: at the root).
    pub fn store(&mut self, pod: u16, parent: Option<u64>, blocks: &[u64]) {
        let mut cur = match parent {
            None => ROOT,
            Some(p) => match self.lookup.get(&pod).and_then(|m| m.get(&p)) {
                Some(&n) => n,
                None => return, // unknown parent: Dynamo drops the event too
            },
        };
        for &b in blocks {
            let next = match self.nodes[cur as usize].children.get(&b) {
                Some(&n) => n,
                None => {
                    let node = Node {
                        children: HashMap::new(),
                        pods: HashSet::new(),
                        parent: cur,
                        hash: b,
                    };
                    let n = match self.free.pop() {
                        Some(i) => {
                            self.nodes[i as usize] = node;
                            i
                        }
                        None => {
                            self.nodes.push(node);
                            (self.nodes.len() - 1) as u32
                        }
                    };
                    self.nodes[cur as usize].children.insert(b, n);
                    n
                }
            };
            self.nodes[next as usize].pods.insert(pod);
            self.lookup.entry(pod).or_default().insert(b, next);
            cur = next;
        }
    }

    pub fn remove(&mut self, pod: u16, blocks: &[u64]) {
        for b in blocks {
            let Some(n) = self.lookup.get_mut(&pod).and_then(|m| m.remove(b)) else {
                continue;
            };
            self.nodes[n as usize].pods.remove(&pod);
            // Prune empty leaves upward.
            let mut cur = n;
            while cur != ROOT
                && self.nodes[cur as usize].pods.is_empty()
                && self.nodes[cur as usize].children.is_empty()
            {
                let parent = self.nodes[cur as usize].parent;
                let hash = self.nodes[cur as usize].hash;
                self.nodes[parent as usize].children.remove(&hash);
                self.free.push(cur);
                cur = parent;
            }
        }
    }

    /// Per pod, how many leading blocks of `chain` it holds (Dynamo's overlap scores).
    pub fn find_matches(&self, chain: &[u64]) -> HashMap<u16, u32> {
        let mut scores: HashMap<u16, u32> = HashMap::new();
        let mut cur = ROOT;
        for (i, b) in chain.iter().enumerate() {
            let Some(&n) = self.nodes[cur as usize].children.get(b) else {
                break;
            };
            let node = &self.nodes[n as usize];
            if node.pods.is_empty() {
                break;
            }
            for p in &node.pods {
                let s = scores.entry(*p).or_insert(0);
                if *s == i as u32 {
                    *s += 1;
                }
            }
            cur = n;
        }
        scores.retain(|_, s| *s > 0);
        scores
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_and_prunes() {
        let mut r = RadixIndex::default();
        r.store(1, None, &[10, 11, 12]);
        r.store(2, None, &[10, 11]);
        r.store(2, Some(11), &[20]);
        let m = r.find_matches(&[10, 11, 12]);
        assert_eq!((m[&1], m[&2]), (3, 2));
        r.remove(1, &[12, 11]);
        let m = r.find_matches(&[10, 11, 12]);
        assert_eq!((m[&1], m[&2]), (1, 2));
        r.remove(2, &[20, 11, 10]);
        r.remove(1, &[10]);
        assert!(r.find_matches(&[10]).is_empty());
        assert_eq!(r.nodes[0].children.len(), 0, "pruned to the root");
    }
}
