//! The service's waiting rooms: one [`AdmissionQueue`] per model, holding the route
//! requests the gate found no room for, and the dispatcher that routes them again.
//!
//! A queued request is answered in two calls because the filter's route callout must
//! keep its short timeout (a hung sidecar fails open within it): the route call answers
//! `202` with a ticket at once, and the filter claims the decision with a wait call that
//! may last the request's TTL. Only a claimed request is dispatched — a decision nobody
//! will collect would hold load on a pod until its timeout — and the wait call's end is
//! the request's end: a client that disconnects makes Envoy cancel the callout, the
//! handler's future is dropped, and [`Claim`]'s drop takes the ticket out of the queue
//! (or releases the decision if one was made in the meantime).
//!
//! Lock order: a room's lock is taken before the registry and the ledger (the
//! dispatcher routes with it held, so a request leaves in exactly one place); nothing
//! that holds either of those takes a room.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_service::Shutdown;
use kvroute_shared::protocol::{AdmissionConfig, QueueState, RouteRequest, RouteResponse};
use parking_lot::{Mutex, RwLock};
use tokio::sync::{oneshot, Notify};

use super::{look, AdmissionQueue, Arrival, Headroom, Limits, Refusal, Step, Ticket};
use crate::route::{self, RouteError};
use crate::state::Sidecar;

/// How often a non-empty queue is looked at without a wake-up: projected prefill drains
/// with time, so room appears without any event saying so.
const LOOK_EVERY: Duration = Duration::from_millis(20);

/// Why a request the gate found no room for was not served by the router. Each is a
/// stable label (metrics, the 429 body's `reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shed {
    /// The queue was at a bound.
    Full,
    /// The request alone is larger than the queue's byte bound.
    TooLarge,
    /// Its band is marked sheddable: refused at once while saturated.
    Sheddable,
    /// Its TTL passed in the queue.
    Expired,
    /// A higher band's request took its place in a full queue.
    Displaced,
    /// Its filter did not claim it in time, or claimed a ticket that is not held.
    Unclaimed,
}

impl Shed {
    pub fn label(self) -> &'static str {
        match self {
            Shed::Full => "queue_full",
            Shed::TooLarge => "too_large",
            Shed::Sheddable => "shed",
            Shed::Expired => "expired",
            Shed::Displaced => "displaced",
            Shed::Unclaimed => "unclaimed",
        }
    }
}

impl From<Refusal> for Shed {
    fn from(r: Refusal) -> Shed {
        match r {
            Refusal::Full => Shed::Full,
            Refusal::TooLarge => Shed::TooLarge,
        }
    }
}

/// How a queued request left the queue.
#[derive(Debug)]
pub enum Verdict {
    Routed(RouteResponse),
    Refused(Shed),
    /// Routed again, it failed for another reason (its pods went away).
    Failed(RouteError),
    /// The sidecar is stopping: the filter sends the request on unsteered.
    Stopping,
}

/// What a route call with admission on comes to.
#[derive(Debug)]
pub enum Admitted {
    Routed(RouteResponse),
    Queued { ticket: Ticket, wait: Duration },
    Refused(Shed),
}

/// A held request: its route request as it will be routed (tokenized already) and, once
/// the filter's wait call came, where its verdict goes.
pub struct Held {
    req: Arc<RouteRequest>,
    claim: Option<oneshot::Sender<Verdict>>,
    claim_by: Instant,
}

type Room = Arc<Mutex<AdmissionQueue<Held>>>;

/// Every model's waiting room, and the dispatcher's wake-up.
#[derive(Default)]
pub struct Waiting {
    rooms: RwLock<HashMap<String, Room>>,
    wake: Notify,
    /// Set once the dispatcher stopped: nothing more is queued.
    closed: std::sync::atomic::AtomicBool,
    /// Decisions handed to wait calls lately, by (model, ticket): a cancel that crosses
    /// the answer on its way releases the decision (the filter that would have reported
    /// it is gone). Pruned after [`ANSWERED_KEEP`], at most [`MAX_ANSWERED`].
    answered: Mutex<HashMap<(String, Ticket), (String, Instant)>>,
    /// Per model, what the last state shared with the other replicas said (waiting and
    /// departures per tenant) and when it went: a state goes when that changes, and
    /// every [`SHARE_AGAIN`] while anything waits or left lately, so peers never take a
    /// live queue for a gone one.
    shared: Mutex<HashMap<String, (u64, Instant)>>,
}

