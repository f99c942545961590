//! The lookup paths: the deepest prefix each live pod holds, by probing the chain with
//! `holders AND alive` — a linear walk for short chains, a binary search or a k-ary
//! search (probes batched per round) for long ones. Every path must agree with the
//! linear walk (`tests/index_oracle.rs`).

use super::*;

#[cfg(test)]
thread_local! {
    /// Table probes made by this thread (tests count them).
    pub(super) static PROBES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

#[inline]
fn count_probes(_n: usize) {
    #[cfg(test)]
    PROBES.with(|p| p.set(p.get() + _n as u64));
}

impl ModelIndex {
    /// Pods holding `key`, masked by the alive set.
    #[inline]
    pub fn holders(&self, key: u64) -> HostBitmap {
        self.shard(key).read().get(key).and(self.alive.snapshot())
    }

    #[inline]
    fn probe(&self, key: u64, cands: HostBitmap) -> HostBitmap {
        count_probes(1);
        self.shard(key).read().get(key).and(cands)
    }

    /// Every live pod with a non-empty cached prefix of `chain`, deepest first (ties by
    /// slot). See [`ModelIndex::lookup_slots`] for the depth semantics.
    pub fn lookup(&self, chain: &[u64]) -> Vec<PodMatch> {
        let mut raw = Vec::new();
        loop {
            let stamp = self.owners_epoch.load(Ordering::Acquire);
            raw.clear();
            self.lookup_slots(chain, &mut raw);
            if raw.is_empty() {
                return Vec::new(); // a miss names nobody: no slot table to read
            }
            let t = self.slots.read();
            if self.owners_epoch.load(Ordering::Acquire) != stamp {
                continue; // a slot changed owner mid-lookup: its bits may be the old pod's
            }
            let alive = self.alive.snapshot();
            return raw
                .iter()
                .filter(|(s, _)| alive.contains(*s))
                .filter_map(|&(slot, depth)| match &t.state[slot as usize] {
                    SlotState::Live(name) => Some(PodMatch {
                        pod: name.clone(),
                        slot,
                        depth,
                    }),
                    _ => None,
                })
                .collect();
        }
    }

    /// `(slot, depth)` of every live pod with depth > 0, deepest first.
    ///
    /// Depth is the largest k such that the pod holds `H0..H(k-1)`. The linear walk
    /// computes exactly that. Binary search assumes residency is prefix-closed (a pod
    /// holding `Hi` holds every earlier block, which the chain makes true of engines that
    /// evict tail-first); when it is not, it returns some k ≥ the exact depth such that
    /// the pod holds `H(k-1)` and not `Hk` — never less than the exact answer, and never
    /// a k at which the pod does not hold the last matched block.
    pub fn lookup_slots(&self, chain: &[u64], out: &mut Vec<(u8, u32)>) {
        let strategy = Strategy::decode(self.strategy.load(Ordering::Relaxed));
        let alive = self.alive.snapshot();
        let start = out.len();
        match strategy {
            Strategy::Linear => self.walk_linear(chain, alive, out),
            Strategy::Binary => self.walk_binary(chain, alive, out),
            Strategy::Kary => self.walk_kary(chain, alive, out),
            Strategy::Auto { linear_max } if chain.len() <= linear_max => {
                self.walk_linear(chain, alive, out)
            }
            Strategy::Auto { .. } => self.walk_kary(chain, alive, out),
        }
        out[start..].sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    }

    fn walk_linear(&self, chain: &[u64], alive: HostBitmap, out: &mut Vec<(u8, u32)>) {
        let mut cands = alive;
        for (i, &h) in chain.iter().enumerate() {
            let still = self.probe(h, cands);
            if i > 0 {
                emit(cands.and_not(still), i as u32, out);
            }
            cands = still;
            if cands.is_empty() {
                return;
            }
        }
        emit(cands, chain.len() as u32, out);
    }

    fn walk_binary(&self, chain: &[u64], alive: HostBitmap, out: &mut Vec<(u8, u32)>) {
        let Some(&h0) = chain.first() else { return };
        let c0 = self.probe(h0, alive);
        if c0.is_empty() {
            return; // the common miss costs one probe
        }
        // Depth-first over (lo, hi, pods whose depth is in [lo, hi]); at most one pending
        // entry per halving, so a fixed stack suffices.
        let mut stack: [(u32, u32, HostBitmap); 66] = [(0, 0, HostBitmap::EMPTY); 66];
        let mut sp = 0;
        stack[sp] = (1, chain.len() as u32, c0);
        sp += 1;
        while sp > 0 {
            sp -= 1;
            let (lo, hi, set) = stack[sp];
            if lo == hi {
                emit(set, lo, out);
                continue;
            }
            let mid = lo + (hi - lo).div_ceil(2);
            let held = self.probe(chain[mid as usize - 1], set);
            let short = set.and_not(held);
            if !short.is_empty() {
                stack[sp] = (lo, mid - 1, short);
                sp += 1;
            }
            if !held.is_empty() {
                stack[sp] = (mid, hi, held);
                sp += 1;
            }
        }
    }

    /// Probe several keys at once: take every shard lock first, then read every entry, so
    /// the reads (each one or two cache misses on a large index) are independent loads the
    /// CPU can overlap; a lock per probe would serialize them (a locked instruction is a
    /// full barrier on x86).
    fn probe_batch(&self, keys: &[u64], out: &mut [HostBitmap]) {
        count_probes(keys.len());
        // read_recursive: the same shard may appear twice in a batch, and a plain read
        // lock taken twice can deadlock behind a waiting writer.
        let guards: [Option<parking_lot::RwLockReadGuard<'_, Shard>>; KARY_BATCH] =
            std::array::from_fn(|i| keys.get(i).map(|k| self.shard(*k).read_recursive()));
        for (g, k) in guards.iter().zip(keys) {
            if let Some(g) = g {
                g.prefetch(*k);
            }
        }
        for ((g, k), o) in guards.iter().zip(keys).zip(out.iter_mut()) {
            if let Some(g) = g {
                *o = g.get(*k);
            }
        }
    }

    fn walk_kary(&self, chain: &[u64], alive: HostBitmap, out: &mut Vec<(u8, u32)>) {
        let n = chain.len() as u32;
        if n == 0 {
            return;
        }
        // Round 0: the first block alone. A miss (the common case for a new prompt) ends
        // after this one probe.
        let c0 = self.probe(chain[0], alive);
        if c0.is_empty() {
            return;
        }
        if n == 1 {
            emit(c0, 1, out);
            return;
        }
        let mut got = [HostBitmap::EMPTY; KARY_BATCH];
        let rest = c0;
        // Pods in `set` have depth in [lo, hi]. The first round's probes include the last
        // block, so full hits are found in it.
        let mut work: Vec<(u32, u32, HostBitmap)> = vec![(1, n, rest)];
        let mut first_round = true;
        let mut next = Vec::new();
        let mut keys = [0u64; KARY_BATCH];
        let mut pos = [0u32; KARY_BATCH];
        while !work.is_empty() {
            // Share the batch among the open intervals.
            let fan = (KARY_BATCH / work.len()).clamp(1, KARY_FANOUT);
            let mut k = 0;
            let mut plan: Vec<(usize, usize)> = Vec::with_capacity(work.len()); // (first, count) in keys
            for &(lo, hi, _) in &work {
                let w = hi - lo; // candidate depths above lo
                let f = (fan as u32).min(w).min((KARY_BATCH - k) as u32) as usize;
                let first = k;
                for j in 1..=f {
                    // Evenly spaced depths in (lo, hi] (the first round ends on hi);
                    // probing depth p means H(p-1).
                    let p = if first_round {
                        lo + (w as u64 * j as u64).div_ceil(f as u64) as u32
                    } else {
                        lo + ((w as u64 * j as u64) / (f as u64 + 1)) as u32 + 1
                    };
                    pos[k] = p.min(hi);
                    keys[k] = chain[pos[k] as usize - 1];
                    k += 1;
                }
                plan.push((first, f));
            }
            self.probe_batch(&keys[..k], &mut got[..k]);
            next.clear();
            for (&(lo, hi, set), &(first, f)) in work.iter().zip(&plan) {
                if f == 0 {
                    emit(set, lo, out);
                    continue;
                }
                let mut cur = set;
                let mut prev = lo;
                for j in first..first + f {
                    let held = cur.and(got[j]);
                    let gone = cur.and_not(held);
                    if !gone.is_empty() {
                        push_interval(&mut next, prev, pos[j] - 1, gone, out);
                    }
                    cur = held;
                    prev = pos[j];
                    if cur.is_empty() {
                        break;
                    }
                }
                if !cur.is_empty() {
                    push_interval(&mut next, prev, hi, cur, out);
                }
            }
            std::mem::swap(&mut work, &mut next);
            first_round = false;
        }
    }
}

const KARY_BATCH: usize = 16;
const KARY_FANOUT: usize = 8;

fn push_interval(
    next: &mut Vec<(u32, u32, HostBitmap)>,
    lo: u32,
    hi: u32,
    set: HostBitmap,
    out: &mut Vec<(u8, u32)>,
) {
    if lo >= hi {
        emit(set, lo, out);
    } else {
        next.push((lo, hi, set));
    }
}

#[inline]
fn emit(set: HostBitmap, depth: u32, out: &mut Vec<(u8, u32)>) {
    if depth == 0 {
        return;
    }
    for s in set.iter() {
        out.push((s, depth));
    }
}
