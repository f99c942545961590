//! The block index of one model: which live pods hold which blocks — cache facts only;
//! decisions belong to the policy. No I/O and no async: the service, the simulator and
//! the benchmarks drive this same code.
//!
//! Shape (after Modular's cache-aware data layer; reasons in docs/architecture.md):
//! - pods of the model get a slot 0..=255 and a bit in a [`HostBitmap`];
//! - `block hash → holders` lives in 256 shards, each its own lock on its own cache line,
//!   the shard chosen by the high bits of `hash × 0x9E3779B97F4A7C15` (Fibonacci hashing);
//! - a lookup probes `index[Hi] AND alive` along the chain: the first block alone (a
//!   miss ends there, after one probe, usually answered by the table's cache-resident
//!   tag bytes without touching DRAM), then a k-ary search whose rounds probe several
//!   positions under one batch of shard locks, so their cache misses overlap (pods drop
//!   out at their first miss); a chain whose first block was seen recently starts from
//!   the depths found then (`memo`), probed with the first block in one round; binary
//!   search and a linear walk are kept as strategies and as the oracle;
//! - pod removal is two-phase: [`ModelIndex::retire`] clears the alive bit (O(1)); then
//!   [`ModelIndex::cleanup`] walks the shards in the background and frees the slot;
//! - tiers live per pod off the hot path (`tiers`).
//!
//! Files by job: `slots` (join, retire, cleanup, reset), `write` (store/remove),
//! `lookup` (the walks), `memo` (the depth memo), `shard`/`table` (one shard's
//! open-addressing table), `bitmap`.
//!
//! Concurrency: lookups take only shard read locks and one short read of the slot table.
//! Writers for one pod serialize on that pod's mutex (so two consumers of the same batch
//! converge), and hold the slot table's read lock one chunk at a time, so retiring a pod
//! (which takes the write lock) waits for at most one chunk, after which no write can be
//! attributed to that slot again. A slot is reused only after its cleanup has finished,
//! and every change of a slot's owner bumps `owners_epoch`, which a lookup validates
//! before it names pods: nothing stale is ever attributed to the next pod in a slot.

pub mod bitmap;
mod lookup;
mod memo;
mod shard;
mod slots;
mod table;
mod tiers;
mod write;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use hashbrown::HashMap;
use kvroute_shared::protocol::TierHint;
use parking_lot::{Mutex, RwLock};

pub use bitmap::{AliveBitmap, HostBitmap, MAX_SLOTS};
use shard::{Change, Shard};
pub use table::KeyHasher;
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

/// A reset found no free slot: the pod is out of every lookup, with no slot, until one
/// frees and it joins again. Its old slot (if it had one) still needs phase 2.
#[derive(Debug)]
#[must_use = "the retired slot must be passed to cleanup"]
pub struct Unslotted {
    pub retired: Option<Retired>,
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
    /// Linear for chains up to `linear_max` blocks, the memoized k-ary search beyond.
    Auto {
        linear_max: usize,
    },
    Linear,
    Binary,
    /// k-ary search: each round probes several chain positions under one batch of shard
    /// locks, so their cache misses overlap instead of queueing one after another.
    Kary,
    /// k-ary search whose first round probes where the last lookup of a chain with the
    /// same first block found its pods' prefixes ending (`memo`).
    Memo,
}

impl Strategy {
    /// As one word, so a lookup reads the strategy without a lock.
    fn encode(self) -> u64 {
        match self {
            Strategy::Linear => 0,
            Strategy::Binary => 1,
            Strategy::Kary => 2,
            Strategy::Memo => 3,
            Strategy::Auto { linear_max } => 4 + linear_max as u64,
        }
    }

    fn decode(v: u64) -> Strategy {
        match v {
            0 => Strategy::Linear,
            1 => Strategy::Binary,
            2 => Strategy::Kary,
            3 => Strategy::Memo,
            n => Strategy::Auto {
                linear_max: (n - 4) as usize,
            },
        }
    }
}

