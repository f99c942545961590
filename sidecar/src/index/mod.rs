//! The block index of one model: which live pods hold which blocks — cache facts only;
//! decisions belong to the policy. No I/O and no async: the service, the simulator and
//! the benchmarks drive this same code.
//!
//! Shape (after Modular's cache-aware data layer; reasons in docs/architecture.md):
//! - pods of the model get a slot 0..=255 and a bit in a [`HostBitmap`];
//! - `block hash → holders` lives in 256 shards, each its own lock on its own cache line,
//!   the shard chosen by the high bits of `hash × 0x9E3779B97F4A7C15` (Fibonacci hashing);
//! - a lookup probes `index[Hi] AND alive` along the chain, by binary search over the
//!   chain for long chains (pods drop out at their first miss) or a linear walk for short
//!   ones;
//! - pod removal is two-phase: [`ModelIndex::retire`] clears the alive bit (O(1)); then
//!   [`ModelIndex::cleanup`] walks the shards in the background and frees the slot;
//! - tiers live per pod off the hot path ([`tiers`]).
//!
//! Concurrency: lookups take only shard read locks and one short read of the slot table.
//! Writers for one pod serialize on that pod's mutex (so two consumers of the same batch
//! converge), and hold the slot table's read lock one chunk at a time, so retiring a pod
//! (which takes the write lock) waits for at most one chunk, after which no write can be
//! attributed to that slot again. A slot is reused only after its cleanup has finished,
//! and every change of a slot's owner bumps `owners_epoch`, which a lookup validates
//! before it names pods: nothing stale is ever attributed to the next pod in a slot.

pub mod bitmap;
pub mod shard;
pub mod table;
pub mod tiers;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use hashbrown::HashMap;
use kvroute_shared::protocol::{Tier, TierHint};
use parking_lot::{Mutex, RwLock};

pub use bitmap::{AliveBitmap, HostBitmap, MAX_SLOTS};
use shard::{Change, KeyHasher, Shard};
use tiers::Tiers;

pub const SHARDS: usize = 256;
const FIB: u64 = 0x9E37_79B9_7F4A_7C15;
/// Blocks applied per hold of the slot table's read lock.
const CHUNK: usize = 256;
/// Table positions scanned per shard-lock hold during cleanup (4 KiB of slots).
const CLEANUP_SLICE: usize = 256;

#[inline]
pub fn shard_of(hash: u64) -> usize {
    (hash.wrapping_mul(FIB) >> 56) as usize
}

/// A shard on its own pair of cache lines (x86 prefetches lines in pairs), so two hot
/// shards never false-share.
#[repr(align(128))]
struct Padded<T>(T);

/// A pod's claim on a slot; stale once the slot is retired.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PodHandle {
    pub slot: u8,
    pub gen: u32,
}

/// A retired slot waiting for phase 2.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a retired slot is reused only after cleanup(); pass it to cleanup"]
pub struct Retired {
    pub slot: u8,
    pub gen: u32,
    pub pod: Arc<str>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexError {
    /// All 256 slots are taken (live or still being cleaned).
    Full { pod: String },
    /// The handle's slot has been retired since.
    Stale,
}

impl std::fmt::Display for IndexError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IndexError::Full { pod } => write!(
                f,
                "cannot add pod {pod}: the model already has {MAX_SLOTS} pods (live or being removed)"
            ),
            IndexError::Stale => f.write_str("pod handle is stale (the pod was removed or restarted)"),
        }
    }
}

impl std::error::Error for IndexError {}

#[derive(Clone, Debug)]
enum SlotState {
    Free,
    Live(Arc<str>),
    Draining,
}

struct SlotTable {
    by_name: std::collections::HashMap<Arc<str>, u8>,
    state: Vec<SlotState>,
    gen: Vec<u32>,
}

struct PodData {
    /// Entries holding this pod's bit (for metrics and tests).
    blocks: AtomicU64,
    /// The pod's writer lock and its tier exceptions.
    writer: Mutex<Tiers>,
}

