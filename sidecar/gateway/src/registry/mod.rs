//! The pod registry: the one owner of what the sidecar knows about each engine pod
//! besides its cached blocks — registrations, event-stream positions (epoch, last
//! sequence, gap and stale marks), liveness, engine load reports, circuit breakers — and
//! of the tombstones that keep removed pods out, and the pod and model limits.
//!
//! Its rules, kept here and nowhere else:
//! - a pod is an `IP:port`; at most [`MAX_PODS`] are known, registered or learned from
//!   events; an explicit registration's word (model, dump URL) beats what batches say;
//! - a removed pod leaves a tombstone with the epoch it had: its batches are refused
//!   until a new epoch (an engine restart) or a new registration;
//! - a pod's stream advances one batch at a time: a new epoch restarts it, a jump past
//!   [`MAX_SEQ_JUMP`] is refused, a gap asks for recovery; below the highest seq, a batch
//!   filling a skipped range is applied, a repeat is a duplicate, and one that contradicts
//!   what was applied at its seq is recovered as a gap — so no batch can make a later
//!   real one look like a duplicate (`seq.rs`);
//! - a batch is admitted only for its pod's model, before anything is allocated for it;
//! - a pod on a loopback, unspecified, link-local or multicast address is learned from
//!   events only when the operator allowed it at start (`--learn-local-pods`, single-host
//!   setups); otherwise only a registration brings it in;
//! - a batch may name only a dump URL on the pod's own IP, at the pod's own port or a
//!   configured dump port ([`dump_url_on_pod`]); a registration may name any.
//!
//! Shaped like the ledger (and mini-redis's `Db`): private state behind one mutex, every
//! change a method. One mutex over pods and tombstones: each access is a short
//! read-modify-write of a few fields, so a finer scheme would buy nothing measurable.
//! Readers get clones, or a [`View`] that holds the lock for a route's candidate
//! assembly and commit (lock order: the registry, then the ledger).

mod error;
mod pod;
mod seq;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_shared::protocol::{Event, EventBatch, PodRegistration, Role};
use parking_lot::{Mutex, MutexGuard};

pub use error::{RegisterError, StreamError};
pub use pod::{EngineLoad, Pod};

/// Pods the registry tracks at most (registered, and learned from events).
pub const MAX_PODS: usize = 4096;
/// Models the sidecar indexes at most (each index costs ~150 KB empty).
pub const MAX_MODELS: usize = 64;
/// How far a batch may run ahead of the last sequence number of its epoch.
pub const MAX_SEQ_JUMP: u64 = 1 << 16;

pub use kvroute_shared::protocol::valid_pod_addr as valid_pod_id;

#[derive(Default)]
pub struct Registry {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    pods: HashMap<Arc<str>, Pod>,
    /// Removed pods and the epoch they had (`None`: removed before any event).
    tombstones: HashMap<String, Option<String>>,
    rules: Rules,
}

/// What the operator allowed at start (flags), beyond the fixed rules.
#[derive(Clone, Debug)]
pub struct Rules {
    /// Learn pods on local addresses from their events (single-host setups).
    pub learn_local_pods: bool,
    /// Ports besides the pod's own where a batch may say its dump is served.
    pub dump_ports: Vec<u16>,
}

/// The port `kvroute-bridge` serves its dump on by default.
pub const BRIDGE_DUMP_PORT: u16 = 9400;

impl Default for Rules {
    fn default() -> Rules {
        Rules {
            learn_local_pods: false,
            dump_ports: vec![BRIDGE_DUMP_PORT],
        }
    }
}

/// Where a batch puts its pod's stream, and what the caller must do about it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Advance {
    /// Already applied (or older): drop it.
    pub duplicate: bool,
    /// A new epoch of a pod seen before: its old blocks must go.
    pub restarted: bool,
    /// Batches were missed: how to recover.
    pub gap: Option<Gap>,
    /// The batch named a dump URL that is not on the pod's address (ignored).
    pub dump_url_refused: bool,
    /// The batch's seq was applied before with other content: recovered as a gap.
    pub conflict: bool,
    /// A late batch below what the index already reflects: recovered as a gap, and its
    /// events are not applied.
    pub late: bool,
}

/// How a pod that missed batches gets its blocks right again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gap {
    /// Fetch its dump from here (the pod is marked stale until it is applied).
    Resync(String),
    /// No dump is known: drop its blocks and rebuild them from live events.
    Drop,
}

impl Registry {
    /// Set what the operator allowed (at start, before any batch).
    pub fn set_rules(&self, rules: Rules) {
        self.inner.lock().rules = rules;
    }

