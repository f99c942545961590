//! The ledger's book: the state behind its one mutex and the few operations that keep
//! its sums consistent (per-pod totals of other replicas' shares, per-prefix counts that
//! vanish at zero). Only [`super::Ledger`] touches it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use kvroute_shared::protocol::PolicyConfig;

use super::{clock, Decision};
use crate::policy::{LoadView, PrefillHorizon, RecentWork};

/// Another replica's decision on one pod.
#[derive(Clone, Copy, Debug)]
pub(super) struct RemoteShare {
    pub(super) at: Instant,
    pub(super) prefill_tokens: u64,
    pub(super) blocks: u64,
    pub(super) prefix: Option<u64>,
    pub(super) inflight: bool,
    /// Its chain's first block, when it sent marks ([`Book::remote_chains`]).
    pub(super) first: Option<u64>,
}

/// Another replica's request in flight, as far as its marks tell its prompt.
#[derive(Debug)]
pub(super) struct RemoteChain {
    pub(super) key: (String, String),
    /// Where the prompt is being computed.
    pub(super) pod: Arc<str>,
    pub(super) marks: Box<[[u64; 2]]>,
}

#[derive(Default, Debug)]
pub(super) struct PodLoad {
    pub(super) horizon: PrefillHorizon,
    pub(super) decode_blocks: u64,
    pub(super) inflight: u32,
    pub(super) recent: RecentWork,
    pub(super) remote: HashMap<(String, String), RemoteShare>,
    /// Sums over `remote`, kept with it so a route reads them in O(1).
    pub(super) remote_blocks: u64,
    pub(super) remote_inflight: u32,
    /// Requests on this pod whose load was released (ours and other replicas'), ever:
    /// what has finished since an engine's load report was taken.
    pub(super) finished: u64,
}

#[derive(Default)]
pub(super) struct Book {
    pub(super) pods: HashMap<Arc<str>, PodLoad>,
    pub(super) decisions: HashMap<u64, Decision>,
    /// In-flight requests per routing prefix and pod; an entry lives while it is > 0.
    pub(super) prefixes: HashMap<u64, HashMap<Arc<str>, u32>>,
    /// Other replicas' shares held, per replica (bounds what one replica can make us
    /// keep); an entry lives while it is > 0.
    pub(super) per_replica: HashMap<String, usize>,
    /// Every other replica's shares held, in all.
    pub(super) remote_total: usize,
    /// When each other replica's delta last arrived (seconds on [`clock`]), at most
    /// [`super::MAX_PEERS`]: who shares the pods, for [`super::Ledger::home_slot`].
    pub(super) peers: HashMap<String, f64>,
    /// This replica's decisions in flight that keep their chain, by its first block (the
    /// newest [`super::CHAINS_PER_PREFIX`]); an entry lives while it has any.
    pub(super) chains: HashMap<u64, VecDeque<u64>>,
    /// Other replicas' requests in flight that sent their chain's marks, by its first
    /// block (the newest [`super::CHAINS_PER_PREFIX`] there, [`super::MAX_REMOTE_CHAINS`]
    /// in all, the oldest dropped first); an entry lives while it has any.
    pub(super) remote_chains: HashMap<u64, VecDeque<RemoteChain>>,
    /// Every remote chain filed, oldest first (some may have gone since).
    pub(super) remote_chain_order: VecDeque<(u64, (String, String))>,
}

impl Book {
    /// Another replica's delta arrived at `t`. A new id past [`super::MAX_PEERS`] first
    /// displaces those not heard for [`super::PEER_FRESH`], else is not remembered.
    pub(super) fn heard(&mut self, replica: &str, t: f64) {
        if let Some(at) = self.peers.get_mut(replica) {
            *at = at.max(t);
            return;
        }
        if self.peers.len() >= super::MAX_PEERS {
            let fresh = super::PEER_FRESH.as_secs_f64();
            self.peers.retain(|_, at| t - *at < fresh);
            if self.peers.len() >= super::MAX_PEERS {
                return;
            }
        }
        self.peers.insert(replica.to_owned(), t);
    }

    pub(super) fn pod(&mut self, id: &Arc<str>) -> &mut PodLoad {
        self.pods.entry(id.clone()).or_default()
    }

    pub(super) fn prefix_add(&mut self, k: u64, pod: &Arc<str>) {
        *self
            .prefixes
            .entry(k)
            .or_default()
            .entry(pod.clone())
            .or_insert(0) += 1;
    }