/// How to walk the chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// Linear for chains up to `linear_max` blocks, binary search beyond.
    Auto {
        linear_max: usize,
    },
    Linear,
    Binary,
    /// k-ary search: each round probes several chain positions under one batch of shard
    /// locks, so their cache misses overlap instead of queueing one after another.
    Kary,
}

impl Default for Strategy {
    fn default() -> Self {
        // Chosen with `kvroute-bench index` (its strategy table): k-ary wins from two
        // blocks up (e.g. 0.43 vs 0.84 µs binary at 4 blocks, 2.3 vs 3.9 µs at 128).
        Strategy::Auto { linear_max: 1 }
    }
}

/// One pod's cached prefix of a chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodMatch {
    pub pod: Arc<str>,
    pub slot: u8,
    /// Blocks `H0..H(depth-1)` are held.
    pub depth: u32,
}

/// Counters a caller can export.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    pub entries: u64,
    pub heap_bytes: u64,
    pub live_pods: u32,
    pub draining_pods: u32,
    pub evicted: u64,
}

/// What applying some blocks did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub changed: u64,
    pub unchanged: u64,
}

pub struct ModelIndex {
    shards: Box<[Padded<RwLock<Shard>>]>,
    alive: AliveBitmap,
    owners_epoch: AtomicU64,
    slots: RwLock<SlotTable>,
    pods: Box<[PodData]>,
    /// Cap on entries per shard (the model cap / 256, rounded up).
    shard_cap: AtomicUsize,
    evicted: AtomicU64,
    strategy: RwLock<Strategy>,
}

impl ModelIndex {
    /// An empty index capped at about `max_blocks` entries.
    pub fn new(max_blocks: u64) -> ModelIndex {
        // A per-process random seed for the in-shard hasher (see shard::KeyHasher).
        let seed = std::collections::hash_map::RandomState::new();
        let seed = std::hash::BuildHasher::hash_one(&seed, 0x006b_7672_6f75_7465_u64);
        let hasher = KeyHasher::new(seed);
        ModelIndex {
            shards: (0..SHARDS)
                .map(|_| Padded(RwLock::new(Shard::new(hasher))))
                .collect(),
            alive: AliveBitmap::default(),
            owners_epoch: AtomicU64::new(0),
            slots: RwLock::new(SlotTable {
                by_name: Default::default(),
                state: vec![SlotState::Free; MAX_SLOTS],
                gen: vec![0; MAX_SLOTS],
            }),
            pods: (0..MAX_SLOTS)
                .map(|_| PodData {
                    blocks: AtomicU64::new(0),
                    writer: Mutex::new(Tiers::new(hasher)),
                })
                .collect(),
            shard_cap: AtomicUsize::new(Self::per_shard(max_blocks)),
            evicted: AtomicU64::new(0),
            strategy: RwLock::new(Strategy::default()),
        }
    }

    fn per_shard(max_blocks: u64) -> usize {
        (max_blocks.max(1) as usize).div_ceil(SHARDS)
    }

    pub fn set_max_blocks(&self, max_blocks: u64) {
        self.shard_cap
            .store(Self::per_shard(max_blocks), Ordering::Relaxed);
    }

    pub fn set_strategy(&self, s: Strategy) {
        *self.strategy.write() = s;
    }

    #[inline]
    fn shard(&self, hash: u64) -> &RwLock<Shard> {
        &self.shards[shard_of(hash)].0
    }

    // ---- pods -------------------------------------------------------------------------

