//! The tenants' turns across gateway replicas: what the other replicas' queues hold,
//! heard from their [`QueueState`]s, and this replica's own departures, so that a
//! replica about to let a request leave can leave the room to a tenant that waits at
//! another replica and is behind.
//!
//! Why it is needed: each replica holds the requests its filters sent, and room on a
//! pod is first seen by the replica whose request there ended, which fills it from its
//! own queue. A tenant's request therefore waits for room that its own replica frees:
//! behind four replicas a light tenant's turn comes a quarter as often, and it waited
//! 1.2-1.9 s where one gateway kept it at 0.5-0.7 s, fairly served replica by replica.
//!
//! Shape: counts per (priority, tenant) — a counter of departures and the same decayed
//! over [`FAIR_WINDOW_S`] — kept for this replica and for every peer as last heard.
//! A replica holds a request back while another tenant of its band waits at a peer and
//! is behind in the fleet's departures, at most [`YIELD_FOR`] per departure of that
//! tenant, so a peer that cannot use the room costs the fleet that long and no more.
//! Pure data, every method takes `now`: the queue that owns it is driven by the service
//! and the simulator alike.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_shared::protocol::{BandState, QueueState, TenantState};

/// Seconds over which a tenant's departures count towards its share (decayed
/// exponentially): long enough to span a few turns of a light tenant, short enough that
/// a tenant back after a quiet spell is not owed its whole absence.
pub const FAIR_WINDOW_S: f64 = 10.0;
/// A peer's state older than this is ignored (the replica may be gone).
pub const PEER_FRESH: Duration = Duration::from_secs(2);
/// A peer not heard for this long is forgotten.
const PEER_FORGET: Duration = Duration::from_secs(30);
/// How long this replica leaves room for one waiting peer tenant before it takes the
/// room itself. The peer hears of room after the load deltas' delay and looks within
/// its look period, but its request may wait for room on its prefix's pod: holding
/// back 0.2 s per departure left a light tenant at 1.22 s behind four replicas, 1 s at
/// 0.70 s, 1.5 s and longer at 0.63 s (one gateway: 0.62 s), with the same hit rate and
/// sheds (docs/policy.md).
pub const YIELD_FOR: Duration = Duration::from_secs(2);
/// A peer's tenant is let first when it is more than this many (decayed) departures
/// behind: a tenant level with another takes turns as before, replica by replica.
const BEHIND_BY: f64 = 1.0;
/// Bounds on what a peer's state may hold; a state beyond them is refused whole.
pub const MAX_PEERS: usize = 64;
pub const MAX_BANDS: usize = 16;
pub const MAX_TENANTS: usize = 64;
pub const MAX_NAME: usize = 256;

/// Why a peer's state was not taken. Stable labels for metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerRefusal {
    /// This replica's own state, echoed back.
    Own,
    /// More bands, tenants or bytes of a name than [`MAX_BANDS`], [`MAX_TENANTS`],
    /// [`MAX_NAME`].
    TooLarge,
    /// A count that is not a finite non-negative number.
    BadNumber,
    /// [`MAX_PEERS`] replicas are already heard.
    TooManyPeers,
}

impl PeerRefusal {
    pub fn label(self) -> &'static str {
        match self {
            PeerRefusal::Own => "own",
            PeerRefusal::TooLarge => "too_large",
            PeerRefusal::BadNumber => "bad_number",
            PeerRefusal::TooManyPeers => "too_many_peers",
        }
    }
}

/// Departures of one tenant of one band.
#[derive(Clone, Copy, Debug)]
struct Served {
    left: u64,
    recent: f64,
    at: Instant,
}

fn decay(recent: f64, since: Duration) -> f64 {
    recent * (-since.as_secs_f64() / FAIR_WINDOW_S).exp()
}