    pub(super) fn prefix_release(&mut self, k: u64, pod: &str) {
        if let Some(per_pod) = self.prefixes.get_mut(&k) {
            if let Some(n) = per_pod.get_mut(pod) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    per_pod.remove(pod);
                }
            }
            if per_pod.is_empty() {
                self.prefixes.remove(&k);
            }
        }
    }

    /// File a decision (not yet in `decisions`) under its chain's first block; past the
    /// bound, the oldest there loses its chain.
    pub(super) fn chains_add(&mut self, d: &Decision) {
        let Some(&first) = d.placement.chain.first() else {
            return;
        };
        let ids = self.chains.entry(first).or_default();
        ids.push_back(d.id);
        if ids.len() > super::CHAINS_PER_PREFIX {
            if let Some(old) = ids.pop_front().and_then(|id| self.decisions.get_mut(&id)) {
                old.placement.chain = Arc::from([]);
            }
        }
    }

    /// File another replica's request under its chain's first block, within the bounds.
    pub(super) fn remote_chain_add(&mut self, first: u64, c: RemoteChain) {
        self.remote_chain_order.push_back((first, c.key.clone()));
        let q = self.remote_chains.entry(first).or_default();
        q.push_back(c);
        if q.len() > super::CHAINS_PER_PREFIX {
            q.pop_front();
        }
        while self.remote_chain_order.len() > super::MAX_REMOTE_CHAINS {
            if let Some((f, k)) = self.remote_chain_order.pop_front() {
                self.remote_chain_remove(f, &k);
            }
        }
    }

    pub(super) fn remote_chain_remove(&mut self, first: u64, key: &(String, String)) {
        if let Some(q) = self.remote_chains.get_mut(&first) {
            q.retain(|c| c.key != *key);
            if q.is_empty() {
                self.remote_chains.remove(&first);
            }
        }
    }

    /// Undo a local decision's load (it has left `decisions` already).
    pub(super) fn unload(&mut self, d: &Decision, now: f64, tps: f64) {
        if let Some(&first) = d.placement.chain.first() {
            if let Some(ids) = self.chains.get_mut(&first) {
                ids.retain(|&id| id != d.id);
                if ids.is_empty() {
                    self.chains.remove(&first);
                }
            }
        }
        let cache = d.cache_pod().clone();
        if let Some(p) = self.pods.get_mut(&cache) {
            p.horizon.release(now, d.placement.prefill_tokens, tps);
        }
        if let Some(p) = self.pods.get_mut(&d.placement.pod) {
            p.decode_blocks = p.decode_blocks.saturating_sub(d.placement.blocks);
            p.inflight = p.inflight.saturating_sub(1);
            p.finished += 1;
        }
        if let Some(k) = d.placement.prefix {
            self.prefix_release(k, &d.placement.pod);
        }
    }

    pub(super) fn remote_remove(
        &mut self,
        pod: &Arc<str>,
        key: &(String, String),
        now: f64,
        tps: f64,
    ) {
        let Some(p) = self.pods.get_mut(pod) else {
            return;
        };
        let Some(r) = p.remote.remove(key) else {
            return;
        };
        self.remote_total = self.remote_total.saturating_sub(1);
        if let Some(n) = self.per_replica.get_mut(&key.0) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_replica.remove(&key.0);
            }
        }
        p.horizon.release(now, r.prefill_tokens, tps);
        p.remote_blocks = p.remote_blocks.saturating_sub(r.blocks);
        if r.inflight {
            p.remote_inflight = p.remote_inflight.saturating_sub(1);
            p.finished += 1;
        }
        if let Some(k) = r.prefix {
            self.prefix_release(k, pod);
        }
        if let Some(f) = r.first {
            self.remote_chain_remove(f, key);
        }
    }
}

pub(super) fn view_of(
    book: &Book,
    pod: &str,
    prefix: Option<u64>,
    now: Instant,
    cfg: &PolicyConfig,
) -> LoadView {
    let t = clock(now);
    let prefix_inflight = prefix
        .and_then(|k| book.prefixes.get(&k))
        .and_then(|m| m.get(pod).copied())
        .unwrap_or(0);
    match book.pods.get(pod) {
        Some(p) => LoadView {
            pending_prefill_tokens: p.horizon.pending(t, cfg.prefill_tokens_per_s),
            decode_blocks: p.decode_blocks.saturating_add(p.remote_blocks),
            inflight: p.inflight.saturating_add(p.remote_inflight),
            queued: 0,
            prefix_inflight,
            recent_blocks: p.recent.value(t, cfg.home_window_s),
            finished: p.finished,
        },
        None => LoadView {
            prefix_inflight,
            ..LoadView::default()
        },
    }
}