impl Default for Strategy {
    fn default() -> Self {
        // Chosen with `kvroute-bench index` (its strategy table): k-ary wins from two
        // blocks up, and starting it from the memo's depths takes a repeated 128-block
        // chain from 1.4 µs to 0.36 µs (binary 1.85 µs, linear 12 µs).
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
    /// New blocks of a pod over its share of a full index that were not indexed.
    pub over_share: u64,
    /// Entries the index may hold now: its configured cap or its share of the budget.
    pub max_blocks: u64,
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
    /// Cap on entries per shard: the smaller of `configured` and `share`, / 256.
    shard_cap: AtomicUsize,
    /// The model's `max_blocks` from the policy.
    configured: AtomicU64,
    /// This index's share of its [`Indexes`]' budget.
    share: AtomicU64,
    evicted: AtomicU64,
    over_share: AtomicU64,
    strategy: AtomicU64,
    memo: memo::DepthMemo,
}

impl ModelIndex {
    /// An empty index capped at about `max_blocks` entries.
    pub fn new(max_blocks: u64) -> ModelIndex {
        // A per-process random seed for the in-shard hasher (see table::KeyHasher).
        let seed = std::collections::hash_map::RandomState::new();
        let seed = std::hash::BuildHasher::hash_one(&seed, 0x006b_7672_6f75_7465_u64);
        let hasher = KeyHasher::new(seed);
        ModelIndex {
            shards: (0..SHARDS)
                .map(|_| Padded(RwLock::new(Shard::new(hasher.clone()))))
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
                    writer: Mutex::new(Tiers::new(hasher.clone())),
                })
                .collect(),
            shard_cap: AtomicUsize::new(Self::per_shard(max_blocks)),
            configured: AtomicU64::new(max_blocks),
            share: AtomicU64::new(u64::MAX),
            evicted: AtomicU64::new(0),
            over_share: AtomicU64::new(0),
            strategy: AtomicU64::new(Strategy::default().encode()),
            memo: Default::default(),
        }
    }

    fn per_shard(max_blocks: u64) -> usize {
        (max_blocks.max(1) as usize).div_ceil(SHARDS)
    }

    /// The model's cap from the policy; the index holds the smaller of it and its share.
    pub fn set_max_blocks(&self, max_blocks: u64) {
        self.configured.store(max_blocks, Ordering::Relaxed);
        self.settle_cap();
    }

    /// This index's share of the budget of all models' indexes ([`Indexes::set_budget`]).
    fn set_share(&self, share: u64) {
        self.share.store(share, Ordering::Relaxed);
        self.settle_cap();
    }

    fn settle_cap(&self) {
        self.shard_cap
            .store(Self::per_shard(self.max_blocks()), Ordering::Relaxed);
    }

    /// Entries this index may hold now.
    pub fn max_blocks(&self) -> u64 {
        let c = self.configured.load(Ordering::Relaxed);
        c.min(self.share.load(Ordering::Relaxed))
    }

    /// Evict every shard down to its cap (after the cap shrank: a new model took its
    /// share of the budget, or the policy lowered it); an insert evicts only its own
    /// shard. One shard lock at a time. Returns the entries evicted.
    pub fn trim(&self) -> u64 {
        let cap = self.shard_cap.load(Ordering::Relaxed);
        let mut n = 0;
        for sh in self.shards.iter() {
            if sh.0.read().len() <= cap {
                continue;
            }
            let mut g = sh.0.write();
            n += g.evict_to(cap, |holders| {
                for s in holders.iter() {
                    self.pods[s as usize].blocks.fetch_sub(1, Ordering::Relaxed);
                }
            });
            g.shrink_to(cap);
        }
        self.evicted.fetch_add(n, Ordering::Relaxed);
        self.prune_tiers();
        n
    }

    /// Drop tier exceptions of blocks that left the index by eviction (an eviction holds
    /// one shard lock and may not take the holders' writer locks, which come first).
    /// O(tier exceptions): most blocks are on the GPU and have none.
    fn prune_tiers(&self) {
        for (slot, pd) in self.pods.iter().enumerate() {
            let mut tiers = pd.writer.lock();
            if tiers.is_empty() {
                continue;
            }
            tiers.retain(|key| self.shard(key).read().get(key).contains(slot as u8));
        }
    }

    pub fn set_strategy(&self, s: Strategy) {
        self.strategy.store(s.encode(), Ordering::Relaxed);
    }

    #[inline]
    fn shard(&self, hash: u64) -> &RwLock<Shard> {
        &self.shards[shard_of(hash)].0
    }

    // ---- pods -------------------------------------------------------------------------

    /// Where the pod's first `depth` blocks of `chain` live (asked for the winner only).
    pub fn tier_hint(&self, slot: u8, chain: &[u64], depth: u32) -> TierHint {
        let blocks = &chain[..(depth as usize).min(chain.len())];
        self.pods[slot as usize].writer.lock().hint(blocks)
    }

    /// How many of a pod's blocks sit on each tier (status page; O(tier exceptions)).
    pub fn tier_counts(&self, h: PodHandle) -> TierHint {
        let held = self.pod_blocks(h);
        self.pods[h.slot as usize].writer.lock().counts(held)
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
        s.heap_bytes += self.memo.heap_bytes() as u64;
        let t = self.slots.read();
        for st in &t.state {
            match st {
                SlotState::Live(_) => s.live_pods += 1,
                SlotState::Draining => s.draining_pods += 1,
                SlotState::Free => {}
            }
        }
        s.evicted = self.evicted.load(Ordering::Relaxed);
        s.over_share = self.over_share.load(Ordering::Relaxed);
        s.max_blocks = self.max_blocks();
        s
    }
}