    /// The pod's handle, giving it a slot if it has none. Idempotent.
    pub fn join(&self, pod: &str) -> Result<PodHandle, IndexError> {
        if let Some(h) = self.handle(pod) {
            return Ok(h);
        }
        let mut t = self.slots.write();
        if let Some(&slot) = t.by_name.get(pod) {
            return Ok(PodHandle {
                slot,
                gen: t.gen[slot as usize],
            });
        }
        let slot = t
            .state
            .iter()
            .position(|s| matches!(s, SlotState::Free))
            .ok_or_else(|| IndexError::Full {
                pod: pod.to_string(),
            })?;
        let name: Arc<str> = Arc::from(pod);
        t.gen[slot] = t.gen[slot].wrapping_add(1);
        t.state[slot] = SlotState::Live(name.clone());
        t.by_name.insert(name, slot as u8);
        // Owner changes are published under the write lock, before the pod can be found.
        self.owners_epoch.fetch_add(1, Ordering::AcqRel);
        self.alive.insert(slot as u8);
        Ok(PodHandle {
            slot: slot as u8,
            gen: t.gen[slot],
        })
    }

    pub fn handle(&self, pod: &str) -> Option<PodHandle> {
        let t = self.slots.read();
        t.by_name.get(pod).map(|&slot| PodHandle {
            slot,
            gen: t.gen[slot as usize],
        })
    }

    /// The O(1) heart of phase 1: clear the pod's alive bit (a CAS), under the slot
    /// table's read lock only, so it never waits for writers or readers to drain. Every
    /// lookup that starts afterwards excludes the pod. `retire` calls this first.
    pub fn flip(&self, pod: &str) -> Option<u8> {
        let t = self.slots.read();
        let slot = *t.by_name.get(pod)?;
        self.alive.remove(slot);
        Some(slot)
    }

    /// Phase 1 of removal: the pod vanishes from every lookup that starts after this
    /// returns. Its slot stays reserved until [`ModelIndex::cleanup`].
    pub fn retire(&self, pod: &str) -> Option<Retired> {
        self.flip(pod)?;
        let mut t = self.slots.write();
        let slot = t.by_name.remove(pod)?;
        self.alive.remove(slot);
        let SlotState::Live(name) =
            std::mem::replace(&mut t.state[slot as usize], SlotState::Draining)
        else {
            return None;
        };
        Some(Retired {
            slot,
            gen: t.gen[slot as usize],
            pod: name,
        })
    }

    /// Phase 2: clear the slot's bit in every shard, one shard lock at a time, drop its
    /// tier data, then free the slot. Returns the entries that held it.
    pub fn cleanup(&self, r: Retired) -> u64 {
        let mut cleared = 0;
        let mut emptied = Vec::new();
        for s in self.shards.iter() {
            // Bounded lock holds: clear bits a slice of the table at a time, then delete the
            // emptied entries a batch at a time. A resize between slices moves entries, so
            // the scan restarts (clearing is idempotent).
            let mut pos = Some(0);
            let mut layout = s.0.read().layout_gen();
            while let Some(from) = pos {
                let mut g = s.0.write();
                if g.layout_gen() != layout {
                    layout = g.layout_gen();
                    pos = Some(0);
                    continue;
                }
                let (c, next) = g.clear_slot_part(r.slot, from, CLEANUP_SLICE, &mut emptied);
                cleared += c;
                pos = next;
                drop(g);
                std::thread::yield_now();
            }
            for batch in emptied.chunks(CLEANUP_SLICE / 4) {
                let mut g = s.0.write();
                for &k in batch {
                    g.remove_if_empty(k);
                }
            }
            emptied.clear();
        }
        let pd = &self.pods[r.slot as usize];
        pd.writer.lock().clear();
        pd.blocks.store(0, Ordering::Relaxed);
        let mut t = self.slots.write();
        if t.gen[r.slot as usize] == r.gen {
            t.state[r.slot as usize] = SlotState::Free;
        }
        cleared
    }

    /// The engine restarted or dropped its cache: the pod keeps its name but its blocks
    /// are gone at once. It moves to a fresh slot (old one retired, to be cleaned); when
    /// no slot is free the old one is cleaned in place first.
    pub fn reset(&self, pod: &str) -> Result<(PodHandle, Option<Retired>), IndexError> {
        let retired = self.retire(pod);
        match self.join(pod) {
            Ok(h) => Ok((h, retired)),
            Err(IndexError::Full { .. }) if retired.is_some() => {
                if let Some(r) = retired {
                    self.cleanup(r);
                }
                Ok((self.join(pod)?, None))
            }
            Err(e) => Err(e),
        }
    }