/// A queue state unchanged is sent again after this long (peers trust one for
/// [`super::fleet::PEER_FRESH`]).
const SHARE_AGAIN: Duration = Duration::from_millis(500);

const ANSWERED_KEEP: Duration = Duration::from_secs(60);
const MAX_ANSWERED: usize = 1 << 16;

/// The headroom the config asks for.
pub fn headroom(a: &AdmissionConfig) -> Headroom {
    Headroom {
        max_backlog_s: a.max_backlog_s,
        max_waiting: a.max_waiting,
        max_inflight: a.max_inflight,
        cache_loss: a.cache_loss,
        reserve_inflight: a.reserve_inflight,
    }
}

/// The queue bounds the config asks for.
pub fn limits(a: &AdmissionConfig) -> Limits {
    Limits {
        max_requests: a.max_queued as usize,
        max_bytes: usize::try_from(a.max_queued_bytes).unwrap_or(usize::MAX),
    }
}

/// What holding a request costs against the byte bound.
fn held_bytes(req: &RouteRequest) -> usize {
    256 + req.chain.len() * 8
        + req.model.len()
        + req.session.as_ref().map_or(0, String::len)
        + req.request_id.as_ref().map_or(0, String::len)
}

impl Waiting {
    fn room(&self, model: &str) -> Option<Room> {
        self.rooms.read().get(model).cloned()
    }

    /// Every room with its model, out of the map's lock (a room's lock is taken after).
    fn named_rooms(&self) -> Vec<(String, Room)> {
        self.rooms
            .read()
            .iter()
            .map(|(m, r)| (m.clone(), r.clone()))
            .collect()
    }

    fn room_or_new(&self, model: &str, a: &AdmissionConfig) -> Room {
        if let Some(r) = self.room(model) {
            r.lock().set_limits(limits(a));
            return r;
        }
        self.rooms
            .write()
            .entry(model.to_owned())
            .or_insert_with(|| Arc::new(Mutex::new(AdmissionQueue::new(limits(a)))))
            .clone()
    }