/// Heap bytes an index entry is allowed at its cap, for turning a budget in bytes into
/// entries: the table's 17-byte slot at its lowest load after growing (~2x), the CLOCK
/// ring's 8 bytes with its slack, the holders slab and tier exceptions; `fill_to_budget`
/// (index/tests.rs) checks a full index's heap against it.
pub const BUDGET_BYTES_PER_ENTRY: u64 = 64;

/// Indexes of all models, created on first use, within one budget of entries: each
/// model holds at most the budget / the models indexed (and its own configured cap), so
/// many models under their caps cannot add up past it.
pub struct Indexes {
    by_model: RwLock<HashMap<String, Arc<ModelIndex>>>,
    budget: AtomicU64,
}

impl Default for Indexes {
    fn default() -> Indexes {
        Indexes {
            by_model: RwLock::default(),
            budget: AtomicU64::new(u64::MAX),
        }
    }
}

impl Indexes {
    /// The entries all models together may hold (`--max-index-mb`).
    pub fn set_budget(&self, entries: u64) {
        self.budget.store(entries.max(1), Ordering::Relaxed);
        self.rebalance(&self.by_model.read());
    }

    pub fn budget(&self) -> u64 {
        self.budget.load(Ordering::Relaxed)
    }

    fn rebalance(&self, m: &HashMap<String, Arc<ModelIndex>>) {
        let share = self.budget() / (m.len().max(1) as u64);
        for ix in m.values() {
            ix.set_share(share);
        }
    }

    /// Heap bytes every model's index holds.
    pub fn heap_bytes(&self) -> u64 {
        self.all().iter().map(|(_, ix)| ix.stats().heap_bytes).sum()
    }

    /// Evict every model down to its cap (the cleaner's tick). Returns the entries evicted.
    pub fn trim(&self) -> u64 {
        self.all().iter().map(|(_, ix)| ix.trim()).sum()
    }

    fn create(
        &self,
        m: &mut HashMap<String, Arc<ModelIndex>>,
        model: &str,
        max_blocks: u64,
    ) -> Arc<ModelIndex> {
        if let Some(i) = m.get(model) {
            return i.clone();
        }
        let ix = Arc::new(ModelIndex::new(max_blocks));
        m.insert(model.to_string(), ix.clone());
        self.rebalance(m);
        ix
    }

    pub fn get(&self, model: &str) -> Option<Arc<ModelIndex>> {
        self.by_model.read().get(model).cloned()
    }

    pub fn get_or_create(&self, model: &str, max_blocks: u64) -> Arc<ModelIndex> {
        if let Some(i) = self.get(model) {
            return i;
        }
        self.create(&mut self.by_model.write(), model, max_blocks)
    }

    /// [`Indexes::get_or_create`], unless that would make more than `max_models`.
    pub fn get_or_create_capped(
        &self,
        model: &str,
        max_blocks: u64,
        max_models: usize,
    ) -> Option<Arc<ModelIndex>> {
        if let Some(i) = self.get(model) {
            return Some(i);
        }
        let mut m = self.by_model.write();
        if !m.contains_key(model) && m.len() >= max_models {
            return None;
        }
        Some(self.create(&mut m, model, max_blocks))
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