    pub fn is_alive(&self, slot: u8) -> bool {
        self.alive.contains(slot)
    }

    pub fn pods(&self) -> Vec<(Arc<str>, PodHandle, u64)> {
        let t = self.slots.read();
        let mut v: Vec<_> = t
            .by_name
            .iter()
            .map(|(n, &s)| {
                let h = PodHandle {
                    slot: s,
                    gen: t.gen[s as usize],
                };
                (
                    n.clone(),
                    h,
                    self.pods[s as usize].blocks.load(Ordering::Relaxed),
                )
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Entries holding this pod's bit.
    pub fn pod_blocks(&self, h: PodHandle) -> u64 {
        self.pods[h.slot as usize].blocks.load(Ordering::Relaxed)
    }

    // ---- events -----------------------------------------------------------------------

    /// Blocks now held on `tier`. Idempotent.
    pub fn store(&self, h: PodHandle, tier: Tier, blocks: &[u64]) -> Result<Applied, IndexError> {
        self.write(h, blocks, |shard, tiers, key, slot| {
            let tb = tiers::bit(tier);
            match shard.store(key, slot) {
                Change::Added => {
                    tiers.set(key, tb);
                    Change::Added
                }
                Change::Unchanged => {
                    if tier != Tier::Gpu || !tiers.is_empty() {
                        let cur = tiers.of(key);
                        tiers.set(key, cur | tb);
                    }
                    Change::Unchanged
                }
                Change::Removed => Change::Unchanged,
            }
        })
    }

    /// Blocks evicted from `tier`; a block leaves the index when no tier holds it. Idempotent.
    pub fn remove(&self, h: PodHandle, tier: Tier, blocks: &[u64]) -> Result<Applied, IndexError> {
        self.write(h, blocks, |shard, tiers, key, slot| {
            let tb = tiers::bit(tier);
            if tiers.is_empty() {
                return if tier == Tier::Gpu {
                    shard.remove(key, slot)
                } else {
                    Change::Unchanged
                };
            }
            let cur = tiers.of(key);
            if cur & tb == 0 {
                return Change::Unchanged;
            }
            let left = cur & !tb;
            if left == 0 {
                tiers.forget(key);
                shard.remove(key, slot)
            } else {
                tiers.set(key, left);
                Change::Unchanged
            }
        })
    }

    fn write(
        &self,
        h: PodHandle,
        blocks: &[u64],
        mut op: impl FnMut(&mut Shard, &mut Tiers, u64, u8) -> Change,
    ) -> Result<Applied, IndexError> {
        let pd = &self.pods[h.slot as usize];
        let mut tiers = pd.writer.lock();
        let cap = self.shard_cap.load(Ordering::Relaxed);
        let mut out = Applied::default();
        for chunk in blocks.chunks(CHUNK) {
            let t = self.slots.read();
            if t.gen[h.slot as usize] != h.gen
                || !matches!(t.state[h.slot as usize], SlotState::Live(_))
            {
                return Err(IndexError::Stale);
            }
            // The pod's block count is settled once per chunk, not per block.
            let (mut added, mut removed) = (0u64, 0u64);
            for &key in chunk {
                let mut shard = self.shard(key).write();
                match op(&mut shard, &mut tiers, key, h.slot) {
                    Change::Added => {
                        added += 1;
                        if shard.len() > cap {
                            let n = shard.evict_to(cap, |holders| {
                                for s in holders.iter() {
                                    self.pods[s as usize].blocks.fetch_sub(1, Ordering::Relaxed);
                                }
                            });
                            self.evicted.fetch_add(n, Ordering::Relaxed);
                        }
                    }
                    Change::Removed => removed += 1,
                    Change::Unchanged => out.unchanged += 1,
                }
            }
            out.changed += added + removed;
            if added >= removed {
                pd.blocks.fetch_add(added - removed, Ordering::Relaxed);
            } else {
                pd.blocks.fetch_sub(removed - added, Ordering::Relaxed);
            }
        }
        Ok(out)
    }

    // ---- lookups ----------------------------------------------------------------------

    /// Pods holding `key`, masked by the alive set.
    #[inline]
    pub fn holders(&self, key: u64) -> HostBitmap {
        self.shard(key).read().get(key).and(self.alive.snapshot())
    }

    #[inline]
    fn probe(&self, key: u64, cands: HostBitmap) -> HostBitmap {
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
        let strategy = *self.strategy.read();
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
        // Round 0: the first and the last block. A miss ends here; a full hit is found.
        let mut got = [HostBitmap::EMPTY; KARY_BATCH];
        let first_last = [chain[0], chain[n as usize - 1]];
        self.probe_batch(&first_last, &mut got);
        let c0 = got[0].and(alive);
        if c0.is_empty() {
            return;
        }
        let full = got[1].and(c0);
        emit(full, n, out);
        let rest = c0.and_not(full);
        if rest.is_empty() || n == 1 {
            return;
        }
        // Pods in `set` have depth in [lo, hi].
        let mut work: Vec<(u32, u32, HostBitmap)> = vec![(1, n - 1, rest)];
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
                    // Evenly spaced depths in (lo, hi]; probing depth p means H(p-1).
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
        }
    }

    /// Where the pod's first `depth` blocks of `chain` live (asked for the winner only).
    pub fn tier_hint(&self, slot: u8, chain: &[u64], depth: u32) -> TierHint {
        let blocks = &chain[..(depth as usize).min(chain.len())];
        self.pods[slot as usize].writer.lock().hint(blocks)
    }

    pub fn stats(&self) -> IndexStats {
        let mut s = IndexStats::default();
        for sh in self.shards.iter() {
            let g = sh.0.read();
            s.entries += g.len() as u64;
            s.heap_bytes += g.heap_bytes() as u64;
        }
        for p in self.pods.iter() {
            s.heap_bytes += p.writer.lock().heap_bytes() as u64;
        }
        s.heap_bytes += (SHARDS * std::mem::size_of::<Padded<RwLock<Shard>>>()) as u64;
        let t = self.slots.read();
        for st in &t.state {
            match st {
                SlotState::Live(_) => s.live_pods += 1,
                SlotState::Draining => s.draining_pods += 1,
                SlotState::Free => {}
            }
        }
        s.evicted = self.evicted.load(Ordering::Relaxed);
        s
    }

    /// Every block held by the pod (for dumps, resync checks and tests). O(index size).
    pub fn blocks_of(&self, h: PodHandle) -> Vec<u64> {
        let mut v = Vec::new();
        for sh in self.shards.iter() {
            sh.0.read().for_each(|k, b| {
                if b.contains(h.slot) {
                    v.push(k);
                }
            });
        }
        v.sort_unstable();
        v
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

/// Indexes of all models, created on first use.
#[derive(Default)]
pub struct Indexes {
    by_model: RwLock<HashMap<String, Arc<ModelIndex>>>,
}

impl Indexes {
    pub fn get(&self, model: &str) -> Option<Arc<ModelIndex>> {
        self.by_model.read().get(model).cloned()
    }

    pub fn get_or_create(&self, model: &str, max_blocks: u64) -> Arc<ModelIndex> {
        if let Some(i) = self.get(model) {
            return i;
        }
        self.by_model
            .write()
            .entry(model.to_string())
            .or_insert_with(|| Arc::new(ModelIndex::new(max_blocks)))
            .clone()
    }

    pub fn all(&self) -> Vec<(String, Arc<ModelIndex>)> {
        let mut v: Vec<_> = self
            .by_model
            .read()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

#[cfg(test)]
mod tests;
