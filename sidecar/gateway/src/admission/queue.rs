//! The waiting room of one model while its pods are saturated: requests held in
//! priority bands, tenants served in turn inside a band, bounded in count and bytes, each
//! entry with the deadline its band's TTL gave it.
//!
//! Pure data, no clock and no I/O: every operation takes `now`, so the service's
//! dispatcher and the simulator's virtual clock drive the same code. The queue decides
//! *order* and *who is refused*; whether the head may leave (the fleet has room for it,
//! scored as things are at that moment) is the caller's question, asked with
//! [`AdmissionQueue::front`] before [`AdmissionQueue::pop`].
//!
//! Shape: bands in a `BTreeMap` keyed by descending priority (a lower band waits while
//! any higher one holds a request); inside a band one FIFO per tenant and a rotation of
//! the tenants that have requests, so a tenant sending ten times more still leaves one
//! request per turn. A ticket index finds an entry for cancellation (a client that went
//! away) without scanning every band.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_shared::protocol::QueueState;

use super::fleet::{Fleet, PeerRefusal};

/// A queued request's handle.
pub type Ticket = u64;

/// Times a tenant's waiting requests are passed over by another tenant's before its next
/// one takes room off its cache ([`AdmissionQueue::passed_over`]): once spilled every
/// contested request of the light tenant at 10:1 (hit 0.855 → 0.819, against 0.831 at
/// two), three left it 37% of the contested turns.
pub const PASSED_TO_RELAX: u32 = 2;
/// How many times more requests another waiting tenant must have had leave for one to
/// count as behind.
pub const BEHIND_FACTOR: u64 = 4;
/// What each tenant's count of contested turns (requests of its that left while another
/// tenant of the band waited) keeps per contested departure: about the last
/// `1 / (1 - TURNS_DECAY)` = 33 of them count.
const TURNS_DECAY: f64 = 0.97;
/// A tenant whose recent contested turns are under this fraction of an even share (half
/// of them with two tenants waiting) is behind after one pass instead of
/// [`PASSED_TO_RELAX`]. At 10:1 (seeds 1-6, one gateway) two passes always left the
/// light tenant 39-45% of the contested turns, one pass always 49-55% at hit 0.799-0.819;
/// one pass while short of its share, 45-47% at 0.799-0.822 (queue-less: 0.756-0.786);
/// with the reserved slots open to it too ([`super::Headroom::for_request`]), 44-47% at
/// 0.849-0.858.
pub const SHARE_FLOOR: f64 = 0.9;
/// Contested turns counted before a share is judged at all.
const TURNS_TO_JUDGE: f64 = 4.0;

/// The queue's bounds, both hard: a request that would cross one is refused (or, if a
/// lower band holds requests, the newest of the lowest band makes room for it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_requests: usize,
    pub max_bytes: usize,
}

/// What a request asks of the queue.
#[derive(Clone, Debug)]
pub struct Arrival<T> {
    pub priority: i32,
    pub tenant: Arc<str>,
    /// What holding the request costs (its route request's size, counted against
    /// [`Limits::max_bytes`]).
    pub bytes: usize,
    /// How long it may wait (its band's TTL).
    pub ttl: Duration,
    pub item: T,
}

/// A held request.
#[derive(Clone, Debug)]
pub struct Entry<T> {
    pub ticket: Ticket,
    pub priority: i32,
    pub tenant: Arc<str>,
    pub bytes: usize,
    pub enqueued: Instant,
    pub deadline: Instant,
    pub item: T,
}

/// Why an arrival was not queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The queue is at a bound and holds nothing of a lower band to make room.
    Full,
    /// The request alone is larger than the byte bound.
    TooLarge,
}

impl Refusal {
    /// Stable label (metrics, error bodies).
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Full => "queue_full",
            Refusal::TooLarge => "too_large",
        }
    }
}

/// The result of [`AdmissionQueue::push`]: the ticket, and the requests pushed out to
/// make room (each must be answered: they were refused after all).
#[derive(Debug)]
pub struct Queued<T> {
    pub ticket: Ticket,
    pub displaced: Vec<Entry<T>>,
}

