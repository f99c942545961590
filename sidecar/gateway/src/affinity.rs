//! Bindings of conversations to pods: a session key to the pod its last turn was routed
//! to, and a Responses response id to the pod that produced (and stored) it.
//!
//! They are facts the policy weighs like cache hits (`Candidate::bound`), never vetoes:
//! a binding to a pod that is gone, draining, broken or over its bounded load is simply
//! not a candidate's, and the next decision rebinds. A session binding credits its pod
//! with a share (`session_weight`) of the prompt its last turn sent — what the pod
//! probably still holds — only when the indexes know nothing of the prompt (cold index,
//! restarted sidecar, a prompt whose front changed): where they do, they are facts and the
//! binding only a guess (crediting it anyway kept sessions on pods that had evicted them,
//! and raised max/mean load on the agentic sessions from 1.74 to 1.87). A response binding credits the whole conversation the engine
//! stored, which the request does not carry (`previous_response_id`): every other pod
//! would have to rebuild it, and vLLM answers 404 for a response it does not hold.
//!
//! A conversation whose client sends no session id is followed by its prompt instead
//! (`Kind::Prompt`, token chains only): its last turn's chain, at a block on a fixed grid
//! near its end (`tip_key`), is the key its next turn finds by probing its own chain at
//! the grid's places. Kept in a table of its own, so single-turn traffic cannot crowd out
//! the sessions clients name, and not shared with other replicas (a turn another
//! replica routed is a new conversation here).
//!
//! Keys are hashed with the model (xxh3 of `model ++ 0 ++ key`), so an entry is a fixed
//! 60-odd bytes whatever the client sent; each table is bounded in count (oldest bound
//! first out) and by a TTL since the last use. Other replicas learn session and response
//! bindings from the load deltas the decisions already broadcast (`LoadDelta::session`,
//! `::response`).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// What a binding says: the pod, and the prompt tokens it is credited with there (the
/// bound turn's prompt; for a response, its prompt and output: the next turn's history).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bound {
    pub pod: Arc<str>,
    pub tokens: u64,
    /// A block near the end of the bound turn's chain, by its place (blocks up to and
    /// including it) and hash: a next turn whose chain has that block at that place
    /// continues the same prompt, and what the pod holds of it says what the pod evicted
    /// (the sidecar's `returns`: by the index for token chains, by the engine's report
    /// for text chains).
    pub tip: Option<(u32, u64)>,
}

#[derive(Debug)]
struct Entry {
    bound: Bound,
    at: Instant,
}

/// One bounded table of bindings.
#[derive(Debug)]
struct Table {
    map: HashMap<u64, Entry>,
    /// Keys in binding order, with the time they were bound; an entry rebound later
    /// leaves a stale item here, skipped when it comes up.
    order: VecDeque<(u64, Instant)>,
}

impl Table {
    fn new() -> Table {
        Table {
            map: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    fn bind(&mut self, key: u64, bound: Bound, now: Instant, max: usize) {
        self.map.insert(key, Entry { bound, at: now });
        self.order.push_back((key, now));
        while self.map.len() > max.max(1) {
            self.pop_oldest();
        }
        // Stale items stay bounded too.
        if self.order.len() > 2 * max.max(1) + 64 {
            let map = &self.map;
            self.order
                .retain(|(k, at)| map.get(k).is_some_and(|e| e.at == *at));
        }
    }

    fn pop_oldest(&mut self) -> Option<Instant> {
        while let Some((k, at)) = self.order.pop_front() {
            if self.map.get(&k).is_some_and(|e| e.at == at) {
                self.map.remove(&k);
                return Some(at);
            }
        }
        None
    }

    fn get(&self, key: u64, now: Instant, ttl: Duration) -> Option<&Bound> {
        self.map
            .get(&key)
            .filter(|e| now.saturating_duration_since(e.at) <= ttl)
            .map(|e| &e.bound)
    }

    fn expire(&mut self, now: Instant, ttl: Duration) -> usize {
        let mut n = 0;
        while let Some(&(k, at)) = self.order.front() {
            let live = self.map.get(&k).is_some_and(|e| e.at == at);
            if live && now.saturating_duration_since(at) <= ttl {
                break;
            }
            self.order.pop_front();
            if live {
                self.map.remove(&k);
                n += 1;
            }
        }
        n
    }
}

/// Which table a binding is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Session,
    Response,
    /// A conversation without a session id, keyed by its last prompt's tip.
    Prompt,
}

impl Kind {
    pub(crate) const ALL: [Kind; 3] = [Kind::Session, Kind::Response, Kind::Prompt];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Session => "session",
            Kind::Response => "response",
            Kind::Prompt => "prompt",
        }
    }
}

