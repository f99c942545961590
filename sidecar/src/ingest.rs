//! Engine events → index and registry. The one path for NATS, `POST /v1/events` and
//! dumps, so every source gets the same checks.
//!
//! Per pod the sidecar tracks `(epoch, seq)`: a new epoch is an engine restart (its old
//! blocks go at once, via a fresh index slot); `seq ≤ last` is a duplicate or replay
//! (ignored, so applying a batch twice or from two consumers ends as once); a gap marks
//! the pod stale and triggers a resync (its dump URL if registered or advertised in the
//! batches, otherwise its blocks are dropped and rebuilt from live events). Batches of one pod are applied under that
//! pod's ingest lock, so two consumers cannot interleave them out of order.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kvroute_shared::protocol::{Event, EventBatch, PodRegistration};
use parking_lot::Mutex;

use crate::index::{ModelIndex, PodHandle};
use crate::pods::{EngineLoad, Pod};
use crate::state::{ResyncJob, Sidecar};

/// Why a well-formed batch was refused (decode errors are refused before this).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IngestError {
    /// The pod is not an `IP:port`.
    BadPod(String),
    /// The registry is full ([`MAX_PODS`]).
    TooManyPods(String),
    /// The sidecar indexes [`MAX_MODELS`] models already.
    TooManyModels(String),
    /// The batch's sequence number is more than [`MAX_SEQ_JUMP`] ahead of the last one
    /// seen in its epoch: refused, so nobody can push a pod's high-water mark to the end
    /// of the range and have its real batches dropped as duplicates.
    SeqJump {
        pod: String,
        last: u64,
        got: u64,
    },
    Unregistered(String),
    Removed(String),
    ModelMismatch {
        pod: String,
        registered: String,
        got: String,
    },
    Full(String),
}

impl IngestError {
    pub fn reason(&self) -> &'static str {
        match self {
            IngestError::BadPod(_) => "bad_pod",
            IngestError::TooManyPods(_) => "pod_cap",
            IngestError::TooManyModels(_) => "model_cap",
            IngestError::SeqJump { .. } => "seq_jump",
            IngestError::Unregistered(_) => "unregistered_pod",
            IngestError::Removed(_) => "removed_pod",
            IngestError::ModelMismatch { .. } => "model_mismatch",
            IngestError::Full(_) => "model_full",
        }
    }
}

impl std::fmt::Display for IngestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IngestError::BadPod(p) => write!(f, "pod {p:?} must be IP:port"),
            IngestError::TooManyPods(p) => {
                write!(f, "pod {p} refused: the sidecar tracks {MAX_PODS} pods already")
            }
            IngestError::TooManyModels(m) => {
                write!(f, "model {m:?} refused: the sidecar indexes {MAX_MODELS} models already")
            }
            IngestError::SeqJump { pod, last, got } => write!(
                f,
                "pod {pod}: seq {got} jumps more than {MAX_SEQ_JUMP} past {last} in one epoch"
            ),
            IngestError::Unregistered(p) => {
                write!(f, "pod {p} is not registered (require_registration is on)")
            }
            IngestError::ModelMismatch {
                pod,
                registered,
                got,
            } => {
                write!(
                    f,
                    "pod {pod} is registered for model {registered:?}, batch says {got:?}"
                )
            }
            IngestError::Full(m) => f.write_str(m),
            IngestError::Removed(p) => write!(
                f,
                "pod {p} was removed; its events are refused until it restarts (new epoch) or is registered again"
            ),
        }
    }
}

/// Pods the registry tracks at most (registered, and learned from events).
pub const MAX_PODS: usize = 4096;
/// Models the sidecar indexes at most (each index costs ~150 KB empty).
pub const MAX_MODELS: usize = 64;
/// How far a batch may run ahead of the last sequence number of its epoch.
pub const MAX_SEQ_JUMP: u64 = 1 << 16;

/// What a batch did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Ingested {
    pub duplicate: bool,
    pub restarted: bool,
    pub gap: bool,
    pub blocks_changed: u64,
    pub removed_pod: bool,
}

/// Per-pod ingest locks (kept apart from the registry so the registry lock stays short).
#[derive(Default)]
pub struct IngestLocks(Mutex<HashMap<Arc<str>, Arc<Mutex<()>>>>);

impl IngestLocks {
    fn get(&self, pod: &str) -> Arc<Mutex<()>> {
        let mut m = self.0.lock();
        if let Some(l) = m.get(pod) {
            return l.clone();
        }
        // Locks of pods that left are not needed once nobody holds them; admission keeps
        // the live ones under MAX_PODS.
        if m.len() >= MAX_PODS {
            m.retain(|_, l| Arc::strong_count(l) > 1);
        }
        let l = Arc::new(Mutex::new(()));
        m.insert(Arc::from(pod), l.clone());
        l
    }
}