struct Band<T> {
    tenants: HashMap<Arc<str>, VecDeque<Entry<T>>>,
    /// Tenants with requests, next to be served first; each appears once.
    turn: VecDeque<Arc<str>>,
    /// Tenants whose first request waited (for room where its cache is) while another
    /// tenant's request of the band left, since their last request left.
    passed: HashMap<Arc<str>, u32>,
    /// Requests each tenant with requests here has had leave since it last had none.
    served: HashMap<Arc<str>, u64>,
    /// Each tenant's recent contested turns, decayed by [`TURNS_DECAY`] per contested
    /// departure; a tenant whose count falls under 0.01 is forgotten, so the map holds
    /// no more tenants than about the last 150 such departures had.
    turns: HashMap<Arc<str>, f64>,
    len: usize,
}

impl<T> Band<T> {
    /// `tenant`'s request left: a contested turn if another tenant still waits here.
    fn count_turn(&mut self, tenant: &Arc<str>) {
        if !self.tenants.keys().any(|t| t != tenant) {
            return;
        }
        self.turns.retain(|_, n| {
            *n *= TURNS_DECAY;
            *n >= 0.01
        });
        *self.turns.entry(tenant.clone()).or_insert(0.0) += 1.0;
    }

    /// Whether `tenant` has had under [`SHARE_FLOOR`] of an even share of the recent
    /// contested turns among the tenants waiting here now.
    fn short_of_turns(&self, tenant: &str) -> bool {
        let waiting = self.tenants.len();
        if waiting < 2 || !self.tenants.contains_key(tenant) {
            return false;
        }
        let of = |t: &str| self.turns.get(t).copied().unwrap_or(0.0);
        let total: f64 = self.tenants.keys().map(|t| of(t)).sum();
        total >= TURNS_TO_JUDGE && of(tenant) < SHARE_FLOOR / waiting as f64 * total
    }
}

impl<T> Default for Band<T> {
    fn default() -> Self {
        Band {
            tenants: HashMap::new(),
            turn: VecDeque::new(),
            passed: HashMap::new(),
            served: HashMap::new(),
            turns: HashMap::new(),
            len: 0,
        }
    }
}

pub struct AdmissionQueue<T> {
    limits: Limits,
    bands: BTreeMap<Reverse<i32>, Band<T>>,
    /// Ticket → (band, tenant) of every held entry.
    where_is: HashMap<Ticket, (i32, Arc<str>)>,
    bytes: usize,
    next: Ticket,
    /// The other replicas' queues and this one's departures (tenants' turns across
    /// replicas).
    fleet: Fleet,
}