/// The key of `key` for `model`.
pub fn key(model: &str, key: &str) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(model.as_bytes());
    h.update(&[0]);
    h.update(key.as_bytes());
    h.digest()
}

/// What [`tip_key`] takes for `model`: its prompt tips' namespace.
pub fn model_key(model: &str) -> u64 {
    key(model, "")
}

/// The key of a prompt's tip: a block of its chain, for the model whose [`model_key`]
/// is `model`. A chain block is a hash of everything before it, so it names its place
/// too; two conversations that share a prompt up to it share the key, and the cache it
/// stands for. Cheap (one xor), since a turn probes up to [`crate::route`]'s limit of
/// them.
pub fn tip_key(model: u64, block: u64) -> u64 {
    block ^ model.rotate_left(29)
}

/// The sidecar's bindings, one table per kind behind one lock each.
#[derive(Debug)]
pub struct Bindings {
    sessions: Mutex<Table>,
    responses: Mutex<Table>,
    prompts: Mutex<Table>,
}

impl Default for Bindings {
    fn default() -> Self {
        Bindings {
            sessions: Mutex::new(Table::new()),
            responses: Mutex::new(Table::new()),
            prompts: Mutex::new(Table::new()),
        }
    }
}

/// Bytes one binding costs, counted generously (map slot, order item, the pod's `Arc`).
pub const BYTES_PER_BINDING: usize = 96;

impl Bindings {
    fn table(&self, kind: Kind) -> &Mutex<Table> {
        match kind {
            Kind::Session => &self.sessions,
            Kind::Response => &self.responses,
            Kind::Prompt => &self.prompts,
        }
    }

    /// Bind `key` to `bound` (replacing what it was bound to), at most `max` per kind.
    pub fn bind(&self, kind: Kind, key: u64, bound: Bound, now: Instant, max: usize) {
        self.table(kind).lock().bind(key, bound, now, max);
    }

    /// The binding of `key`, unless it is older than `ttl`.
    pub fn get(&self, kind: Kind, key: u64, now: Instant, ttl: Duration) -> Option<Bound> {
        self.table(kind).lock().get(key, now, ttl).cloned()
    }

    /// The first of `keys` bound (and used within `ttl`), under one lock.
    pub fn find(
        &self,
        kind: Kind,
        keys: impl IntoIterator<Item = u64>,
        now: Instant,
        ttl: Duration,
    ) -> Option<(u64, Bound)> {
        let t = self.table(kind).lock();
        keys.into_iter()
            .find_map(|k| t.get(k, now, ttl).map(|b| (k, b.clone())))
    }

    /// Forget `key` (its place in the binding order is skipped when it comes up).
    pub fn unbind(&self, kind: Kind, key: u64) {
        self.table(kind).lock().map.remove(&key);
    }

    /// Drop bindings unused for longer than `ttl`, and any over `max` (the cleaner's
    /// tick, so a lowered limit takes effect). Returns how many went.
    pub fn expire(&self, now: Instant, ttl: Duration, max: usize) -> usize {
        let mut n = 0;
        for kind in Kind::ALL {
            let mut t = self.table(kind).lock();
            n += t.expire(now, ttl);
            while t.map.len() > max {
                t.pop_oldest();
                n += 1;
            }
        }
        n
    }

    /// Bindings held, per kind.
    pub fn len(&self, kind: Kind) -> usize {
        self.table(kind).lock().map.len()
    }