pub fn ingest(
    sc: &Sidecar,
    locks: &IngestLocks,
    batch: &EventBatch,
) -> Result<Ingested, IngestError> {
    ingest_at(sc, locks, batch, Instant::now())
}

/// [`ingest`] at `now` (the simulator's virtual clock).
pub fn ingest_at(
    sc: &Sidecar,
    locks: &IngestLocks,
    batch: &EventBatch,
    now: Instant,
) -> Result<Ingested, IngestError> {
    let r = ingest_inner(sc, locks, batch, now);
    match &r {
        Ok(i) if i.duplicate => {
            sc.metrics.duplicates.inc();
        }
        Ok(i) => {
            sc.metrics.events_applied.inc();
            sc.metrics.event_blocks.inc_by(i.blocks_changed);
            if let Some(ts) = batch.ts {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs_f64())
                    .unwrap_or(ts);
                sc.metrics.set_event_lag(&batch.pod, (now - ts).max(0.0));
            }
        }
        Err(e) => sc.metrics.events_rejected.inc(e.reason(), 1),
    }
    r
}

fn ingest_inner(
    sc: &Sidecar,
    locks: &IngestLocks,
    b: &EventBatch,
    now: Instant,
) -> Result<Ingested, IngestError> {
    let cfg = sc.config();
    // Admission, before anything is allocated for this pod or model.
    if !crate::state::valid_pod_id(&b.pod) {
        return Err(IngestError::BadPod(b.pod.clone()));
    }
    {
        let pods = sc.pods.lock();
        if !pods.contains_key(b.pod.as_str()) {
            if cfg.require_registration {
                return Err(IngestError::Unregistered(b.pod.clone()));
            }
            if pods.len() >= MAX_PODS {
                return Err(IngestError::TooManyPods(b.pod.clone()));
            }
        }
    }
    let Some(index) = sc.index(&b.model) else {
        return Err(IngestError::TooManyModels(b.model.clone()));
    };
    let lock = locks.get(&b.pod);
    let _serial = lock.lock();
    let mut out = Ingested::default();
    {
        let mut t = sc.tombstones.lock();
        if let Some(epoch) = t.get(b.pod.as_str()) {
            if epoch.is_none() || epoch.as_deref() == Some(b.epoch.as_str()) {
                return Err(IngestError::Removed(b.pod.clone()));
            }
            t.remove(b.pod.as_str());
        }
    }

    // Position in the pod's stream, under the registry lock (short).
    let resync_url;
    let mut drop_blocks = false;
    {
        let mut pods = sc.pods.lock();
        let pod = match pods.get_mut(b.pod.as_str()) {
            Some(p) => p,
            None if cfg.require_registration => {
                return Err(IngestError::Unregistered(b.pod.clone()))
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
            return Err(IngestError::ModelMismatch {
                pod: b.pod.clone(),
                registered: pod.reg.model.clone(),
                got: b.model.clone(),
            });
        }
        pod.last_seen = now;
        // An engine-side publisher may say where its dump is; an explicit registration's
        // word wins.
        // word wins. Only a URL on the pod's own address is taken: the sidecar fetches it,
        // and an event must not be able to aim the sidecar's HTTP client elsewhere.
        if !pod.registered && b.dump_url.is_some() && pod.reg.dump_url != b.dump_url {
            match b.dump_url.as_deref().filter(|u| dump_url_on_pod(u, &b.pod)) {
                Some(u) => pod.reg.dump_url = Some(u.to_string()),
                None => sc.metrics.events_rejected.inc("dump_url_elsewhere", 1),
            }
        }
        if pod.epoch.as_deref() != Some(b.epoch.as_str()) {
            if pod.epoch.is_some() {
                out.restarted = true;
            }
            pod.epoch = Some(b.epoch.clone());
            pod.last_seq = None;
            pod.stale = false;
        }
        match pod.last_seq {
            Some(last) if b.seq <= last => {
                out.duplicate = true;
                return Ok(out);
            }
            Some(last) if b.seq - last > MAX_SEQ_JUMP => {
                return Err(IngestError::SeqJump {
                    pod: b.pod.clone(),
                    last,
                    got: b.seq,
                })
            }
            Some(last) if b.seq > last + 1 => out.gap = true,
            // First batch we see of this epoch, not its first: we missed the start (our
            // own restart, or the engine's early batches). Resync when a dump is known.
            None if b.seq > 0
                && !out.restarted
                && (pod.events_seen || pod.reg.dump_url.is_some()) =>
            {
                out.gap = true
            }
            _ => {}
        }
        pod.last_seq = Some(b.seq);
        if b.events.iter().any(|e| {
            matches!(
                e,
                Event::Stored { .. } | Event::Removed { .. } | Event::Cleared
            )
        }) {
            pod.events_seen = true;
        }
        resync_url = if out.gap {
            pod.reg.dump_url.clone()
        } else {
            None
        };
        if out.gap {
            sc.metrics.seq_gaps.inc();
            match resync_url {
                Some(_) => pod.stale = true,
                None => drop_blocks = true,
            }
        }
    }

    let mut handle = match index.join(&b.pod) {
        Ok(h) => h,
        Err(e) => {
            sc.metrics.pods_refused.inc();
            // A pod learned from this very batch leaves no registry entry behind.
            let mut pods = sc.pods.lock();
            if pods.get(b.pod.as_str()).is_some_and(|p| !p.registered) {
                pods.remove(b.pod.as_str());
            }
            return Err(IngestError::Full(e.to_string()));
        }
    };
    if out.restarted {
        sc.metrics.epochs.inc();
        handle = reset_pod(sc, &index, b, "new epoch")?;
    }
    if drop_blocks {
        sc.metrics.resyncs.inc("drop", 1);
        handle = reset_pod(sc, &index, b, "sequence gap, no dump url")?;
    }
    if let Some(url) = resync_url {
        sc.queue_resync(ResyncJob {
            pod: Arc::from(b.pod.as_str()),
            model: b.model.clone(),
            url,
        });
    }

    let mut load = None;
    for ev in &b.events {
        match ev {
            Event::Stored { tier, blocks, .. } => {
                if let Ok(a) = index.store(handle, *tier, blocks) {
                    out.blocks_changed += a.changed;
                }
            }
            Event::Removed { tier, blocks } => {
                if let Ok(a) = index.remove(handle, *tier, blocks) {
                    out.blocks_changed += a.changed;
                }
            }
            Event::Cleared => handle = reset_pod(sc, &index, b, "cleared")?,
            Event::Shutdown => {
                sc.remove_pod_at(&b.pod, "shutdown", now);
                out.removed_pod = true;
                return Ok(out);
            }
            Event::Load {
                running,
                waiting,
                kv_usage,
                ..
            } => {
                load = Some(EngineLoad {
                    running: *running,
                    waiting: *waiting,
                    kv_usage: *kv_usage,
                    at: now,
                });
            }
        }
    }
    if let Some(l) = load {
        if let Some(p) = sc.pods.lock().get_mut(b.pod.as_str()) {
            p.engine = Some(l);
        }
    }
    Ok(out)
}

/// An http(s) URL whose host is the pod's own IP: the only dump location a batch may
/// name (a registration may name any).
pub fn dump_url_on_pod(url: &str, pod: &str) -> bool {
    let (Ok(u), Ok(addr)) = (
        reqwest::Url::parse(url),
        pod.parse::<std::net::SocketAddr>(),
    ) else {
        return false;
    };
    let host_is_pod = u
        .host_str()
        .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
        .and_then(|h| h.parse::<std::net::IpAddr>().ok())
        .is_some_and(|ip| ip == addr.ip());
    matches!(u.scheme(), "http" | "https") && host_is_pod && u.username().is_empty()
}

/// Drop all of a pod's blocks at once: it moves to a fresh slot, the old one is cleaned
/// in the background.
fn reset_pod(
    sc: &Sidecar,
    index: &Arc<ModelIndex>,
    b: &EventBatch,
    why: &str,
) -> Result<PodHandle, IngestError> {
    let (h, old) = index
        .reset(&b.pod)
        .map_err(|e| IngestError::Full(e.to_string()))?;
    if let Some(r) = old {
        sc.queue_cleanup(index.clone(), r);
    }
    if let Some((ix, r)) = sc.predicted.forget(&b.model, &b.pod) {
        sc.queue_cleanup(ix, r);
    }
    tracing::debug!(pod = %b.pod, why, "pod blocks dropped");
    Ok(h)
}

/// Replace a pod's blocks with a full dump (after a gap), then clear its stale mark.
pub fn apply_dump(
    sc: &Sidecar,
    locks: &IngestLocks,
    pod: &str,
    dump: &EventBatch,
) -> Result<u64, IngestError> {
    let lock = locks.get(pod);
    let _serial = lock.lock();
    // A pod removed (or moved to another model) while its dump was on the way stays
    // removed: the dump must not give it a slot again.
    if sc
        .pods
        .lock()
        .get(pod)
        .is_none_or(|p| p.reg.model != dump.model)
    {
        return Err(IngestError::Removed(pod.to_string()));
    }
    let index = sc
        .index(&dump.model)
        .ok_or_else(|| IngestError::TooManyModels(dump.model.clone()))?;
    let (h, old) = index
        .reset(pod)
        .map_err(|e| IngestError::Full(e.to_string()))?;
    if let Some(r) = old {
        sc.queue_cleanup(index.clone(), r);
    }
    let mut n = 0;
    for ev in &dump.events {
        if let Event::Stored { tier, blocks, .. } = ev {
            if let Ok(a) = index.store(h, *tier, blocks) {
                n += a.changed;
            }
        }
    }
    if let Some(p) = sc.pods.lock().get_mut(pod) {
        p.stale = false;
        // The dump is the state as of its own (epoch, seq).
        if p.epoch.as_deref() == Some(dump.epoch.as_str()) {
            p.last_seq = Some(p.last_seq.map_or(dump.seq, |s| s.max(dump.seq)));
        }
    }
    sc.metrics.resyncs.inc("dump", 1);
    Ok(n)
}

/// Drop a pod's blocks (a gap with no usable dump) and clear its stale mark.
pub fn drop_blocks(sc: &Sidecar, locks: &IngestLocks, pod: &str, model: &str) {
    let lock = locks.get(pod);
    let _serial = lock.lock();
    if let Some(ix) = sc.indexes.get(model) {
        if ix.handle(pod).is_some() {
            if let Ok((_, Some(old))) = ix.reset(pod) {
                sc.queue_cleanup(ix.clone(), old);
            }
        }
    }
    if let Some(p) = sc.pods.lock().get_mut(pod) {
        p.stale = false;
    }
}

#[cfg(test)]
mod tests {
    //! Hostile batches: each is refused with its label and leaves nothing behind.
    use super::*;
    use kvroute_shared::protocol::PolicyConfig;

    fn batch(pod: &str, model: &str, epoch: &str, seq: u64, events: Vec<Event>) -> EventBatch {
        EventBatch {
            v: 1,
            pod: pod.into(),
            model: model.into(),
            epoch: epoch.into(),
            seq,
            ts: None,
            dump_url: None,
            events,
        }
    }

    fn stored(blocks: &[u64]) -> Event {
        Event::Stored {
            tier: Default::default(),
            parent: None,
            blocks: blocks.to_vec(),
            tokens: None,
        }
    }

    #[test]
    fn a_pod_that_is_not_an_ip_and_port_allocates_nothing() {
        let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
        let locks = IngestLocks::default();
        for pod in [
            "pod-a.ns.svc:8000",
            "10.0.0.1",
            "10.0.0.1:99999",
            "x\n:1",
            "",
        ] {
            let r = ingest(&sc, &locks, &batch(pod, "m", "e", 0, vec![stored(&[1])]));
            assert_eq!(r.map_err(|e| e.reason()), Err("bad_pod"), "{pod:?}");
        }
        assert!(sc.pods.lock().is_empty());
        assert!(locks.0.lock().is_empty());
        assert!(sc.indexes.all().is_empty(), "no model index was created");
    }

    #[test]
    fn a_sequence_number_pushed_to_the_end_of_the_range_cannot_freeze_a_pod() {
        let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
        let locks = IngestLocks::default();
        let pod = "10.0.0.1:8000";
        ingest(&sc, &locks, &batch(pod, "m", "e", 0, vec![stored(&[1])])).expect("first");
        let forged = batch(pod, "m", "e", u64::MAX, vec![Event::Cleared]);
        assert_eq!(
            ingest(&sc, &locks, &forged).map_err(|e| e.reason()),
            Err("seq_jump")
        );
        // The engine's next real batch is applied, not dropped as a duplicate.
        let next = ingest(&sc, &locks, &batch(pod, "m", "e", 1, vec![stored(&[2])])).expect("next");
        assert!(!next.duplicate && next.blocks_changed == 1, "{next:?}");
        let ix = sc.indexes.get("m").expect("index");
        assert_eq!(ix.lookup(&[1]).len(), 1, "the forged batch cleared nothing");
    }

    #[test]
    fn forged_models_and_pods_are_capped() {
        let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
        let locks = IngestLocks::default();
        for i in 0..MAX_MODELS + 10 {
            let pod = format!("10.1.{}.{}:8000", i / 200, i % 200 + 1);
            let r = ingest(
                &sc,
                &locks,
                &batch(&pod, &format!("model-{i}"), "e", 0, vec![]),
            );
            if i < MAX_MODELS {
                r.expect("under the cap");
            } else {
                assert_eq!(r.map_err(|e| e.reason()), Err("model_cap"));
            }
        }
        assert_eq!(sc.indexes.all().len(), MAX_MODELS);
        let mut refused = 0;
        for i in 0..MAX_PODS + 10 {
            let pod = format!("10.2.{}.{}:8000", i / 250, i % 250 + 1);
            if let Err(e) = ingest(&sc, &locks, &batch(&pod, "model-0", "e", 0, vec![])) {
                // Full index slots (256 per model) or the registry cap: either way refused.
                assert!(matches!(e.reason(), "pod_cap" | "model_full"), "{e}");
                refused += 1;
            }
        }
        assert!(refused > 0);
        // Every pod in the registry holds an index slot: refused ones left nothing.
        let ix = sc.indexes.get("model-0").expect("index");
        let pods = sc.pods.lock();
        assert!(pods.len() <= MAX_PODS);
        let of_model_0 = pods.values().filter(|p| p.reg.model == "model-0").count();
        assert_eq!(of_model_0, ix.pods().len());
    }

    #[test]
    fn a_batch_can_only_name_a_dump_on_its_own_pod() {
        assert!(dump_url_on_pod(
            "http://10.0.0.7:9400/dump",
            "10.0.0.7:8000"
        ));
        assert!(dump_url_on_pod(
            "https://[fd00::7]:9400/d",
            "[fd00::7]:8000"
        ));
        for bad in [
            "http://169.254.169.254/latest/meta-data/",
            "http://10.0.0.8:9400/dump",
            "http://localhost:9400/dump",
            "file:///etc/passwd",
            "gopher://10.0.0.7:70/",
            "http://user@10.0.0.7:9400/dump",
            "not a url",
        ] {
            assert!(!dump_url_on_pod(bad, "10.0.0.7:8000"), "{bad}");
        }
        // An unregistered pod's batch naming a dump elsewhere: the URL is not taken.
        let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
        let locks = IngestLocks::default();
        let mut b = batch("10.0.0.7:8000", "m", "e", 0, vec![stored(&[1])]);
        b.dump_url = Some("http://169.254.169.254/".into());
        ingest(&sc, &locks, &b).expect("the events still count");
        assert_eq!(
            sc.pods
                .lock()
                .get("10.0.0.7:8000")
                .and_then(|p| p.reg.dump_url.clone()),
            None
        );
        assert_eq!(sc.metrics.events_rejected.get("dump_url_elsewhere"), 1);
    }

    #[test]
    fn a_dump_for_a_removed_pod_does_not_bring_it_back() {
        let (sc, _ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
        let locks = IngestLocks::default();
        let pod = "10.0.0.7:8000";
        ingest(&sc, &locks, &batch(pod, "m", "e", 0, vec![stored(&[1])])).expect("first");
        assert!(sc.remove_pod(pod, "api"));
        let dump = batch(pod, "m", "e", 5, vec![stored(&[1, 2, 3])]);
        assert_eq!(
            apply_dump(&sc, &locks, pod, &dump).map_err(|e| e.reason()),
            Err("removed_pod")
        );
        let ix = sc.indexes.get("m").expect("index");
        assert!(ix.handle(pod).is_none(), "no slot for the removed pod");
        assert!(ix.lookup(&[1, 2, 3]).is_empty());
    }

    #[test]
    fn one_resync_per_pod_is_queued() {
        let (sc, mut ch) = Sidecar::new(PolicyConfig::default()).expect("sidecar");
        let job = |pod: &str| ResyncJob {
            pod: Arc::from(pod),
            model: "m".into(),
            url: format!("http://{pod}/dump"),
        };
        for _ in 0..100 {
            sc.queue_resync(job("10.0.0.7:8000"));
        }
        sc.queue_resync(job("10.0.0.8:8000"));
        let mut queued = 0;
        while ch.resync.try_recv().is_ok() {
            queued += 1;
        }
        assert_eq!(queued, 2);
        assert_eq!(sc.metrics.resyncs.get("already_queued"), 99);
        sc.resync_done("10.0.0.7:8000");
        sc.queue_resync(job("10.0.0.7:8000"));
        assert!(
            ch.resync.try_recv().is_ok(),
            "after it is done, it may be asked again"
        );
    }
}