    /// Register or update a pod. Returns the model it was in before, when the
    /// registration moves it to another one (its blocks there must go).
    pub fn register(
        &self,
        id: &str,
        reg: PodRegistration,
        now: Instant,
    ) -> Result<Option<String>, RegisterError> {
        if reg.model.is_empty() {
            return Err(RegisterError::EmptyModel);
        }
        reg.validate().map_err(RegisterError::Invalid)?;
        if !valid_pod_id(id) {
            return Err(RegisterError::BadPodId(id.to_string()));
        }
        let mut g = self.inner.lock();
        g.tombstones.remove(id);
        Ok(match g.pods.get_mut(id) {
            Some(p) => {
                let old_model = std::mem::replace(&mut p.reg, reg).model;
                p.registered = true;
                (old_model != p.reg.model).then_some(old_model)
            }
            None => {
                g.pods.insert(Arc::from(id), Pod::new(id, reg, true, now));
                None
            }
        })
    }

    /// Undo a registration the index had no room for (no tombstone: it never joined).
    pub fn refuse(&self, id: &str) {
        self.inner.lock().pods.remove(id);
    }

    /// Remove a pod; `tombstone` keeps its epoch's events out. `under_lock` runs while
    /// the registry is still locked, so no route can give the pod load after it (the
    /// caller releases the pod's ledger entries there). `None` if the pod is unknown.
    pub fn remove<R>(
        &self,
        id: &str,
        tombstone: bool,
        under_lock: impl FnOnce(&Pod) -> R,
    ) -> Option<(Pod, R)> {
        let mut g = self.inner.lock();
        let pod = g.pods.remove(id)?;
        let r = under_lock(&pod);
        if tombstone {
            // Bounded: under churn beyond this, the oldest guard against a stale engine's
            // return is the one given up (any one, in fact: none is worth unbounded memory).
            if g.tombstones.len() >= MAX_PODS {
                if let Some(k) = g.tombstones.keys().next().cloned() {
                    g.tombstones.remove(&k);
                }
            }
            g.tombstones.insert(id.to_string(), pod.epoch.clone());
        }
        Some((pod, r))
    }

    /// Admission, before anything is allocated for a batch's pod or model: a valid id,
    /// the pod's own model when it is known, and for a pod not seen before, room for it,
    /// its registration when one is required, and an address events may bring in.
    pub fn admit(
        &self,
        pod: &str,
        model: &str,
        require_registration: bool,
    ) -> Result<(), StreamError> {
        if !valid_pod_id(pod) {
            return Err(StreamError::BadPod(pod.to_string()));
        }
        let g = self.inner.lock();
        match g.pods.get(pod) {
            Some(p) if p.reg.model != model => Err(StreamError::ModelMismatch {
                pod: pod.to_string(),
                registered: p.reg.model.clone(),
                got: model.to_string(),
            }),
            Some(_) => Ok(()),
            None if require_registration => Err(StreamError::Unregistered(pod.to_string())),
            None if !g.rules.learn_local_pods && local_address(pod) => {
                Err(StreamError::LocalPod(pod.to_string()))
            }
            None if g.pods.len() >= MAX_PODS => Err(StreamError::TooManyPods(pod.to_string())),
            None => Ok(()),
        }
    }