    /// Have the dispatcher look now (a decision was released, load changed).
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Requests held, in all.
    pub fn len(&self) -> usize {
        let rooms: Vec<Room> = self.rooms.read().values().cloned().collect();
        rooms.iter().map(|r| r.lock().len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// (model, priority, tenant, requests) of everything held, and each model's bytes.
    pub fn depths(&self) -> Vec<(String, i32, Arc<str>, usize)> {
        let mut out = Vec::new();
        for (m, r) in self.named_rooms() {
            for (p, t, n) in r.lock().depths() {
                out.push((m.clone(), p, t, n));
            }
        }
        out.sort();
        out
    }

    /// Another replica's queue state, for its model's room ([`AdmissionQueue::apply_peer`]).
    /// A model this replica holds no room for has nothing to share turns with: ignored.
    pub fn apply_peer(&self, sc: &Sidecar, s: &QueueState, now: Instant) -> &'static str {
        let Some(room) = self.room(&s.model) else {
            return "no_room";
        };
        let applied = room.lock().apply_peer(sc.replica(), s, now);
        applied.map_or_else(|e| e.label(), |()| "applied")
    }

    /// Other replicas whose queue states are fresh, for the model that hears most.
    pub fn peers(&self, now: Instant) -> usize {
        let rooms: Vec<Room> = self.rooms.read().values().cloned().collect();
        rooms.iter().map(|r| r.lock().peers(now)).max().unwrap_or(0)
    }

    /// The states to send the other replicas now: each room's whose tenants' waiting
    /// or departures changed since it was last sent, or that was sent [`SHARE_AGAIN`]
    /// ago and still has tenants to speak of.
    pub fn states_to_share(&self, sc: &Sidecar, now: Instant) -> Vec<QueueState> {
        let rooms = self.named_rooms();
        let mut shared = self.shared.lock();
        let mut out = Vec::new();
        for (model, room) in rooms {
            let state = room.lock().state(sc.replica(), &model, now);
            let sig = signature(&state);
            let due = match shared.get(&model) {
                None => true,
                Some(&(last, at)) => {
                    last != sig
                        || (!state.bands.is_empty()
                            && now.saturating_duration_since(at) >= SHARE_AGAIN)
                }
            };
            if due {
                shared.insert(model, (sig, now));
                out.push(state);
            }
        }
        out
    }

    /// Route `req` (already [`route::tokenized`]) if a pod has room for it before
    /// `deadline`; else queue it for its filter to claim, or refuse it.
    pub fn admit(
        &self,
        sc: &Sidecar,
        req: RouteRequest,
        deadline: Option<std::time::SystemTime>,
        now: Instant,
    ) -> Result<Admitted, RouteError> {
        let cfg = sc.config();
        let a = &cfg.admission;
        let priority = a.priority(&req.admission);
        let top = priority >= top_priority(a);
        let waiting_above = self
            .room(&req.model)
            .is_some_and(|r| super::must_wait(&r.lock(), priority));
        // A newcomer does not overtake requests of its band or above already waiting.
        if !waiting_above {
            match route::route_gated(sc, &req, deadline, &headroom(a).for_request(top, false)) {
                Err(RouteError::Saturated) => {}
                Ok(r) => {
                    sc.metrics.admission.inc("routed", 1);
                    return Ok(Admitted::Routed(r));
                }
                Err(e) => return Err(e),
            }
        }
        if a.sheddable(priority) {
            return Ok(self.refused(sc, Shed::Sheddable));
        }
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            // Stopping: nobody would dispatch it. Routed past the gate, as without
            // admission, rather than refused.
            return route::route_until(sc, &req, deadline).map(Admitted::Routed);
        }
        let ttl = a.ttl(priority);
        let tenant: Arc<str> = req.admission.tenant.as_deref().unwrap_or("").into();
        let arrival = Arrival {
            priority,
            tenant,
            bytes: held_bytes(&req),
            ttl,
            item: Held {
                req: Arc::new(req.clone()),
                claim: None,
                claim_by: now + Duration::from_millis(a.claim_timeout_ms),
            },
        };
        let room = self.room_or_new(&req.model, a);
        let pushed = room.lock().push(arrival, now);
        match pushed {
            Ok(q) => {
                for e in q.displaced {
                    self.answer(sc, e.ticket, e.item, Verdict::Refused(Shed::Displaced), now);
                }
                sc.metrics.admission.inc("queued", 1);
                self.wake();
                Ok(Admitted::Queued {
                    ticket: q.ticket,
                    wait: ttl,
                })
            }
            Err(r) => Ok(self.refused(sc, r.into())),
        }
    }

    fn refused(&self, sc: &Sidecar, why: Shed) -> Admitted {
        sc.metrics.admission.inc(why.label(), 1);
        Admitted::Refused(why)
    }

    /// Claim a queued request's verdict: resolves when it leaves the queue. Dropping the
    /// future takes the request out (see [`Claim`]).
    pub async fn wait(&self, sc: &Arc<Sidecar>, model: &str, ticket: Ticket) -> Verdict {
        let Some(room) = self.room(model) else {
            sc.metrics.admission.inc(Shed::Unclaimed.label(), 1);
            return Verdict::Refused(Shed::Unclaimed);
        };
        let rx = {
            let mut q = room.lock();
            match q.get_mut(ticket) {
                Some(e) if e.item.claim.is_none() => {
                    let (tx, rx) = oneshot::channel();
                    e.item.claim = Some(tx);
                    rx
                }
                // Unknown (displaced, expired, unclaimed too long) or claimed twice.
                _ => {
                    sc.metrics.admission.inc(Shed::Unclaimed.label(), 1);
                    return Verdict::Refused(Shed::Unclaimed);
                }
            }
        };
        self.wake();
        let mut claim = Claim {
            sc: sc.clone(),
            room,
            ticket,
            rx: Some(rx),
        };
        let verdict = match claim.rx.as_mut() {
            Some(rx) => rx.await.unwrap_or(Verdict::Stopping),
            None => Verdict::Stopping,
        };
        claim.rx = None;
        verdict
    }