impl Served {
    fn recent_at(&self, now: Instant) -> f64 {
        decay(self.recent, now.saturating_duration_since(self.at))
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct PeerTenant {
    waiting: u32,
    left: u64,
    recent: f64,
}

struct Peer {
    heard: Instant,
    bands: HashMap<i32, HashMap<Arc<str>, PeerTenant>>,
}

#[derive(Default)]
pub struct Fleet {
    peers: HashMap<String, Peer>,
    served: HashMap<(i32, Arc<str>), Served>,
    /// Per peer tenant held back for: since when, and the fleet's count of its
    /// departures then (a departure starts a new hold).
    holding: HashMap<(i32, Arc<str>), (Instant, u64)>,
}

impl Fleet {
    /// A request of `tenant` left this replica's queue.
    pub fn left(&mut self, priority: i32, tenant: &Arc<str>, now: Instant) {
        let s = self
            .served
            .entry((priority, tenant.clone()))
            .or_insert(Served {
                left: 0,
                recent: 0.0,
                at: now,
            });
        s.recent = s.recent_at(now) + 1.0;
        s.at = now;
        s.left += 1;
    }

    /// This replica's state for its peers: the tenants waiting here (`local`: priority,
    /// tenant, requests) and every tenant that left lately. Counts idle for
    /// [`PEER_FORGET`] are dropped here.
    pub fn state(
        &mut self,
        replica: &str,
        model: &str,
        local: &[(i32, Arc<str>, usize)],
        now: Instant,
    ) -> QueueState {
        self.served
            .retain(|_, s| now.saturating_duration_since(s.at) < PEER_FORGET);
        let mut bands: HashMap<i32, Vec<TenantState>> = HashMap::new();
        for (priority, tenant, waiting) in local {
            let s = self.served.get(&(*priority, tenant.clone()));
            bands.entry(*priority).or_default().push(TenantState {
                tenant: tenant.to_string(),
                waiting: u32::try_from(*waiting).unwrap_or(u32::MAX),
                left: s.map_or(0, |s| s.left),
                recent: s.map_or(0.0, |s| s.recent_at(now)),
            });
        }
        for ((p, t), s) in &self.served {
            let band = bands.entry(*p).or_default();
            if !band.iter().any(|x| *x.tenant == **t) {
                band.push(TenantState {
                    tenant: t.to_string(),
                    waiting: 0,
                    left: s.left,
                    recent: s.recent_at(now),
                });
            }
        }
        let mut bands: Vec<BandState> = bands
            .into_iter()
            .map(|(priority, mut tenants)| {
                // Within the bound, the ones that matter most: waiting, then busiest.
                tenants.sort_by(|a, b| {
                    b.waiting
                        .cmp(&a.waiting)
                        .then(b.recent.total_cmp(&a.recent))
                });
                tenants.truncate(MAX_TENANTS);
                BandState { priority, tenants }
            })
            .collect();
        bands.sort_by_key(|b| std::cmp::Reverse(b.priority));
        bands.truncate(MAX_BANDS);
        QueueState {
            replica: replica.to_owned(),
            model: model.to_owned(),
            bands,
        }
    }

    /// Take a peer's state in place of the one heard before. A state beyond the bounds
    /// is refused whole, leaving the previous one.
    pub fn apply(&mut self, own: &str, s: &QueueState, now: Instant) -> Result<(), PeerRefusal> {
        if s.replica == own {
            return Err(PeerRefusal::Own);
        }
        if s.replica.len() > MAX_NAME
            || s.bands.len() > MAX_BANDS
            || s.bands.iter().any(|b| {
                b.tenants.len() > MAX_TENANTS || b.tenants.iter().any(|t| t.tenant.len() > MAX_NAME)
            })
        {
            return Err(PeerRefusal::TooLarge);
        }
        if s.bands
            .iter()
            .flat_map(|b| &b.tenants)
            .any(|t| !t.recent.is_finite() || t.recent < 0.0)
        {
            return Err(PeerRefusal::BadNumber);
        }
        if !self.peers.contains_key(&s.replica) && self.peers.len() >= MAX_PEERS {
            self.peers
                .retain(|_, p| now.saturating_duration_since(p.heard) < PEER_FORGET);
            if self.peers.len() >= MAX_PEERS {
                return Err(PeerRefusal::TooManyPeers);
            }
        }
        let mut bands: HashMap<i32, HashMap<Arc<str>, PeerTenant>> = HashMap::new();
        for b in &s.bands {
            let band = bands.entry(b.priority).or_default();
            for t in &b.tenants {
                band.insert(
                    t.tenant.as_str().into(),
                    PeerTenant {
                        waiting: t.waiting,
                        left: t.left,
                        recent: t.recent,
                    },
                );
            }
        }
        self.peers
            .insert(s.replica.clone(), Peer { heard: now, bands });
        Ok(())
    }

    fn fresh(&self, now: Instant) -> impl Iterator<Item = &Peer> {
        self.peers
            .values()
            .filter(move |p| now.saturating_duration_since(p.heard) <= PEER_FRESH)
    }

    /// Departures of `tenant` in `priority`'s band across the fleet, decayed.
    fn recent(&self, priority: i32, tenant: &Arc<str>, now: Instant) -> f64 {
        let mine = self
            .served
            .get(&(priority, tenant.clone()))
            .map_or(0.0, |s| s.recent_at(now));
        mine + self
            .fresh(now)
            .filter_map(|p| p.bands.get(&priority)?.get(tenant))
            .map(|t| t.recent)
            .sum::<f64>()
    }

    /// Departures of `tenant` in `priority`'s band across the fleet, counted.
    fn left_count(&self, priority: i32, tenant: &Arc<str>) -> u64 {
        let mine = self
            .served
            .get(&(priority, tenant.clone()))
            .map_or(0, |s| s.left);
        mine + self
            .peers
            .values()
            .filter_map(|p| p.bands.get(&priority)?.get(tenant))
            .map(|t| t.left)
            .sum::<u64>()
    }

    /// Whether a request of `tenant` in `priority`'s band should stay so that room goes
    /// to another tenant waiting at a peer and behind `tenant` in the fleet's recent
    /// departures: at most [`YIELD_FOR`] per departure of that tenant. Whether the
    /// peer's request can use the room (it may wait for its prefix's pod) is not known
    /// here; holding back only for requests that take room anywhere left the light
    /// tenant behind four replicas at 1.46 s against 1.22 s, with 0.2 s holds.
    pub fn yields(&mut self, priority: i32, tenant: &Arc<str>, now: Instant) -> bool {
        let mine = self.recent(priority, tenant, now);
        if mine < BEHIND_BY {
            return false;
        }
        let behind: Vec<Arc<str>> = self
            .fresh(now)
            .filter_map(|p| p.bands.get(&priority))
            .flat_map(|m| m.iter())
            .filter(|(u, t)| **u != *tenant && t.waiting > 0)
            .map(|(u, _)| u.clone())
            .collect();
        for u in behind {
            if self.recent(priority, &u, now) + BEHIND_BY >= mine {
                continue;
            }
            let left = self.left_count(priority, &u);
            let key = (priority, u);
            match self.holding.get(&key) {
                Some(&(since, l)) if l == left => {
                    if now.saturating_duration_since(since) <= YIELD_FOR {
                        return true;
                    }
                }
                _ => {
                    self.holding.insert(key, (now, left));
                    return true;
                }
            }
        }
        if self.holding.len() > 4 * MAX_TENANTS {
            self.holding
                .retain(|_, (since, _)| now.saturating_duration_since(*since) <= PEER_FORGET);
        }
        false
    }

    /// Peers heard lately (status page, metrics).
    pub fn peers(&self, now: Instant) -> usize {
        self.fresh(now).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(replica: &str, priority: i32, tenants: &[(&str, u32, u64, f64)]) -> QueueState {
        QueueState {
            replica: replica.into(),
            model: "m".into(),
            bands: vec![BandState {
                priority,
                tenants: tenants
                    .iter()
                    .map(|&(t, waiting, left, recent)| TenantState {
                        tenant: t.into(),
                        waiting,
                        left,
                        recent,
                    })
                    .collect(),
            }],
        }
    }

    fn busy(f: &mut Fleet, tenant: &Arc<str>, n: usize, now: Instant) {
        for _ in 0..n {
            f.left(0, tenant, now);
        }
    }

    #[test]
    fn a_tenant_behind_at_another_replica_gets_the_room_for_a_while() {
        let now = Instant::now();
        let (heavy, light): (Arc<str>, Arc<str>) = ("heavy".into(), "light".into());
        let mut f = Fleet::default();
        busy(&mut f, &heavy, 5, now);
        f.apply("a", &peer("b", 0, &[("light", 1, 3, 0.5)]), now)
            .expect("taken");
        assert!(f.yields(0, &heavy, now), "heavy holds back for light");
        assert!(!f.yields(1, &heavy, now), "another band is not light's");
        assert!(!f.yields(0, &light, now), "nobody is behind light");
        assert!(
            f.yields(0, &heavy, now + YIELD_FOR),
            "still within the hold"
        );
        // Light's replica never took the room: this replica takes it back.
        let late = now + YIELD_FOR + Duration::from_millis(1);
        f.apply("a", &peer("b", 0, &[("light", 1, 3, 0.5)]), late)
            .expect("taken");
        assert!(!f.yields(0, &heavy, late), "a hold lasts YIELD_FOR");
        // Light left there: a new hold starts for its next request.
        f.apply("a", &peer("b", 0, &[("light", 1, 4, 1.5)]), late)
            .expect("taken");
        assert!(f.yields(0, &heavy, late));
    }

    #[test]
    fn nobody_waits_for_a_tenant_level_idle_or_unheard() {
        let now = Instant::now();
        let heavy: Arc<str> = "heavy".into();
        let mut f = Fleet::default();
        busy(&mut f, &heavy, 3, now);
        // Level: 3 departures against 2.5 (within one).
        f.apply("a", &peer("b", 0, &[("other", 4, 9, 2.5)]), now)
            .expect("taken");
        assert!(!f.yields(0, &heavy, now));
        // Behind, but nothing waiting.
        f.apply("a", &peer("b", 0, &[("other", 0, 0, 0.0)]), now)
            .expect("taken");
        assert!(!f.yields(0, &heavy, now));
        // Behind and waiting, but its replica was last heard too long ago.
        f.apply("a", &peer("b", 0, &[("other", 2, 0, 0.0)]), now)
            .expect("taken");
        let later = now + PEER_FRESH + Duration::from_millis(1);
        assert!(!f.yields(0, &heavy, later));
        // Its own departures spread over peers count too: heavy left 3 here and 6 at c.
        f.apply("a", &peer("c", 0, &[("heavy", 9, 6, 6.0)]), now)
            .expect("taken");
        f.apply("a", &peer("b", 0, &[("other", 2, 8, 8.0)]), now)
            .expect("taken");
        assert!(!f.yields(0, &heavy, now), "8 against 9: level");
    }

    #[test]
    fn hostile_states_are_refused_whole_and_leave_the_last_one() {
        let now = Instant::now();
        let heavy: Arc<str> = "heavy".into();
        let mut f = Fleet::default();
        busy(&mut f, &heavy, 5, now);
        f.apply("a", &peer("b", 0, &[("light", 1, 0, 0.0)]), now)
            .expect("taken");
        let refused = |f: &mut Fleet, s: QueueState| f.apply("a", &s, now).err();
        assert_eq!(
            refused(&mut f, peer("a", 0, &[("light", 1, 0, 0.0)])),
            Some(PeerRefusal::Own)
        );
        let long = "x".repeat(MAX_NAME + 1);
        assert_eq!(
            refused(&mut f, peer("b", 0, &[(long.as_str(), 1, 0, 0.0)])),
            Some(PeerRefusal::TooLarge)
        );
        let mut many = peer("b", 0, &[]);
        many.bands[0].tenants = (0..=MAX_TENANTS)
            .map(|i| TenantState {
                tenant: i.to_string(),
                ..Default::default()
            })
            .collect();
        assert_eq!(refused(&mut f, many), Some(PeerRefusal::TooLarge));
        let mut bands = peer("b", 0, &[]);
        bands.bands = (0..=MAX_BANDS as i32)
            .map(|priority| BandState {
                priority,
                tenants: Vec::new(),
            })
            .collect();
        assert_eq!(refused(&mut f, bands), Some(PeerRefusal::TooLarge));
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            assert_eq!(
                refused(&mut f, peer("b", 0, &[("light", 1, 0, bad)])),
                Some(PeerRefusal::BadNumber)
            );
        }
        assert!(f.yields(0, &heavy, now), "b's last good state stands");
        // Replicas beyond the bound are refused until the silent ones are forgotten.
        for i in 1..MAX_PEERS {
            f.apply("a", &peer(&format!("p{i}"), 0, &[]), now)
                .expect("within the bound");
        }
        assert_eq!(
            refused(&mut f, peer("one-too-many", 0, &[])),
            Some(PeerRefusal::TooManyPeers)
        );
        let later = now + PEER_FORGET;
        assert!(f.apply("a", &peer("one-too-many", 0, &[]), later).is_ok());
        assert_eq!(f.peers(later), 1);
    }

    #[test]
    fn a_state_names_who_waits_and_who_left_lately_within_bounds() {
        let now = Instant::now();
        let heavy: Arc<str> = "heavy".into();
        let mut f = Fleet::default();
        busy(&mut f, &heavy, 4, now);
        let local: Vec<(i32, Arc<str>, usize)> = (0..2 * MAX_TENANTS)
            .map(|i| (0, i.to_string().into(), 1 + i))
            .collect();
        let s = f.state("a", "m", &local, now);
        assert_eq!(s.bands.len(), 1);
        let tenants = &s.bands[0].tenants;
        assert_eq!(tenants.len(), MAX_TENANTS);
        assert_eq!(
            tenants[0].waiting as usize,
            2 * MAX_TENANTS,
            "most waiting first"
        );
        // Heavy waits nowhere here and is cut by the bound; alone, it is named.
        let s = f.state("a", "m", &[], now + Duration::from_secs(10));
        let t = &s.bands[0].tenants[0];
        assert_eq!((t.tenant.as_str(), t.waiting, t.left), ("heavy", 0, 4));
        assert!(
            (t.recent - 4.0 / std::f64::consts::E).abs() < 1e-9,
            "decayed over the window"
        );
        // Long idle, it is dropped.
        assert!(f.state("a", "m", &[], now + PEER_FORGET).bands.is_empty());
        // What another replica makes of it.
        let mut b = Fleet::default();
        assert!(b.apply("b", &f.state("a", "m", &local, now), now).is_ok());
        assert_eq!(b.peers(now), 1);
    }

    use proptest::prelude::*;

    fn any_state() -> impl Strategy<Value = QueueState> {
        let tenant = (
            "[a-z]{0,3}|x{250,260}",
            any::<u32>(),
            any::<u64>(),
            prop_oneof![
                any::<f64>(),
                Just(f64::NAN),
                Just(f64::INFINITY),
                0.0..100.0f64
            ],
        )
            .prop_map(|(tenant, waiting, left, recent)| TenantState {
                tenant,
                waiting,
                left,
                recent,
            });
        let band = (any::<i32>(), proptest::collection::vec(tenant, 0..70))
            .prop_map(|(priority, tenants)| BandState { priority, tenants });
        ("[a-c]{1,2}", proptest::collection::vec(band, 0..18)).prop_map(|(replica, bands)| {
            QueueState {
                replica,
                model: "m".into(),
                bands,
            }
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Whatever peers send, taking it and asking whether to hold back never panics,
        /// and every state taken is within the bounds.
        #[test]
        fn any_peer_state_is_taken_or_refused_whole(
            states in proptest::collection::vec(any_state(), 1..8),
            ask in any::<i32>(),
        ) {
            let now = Instant::now();
            let mine: Arc<str> = "a".into();
            let mut f = Fleet::default();
            busy(&mut f, &mine, 3, now);
            for s in &states {
                let ok = f.apply("own", s, now).is_ok();
                let within = s.bands.len() <= MAX_BANDS
                    && s.bands.iter().all(|b| b.tenants.len() <= MAX_TENANTS
                        && b.tenants.iter().all(|t| t.tenant.len() <= MAX_NAME
                            && t.recent.is_finite() && t.recent >= 0.0));
                prop_assert_eq!(ok, within);
                let _ = f.yields(ask, &mine, now);
                let _ = f.yields(0, &mine, now);
            }
            prop_assert!(f.peers.len() <= MAX_PEERS);
            let _ = f.state("own", "m", &[], now);
        }
    }
}
