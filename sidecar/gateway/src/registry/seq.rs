//! Which sequence numbers of a pod's current epoch were applied, beyond the highest
//! (`Pod::last_seq`): the ranges a forward jump skipped (holes), and the digests of the
//! batches applied most recently. Together they keep one rule: **no batch makes a later
//! real batch look like a duplicate.**
//!
//! - A batch below the highest seq that falls in a hole is a late or real batch. If no
//!   later batch was applied since the pod's blocks were last rebuilt, it is applied (the
//!   engine going on after a forged jump); otherwise the index already reflects later
//!   events, so applying it out of order could bring back what they removed: it is not
//!   applied and the pod is recovered as after a gap (one recovery per late batch; the
//!   next ones apply in order).
//! - One whose seq was applied with the same digest is a duplicate: dropped.
//! - One whose seq was applied with another digest is a conflict (two batches claim
//!   one place in the stream, so one of them is forged or the engine restarted without a
//!   new epoch): the pod is recovered as after a gap, and the batch applied.
//! - Below both (older than [`WINDOW`] applied batches, and in no hole): a stale
//!   redelivery, dropped.
//!
//! Bounded per pod: [`MAX_HOLES`] ranges and [`WINDOW`] digests (~1.3 KB).

use std::collections::VecDeque;

/// Skipped ranges remembered per pod; beyond, the oldest is given up (its batches, if
/// they ever come, are dropped as stale; the gap that made it was already recovered).
pub const MAX_HOLES: usize = 16;
/// Digests of the last applied batches kept per pod.
pub const WINDOW: usize = 64;

/// How a batch at or below the pod's highest seq stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Behind {
    /// Its seq was skipped by a jump, and nothing later has been applied since the
    /// pod's blocks were last rebuilt: apply it.
    FillsHole,
    /// Its seq was skipped, but later batches are already applied: out of order.
    Late,
    Duplicate,
    /// Its seq was applied with other content.
    Conflict,
}

#[derive(Clone, Debug, Default)]
pub struct SeqWindow {
    /// Inclusive, disjoint, in the order made.
    holes: Vec<(u64, u64)>,
    /// `(seq, digest)` of applied batches, oldest first.
    applied: VecDeque<(u64, u64)>,
    /// The highest seq applied since the pod's blocks were last rebuilt.
    top_since_rebuild: Option<u64>,
}

impl SeqWindow {
    /// A new epoch: nothing of the old one counts.
    pub fn clear(&mut self) {
        self.holes.clear();
        self.applied.clear();
        self.top_since_rebuild = None;
    }

    /// The pod's blocks are being rebuilt (dropped, or replaced by a dump): what was
    /// applied before no longer stands in the way of a late batch.
    pub fn rebuilt(&mut self) {
        self.top_since_rebuild = None;
    }

    /// A batch at `seq` with `digest` was applied.
    pub fn applied(&mut self, seq: u64, digest: u64) {
        if let Some(e) = self.applied.iter_mut().find(|(s, _)| *s == seq) {
            e.1 = digest;
            return;
        }
        if self.applied.len() >= WINDOW {
            self.applied.pop_front();
        }
        self.applied.push_back((seq, digest));
        self.top_since_rebuild = Some(self.top_since_rebuild.map_or(seq, |t| t.max(seq)));
    }

    /// A jump skipped `from..=to`.
    pub fn skipped(&mut self, from: u64, to: u64) {
        if from > to {
            return;
        }
        if self.holes.len() >= MAX_HOLES {
            self.holes.remove(0);
        }
        self.holes.push((from, to));
    }

    /// Judge a batch at or below the highest seq; a hole it fills is filled.
    pub fn behind(&mut self, seq: u64, digest: u64) -> Behind {
        if let Some(i) = self.holes.iter().position(|&(a, b)| (a..=b).contains(&seq)) {
            let (a, b) = self.holes.remove(i);
            if a < seq {
                self.holes.push((a, seq - 1));
            }
            if seq < b {
                self.holes.push((seq + 1, b));
            }
            // Filling every other seq of a hole splits it each time: still bounded.
            while self.holes.len() > MAX_HOLES {
                self.holes.remove(0);
            }
            if self.top_since_rebuild.is_some_and(|t| t > seq) {
                return Behind::Late;
            }
            return Behind::FillsHole;
        }
        match self.applied.iter().find(|(s, _)| *s == seq) {
            Some(&(_, d)) if d != digest => Behind::Conflict,
            _ => Behind::Duplicate,
        }
    }

    /// A dump taken at `seq` covers everything up to it: batches from there down are
    /// older than the snapshot and must not be applied over it.
    pub fn covered_through(&mut self, seq: u64) {
        self.holes.retain_mut(|(a, b)| {
            *a = (*a).max(seq.saturating_add(1));
            *a <= *b
        });
    }

    #[cfg(test)]
    pub fn holes(&self) -> usize {
        self.holes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_per_pod_and_holes_split_as_they_fill() {
        let mut w = SeqWindow::default();
        for i in 0..100u64 {
            w.skipped(i * 10, i * 10 + 5);
            w.applied(i * 10 + 6, i);
        }
        assert_eq!(w.holes(), MAX_HOLES);
        assert_eq!(w.applied.len(), WINDOW);
        let last = 99 * 10;
        assert_eq!(
            w.behind(last + 2, 0),
            Behind::Late,
            "later batches were applied"
        );
        assert_eq!(w.holes(), MAX_HOLES, "split in two, the oldest given up");
        assert_eq!(w.behind(last + 2, 0), Behind::Duplicate, "filled once");
        assert_eq!(w.behind(last + 6, 99), Behind::Duplicate);
        assert_eq!(w.behind(last + 6, 7), Behind::Conflict);
        w.covered_through(last + 3);
        w.rebuilt();
        assert_eq!(
            w.behind(last + 1, 0),
            Behind::Duplicate,
            "older than the dump"
        );
        assert_eq!(
            w.behind(last + 4, 0),
            Behind::FillsHole,
            "nothing later since"
        );
    }
}