    /// For `/v1/status`: counts per kind, the limit, and the bytes they may take.
    pub fn status(&self, max: u64) -> serde_json::Value {
        let mut v = serde_json::Map::new();
        for kind in Kind::ALL {
            v.insert(kind.as_str().into(), self.len(kind).into());
        }
        v.insert("max_per_kind".into(), max.into());
        v.insert(
            "max_bytes".into(),
            (Kind::ALL.len() * max as usize * BYTES_PER_BINDING).into(),
        );
        serde_json::Value::Object(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(pod: &str, tokens: u64) -> Bound {
        Bound {
            pod: Arc::from(pod),
            tokens,
            tip: None,
        }
    }

    /// Prompt tips are keyed by model, place and block; `find` takes the first bound key
    /// it is given, `unbind` forgets one, and the table is apart from the sessions'.
    #[test]
    fn prompt_tips_are_found_by_probing_and_forgotten_when_moved() {
        let (bs, t0, ttl) = (Bindings::default(), Instant::now(), Duration::from_secs(60));
        let m = model_key("m");
        let k = tip_key(m, 1047);
        assert_ne!(k, tip_key(model_key("m2"), 1047), "the model is in the key");
        bs.bind(Kind::Prompt, k, b("a", 768), t0, 4);
        assert_eq!(bs.len(Kind::Session), 0);
        let probes = [tip_key(m, 1063), k, tip_key(m, 1031)];
        assert_eq!(
            bs.find(Kind::Prompt, probes, t0, ttl),
            Some((k, b("a", 768)))
        );
        assert_eq!(bs.find(Kind::Session, probes, t0, ttl), None);
        assert_eq!(
            bs.find(Kind::Prompt, probes, t0 + Duration::from_secs(61), ttl),
            None,
            "past the TTL"
        );
        bs.unbind(Kind::Prompt, k);
        assert_eq!(bs.find(Kind::Prompt, probes, t0, ttl), None);
        // The order item it left is skipped when the oldest go.
        for i in 0..8u64 {
            bs.bind(Kind::Prompt, i, b("a", 1), t0, 4);
        }
        assert_eq!(bs.len(Kind::Prompt), 4);
        assert_eq!(bs.status(4)["prompt"], 4);
    }

    #[test]
    fn a_binding_is_replaced_bounded_and_expires() {
        let (bs, t0, ttl) = (Bindings::default(), Instant::now(), Duration::from_secs(60));
        let k = key("m", "session-1");
        assert_ne!(k, key("m2", "session-1"), "the model is in the key");
        bs.bind(Kind::Session, k, b("a", 10), t0, 4);
        bs.bind(Kind::Session, k, b("b", 12), t0 + Duration::from_secs(1), 4);
        assert_eq!(bs.get(Kind::Session, k, t0, ttl), Some(b("b", 12)));
        assert_eq!(bs.get(Kind::Response, k, t0, ttl), None, "kinds are apart");
        assert_eq!(bs.len(Kind::Session), 1);
        // Past the TTL it is not used, and the cleaner drops it.
        let late = t0 + Duration::from_secs(62);
        assert_eq!(bs.get(Kind::Session, k, late, ttl), None);
        assert_eq!(bs.expire(late, ttl, 4), 1);
        assert_eq!(bs.len(Kind::Session), 0);
        // At most `max`: the oldest bound goes first, a rebound one counts as new.
        for i in 0..10u64 {
            bs.bind(
                Kind::Response,
                i,
                b("a", 1),
                t0 + Duration::from_millis(i),
                4,
            );
            bs.bind(
                Kind::Response,
                0,
                b("a", 1),
                t0 + Duration::from_millis(i),
                4,
            );
        }
        assert_eq!(bs.len(Kind::Response), 4);
        assert!(bs.get(Kind::Response, 0, t0, ttl).is_some());
        assert!(bs.get(Kind::Response, 9, t0, ttl).is_some());
        assert!(bs.get(Kind::Response, 1, t0, ttl).is_none());
        // A flood of rebinds of one key keeps the order queue bounded.
        for i in 0..10_000u64 {
            bs.bind(
                Kind::Session,
                7,
                b("a", 1),
                t0 + Duration::from_micros(i),
                4,
            );
        }
        assert!(bs.sessions.lock().order.len() <= 2 * 4 + 64 + 1);
        // A lowered limit is applied by the cleaner.
        assert_eq!(bs.expire(t0, ttl, 2), 2);
        assert_eq!(bs.len(Kind::Response), 2);
    }
}