    /// Send a verdict to whoever claimed the request; if nobody will read it, a decision
    /// it carries is released at once.
    fn answer(&self, sc: &Sidecar, ticket: Ticket, held: Held, v: Verdict, now: Instant) {
        let label = match &v {
            Verdict::Routed(_) => "dispatched",
            Verdict::Refused(s) => s.label(),
            Verdict::Failed(_) => "failed",
            Verdict::Stopping => "stopping",
        };
        sc.metrics.admission.inc(label, 1);
        let Some(tx) = held.claim else {
            return;
        };
        let decision = match &v {
            Verdict::Routed(r) => r.decision.clone(),
            _ => None,
        };
        match tx.send(v) {
            Err(Verdict::Routed(r)) => {
                release(sc, r.decision.as_deref(), now);
            }
            Ok(()) => {
                if let Some(d) = decision {
                    let mut a = self.answered.lock();
                    if a.len() >= MAX_ANSWERED {
                        a.retain(|_, (_, at)| now.saturating_duration_since(*at) < ANSWERED_KEEP);
                    }
                    if a.len() < MAX_ANSWERED {
                        a.insert((held.req.model.clone(), ticket), (d, now));
                    }
                }
            }
            Err(_) => {}
        }
    }

    /// The filter says a queued request's client went away: it leaves the queue, or the
    /// decision it was given is released. Whether anything was found.
    pub fn cancel(&self, sc: &Sidecar, model: &str, ticket: Ticket) -> bool {
        if let Some(room) = self.room(model) {
            if room.lock().cancel(ticket).is_some() {
                sc.metrics.admission.inc("cancelled", 1);
                return true;
            }
        }
        let Some((decision, _)) = self.answered.lock().remove(&(model.to_owned(), ticket)) else {
            return false;
        };
        let released = release(sc, Some(&decision), Instant::now());
        if released {
            sc.metrics.admission.inc("cancelled", 1);
        }
        released
    }

    /// One look at every room: shed what expired or was never claimed, then route the
    /// claimed requests in dispatch order while pods have room for them.
    pub fn look(&self, sc: &Sidecar, now: Instant) {
        let cfg = sc.config();
        let a = &cfg.admission;
        self.answered
            .lock()
            .retain(|_, (_, at)| now.saturating_duration_since(*at) < ANSWERED_KEEP);
        let rooms: Vec<Room> = self.rooms.read().values().cloned().collect();
        for room in rooms {
            let mut out = Vec::new();
            {
                let mut q = room.lock();
                q.set_limits(limits(a));
                for e in q.expire(now) {
                    out.push((
                        e.ticket,
                        e.item,
                        Verdict::Refused(Shed::Expired),
                        e.enqueued,
                    ));
                }
                let lost: Vec<Ticket> = q
                    .order(usize::MAX)
                    .into_iter()
                    .filter(|t| {
                        q.get(*t)
                            .is_some_and(|e| e.item.claim.is_none() && e.item.claim_by <= now)
                    })
                    .collect();
                for t in lost {
                    if let Some(e) = q.cancel(t) {
                        out.push((
                            e.ticket,
                            e.item,
                            Verdict::Refused(Shed::Unclaimed),
                            e.enqueued,
                        ));
                    }
                }
                let top = top_priority(a);
                let h = headroom(a);
                let left = look(&mut q, now, |e, passed_over| {
                    if e.item.claim.as_ref().is_none_or(|c| c.is_closed()) {
                        return Step::Wait;
                    }
                    let gate = h.for_request(e.priority >= top, passed_over);
                    match route::route_gated(sc, &e.item.req, None, &gate) {
                        Err(RouteError::Saturated) => Step::Wait,
                        Ok(r) => Step::Leave(Verdict::Routed(r)),
                        Err(err) => Step::Leave(Verdict::Failed(err)),
                    }
                });
                for (e, v) in left {
                    out.push((e.ticket, e.item, v, e.enqueued));
                }
            }
            for (ticket, held, v, enqueued) in out {
                if matches!(v, Verdict::Routed(_)) {
                    sc.metrics
                        .admission_wait_seconds
                        .observe(now.saturating_duration_since(enqueued).as_secs_f64());
                }
                self.answer(sc, ticket, held, v, now);
            }
        }
    }