    /// Advance the batch's pod's stream by this batch (the pod is learned from it if it
    /// is new and registration is not required). Called under the pod's ingest lock, so
    /// one pod's batches advance one at a time.
    pub fn advance(
        &self,
        b: &EventBatch,
        require_registration: bool,
        now: Instant,
    ) -> Result<Advance, StreamError> {
        let mut g = self.inner.lock();
        let Inner {
            pods,
            tombstones,
            rules,
        } = &mut *g;
        if let Some(epoch) = tombstones.get(b.pod.as_str()) {
            if epoch.is_none() || epoch.as_deref() == Some(b.epoch.as_str()) {
                return Err(StreamError::Removed(b.pod.clone()));
            }
            tombstones.remove(b.pod.as_str());
        }
        let pod = match pods.get_mut(b.pod.as_str()) {
            Some(p) => p,
            None if require_registration => return Err(StreamError::Unregistered(b.pod.clone())),
            None if !rules.learn_local_pods && local_address(&b.pod) => {
                return Err(StreamError::LocalPod(b.pod.clone()))
            }
            None => {
                let reg = PodRegistration {
                    model: b.model.clone(),
                    ..Default::default()
                };
                pods.entry(Arc::from(b.pod.as_str()))
                    .or_insert_with(|| Pod::new(&b.pod, reg, false, now))
            }
        };
        if pod.reg.model != b.model {
            return Err(StreamError::ModelMismatch {
                pod: b.pod.clone(),
                registered: pod.reg.model.clone(),
                got: b.model.clone(),
            });
        }
        pod.last_seen = now;
        let mut out = Advance::default();
        // An engine-side publisher may say where its dump is; an explicit registration's
        // word wins. Only a URL on the pod's own address is taken: the sidecar fetches it,
        // and an event must not be able to aim the sidecar's HTTP client elsewhere.
        if !pod.registered && b.dump_url.is_some() && pod.reg.dump_url != b.dump_url {
            let ports = &rules.dump_ports;
            match b
                .dump_url
                .as_deref()
                .filter(|u| dump_url_on_pod(u, &b.pod, ports))
            {
                Some(u) => pod.reg.dump_url = Some(u.to_string()),
                None => out.dump_url_refused = true,
            }
        }
        if pod.epoch.as_deref() != Some(b.epoch.as_str()) {
            out.restarted = pod.epoch.is_some();
            pod.epoch = Some(b.epoch.clone());
            pod.last_seq = None;
            pod.window.clear();
            pod.stale = false;
        }
        let digest = b.digest();
        let gap = match pod.last_seq {
            Some(last) if b.seq <= last => match pod.window.behind(b.seq, digest) {
                seq::Behind::Duplicate => {
                    out.duplicate = true;
                    return Ok(out);
                }
                seq::Behind::FillsHole => false,
                seq::Behind::Late => {
                    out.late = true;
                    true
                }
                seq::Behind::Conflict => {
                    out.conflict = true;
                    true
                }
            },
            Some(last) if b.seq - last > MAX_SEQ_JUMP => {
                return Err(StreamError::SeqJump {
                    pod: b.pod.clone(),
                    last,
                    got: b.seq,
                })
            }
            Some(last) => {
                pod.window.skipped(last + 1, b.seq - 1);
                b.seq > last + 1
            }
            // First batch we see of this epoch, not its first: we missed the start (our
            // own restart, or the engine's early batches). Resync when a dump is known.
            None => b.seq > 0 && !out.restarted && (pod.events_seen || pod.reg.dump_url.is_some()),
        };
        if !gap {
            pod.window.applied(b.seq, digest);
        }
        pod.last_seq = Some(pod.last_seq.map_or(b.seq, |l| l.max(b.seq)));
        if b.events.iter().any(|e| {
            matches!(
                e,
                Event::Stored { .. } | Event::Removed { .. } | Event::Cleared
            )
        }) {
            pod.events_seen = true;
        }
        if gap {
            // Whatever recovers the pod, the blocks applied so far stop counting.
            pod.window.rebuilt();
            if !out.late {
                pod.window.applied(b.seq, digest);
            }
            out.gap = Some(match pod.reg.dump_url.clone() {
                Some(url) => {
                    pod.stale = true;
                    Gap::Resync(url)
                }
                None => {
                    // Its blocks are dropped and rebuilt from this batch on.
                    pod.stale = false;
                    Gap::Drop
                }
            });
        }
        Ok(out)
    }

    /// A pod learned from a batch that then could not join its model's index leaves no
    /// entry behind (a registered one stays: its registration stands).
    pub fn forget_learned(&self, pod: &str) {
        let mut g = self.inner.lock();
        if g.pods.get(pod).is_some_and(|p| !p.registered) {
            g.pods.remove(pod);
        }
    }

    pub fn contains(&self, pod: &str) -> bool {
        self.inner.lock().pods.contains_key(pod)
    }

    /// The model the pod is in, if it is known.
    pub fn model_of(&self, pod: &str) -> Option<String> {
        self.inner.lock().pods.get(pod).map(|p| p.reg.model.clone())
    }

    /// The engine's own load report (from its batches).
    pub fn record_engine_load(&self, pod: &str, load: EngineLoad) {
        if let Some(p) = self.inner.lock().pods.get_mut(pod) {
            p.engine = Some(load);
        }
    }

    /// A completion report's status, for the pod's circuit breaker.
    pub fn record_status(
        &self,
        pod: &str,
        status: u16,
        failures_to_open: u32,
        cooldown: Duration,
        now: Instant,
    ) {
        if let Some(p) = self.inner.lock().pods.get_mut(pod) {
            p.record_status(status, failures_to_open, cooldown, now);
        }
    }

    /// A dump taken at `(epoch, seq)` replaced the pod's blocks: it is no longer stale,
    /// and its stream continues after the dump when the dump is of its current epoch.
    pub fn resynced(&self, pod: &str, epoch: &str, seq: u64) {
        if let Some(p) = self.inner.lock().pods.get_mut(pod) {
            p.stale = false;
            if p.epoch.as_deref() == Some(epoch) {
                p.last_seq = Some(p.last_seq.map_or(seq, |s| s.max(seq)));
                p.window.covered_through(seq);
                p.window.rebuilt();
            }
        }
    }

