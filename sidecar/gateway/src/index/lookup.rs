//! The lookup paths: the deepest prefix each live pod holds, by probing the chain with
//! `holders AND alive` — a linear walk for short chains, a binary search or a k-ary
//! search (probes batched per round) for long ones, the k-ary one optionally started from
//! the depth memo. Every path must agree with the linear walk (`tests/index_oracle.rs`
//! runs each, the memoized one cold and warm).

use super::memo::Depths;
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
        thread_local! {
            // The walk's scratch, reused: a lookup allocates only its answer.
            static RAW: std::cell::RefCell<Vec<(u8, u32)>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        RAW.with(|raw| {
            let Ok(mut raw) = raw.try_borrow_mut() else {
                return self.lookup_with(chain, &mut Vec::new()); // re-entered: not expected
            };
            self.lookup_with(chain, &mut raw)
        })
    }

    fn lookup_with(&self, chain: &[u64], raw: &mut Vec<(u8, u32)>) -> Vec<PodMatch> {
        loop {
            let stamp = self.owners_epoch.load(Ordering::Acquire);
            raw.clear();
            self.lookup_slots(chain, raw);
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
            Strategy::Kary => self.walk_kary(chain, alive, out, false),
            Strategy::Memo => self.walk_kary(chain, alive, out, true),
            Strategy::Auto { linear_max } if chain.len() <= linear_max => {
                self.walk_linear(chain, alive, out)
            }
            Strategy::Auto { .. } => self.walk_kary(chain, alive, out, true),
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

    /// k-ary search. With `memo`, a first block the memo knows is probed together with
    /// `d` and `d+1` for each remembered depth `d` (and the last block), which usually
    /// settles every pod in that one round; the depths found are remembered for the next
    /// chain starting with the same block.
    fn walk_kary(&self, chain: &[u64], alive: HostBitmap, out: &mut Vec<(u8, u32)>, memo: bool) {
        let n = chain.len() as u32;
        let Some(&h0) = chain.first() else { return };
        let mut keys = [0u64; KARY_BATCH];
        let mut pos = [0u32; KARY_BATCH];
        let mut got = [HostBitmap::EMPTY; KARY_BATCH];
        // A chain of up to KARY_BATCH + 1 blocks is settled in two rounds without the
        // memo (the first block, then every other position), so it gains nothing from a
        // guess that may be wrong.
        let seen = if memo && n as usize > KARY_BATCH + 1 {
            self.memo.get(h0)
        } else {
            None
        };
        let start = out.len();
        let mut work: Vec<(u32, u32, HostBitmap)> = Vec::new();
        let mut next = Vec::new();
        if let Some(depths) = seen {
            // One round: the first block with the remembered boundaries.
            keys[0] = h0;
            let mut k = 1;
            let mut want = [0u32; 2 * super::memo::DEPTHS + 1];
            let mut w = 0;
            for d in depths.iter() {
                for p in [d, d + 1] {
                    if p >= 2 && p <= n {
                        want[w] = p;
                        w += 1;
                    }
                }
            }
            want[w] = n;
            w += 1;
            let want = &mut want[..w];
            want.sort_unstable();
            for (i, &p) in want.iter().enumerate() {
                if i == 0 || p != want[i - 1] {
                    pos[k] = p;
                    keys[k] = chain[p as usize - 1];
                    k += 1;
                }
            }
            self.probe_batch(&keys[..k], &mut got[..k]);
            let c0 = got[0].and(alive);
            if c0.is_empty() {
                self.memo.put(h0, seen, Default::default());
                return;
            }
            split(1, n, c0, &pos[1..k], &got[1..k], &mut next, out);
        } else {
            // The first block alone: a miss (the common case for a new prompt) ends
            // after this one probe.
            let c0 = self.probe(h0, alive);
            if c0.is_empty() {
                return;
            }
            if n == 1 {
                emit(c0, 1, out);
                return;
            }
            // The first round's probes end on the last block, so full hits settle in it.
            let f = KARY_FANOUT.min(n as usize - 1);
            for j in 1..=f {
                pos[j - 1] = 1 + ((n as u64 - 1) * j as u64).div_ceil(f as u64) as u32;
                keys[j - 1] = chain[pos[j - 1] as usize - 1];
            }
            self.probe_batch(&keys[..f], &mut got[..f]);
            split(1, n, c0, &pos[..f], &got[..f], &mut next, out);
        }
        std::mem::swap(&mut work, &mut next);
        // Pods in `set` have depth in [lo, hi]; later rounds share the batch among the
        // open intervals, probing evenly spaced depths strictly inside each.
        let mut plan: Vec<(usize, usize)> = Vec::new(); // (first, count) in keys
        while !work.is_empty() {
            let fan = (KARY_BATCH / work.len()).clamp(1, KARY_FANOUT);
            let mut k = 0;
            plan.clear();
            for &(lo, hi, _) in &work {
                let w = hi - lo; // candidate depths above lo
                let f = (fan as u32).min(w).min((KARY_BATCH - k) as u32) as usize;
                let first = k;
                for j in 1..=f {
                    // Probing depth p means H(p-1).
                    let p = lo + ((w as u64 * j as u64) / (f as u64 + 1)) as u32 + 1;
                    pos[k] = p.min(hi);
                    keys[k] = chain[pos[k] as usize - 1];
                    k += 1;
                }
                plan.push((first, f));
            }
            self.probe_batch(&keys[..k], &mut got[..k]);
            next.clear();
            for (&(lo, hi, set), &(first, f)) in work.iter().zip(&plan) {
                let r = first..first + f;
                split(lo, hi, set, &pos[r.clone()], &got[r], &mut next, out);
            }
            std::mem::swap(&mut work, &mut next);
        }
        if memo && n as usize > KARY_BATCH + 1 {
            self.memo.put(
                h0,
                seen,
                Depths::deepest(out[start..].iter().map(|&(_, d)| d)),
            );
        }
    }
}

/// Narrow the pods of `set` (depths in [lo, hi]) by probes at increasing depths `pos`
/// (results `got`): a pod drops out at the first probe it does not hold, which bounds
/// its depth to the interval since the previous probe.
fn split(
    lo: u32,
    hi: u32,
    set: HostBitmap,
    pos: &[u32],
    got: &[HostBitmap],
    next: &mut Vec<(u32, u32, HostBitmap)>,
    out: &mut Vec<(u8, u32)>,
) {
    if pos.is_empty() {
        emit(set, lo, out);
        return;
    }
    let mut cur = set;
    let mut prev = lo;
    for (&p, &g) in pos.iter().zip(got) {
        let held = cur.and(g);
        let gone = cur.and_not(held);
        if !gone.is_empty() {
            push_interval(next, prev, p - 1, gone, out);
        }
        cur = held;
        prev = p;
        if cur.is_empty() {
            return;
        }
    }
    push_interval(next, prev, hi, cur, out);
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