    /// The sidecar is stopping: every held request is answered so its filter sends it on
    /// unsteered now rather than at its TTL.
    pub fn close(&self, sc: &Sidecar) {
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        let now = Instant::now();
        let rooms: Vec<Room> = self.rooms.read().values().cloned().collect();
        for room in rooms {
            let held: Vec<(Ticket, Held)> = {
                let mut q = room.lock();
                std::iter::from_fn(|| q.pop().map(|e| (e.ticket, e.item))).collect()
            };
            for (t, h) in held {
                self.answer(sc, t, h, Verdict::Stopping, now);
            }
        }
    }
}

/// The highest priority the config names: requests at or above it may use the
/// in-flight slots kept for the top band.
pub fn top_priority(a: &AdmissionConfig) -> i32 {
    a.bands
        .iter()
        .map(|b| b.priority)
        .chain(a.objectives.values().copied())
        .fold(a.default_priority, i32::max)
}

/// Release a decision nobody will use (its claimant left between dispatch and answer);
/// whether it was still outstanding. The load it frees may let a queued request out.
fn release(sc: &Sidecar, decision: Option<&str>, now: Instant) -> bool {
    let Some(id) = decision.and_then(|d| sc.ledger().parse_id(d)) else {
        return false;
    };
    let cfg = sc.config();
    let Some((d, deltas)) = sc.ledger().release(id, now, &cfg) else {
        return false;
    };
    sc.settle(&d);
    sc.metrics.load_released.inc("abandoned", 1);
    sc.publish(deltas);
    sc.waiting.wake();
    true
}

/// A wait call in progress. Dropped before its verdict arrived (the client went away and
/// Envoy cancelled the call): the request leaves the queue, or, if it was dispatched in
/// the meantime, its decision is released.
struct Claim {
    sc: Arc<Sidecar>,
    room: Room,
    ticket: Ticket,
    rx: Option<oneshot::Receiver<Verdict>>,
}

impl Drop for Claim {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        if self.room.lock().cancel(self.ticket).is_some() {
            self.sc.metrics.admission.inc("cancelled", 1);
            return;
        }
        rx.close();
        if let Ok(Verdict::Routed(r)) = rx.try_recv() {
            self.sc.metrics.admission.inc("cancelled", 1);
            release(&self.sc, r.decision.as_deref(), Instant::now());
        }
    }
}

/// What a queue state says that its peers act on: who waits, and how many left.
fn signature(s: &QueueState) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for b in &s.bands {
        b.priority.hash(&mut h);
        for t in &b.tenants {
            (&t.tenant, t.waiting, t.left).hash(&mut h);
        }
    }
    h.finish()
}