    /// One of the pod's batches was lost before it reached the index (its ingest queue was
    /// full): its blocks are discounted as stale until its next gap is repaired, which
    /// its next applied batch starts.
    pub fn mark_stale(&self, pod: &str) {
        if let Some(p) = self.inner.lock().pods.get_mut(pod) {
            p.stale = true;
        }
    }

    /// The pod's blocks were dropped to be rebuilt from live events: not stale any more.
    pub fn rebuilt(&self, pod: &str) {
        if let Some(p) = self.inner.lock().pods.get_mut(pod) {
            p.stale = false;
            p.window.rebuilt();
        }
    }

    /// Pods that have spoken (sent any batch) and then were silent for `timeout`.
    pub fn silent(&self, now: Instant, timeout: Duration) -> Vec<String> {
        self.inner
            .lock()
            .pods
            .values()
            .filter(|p| p.epoch.is_some() && now.duration_since(p.last_seen) > timeout)
            .map(|p| p.id.to_string())
            .collect()
    }

    /// A copy of one pod.
    pub fn get(&self, id: &str) -> Option<Pod> {
        self.inner.lock().pods.get(id).cloned()
    }

    /// A copy of every pod, in id order.
    pub fn all(&self) -> Vec<Pod> {
        let mut v: Vec<Pod> = self.inner.lock().pods.values().cloned().collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// Stale pods and pods whose breaker is closed (for the gauges).
    pub fn counts(&self, now: Instant) -> (u64, u64) {
        let g = self.inner.lock();
        let stale = g.pods.values().filter(|p| p.stale).count() as u64;
        let live = g.pods.values().filter(|p| !p.breaker_open(now)).count() as u64;
        (stale, live)
    }

    /// The registry, locked for reading until the view is dropped: a route assembles its
    /// candidates and commits its decision under one view, so a pod removed meanwhile
    /// is either not a candidate or removed after the commit.
    pub fn view(&self) -> View<'_> {
        View(self.inner.lock())
    }
}

/// The registry, read-only, locked (see [`Registry::view`]). Take the ledger after it,
/// never before; hold it for no longer than a route.
pub struct View<'a>(MutexGuard<'a, Inner>);

impl View<'_> {
    pub fn get(&self, id: &str) -> Option<&Pod> {
        self.0.pods.get(id)
    }

    /// The registry's own handle of a pod's id (shared, so callers keep no copies).
    pub fn id(&self, id: &str) -> Option<&Arc<str>> {
        self.0.pods.get_key_value(id).map(|(k, _)| k)
    }

    /// The pods of `model`, in no particular order.
    pub fn of_model<'s>(&'s self, model: &'s str) -> impl Iterator<Item = &'s Pod> + 's {
        self.0.pods.values().filter(move |p| p.reg.model == model)
    }

    /// The model has both prefill and decode pods.
    pub fn disaggregated(&self, model: &str) -> bool {
        let (mut prefill, mut decode) = (false, false);
        for p in self.of_model(model) {
            prefill |= p.reg.role == Role::Prefill;
            decode |= p.reg.role == Role::Decode;
        }
        prefill && decode
    }
}

/// An http(s) URL whose host is the pod's own IP and whose port is the pod's own or one
/// of `ports`: the only dump location a batch may name (a registration may name any).
pub fn dump_url_on_pod(url: &str, pod: &str, ports: &[u16]) -> bool {
    let (Ok(u), Some((addr, _))) = (
        reqwest::Url::parse(url),
        kvroute_shared::protocol::parse_pod(pod),
    ) else {
        return false;
    };
    let host_is_pod = u
        .host_str()
        .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
        .and_then(|h| h.parse::<std::net::IpAddr>().ok())
        .is_some_and(|ip| ip == addr.ip());
    let port_ok = u
        .port_or_known_default()
        .is_some_and(|p| p == addr.port() || ports.contains(&p));
    matches!(u.scheme(), "http" | "https") && host_is_pod && port_ok && u.username().is_empty()
}

/// A pod address that names this host or no host in particular: loopback, unspecified,
/// link-local, multicast (v4 and v6, v4-mapped included).
pub fn local_address(pod: &str) -> bool {
    use std::net::IpAddr;
    let Some((addr, _)) = kvroute_shared::protocol::parse_pod(pod) else {
        return false;
    };
    let ip = match addr.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        ip => ip,
    };
    match ip {
        IpAddr::V4(v4) => {
            v4.is_loopback() || v4.is_unspecified() || v4.is_link_local() || v4.is_multicast()
        }
        IpAddr::V6(v6) => {
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (v6.segments()[0] & 0xffc0) == 0xfe80
        }
    }
}