impl<T> AdmissionQueue<T> {
    pub fn new(limits: Limits) -> Self {
        AdmissionQueue {
            limits,
            bands: BTreeMap::new(),
            where_is: HashMap::new(),
            bytes: 0,
            next: 1,
            fleet: Fleet::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.where_is.len()
    }

    pub fn is_empty(&self) -> bool {
        self.where_is.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// New bounds (a reloaded config). Entries already held stay: a smaller bound only
    /// refuses arrivals until the queue drains under it.
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    /// The highest priority with a request waiting.
    pub fn top_priority(&self) -> Option<i32> {
        self.bands.keys().next().map(|Reverse(p)| *p)
    }

    /// Queue a request, pushing out the newest requests of the lowest band below its
    /// own if that is what it takes to stay within the bounds.
    pub fn push(&mut self, a: Arrival<T>, now: Instant) -> Result<Queued<T>, Refusal> {
        if a.bytes > self.limits.max_bytes {
            return Err(Refusal::TooLarge);
        }
        let over = |q: &Self, extra: usize| {
            q.len() + 1 > q.limits.max_requests || q.bytes + extra > q.limits.max_bytes
        };
        // Find the room first and take it only if there is enough: a refused arrival
        // must not have displaced anyone.
        if over(self, a.bytes) {
            let (mut n, mut b) = (self.len(), self.bytes);
            let mut victims = Vec::new();
            'find: for (Reverse(p), band) in self.bands.iter().rev() {
                if *p >= a.priority {
                    break;
                }
                for tenant in band.turn.iter().rev() {
                    for e in band.tenants[tenant].iter().rev() {
                        victims.push(e.ticket);
                        n -= 1;
                        b -= e.bytes;
                        if n < self.limits.max_requests && b + a.bytes <= self.limits.max_bytes {
                            break 'find;
                        }
                    }
                }
            }
            if n + 1 > self.limits.max_requests || b + a.bytes > self.limits.max_bytes {
                return Err(Refusal::Full);
            }
            let displaced = victims.into_iter().filter_map(|t| self.cancel(t)).collect();
            let ticket = self.insert(a, now);
            return Ok(Queued { ticket, displaced });
        }
        let ticket = self.insert(a, now);
        Ok(Queued {
            ticket,
            displaced: Vec::new(),
        })
    }

    fn insert(&mut self, a: Arrival<T>, now: Instant) -> Ticket {
        let ticket = self.next;
        self.next += 1;
        let band = self.bands.entry(Reverse(a.priority)).or_default();
        let fifo = band.tenants.entry(a.tenant.clone()).or_default();
        if fifo.is_empty() {
            band.turn.push_back(a.tenant.clone());
        }
        fifo.push_back(Entry {
            ticket,
            priority: a.priority,
            tenant: a.tenant.clone(),
            bytes: a.bytes,
            enqueued: now,
            deadline: now + a.ttl,
            item: a.item,
        });
        band.len += 1;
        self.bytes += a.bytes;
        self.where_is.insert(ticket, (a.priority, a.tenant));
        ticket
    }

    /// A held request by its ticket.
    pub fn get(&self, ticket: Ticket) -> Option<&Entry<T>> {
        let (priority, tenant) = self.where_is.get(&ticket)?;
        self.bands
            .get(&Reverse(*priority))?
            .tenants
            .get(tenant)?
            .iter()
            .find(|e| e.ticket == ticket)
    }

    pub fn get_mut(&mut self, ticket: Ticket) -> Option<&mut Entry<T>> {
        let (priority, tenant) = self.where_is.get(&ticket)?;
        self.bands
            .get_mut(&Reverse(*priority))?
            .tenants
            .get_mut(tenant)?
            .iter_mut()
            .find(|e| e.ticket == ticket)
    }

    /// The request that leaves next: the highest band's, from the tenant whose turn it is.
    pub fn front(&self) -> Option<&Entry<T>> {
        let band = self.bands.values().next()?;
        let tenant = band.turn.front()?;
        band.tenants.get(tenant)?.front()
    }

    /// Take [`Self::front`] out; its tenant goes to the back of its band's turn.
    pub fn pop(&mut self) -> Option<Entry<T>> {
        let (&key, band) = self.bands.iter_mut().next()?;
        let tenant = band.turn.pop_front()?;
        let fifo = band.tenants.get_mut(&tenant)?;
        let e = fifo.pop_front()?;
        if fifo.is_empty() {
            band.tenants.remove(&tenant);
        } else {
            band.turn.push_back(tenant);
        }
        band.len -= 1;
        if band.len == 0 {
            self.bands.remove(&key);
        }
        self.bytes -= e.bytes;
        self.where_is.remove(&e.ticket);
        Some(e)
    }

    /// The next `limit` tickets in the order [`Self::pop`] would give them: the highest
    /// band first, its tenants in turn. A dispatcher whose head cannot leave yet (its
    /// cache's pod has no room) looks further with it instead of blocking the rest.
    pub fn order(&self, limit: usize) -> Vec<Ticket> {
        let mut out = Vec::with_capacity(limit.min(self.len()));
        for band in self.bands.values() {
            let mut fifos: Vec<_> = band
                .turn
                .iter()
                .filter_map(|t| band.tenants.get(t).map(|f| f.iter()))
                .collect();
            while out.len() < limit && !fifos.is_empty() {
                fifos.retain_mut(|f| match f.next() {
                    Some(e) if out.len() < limit => {
                        out.push(e.ticket);
                        true
                    }
                    _ => false,
                });
            }
            if out.len() >= limit {
                break;
            }
        }
        out
    }

    /// Another tenant's request of `priority`'s band left while `tenant`'s waited.
    pub fn note_passed(&mut self, priority: i32, tenant: &Arc<str>) {
        if let Some(band) = self.bands.get_mut(&Reverse(priority)) {
            if band.tenants.contains_key(tenant) {
                *band.passed.entry(tenant.clone()).or_insert(0) += 1;
            }
        }
    }

    /// Whether `tenant` is behind in `priority`'s band: its requests were passed over
    /// [`PASSED_TO_RELAX`] times since one of them last left (once, while its share of
    /// the recent contested turns is under [`SHARE_FLOOR`] of an even one), and another
    /// tenant waiting there has had over [`BEHIND_FACTOR`] times as many leave. Its next
    /// one should take room wherever there is some. Tenants of about equal volume are
    /// never behind (the turns already share between them; relaxing them spilled prompts
    /// off their caches, 0.855 → 0.78 hit rate with four equal tenants), nor is the one
    /// served most.
    pub fn passed_over(&self, priority: i32, tenant: &str) -> bool {
        let Some(b) = self.bands.get(&Reverse(priority)) else {
            return false;
        };
        let mine = b.served.get(tenant).copied().unwrap_or(0);
        let needed = if b.short_of_turns(tenant) {
            1
        } else {
            PASSED_TO_RELAX
        };
        b.passed.get(tenant).is_some_and(|&n| n >= needed)
            && b.served.iter().any(|(t, &n)| {
                &**t != tenant && n > BEHIND_FACTOR * mine && b.tenants.contains_key(t)
            })
    }

    /// Take a request out to dispatch it: its tenant's turn is used (it goes to the back
    /// of its band's turn), as with [`Self::pop`], and counted for the other replicas.
    pub fn take(&mut self, ticket: Ticket, now: Instant) -> Option<Entry<T>> {
        let e = self.cancel(ticket)?;
        self.fleet.left(e.priority, &e.tenant, now);
        if let Some(band) = self.bands.get_mut(&Reverse(e.priority)) {
            band.count_turn(&e.tenant);
            band.passed.remove(&e.tenant);
            if band.tenants.contains_key(&e.tenant) {
                *band.served.entry(e.tenant.clone()).or_insert(0) += 1;
            }
            if let Some(at) = band.turn.iter().position(|t| *t == e.tenant) {
                if let Some(t) = band.turn.remove(at) {
                    band.turn.push_back(t);
                }
            }
        }
        Some(e)
    }

    /// This queue as the other replicas need it ([`Fleet::state`]).
    pub fn state(&mut self, replica: &str, model: &str, now: Instant) -> QueueState {
        self.fleet.state(replica, model, &self.depths(), now)
    }

    /// Another replica's state ([`Fleet::apply`]). Its departures do not count as
    /// passing this queue's tenants over: relaxing them for it spilled the light
    /// tenant's prompts off their caches (hit 0.822 → 0.802 behind four replicas).
    pub fn apply_peer(
        &mut self,
        own: &str,
        s: &QueueState,
        now: Instant,
    ) -> Result<(), PeerRefusal> {
        self.fleet.apply(own, s, now)
    }

    /// Whether `tenant`'s request should leave room to a tenant behind it waiting at
    /// another replica ([`Fleet::yields`]).
    pub fn yields(&mut self, priority: i32, tenant: &Arc<str>, now: Instant) -> bool {
        self.fleet.yields(priority, tenant, now)
    }

    /// Peers whose states are fresh.
    pub fn peers(&self, now: Instant) -> usize {
        self.fleet.peers(now)
    }

    /// Remove a request (its client left, or its answer is no longer wanted).
    pub fn cancel(&mut self, ticket: Ticket) -> Option<Entry<T>> {
        let (priority, tenant) = self.where_is.remove(&ticket)?;
        let key = Reverse(priority);
        let band = self.bands.get_mut(&key)?;
        let fifo = band.tenants.get_mut(&tenant)?;
        let at = fifo.iter().position(|e| e.ticket == ticket)?;
        let e = fifo.remove(at)?;
        if fifo.is_empty() {
            band.tenants.remove(&tenant);
            band.turn.retain(|t| *t != tenant);
            band.passed.remove(&tenant);
            band.served.remove(&tenant);
        }
        band.len -= 1;
        if band.len == 0 {
            self.bands.remove(&key);
        }
        self.bytes -= e.bytes;
        Some(e)
    }

    /// Take out every request whose deadline has passed, oldest band order kept.
    pub fn expire(&mut self, now: Instant) -> Vec<Entry<T>> {
        let due: Vec<Ticket> = self
            .bands
            .values()
            .flat_map(|b| b.tenants.values())
            .flat_map(|f| f.iter())
            .filter(|e| e.deadline <= now)
            .map(|e| e.ticket)
            .collect();
        due.into_iter().filter_map(|t| self.cancel(t)).collect()
    }

    /// The earliest deadline held (when the dispatcher must next look).
    pub fn next_deadline(&self) -> Option<Instant> {
        self.bands
            .values()
            .flat_map(|b| b.tenants.values())
            .filter_map(|f| f.iter().map(|e| e.deadline).min())
            .min()
    }

    /// Requests held per (priority, tenant), for metrics and the status page.
    pub fn depths(&self) -> Vec<(i32, Arc<str>, usize)> {
        self.bands
            .iter()
            .flat_map(|(Reverse(p), b)| b.tenants.iter().map(|(t, f)| (*p, t.clone(), f.len())))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arrival(priority: i32, tenant: &str, bytes: usize, item: u32) -> Arrival<u32> {
        Arrival {
            priority,
            tenant: tenant.into(),
            bytes,
            ttl: Duration::from_secs(10),
            item,
        }
    }

    fn q(max_requests: usize, max_bytes: usize) -> AdmissionQueue<u32> {
        AdmissionQueue::new(Limits {
            max_requests,
            max_bytes,
        })
    }

    fn drain(q: &mut AdmissionQueue<u32>) -> Vec<u32> {
        std::iter::from_fn(|| q.pop().map(|e| e.item)).collect()
    }

    #[test]
    fn higher_bands_leave_first_and_tenants_take_turns() {
        let now = Instant::now();
        let mut q = q(100, 1 << 20);
        // Tenant a floods the low band ten to one; b sends one; a high request comes last.
        for i in 0..10 {
            q.push(arrival(0, "a", 10, i), now).expect("queued");
        }
        q.push(arrival(0, "b", 10, 100), now).expect("queued");
        q.push(arrival(0, "b", 10, 101), now).expect("queued");
        q.push(arrival(5, "a", 10, 500), now).expect("queued");
        assert_eq!(q.top_priority(), Some(5));
        assert_eq!(q.front().map(|e| e.item), Some(500));
        let order = drain(&mut q);
        assert_eq!(order[..5], [500, 0, 100, 1, 101]);
        assert_eq!(order[5..], [2, 3, 4, 5, 6, 7, 8, 9]);
        assert!(q.is_empty());
        assert_eq!(q.bytes(), 0);
        assert!(q.depths().is_empty());
    }

    #[test]
    fn order_is_what_pop_would_give_and_take_uses_the_turn() {
        let now = Instant::now();
        let mut q = q(100, 1 << 20);
        for (p, t, i) in [
            (0, "a", 1),
            (0, "a", 2),
            (0, "b", 3),
            (1, "c", 4),
            (0, "a", 5),
        ] {
            q.push(arrival(p, t, 1, i), now).expect("queued");
        }
        let order = q.order(10);
        let items: Vec<u32> = {
            let mut copy = super::AdmissionQueue::new(q.limits());
            for (p, t, i) in [
                (0, "a", 1),
                (0, "a", 2),
                (0, "b", 3),
                (1, "c", 4),
                (0, "a", 5),
            ] {
                copy.push(arrival(p, t, 1, i), now).expect("queued");
            }
            drain(&mut copy)
        };
        assert_eq!(items, [4, 1, 3, 2, 5]);
        assert_eq!(order, [4, 1, 3, 2, 5], "tickets equal items here");
        assert_eq!(q.order(2), [4, 1]);
        // Taking tenant a's first request moves a behind b.
        assert_eq!(q.take(1, Instant::now()).map(|e| e.item), Some(1));
        assert_eq!(drain(&mut q), [4, 3, 2, 5]);
    }

    /// Through `look`: a light tenant whose request waits for its cache's pod while a
    /// heavy tenant's leave is behind after being passed over twice, and then takes room
    /// anywhere; equal tenants never are.
    #[test]
    fn a_tenant_passed_over_and_far_behind_takes_room_anywhere() {
        let now = Instant::now();
        let mut q1 = q(100, 1 << 20);
        for i in 0..20 {
            q1.push(arrival(0, "heavy", 1, i), now).expect("queued");
        }
        q1.push(arrival(0, "light", 1, 100), now).expect("queued");
        // Every heavy request has room; the light one only when told it is behind.
        let mut relaxed_light = 0;
        for _ in 0..12 {
            let left = crate::admission::look(&mut q1, now, |e, behind| {
                if e.tenant.as_ref() == "light" {
                    if behind {
                        relaxed_light += 1;
                        return crate::admission::Step::Leave(());
                    }
                    return crate::admission::Step::Wait;
                }
                crate::admission::Step::Leave(())
            });
            if left.iter().any(|(e, _)| e.tenant.as_ref() == "light") {
                break;
            }
        }
        assert_eq!(
            relaxed_light, 1,
            "the light request left once it was behind"
        );
        assert!(!q1.passed_over(0, "light"), "it left: its count is gone");
        // Two tenants of equal volume: passed over, but not behind.
        let mut q2 = q(100, 1 << 20);
        for i in 0..6 {
            q2.push(arrival(0, "a", 1, i), now).expect("queued");
            q2.push(arrival(0, "b", 1, 10 + i), now).expect("queued");
        }
        for _ in 0..3 {
            let t = q2.order(1)[0];
            q2.take(t, Instant::now());
        }
        q2.note_passed(0, &Arc::from("a"));
        q2.note_passed(0, &Arc::from("a"));
        assert!(!q2.passed_over(0, "a"));
    }

    /// A tenant that has had its share of the recent contested turns is behind after two
    /// passes; one short of it, after one.
    #[test]
    fn a_tenant_short_of_its_turns_is_behind_after_one_pass() {
        let now = Instant::now();
        let light: Arc<str> = Arc::from("light");
        let mut q = q(100, 1 << 20);
        for i in 0..40 {
            q.push(arrival(0, "heavy", 1, i), now).expect("queued");
        }
        let take_heavy = |q: &mut AdmissionQueue<u32>| {
            let t = q
                .order(100)
                .into_iter()
                .find(|t| q.get(*t).is_some_and(|e| e.tenant.as_ref() == "heavy"))
                .expect("a heavy request");
            q.take(t, now).expect("taken");
        };
        // Turns taken in alternation, each while the other tenant waited.
        for i in 0..5 {
            let t = q
                .push(arrival(0, "light", 1, 100 + i), now)
                .expect("queued")
                .ticket;
            q.take(t, now).expect("taken");
            take_heavy(&mut q);
        }
        let t = q
            .push(arrival(0, "light", 1, 200), now)
            .expect("queued")
            .ticket;
        q.note_passed(0, &light);
        assert!(!q.passed_over(0, "light"), "it had its share: two passes");
        q.note_passed(0, &light);
        assert!(q.passed_over(0, "light"));
        q.take(t, now).expect("taken");
        // Then eight of the heavy tenant's leave while the light one's next waits.
        q.push(arrival(0, "light", 1, 300), now).expect("queued");
        for _ in 0..8 {
            take_heavy(&mut q);
        }
        assert!(!q.passed_over(0, "light"), "not passed over yet");
        q.note_passed(0, &light);
        assert!(q.passed_over(0, "light"), "short of its turns: one pass");
    }

    #[test]
    fn bounds_refuse_or_displace_only_lower_bands() {
        let now = Instant::now();
        let mut q = q(3, 1000);
        for i in 0..3 {
            q.push(arrival(0, "a", 100, i), now).expect("queued");
        }
        // Same band: nothing lower to make room.
        assert_eq!(
            q.push(arrival(0, "b", 1, 9), now).err(),
            Some(Refusal::Full)
        );
        assert_eq!(q.len(), 3);
        // A higher band pushes out the newest low request.
        let got = q.push(arrival(1, "b", 100, 10), now).expect("queued");
        let out: Vec<u32> = got.displaced.iter().map(|e| e.item).collect();
        assert_eq!(out, [2]);
        assert_eq!(q.len(), 3);
        // Bytes: 300 held (two low, one of band 1). A band-1 request of 901 bytes would
        // need the other band-1 one gone too: refused, and nobody displaced.
        let got = q.push(arrival(1, "c", 901, 11), now);
        assert_eq!(got.err(), Some(Refusal::Full));
        assert_eq!(q.len(), 3, "a refusal displaces nobody");
        // 800 bytes of band 2 fit once the newest low one leaves.
        let got = q.push(arrival(2, "c", 800, 12), now).expect("queued");
        let out: Vec<u32> = got.displaced.iter().map(|e| e.item).collect();
        assert_eq!(out, [1]);
        assert_eq!(q.bytes(), 1000);
        assert_eq!(
            q.push(arrival(9, "d", 1001, 13), now).err(),
            Some(Refusal::TooLarge)
        );
        assert_eq!(drain(&mut q), [12, 10, 0]);
    }

    #[test]
    fn deadlines_expire_and_cancel_removes_exactly_one() {
        let now = Instant::now();
        let mut q = q(100, 1 << 20);
        let mut short = arrival(0, "a", 1, 1);
        short.ttl = Duration::from_secs(1);
        q.push(short, now).expect("queued");
        let t2 = q.push(arrival(0, "a", 1, 2), now).expect("queued").ticket;
        q.push(arrival(0, "b", 1, 3), now).expect("queued");
        assert_eq!(q.next_deadline(), Some(now + Duration::from_secs(1)));
        assert!(q.expire(now).is_empty());
        let gone: Vec<u32> = q
            .expire(now + Duration::from_secs(1))
            .into_iter()
            .map(|e| e.item)
            .collect();
        assert_eq!(gone, [1]);
        assert_eq!(q.cancel(t2).map(|e| e.item), Some(2));
        assert!(q.cancel(t2).is_none(), "a ticket cancels once");
        assert_eq!(q.depths(), vec![(0, Arc::from("b"), 1)]);
        assert_eq!(drain(&mut q), [3]);
        assert_eq!(q.bytes(), 0);
    }

    /// Random operations keep the counters equal to what is held, and the bounds.
    #[test]
    fn bookkeeping_holds_under_random_operations() {
        let now = Instant::now();
        let mut q = q(20, 2000);
        let mut x: u64 = 7;
        let mut rnd = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let mut tickets = Vec::new();
        for step in 0..5000u32 {
            let t = now + Duration::from_millis(step as u64);
            match rnd(10) {
                0..=4 => {
                    let mut a = arrival(
                        rnd(3) as i32,
                        ["a", "b", "c"][rnd(3) as usize],
                        1 + rnd(300) as usize,
                        step,
                    );
                    a.ttl = Duration::from_millis(1 + rnd(200));
                    if let Ok(got) = q.push(a, t) {
                        tickets.push(got.ticket);
                    }
                }
                5 | 6 => {
                    q.pop();
                }
                7 => {
                    if !tickets.is_empty() {
                        let i = rnd(tickets.len() as u64) as usize;
                        q.cancel(tickets.swap_remove(i));
                    }
                }
                _ => {
                    assert!(q.expire(t).iter().all(|e| e.deadline <= t));
                }
            }
            assert!(q.len() <= 20 && q.bytes() <= 2000);
            let held: usize = q.depths().iter().map(|d| d.2).sum();
            assert_eq!(held, q.len());
        }
    }
}