/// The dispatcher: looks at the queues when woken (a report released load, a request
/// was claimed) and every [`LOOK_EVERY`] while any holds a request; on shutdown answers
/// every held request.
pub async fn run(sc: Arc<Sidecar>, mut shutdown: Shutdown) {
    loop {
        let idle = sc.waiting.is_empty();
        tokio::select! {
            _ = shutdown.wait() => break,
            _ = sc.waiting.wake.notified() => {}
            _ = tokio::time::sleep(LOOK_EVERY), if !idle => {}
        }
        let sc2 = sc.clone();
        // Routing takes the registry's and the ledger's locks: off the async workers.
        let r = tokio::task::spawn_blocking(move || sc2.waiting.look(&sc2, Instant::now())).await;
        if let Err(e) = r {
            tracing::error!("admission look failed: {e}");
        }
    }
    sc.waiting.close(&sc);
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_shared::protocol::{
        AdmissionBand, CompletionReport, PodRegistration, PolicyConfig,
    };

    /// Two pods taking one request each, a high band (priority 5, 30 s) above the
    /// default one (10 s) and a sheddable band below 0.
    fn fleet() -> (Arc<Sidecar>, impl Sized) {
        let admission = AdmissionConfig {
            enabled: true,
            max_inflight: 1,
            max_backlog_s: 1000.0,
            cache_loss: 1.0,
            bands: vec![
                AdmissionBand {
                    priority: -10,
                    ttl_s: 30.0,
                    sheddable: true,
                },
                AdmissionBand {
                    priority: 0,
                    ttl_s: 10.0,
                    sheddable: false,
                },
                AdmissionBand {
                    priority: 5,
                    ttl_s: 30.0,
                    sheddable: false,
                },
            ],
            objectives: [("interactive".to_string(), 5)].into(),
            ..AdmissionConfig::default()
        };
        let cfg = PolicyConfig {
            admission,
            ..PolicyConfig::default()
        };
        let (sc, ch) = Sidecar::new(cfg).expect("sidecar");
        for p in 0..2 {
            let reg: PodRegistration =
                serde_json::from_value(serde_json::json!({"model": "m"})).expect("reg");
            sc.register(&format!("10.0.0.{p}:8000"), reg)
                .expect("register");
        }
        (sc, ch)
    }

    fn req(n: u64, priority: Option<i32>, objective: Option<&str>) -> RouteRequest {
        RouteRequest {
            request_id: Some(format!("r{n}")),
            admission: kvroute_shared::protocol::Admission {
                priority,
                objective: objective.map(str::to_owned),
                tenant: None,
            },
            ..RouteRequest::tokens("m", 16, (n * 100..n * 100 + 8).collect())
        }
    }

    fn done(sc: &Sidecar, r: &RouteResponse) {
        crate::route::report(
            sc,
            &CompletionReport {
                decision: r.decision.clone().unwrap_or_default(),
                pod: r.pod.clone(),
                status: 200,
                ..Default::default()
            },
        );
    }

    fn routed(a: Result<Admitted, RouteError>) -> RouteResponse {
        match a {
            Ok(Admitted::Routed(r)) => r,
            other => panic!("expected routed, got {other:?}"),
        }
    }

    fn queued(a: Result<Admitted, RouteError>) -> Ticket {
        match a {
            Ok(Admitted::Queued { ticket, .. }) => ticket,
            other => panic!("expected queued, got {other:?}"),
        }
    }

    /// The whole life of queued requests: a saturated model queues them (a sheddable
    /// band is refused at once), a released decision lets the highest band out first,
    /// scored then; a claim dropped before its verdict leaves the queue; an unclaimed
    /// ticket is dropped after its claim timeout; a TTL ends in `expired`; nothing is
    /// left holding load.
    #[tokio::test]
    async fn queued_requests_leave_by_band_and_every_end_is_counted() {
        let (sc, _ch) = fleet();
        let w = &sc.waiting;
        let now = Instant::now();
        let a = routed(w.admit(&sc, req(1, None, None), None, now));
        let b = routed(w.admit(&sc, req(2, None, None), None, now));
        assert_ne!(a.pod, b.pod, "one request per pod");
        let low = queued(w.admit(&sc, req(3, None, None), None, now));
        let high = queued(w.admit(&sc, req(4, None, Some("interactive")), None, now));
        assert!(matches!(
            w.admit(&sc, req(5, Some(-5), None), None, now),
            Ok(Admitted::Refused(Shed::Sheddable))
        ));
        assert_eq!(w.len(), 2);
        // Both claimed; the first decision released lets the high band out.
        let (sc1, sc2) = (sc.clone(), sc.clone());
        let low_wait = tokio::spawn(async move { sc1.waiting.wait(&sc1, "m", low).await });
        let high_wait = tokio::spawn(async move { sc2.waiting.wait(&sc2, "m", high).await });
        while w.room("m").is_some_and(|r| {
            let q = r.lock();
            [low, high]
                .iter()
                .any(|t| q.get(*t).is_some_and(|e| e.item.claim.is_none()))
        }) {
            tokio::task::yield_now().await;
        }
        w.look(&sc, Instant::now());
        assert_eq!(w.len(), 2, "no room yet: nothing leaves");
        done(&sc, &a);
        w.look(&sc, Instant::now());
        let Verdict::Routed(h) = high_wait.await.expect("join") else {
            panic!("high band routed first")
        };
        assert_eq!(h.pod, a.pod, "to the pod that has room");
        assert_eq!(w.len(), 1);
        done(&sc, &b);
        w.look(&sc, Instant::now());
        let Verdict::Routed(l) = low_wait.await.expect("join") else {
            panic!("low band routed next")
        };
        assert_eq!(l.pod, b.pod);
        // Saturated again: a claim dropped before its verdict takes its request out.
        let t = queued(w.admit(&sc, req(6, None, None), None, Instant::now()));
        let sc3 = sc.clone();
        let dropped = tokio::spawn(async move { sc3.waiting.wait(&sc3, "m", t).await });
        tokio::task::yield_now().await;
        dropped.abort();
        let _ = dropped.await;
        assert_eq!(w.len(), 0, "the cancelled claim left the queue");
        // Never claimed: gone after the claim timeout; claimed later, it is unknown.
        let t = queued(w.admit(&sc, req(7, None, None), None, Instant::now()));
        w.look(&sc, Instant::now() + Duration::from_secs(2));
        assert_eq!(w.len(), 0);
        assert!(matches!(
            w.wait(&sc, "m", t).await,
            Verdict::Refused(Shed::Unclaimed)
        ));
        // Claimed but never given room: its TTL (10 s) ends it.
        let t = queued(w.admit(&sc, req(8, None, None), None, Instant::now()));
        let sc4 = sc.clone();
        let expiring = tokio::spawn(async move { sc4.waiting.wait(&sc4, "m", t).await });
        while w
            .room("m")
            .is_some_and(|r| r.lock().get(t).is_some_and(|e| e.item.claim.is_none()))
        {
            tokio::task::yield_now().await;
        }
        w.look(&sc, Instant::now() + Duration::from_secs(11));
        assert!(matches!(
            expiring.await.expect("join"),
            Verdict::Refused(Shed::Expired)
        ));
        let m = &sc.metrics.admission;
        for (label, n) in [
            ("routed", 2),
            ("queued", 5),
            ("shed", 1),
            ("dispatched", 2),
            ("cancelled", 1),
            ("unclaimed", 2),
            ("expired", 1),
        ] {
            assert_eq!(m.get(label), n, "{label}");
        }
        done(&sc, &h);
        done(&sc, &l);
        assert_eq!(
            sc.ledger().outstanding(),
            0,
            "no decision left holding load"
        );
    }

    /// A decision made for a claimant that left before reading it is released, not left
    /// on its pod until the load timeout.
    #[tokio::test]
    async fn a_decision_nobody_reads_is_released() {
        let (sc, _ch) = fleet();
        let w = &sc.waiting;
        let now = Instant::now();
        let a = routed(w.admit(&sc, req(1, None, None), None, now));
        let _b = routed(w.admit(&sc, req(2, None, None), None, now));
        let t = queued(w.admit(&sc, req(3, None, None), None, now));
        // A claim whose receiver is already gone when the verdict is sent.
        let (tx, rx) = oneshot::channel();
        if let Some(room) = w.room("m") {
            if let Some(e) = room.lock().get_mut(t) {
                e.item.claim = Some(tx);
            }
        }
        drop(rx);
        done(&sc, &a);
        let before = sc.ledger().outstanding();
        // The closed claim is skipped, not dispatched: nothing committed for it.
        w.look(&sc, Instant::now());
        assert_eq!(sc.ledger().outstanding(), before);
        assert_eq!(w.len(), 1, "left for its TTL or claim timeout");
    }

    /// Two replicas, each saturated: the one whose heavy tenant has had requests leave
    /// holds its next one back while the other replica's light tenant waits (until the
    /// hold's bound), having heard it from the other's queue state; a state goes out
    /// when it changes and not again until [`SHARE_AGAIN`] while it does not.
    #[tokio::test]
    async fn a_replica_holds_back_for_a_tenant_behind_at_another() {
        let tenant = |r: RouteRequest, t: &str| RouteRequest {
            admission: kvroute_shared::protocol::Admission {
                tenant: Some(t.into()),
                ..r.admission
            },
            ..r
        };
        let claim = |sc: &Arc<Sidecar>, t: Ticket| {
            let sc = sc.clone();
            tokio::spawn(async move { sc.waiting.wait(&sc, "m", t).await })
        };
        async fn claimed(sc: &Sidecar, t: Ticket) {
            while sc
                .waiting
                .room("m")
                .is_some_and(|r| r.lock().get(t).is_some_and(|e| e.item.claim.is_none()))
            {
                tokio::task::yield_now().await;
            }
        }
        let ((a, _ca), (b, _cb)) = (fleet(), fleet());
        let now = Instant::now();
        let mut running: Vec<RouteResponse> = (1..=2)
            .map(|n| routed(a.waiting.admit(&a, req(n, None, None), None, now)))
            .collect();
        let heavy: Vec<Ticket> = (3..=5)
            .map(|n| {
                queued(
                    a.waiting
                        .admit(&a, tenant(req(n, None, None), "heavy"), None, now),
                )
            })
            .collect();
        let mut waits: Vec<_> = heavy.iter().map(|&t| claim(&a, t)).collect();
        for &t in &heavy {
            claimed(&a, t).await;
        }
        // Two heavy requests leave as room appears.
        for _ in 0..2 {
            done(&a, &running.remove(0));
            a.waiting.look(&a, Instant::now());
            let Verdict::Routed(r) = waits.remove(0).await.expect("join") else {
                panic!("routed")
            };
            running.push(r);
        }
        // The other replica is saturated too, and its light tenant waits.
        for n in 6..=7 {
            routed(b.waiting.admit(&b, req(n, None, None), None, now));
        }
        queued(
            b.waiting
                .admit(&b, tenant(req(8, None, None), "light"), None, now),
        );
        let states = b.waiting.states_to_share(&b, now);
        assert_eq!(states.len(), 1);
        assert!(
            b.waiting.states_to_share(&b, now).is_empty(),
            "unchanged: not sent again yet"
        );
        assert_eq!(
            b.waiting.states_to_share(&b, now + SHARE_AGAIN).len(),
            1,
            "sent again while a tenant waits"
        );
        assert_eq!(
            a.waiting.apply_peer(&a, &states[0], Instant::now()),
            "applied"
        );
        assert_eq!(b.waiting.apply_peer(&b, &states[0], Instant::now()), "own");
        // Room on replica a: its heavy request stays for the light one...
        done(&a, &running.remove(0));
        a.waiting.look(&a, Instant::now());
        assert_eq!(a.waiting.len(), 1, "held back for the light tenant");
        // Light still waits there (b keeps saying so); past the hold's bound a takes
        // the room itself.
        let later = Instant::now() + crate::admission::fleet::YIELD_FOR + Duration::from_millis(10);
        let again = b.waiting.states_to_share(&b, later);
        assert_eq!(a.waiting.apply_peer(&a, &again[0], later), "applied");
        a.waiting.look(&a, later);
        let Verdict::Routed(_) = waits.remove(0).await.expect("join") else {
            panic!("routed after the hold")
        };
        assert!(a.waiting.is_empty());
    }
}
