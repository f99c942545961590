//! `kvroute-bench sim`: a deterministic discrete-event simulation of P engine pods and
//! G gateways (virtual time, seeded). Each gateway is a real [`Sidecar`] routing
//! through the sidecar's own code — `route::route_with`, the ledger, `ingest_at`,
//! `report_at` — on a virtual clock; only the pick differs between the policies
//! compared ([`baselines`]). Nothing of the routing path is re-implemented here.
//!
//! Pod model (as `kvroute-engine-sim`): a request waits for a batch slot (FIFO, at most
//! `max_batch` running), then for the pod's prefill lane (prefill is serialized), then
//! decodes `output_tokens` steps of `decode_ms × (1 + 0.1 × running)`. TTFT is arrival to
//! end of prefill. Pods' LRU caches emit stored/removed events that reach every gateway
//! after `event_delay_s` (a fraction `event_loss` is lost); each pod's load (running,
//! waiting) reaches them at once, as the bridges' load events would. A request's
//! completion report goes back to the gateway that routed it. With [`TextChains`] the
//! requests are routed as text chains (predicted residency, as chat without a
//! tokenizer): each chain block is that many canonical bytes, which the pods tokenize at
//! the conversation's own bytes per token, and no pod event names a text block. With several gateways,
//! each one's load deltas reach the others after `delta_delay_s` (or never, with
//! `replica_sync` off: the herding a router without replica sync shows), and so does its
//! admission queue's state after each change (the service sends it within 20 ms of one).

mod baselines;
mod fidelity;
mod report;
mod workloads;

use std::cmp::Ordering as CmpOrdering;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_shared::protocol::AdmissionConfig;
use kvroute_shared::protocol::{
    CompletionReport, Event, EventBatch, LoadDelta, PolicyConfig, QueueState, RouteRequest, Tier,
};
use kvroute_shared::Mode;
use kvroute_sidecar::admission::{self, waiting, AdmissionQueue, Arrival, Headroom, Limits, Step};
use kvroute_sidecar::Sidecar;
use kvroute_sidecar::{self as sidecar, Recovery};
use kvroute_sidecar::{RouteError, Selector};
use serde_json::json;
use tokio::sync::mpsc;

use crate::bench::{Rng, Samples};
use crate::cache::BlockCache;
use crate::engine::CostModel;
use crate::workload::Request;

pub use baselines::{Decision, Imitation, Policy};
pub use fidelity::{imitated, replay, replay_dump, with_chains, Agreement, Dumped};
pub use report::{
    by_policy, compare, infinite_cache_bound, seed_table, session_balance, summarize_seeds,
    svg_bars, Bound, SeedSummary, SessionBalance,
};
pub use workloads::{default_rate, generated, WORKLOADS};

/// Simulated pod `k`'s id: an address, or one rank of one (`dp_ranks` > 1).
fn pod_id(k: usize, dp_ranks: usize) -> String {
    let (a, r) = (k / dp_ranks.max(1), k % dp_ranks.max(1));
    let addr = format!("10.0.{}.{}:8000", a / 250, a % 250 + 1);
    if dp_ranks > 1 {
        format!("{addr}@{r}")
    } else {
        addr
    }
}

/// The model name the simulated pods serve.
const MODEL: &str = "sim";

#[derive(Clone, Debug)]
pub struct SimOpts {
    pub pods: usize,
    pub capacity_blocks: usize,
    pub block_tokens: u32,
    pub cost: CostModel,
    pub event_delay_s: f64,
    pub event_loss: f64,
    pub seed: u64,
    pub config: PolicyConfig,
    /// Gateways (sidecar replicas) in front of the pods; requests arrive at them in turn.
    pub gateways: usize,
    /// Delay of load deltas between gateways.
    pub delta_delay_s: f64,
    /// Gateways exchange load deltas (off: each knows only its own decisions and the
    /// engines' load reports).
    pub replica_sync: bool,
    /// Route text chains instead of token chains.
    pub text: Option<TextChains>,
    /// Data-parallel ranks per engine address (1: none): pod `k` is rank `k % dp_ranks`
    /// of address `k / dp_ranks`, a pod of its own (`ip:port@rank`).
    pub dp_ranks: usize,
    /// Hold requests in each gateway's admission queue while no pod has room for them.
    pub admission: Option<SimAdmission>,
    /// Requests name their session to the router (off: as a chat client that sends no
    /// session id; the simulator still counts sessions' moves from the trace).
    pub session_ids: bool,
}

/// The router's admission queue in the simulation: the sidecar's own gate
/// (`route_gated_with`) and queue ([`AdmissionQueue`]), one per gateway. A request
/// the gate refuses waits in its priority band, its tenant taking turns with the
/// others; whenever a pod's work moves on the queue's head is routed again, scored as
/// things are then; past its TTL it is shed (a 429 in the service).
#[derive(Clone, Debug)]
pub struct SimAdmission {
    /// The sidecar's own admission settings, as an operator writes them: the gate's
    /// thresholds, the queue's bounds, the bands with their TTLs (a sheddable band is
    /// refused at once while saturated).
    pub config: AdmissionConfig,
    /// Request `i`'s priority (`priority[i % len]`; empty: all the default priority).
    pub priority: Vec<i32>,
    /// Request `i`'s tenant (`tenant[i % len]`; empty: one tenant).
    pub tenant: Vec<u32>,
}

impl SimAdmission {
    fn class(&self, i: usize) -> (i32, u32) {
        let p = if self.priority.is_empty() {
            self.config.default_priority
        } else {
            self.priority[i % self.priority.len()]
        };
        let t = if self.tenant.is_empty() {
            0
        } else {
            self.tenant[i % self.tenant.len()]
        };
        (p, t)
    }

    /// The headroom a request of `priority` may use, its tenant passed over or not
    /// (the service's rule).
    fn headroom_for(&self, priority: i32, passed_over: bool) -> Headroom {
        let top = waiting::top_priority(&self.config);
        waiting::headroom(&self.config).for_request(priority >= top, passed_over)
    }

    fn limits(&self) -> Limits {
        waiting::limits(&self.config)
    }
}

/// Requests as text chains: a chain block is `block_bytes` canonical bytes, and the
/// blocks a conversation (session `s`, or the request's index without one) sends first
/// tokenize at `bytes_per_token[s % len]` — prose, code, numbers, CJK each at its own
/// ratio; a block shared with an earlier conversation keeps that one's ratio.
#[derive(Clone, Debug)]
pub struct TextChains {
    pub block_bytes: u32,
    pub bytes_per_token: Vec<f64>,
}

impl SimOpts {
    /// One gateway, 50 ms event delay, no loss, the default policy.
    pub fn new(pods: usize, capacity_blocks: usize, block_tokens: u32) -> SimOpts {
        SimOpts {
            pods,
            capacity_blocks,
            block_tokens,
            cost: default_cost(),
            event_delay_s: 0.05,
            event_loss: 0.0,
            seed: 1,
            config: PolicyConfig::default(),
            gateways: 1,
            delta_delay_s: 0.02,
            replica_sync: true,
            text: None,
            dp_ranks: 1,
            admission: None,
            session_ids: true,
        }
    }
}

/// Figures of one policy on one workload.
#[derive(Clone, Debug, Default)]
pub struct SimResult {
    pub policy: String,
    pub workload: String,
    pub gateways: usize,
    pub hit_rate: f64,
    pub ttft_mean_ms: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2e_mean_ms: f64,
    pub e2e_p99_ms: f64,
    pub throughput_rps: f64,
    pub max_mean_load: f64,
    /// Decisions and the reports the gateways judged mispredicted (all gateways).
    pub decisions: u64,
    pub mispredictions: u64,
    /// Share of the requests continuing a session (an earlier request with the same
    /// session id ran) that ran on another pod than the session's previous request.
    pub session_moves: f64,
    /// Where the prompt blocks that missed the cache went, as shares of all prompt
    /// blocks (so `1 - hit_rate` is their sum plus the misses of requests without a
    /// session): a session's first request, a later one on the session's previous pod
    /// (its own new text, and what that pod evicted of the session since), a later one
    /// moved to another pod.
    pub missed: Misses,
    /// With admission: requests shed (TTL passed, or pushed out of a full queue),
    /// requests that waited in the queue, the most bytes it held, and figures per
    /// (priority, tenant) class.
    pub shed: u64,
    pub queued: u64,
    pub queue_peak_bytes: usize,
    pub classes: Vec<ClassFigures>,
    /// Prompt blocks a pod held when their request was routed and that it computed
    /// again, as a share of all prompt blocks served: the cache locality routing gave up
    /// (a prefix no pod holds is a miss wherever it goes, and counts nothing here).
    pub locality_lost: f64,
    /// Prompt blocks each request found cached, by its place in the workload (`None`:
    /// shed). Two runs' hit rates compare only over the requests both served: the
    /// admission queue sheds mostly requests that wait for their prefix's pod.
    pub request_hits: Vec<Option<u64>>,
}

impl SimResult {
    /// The hit rate over the requests `i` for which `served(i)` holds and this run
    /// served: prompt blocks found cached over their prompt blocks.
    pub fn hit_rate_over(&self, reqs: &[Request], served: impl Fn(usize) -> bool) -> f64 {
        let (mut hit, mut blocks) = (0u64, 0u64);
        for (i, (h, r)) in self.request_hits.iter().zip(reqs).enumerate() {
            if let (Some(h), true) = (h, served(i)) {
                hit += h;
                blocks += r.chain.len() as u64;
            }
        }
        hit as f64 / blocks.max(1) as f64
    }
}

/// See [`SimResult::missed`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Misses {
    pub first: f64,
    pub stayed: f64,
    pub moved: f64,
}

/// One (priority, tenant) class's figures under admission. `dispatched_saturated`:
/// its requests that left the queue (the dispatches made while the fleet was full).
#[derive(Clone, Debug, Default)]
pub struct ClassFigures {
    pub priority: i32,
    pub tenant: u32,
    pub requests: u64,
    pub served: u64,
    pub shed: u64,
    pub dispatched_saturated: u64,
    /// Of those, dispatched while another tenant of the same band was waiting too.
    pub dispatched_contested: u64,
    pub ttft_mean_ms: f64,
    pub ttft_p99_ms: f64,
}

impl SimResult {
    pub fn json(&self) -> serde_json::Value {
        let r = |x: f64| (x * 1000.0).round() / 1000.0;
        let mut v = json!({"workload": self.workload, "gateways": self.gateways, "policy": self.policy,
               "hit_rate": r(self.hit_rate), "ttft_mean_ms": r(self.ttft_mean_ms),
               "ttft_p50_ms": r(self.ttft_p50_ms), "ttft_p99_ms": r(self.ttft_p99_ms), "e2e_mean_ms": r(self.e2e_mean_ms),
               "e2e_p99_ms": r(self.e2e_p99_ms), "throughput_rps": r(self.throughput_rps), "max_mean_load": r(self.max_mean_load),
               "mispredictions": self.mispredictions, "session_moves": r(self.session_moves),
               "missed": {"first": r(self.missed.first), "stayed": r(self.missed.stayed), "moved": r(self.missed.moved)},
               "locality_lost": r(self.locality_lost), "queued": self.queued, "shed": self.shed});
        // Per (priority, tenant) class, with admission only.
        if !self.classes.is_empty() {
            v["classes"] = self
                .classes
                .iter()
                .map(|c| {
                    json!({"priority": c.priority, "tenant": c.tenant, "requests": c.requests,
                           "served": c.served, "shed": c.shed,
                           "dispatched_saturated": c.dispatched_saturated,
                           "dispatched_contested": c.dispatched_contested,
                           "ttft_mean_ms": r(c.ttft_mean_ms), "ttft_p99_ms": r(c.ttft_p99_ms)})
                })
                .collect();
        }
        v
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Ev {
    Arrive(usize),
    PrefillDone(usize, usize),
    DecodeDone(usize, usize),
    /// A pod's cache events reach the gateways (index into `pending_events`).
    Visible(usize),
    /// A load delta reaches gateway `.0` (index into `pending_deltas`).
    Delta(usize, usize),
    /// Gateway `.0` looks at its admission queue (a deadline, or a periodic look).
    Admit(usize),
    /// Another gateway's queue state reaches gateway `.0` (index into `pending_queues`).
    Queue(usize, usize),
}

#[derive(PartialEq)]
struct At(f64, u64, Ev);
impl Eq for At {}
impl PartialOrd for At {
    fn partial_cmp(&self, o: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(o))
    }
}
impl Ord for At {
    fn cmp(&self, o: &Self) -> CmpOrdering {
        // Min-heap on (time, sequence).
        o.0.total_cmp(&self.0).then(o.1.cmp(&self.1))
    }
}

struct Pod {
    id: String,
    cache: BlockCache,
    waiting: VecDeque<usize>,
    prefill_queue: VecDeque<usize>,
    lane_busy: bool,
    running: usize,
    assigned: u64,
    /// Sequence number of the pod's next event batch.
    seq: u64,
}

/// One simulated gateway: a sidecar, its recovery (stream locks), its outbox and its selector.
struct Gateway {
    sc: Arc<Sidecar>,
    recovery: Recovery,
    outbox: mpsc::Receiver<LoadDelta>,
    selector: Box<dyn Selector>,
    /// Requests (by index) waiting for room.
    queue: AdmissionQueue<usize>,
    /// An `Ev::Admit` for this gateway is on the heap.
    look_pending: bool,
}

struct Sim<'a> {
    o: &'a SimOpts,
    reqs: &'a [Request],
    pods: Vec<Pod>,
    pod_of_id: HashMap<String, usize>,
    gws: Vec<Gateway>,
    heap: BinaryHeap<At>,
    seq: u64,
    /// Virtual time 0.
    origin: Instant,
    pending_events: Vec<(usize, Vec<u64>, Vec<u64>)>,
    pending_deltas: Vec<Option<LoadDelta>>,
    /// Queue states on their way between gateways.
    pending_queues: Vec<QueueState>,
    /// Text chains: the engine tokens each block stands for.
    text_tokens: Option<HashMap<u64, f64>>,
    rng: Rng,
    // Per request.
    arrive: Vec<f64>,
    pod_of: Vec<usize>,
    gw_of: Vec<usize>,
    decision: Vec<String>,
    hit: Vec<u64>,
    /// The longest prefix of request i's chain any pod cached when it was routed.
    held_anywhere: Vec<u64>,
    ttft: Vec<f64>,
    done: Vec<f64>,
    shed: Vec<bool>,
    from_queue: Vec<bool>,
    /// Left the queue while another tenant of its band was waiting too: the dispatches
    /// fairness decides.
    contested: Vec<bool>,
    queue_peak_bytes: usize,
}

impl Sim<'_> {
    fn push(&mut self, t: f64, e: Ev) {
        self.seq += 1;
        self.heap.push(At(t, self.seq, e));
    }

    fn at(&self, t: f64) -> Instant {
        self.origin + Duration::from_secs_f64(t.max(0.0))
    }

    /// The engine tokens of request `i`'s first `blocks` chain blocks: each text block
    /// tokenizes at the ratio of the conversation that first sent it, so a shared
    /// system prompt is the same tokens for everyone (token chains: `block_tokens` each).
    fn tokens_of(&self, i: usize, blocks: usize) -> f64 {
        let chain = &self.reqs[i].chain;
        match &self.text_tokens {
            None => blocks as f64 * self.o.block_tokens as f64,
            Some(per) => chain[..blocks.min(chain.len())]
                .iter()
                .map(|b| per.get(b).copied().unwrap_or(0.0))
                .sum(),
        }
    }

    /// Request `i`'s prompt in engine tokens (a text request's blocks at their ratios).
    fn input_tokens_of(&self, i: usize) -> u64 {
        let r = &self.reqs[i];
        match &self.o.text {
            None => r.input_tokens as u64,
            Some(_) => {
                // The part beyond the full blocks at the last block's ratio.
                let full = r.chain.len();
                let extra = (r.input_tokens as f64 / self.o.block_tokens.max(1) as f64
                    - full as f64)
                    .max(0.0);
                let last = self.tokens_of(i, full) - self.tokens_of(i, full.saturating_sub(1));
                (self.tokens_of(i, full) + extra * last) as u64
            }
        }
    }

    /// One batch from pod `k` to every gateway, as the event plane delivers it.
    fn publish(&mut self, k: usize, events: Vec<Event>, t: f64) {
        let p = &mut self.pods[k];
        let batch = EventBatch::new(&p.id, MODEL, "sim", p.seq, events);
        p.seq += 1;
        let now = self.at(t);
        for g in &self.gws {
            let _ = sidecar::ingest_at(&g.sc, &g.recovery, &batch, now);
        }
    }

    /// The engine's load report (running, waiting) after it changed.
    fn report_load(&mut self, k: usize, t: f64) {
        let p = &self.pods[k];
        let ev = Event::Load {
            running: p.running as u32,
            waiting: p.waiting.len() as u32,
            kv_usage: 0.0,
            capacity_blocks: None,
        };
        self.publish(k, vec![ev], t);
    }

    /// Deltas gateway `g` queued go to every other gateway after the delay.
    fn forward_deltas(&mut self, g: usize, t: f64) {
        while let Ok(d) = self.gws[g].outbox.try_recv() {
            if !self.o.replica_sync {
                continue;
            }
            let id = self.pending_deltas.len();
            self.pending_deltas.push(Some(d));
            for other in (0..self.gws.len()).filter(|&x| x != g) {
                self.push(t + self.o.delta_delay_s, Ev::Delta(other, id));
            }
        }
    }

    fn route(&mut self, i: usize, t: f64) -> Result<usize, RouteError> {
        self.route_as(i, t, false)
    }

    /// [`Self::route`]; `passed_over`: a queued request whose tenant was passed over
    /// (`admission::look`), which takes room wherever there is some.
    fn route_as(&mut self, i: usize, t: f64, passed_over: bool) -> Result<usize, RouteError> {
        let r = &self.reqs[i];
        let g = i % self.gws.len();
        self.gw_of[i] = g;
        // A text request's `prompt_tokens` is what the filter sends: its canonical bytes
        // at four a token.
        let (mode, block_size, prompt_tokens) = match &self.o.text {
            None => (Mode::Tokens, self.o.block_tokens, r.input_tokens),
            Some(t) => {
                let blocks = r.input_tokens as f64 / self.o.block_tokens.max(1) as f64;
                let bytes = blocks * t.block_bytes as f64;
                (Mode::Text, t.block_bytes, (bytes / 4.0).ceil() as u32)
            }
        };
        let req = RouteRequest {
            model: MODEL.into(),
            adapter: String::new(),
            mode,
            block_size,
            chain: r.chain.clone(),
            prompt_tokens,
            request_id: None,
            session: r
                .session
                .filter(|_| self.o.session_ids)
                .map(|s| s.to_string()),
            previous_response: None,
            role: None,
            dry_run: false,
            explain: false,
            prompt_body: None,
            admission: Default::default(),
        };
        let now = self.at(t);
        let gw = &mut self.gws[g];
        let gate = self
            .o
            .admission
            .as_ref()
            .map(|a| a.headroom_for(a.class(i).0, passed_over));
        let routed = match &gate {
            Some(h) => sidecar::route_gated_with(&gw.sc, &req, now, gw.selector.as_mut(), h),
            None => sidecar::route_with(&gw.sc, &req, now, gw.selector.as_mut()),
        };
        let k = match routed {
            Ok(a) => {
                self.decision[i] = a.decision.unwrap_or_default();
                Ok(self.pod_of_id.get(&a.pod).copied().unwrap_or(0))
            }
            Err(RouteError::Saturated) => Err(RouteError::Saturated),
            Err(_) => Ok(0),
        };
        self.forward_deltas(g, t);
        k
    }

    /// Send request `i` to pod `k`.
    fn dispatch(&mut self, i: usize, k: usize, now: f64) {
        let chain = &self.reqs[i].chain;
        self.held_anywhere[i] = self
            .pods
            .iter()
            .map(|p| p.cache.prefix_hits(chain) as u64)
            .max()
            .unwrap_or(0);
        self.pod_of[i] = k;
        self.pods[k].assigned += 1;
        self.pods[k].waiting.push_back(i);
        self.try_start(k, now);
        self.report_load(k, now);
    }

    /// A request the gate refused waits in its gateway's queue (behind any of its band
    /// or above already waiting: a newcomer does not overtake them); a sheddable band's
    /// is refused at once.
    fn hold(&mut self, i: usize, now: f64) {
        let Some(a) = &self.o.admission else { return };
        let g = i % self.gws.len();
        let (priority, tenant) = a.class(i);
        if a.config.sheddable(priority) {
            self.shed[i] = true;
            return;
        }
        let arrival = Arrival {
            priority,
            tenant: tenant.to_string().into(),
            bytes: 64 + self.reqs[i].chain.len() * 8,
            ttl: a.config.ttl(priority),
            item: i,
        };
        let at = self.at(now);
        match self.gws[g].queue.push(arrival, at) {
            Ok(q) => {
                for e in q.displaced {
                    self.shed[e.item] = true;
                }
                self.queue_peak_bytes = self.queue_peak_bytes.max(self.gws[g].queue.bytes());
            }
            Err(_) => self.shed[i] = true,
        }
        self.share_queue(g, now);
        self.schedule_look(g, now);
    }

    /// Look at gateway `g`'s queue again at its next deadline or in 50 ms, whichever
    /// comes first (the ledger's prefill horizons free room as time passes).
    fn schedule_look(&mut self, g: usize, now: f64) {
        if self.gws[g].look_pending || self.gws[g].queue.is_empty() {
            return;
        }
        let mut at = now + 0.05;
        if let Some(d) = self.gws[g].queue.next_deadline() {
            let d = d.saturating_duration_since(self.origin).as_secs_f64();
            at = at.min(d.max(now));
        }
        self.gws[g].look_pending = true;
        self.push(at, Ev::Admit(g));
    }

    /// Shed what expired, then route the queue's head again while there is room.
    fn admit(&mut self, g: usize, now: f64) {
        if self.o.admission.is_none() {
            return;
        }
        let at = self.at(now);
        for e in self.gws[g].queue.expire(at) {
            self.shed[e.item] = true;
        }
        // The sidecar's own look: the first requests in dispatch order, each routed
        // again; one that has no room (where its cache is) stays and the next is tried.
        // The queue is out of `self` meanwhile, since routing needs all of it.
        let limits = self.gws[g].queue.limits();
        let mut q = std::mem::replace(&mut self.gws[g].queue, AdmissionQueue::new(limits));
        // Who waits in each band, kept as requests leave.
        let mut waiting: HashMap<(i32, Arc<str>), usize> = q
            .depths()
            .into_iter()
            .map(|(band, tenant, n)| ((band, tenant), n))
            .collect();
        let at = self.at(now);
        admission::look(&mut q, at, |e, passed_over| {
            let i = e.item;
            match self.route_as(i, now, passed_over) {
                Ok(k) => {
                    self.contested[i] = waiting
                        .iter()
                        .any(|((b, t), &n)| *b == e.priority && *t != e.tenant && n > 0);
                    if let Some(n) = waiting.get_mut(&(e.priority, e.tenant.clone())) {
                        *n = n.saturating_sub(1);
                    }
                    self.from_queue[i] = true;
                    self.dispatch(i, k, now);
                    Step::Leave(())
                }
                Err(_) => Step::Wait,
            }
        });
        self.gws[g].queue = q;
        self.share_queue(g, now);
        self.schedule_look(g, now);
    }

    /// Gateway `g`'s queue state reaches the others after the deltas' delay.
    fn share_queue(&mut self, g: usize, now: f64) {
        if self.gws.len() < 2 || !self.o.replica_sync {
            return;
        }
        let at = self.at(now);
        let s = self.gws[g].queue.state(&format!("g{g}"), MODEL, at);
        let id = self.pending_queues.len();
        self.pending_queues.push(s);
        for other in (0..self.gws.len()).filter(|&x| x != g) {
            self.push(now + self.o.delta_delay_s, Ev::Queue(other, id));
        }
    }

    fn try_start(&mut self, k: usize, now: f64) {
        let max = self.o.cost.max_batch.max(1);
        while self.pods[k].running < max {
            let Some(i) = self.pods[k].waiting.pop_front() else {
                break;
            };
            self.pods[k].running += 1;
            self.pods[k].prefill_queue.push_back(i);
        }
        if !self.pods[k].lane_busy {
            if let Some(i) = self.pods[k].prefill_queue.pop_front() {
                self.pods[k].lane_busy = true;
                let r = &self.reqs[i];
                let adm = self.pods[k].cache.admit(&r.chain);
                let input = self.input_tokens_of(i);
                let cached = (self.tokens_of(i, adm.hit_blocks) as u64).min(input);
                self.hit[i] = adm.hit_blocks as u64;
                let dur = self.o.cost.prefill_s(input - cached);
                // Engines publish token chains; none of them names a text block.
                if self.o.text.is_none()
                    && !(adm.stored.is_empty() && adm.removed.is_empty())
                    && self.rng.f64() >= self.o.event_loss
                {
                    self.pending_events.push((k, adm.stored, adm.removed));
                    let id = self.pending_events.len() - 1;
                    self.push(now + self.o.event_delay_s, Ev::Visible(id));
                }
                self.push(now + dur, Ev::PrefillDone(k, i));
            }
        }
    }

    fn run(&mut self) {
        for (i, r) in self.reqs.iter().enumerate() {
            self.push(r.ts_ms / 1e3, Ev::Arrive(i));
        }
        // Every pod announces its (empty) cache, so routers know it sends events.
        for k in 0..self.pods.len() {
            self.publish(k, vec![Event::Cleared], 0.0);
        }
        while let Some(At(now, _, ev)) = self.heap.pop() {
            match ev {
                Ev::Arrive(i) => {
                    self.arrive[i] = now;
                    let g = i % self.gws.len();
                    let waiting_above =
                        self.o.admission.as_ref().is_some_and(|a| {
                            admission::must_wait(&self.gws[g].queue, a.class(i).0)
                        });
                    if waiting_above {
                        self.hold(i, now);
                        continue;
                    }
                    match self.route(i, now) {
                        Ok(k) => self.dispatch(i, k, now),
                        Err(_) => self.hold(i, now),
                    }
                }
                Ev::Admit(g) => {
                    self.gws[g].look_pending = false;
                    self.admit(g, now);
                }
                Ev::PrefillDone(k, i) => {
                    self.ttft[i] = now - self.arrive[i];
                    self.pods[k].lane_busy = false;
                    let steps = self.reqs[i].output_tokens.max(1) as f64;
                    let d = steps * self.o.cost.decode_step_s(self.pods[k].running);
                    self.push(now + d, Ev::DecodeDone(k, i));
                    self.try_start(k, now);
                    self.report_load(k, now);
                }
                Ev::DecodeDone(k, i) => {
                    self.done[i] = now;
                    self.pods[k].running -= 1;
                    let g = self.gw_of[i];
                    let report = CompletionReport {
                        decision: std::mem::take(&mut self.decision[i]),
                        pod: self.pods[k].id.clone(),
                        model: MODEL.into(),
                        status: 200,
                        cached_tokens: Some(match self.o.text {
                            None => (self.hit[i] * self.o.block_tokens as u64) as u32,
                            Some(_) => (self.tokens_of(i, self.hit[i] as usize) as u64)
                                .min(self.input_tokens_of(i))
                                as u32,
                        }),
                        prompt_tokens: Some(self.input_tokens_of(i) as u32),
                        ..Default::default()
                    };
                    sidecar::report_at(&self.gws[g].sc, &report, self.at(now));
                    self.forward_deltas(g, now);
                    self.try_start(k, now);
                    self.report_load(k, now);
                    self.admit(g, now);
                }
                Ev::Visible(id) => {
                    let (k, stored, removed) = std::mem::take(&mut self.pending_events[id]);
                    let mut events = Vec::with_capacity(2);
                    if !removed.is_empty() {
                        events.push(Event::Removed {
                            tier: Tier::Gpu,
                            blocks: removed,
                        });
                    }
                    if !stored.is_empty() {
                        events.push(Event::Stored {
                            tier: Tier::Gpu,
                            parent: None,
                            blocks: stored,
                            tokens: None,
                        });
                    }
                    self.publish(k, events, now);
                }
                Ev::Delta(g, id) => {
                    if let Some(d) = &self.pending_deltas[id] {
                        self.gws[g].sc.apply_remote_at(d, self.at(now));
                    }
                }
                Ev::Queue(g, id) => {
                    let at = self.at(now);
                    let s = &self.pending_queues[id];
                    let _ = self.gws[g].queue.apply_peer(&format!("g{g}"), s, at);
                }
            }
        }
    }
}

/// Each text block's engine tokens: its bytes at the ratio of the conversation (session,
/// or request) that first sends it, in arrival order.
fn text_block_tokens(reqs: &[Request], t: &TextChains) -> HashMap<u64, f64> {
    let mut order: Vec<usize> = (0..reqs.len()).collect();
    order.sort_by(|&a, &b| reqs[a].ts_ms.total_cmp(&reqs[b].ts_ms));
    let mut per = HashMap::new();
    for i in order {
        let k = reqs[i].session.unwrap_or(i as u64) as usize;
        let bpt = t.bytes_per_token[k % t.bytes_per_token.len().max(1)].max(0.1);
        for &b in &reqs[i].chain {
            per.entry(b).or_insert(t.block_bytes as f64 / bpt);
        }
    }
    per
}

/// The gateways' policy: `o.config` with the simulated model's block size.
fn gateway_config(o: &SimOpts) -> PolicyConfig {
    let mut cfg = o.config.clone();
    let mut m = cfg.model(MODEL).clone();
    m.block_size = o.block_tokens;
    if let Some(t) = &o.text {
        m.text_block_bytes = t.block_bytes;
    }
    cfg.models.insert(MODEL.into(), m);
    cfg
}

pub fn simulate(reqs: &[Request], o: &SimOpts, p: Policy) -> SimResult {
    simulate_labelled(reqs, o, p, "")
}

/// [`simulate`], naming the workload in the result.
pub fn simulate_labelled(reqs: &[Request], o: &SimOpts, p: Policy, workload: &str) -> SimResult {
    let cfg = gateway_config(o);
    let gws: Vec<Gateway> = (0..o.gateways.max(1))
        .map(|g| {
            let (sc, ch) = Sidecar::with_replica(cfg.clone(), Some(format!("g{g}")))
                .unwrap_or_else(|errs| {
                    panic!("the simulator's policy config is invalid: {errs:?}")
                });
            sc.enable_replica_sync(o.gateways > 1);
            Gateway {
                sc,
                recovery: Recovery::default(),
                outbox: ch.outbox,
                selector: p.selector(o.seed.wrapping_add(g as u64), o.dp_ranks),
                queue: AdmissionQueue::new(o.admission.as_ref().map_or(
                    Limits {
                        max_requests: 0,
                        max_bytes: 0,
                    },
                    |a| a.limits(),
                )),
                look_pending: false,
            }
        })
        .collect();
    let pods: Vec<Pod> = (0..o.pods)
        .map(|k| Pod {
            id: pod_id(k, o.dp_ranks),
            cache: BlockCache::new(o.capacity_blocks),
            waiting: VecDeque::new(),
            prefill_queue: VecDeque::new(),
            lane_busy: false,
            running: 0,
            assigned: 0,
            seq: 0,
        })
        .collect();
    let n = reqs.len();
    let mut s = Sim {
        o,
        reqs,
        pod_of_id: pods
            .iter()
            .enumerate()
            .map(|(k, p)| (p.id.clone(), k))
            .collect(),
        pods,
        gws,
        heap: BinaryHeap::new(),
        seq: 0,
        origin: kvroute_sidecar::clock_origin() + Duration::from_secs(1),
        pending_events: Vec::new(),
        pending_deltas: Vec::new(),
        pending_queues: Vec::new(),
        text_tokens: o.text.as_ref().map(|t| text_block_tokens(reqs, t)),
        rng: Rng(o.seed),
        arrive: vec![0.0; n],
        pod_of: vec![0; n],
        gw_of: vec![0; n],
        decision: vec![String::new(); n],
        hit: vec![0; n],
        held_anywhere: vec![0; n],
        ttft: vec![0.0; n],
        done: vec![0.0; n],
        shed: vec![false; n],
        from_queue: vec![false; n],
        contested: vec![false; n],
        queue_peak_bytes: 0,
    };
    s.run();
    let classes =
        s.o.admission
            .as_ref()
            .map(|a| class_figures(&s, a))
            .unwrap_or_default();
    // Shed requests never ran: they count in no latency or hit figure.
    let ran: Vec<usize> = (0..n).filter(|&i| !s.shed[i]).collect();
    let total_blocks: u64 = ran.iter().map(|&i| reqs[i].chain.len() as u64).sum();
    let hits: u64 = ran.iter().map(|&i| s.hit[i]).sum();
    let mut ttft = Samples(ran.iter().map(|&i| (s.ttft[i] * 1e6) as u64).collect());
    let mut e2e = Samples(
        ran.iter()
            .map(|&i| ((s.done[i] - s.arrive[i]) * 1e6) as u64)
            .collect(),
    );
    let span = s.done.iter().copied().fold(0.0, f64::max)
        - s.arrive.iter().copied().fold(f64::INFINITY, f64::min);
    let loads: Vec<f64> = s.pods.iter().map(|p| p.assigned as f64).collect();
    let mean = loads.iter().sum::<f64>() / loads.len().max(1) as f64;
    let turns = session_turns(reqs, &ran, &s.arrive, &s.pod_of, &s.hit);
    let share = |blocks: u64| blocks as f64 / total_blocks.max(1) as f64;
    SimResult {
        policy: p.name().to_string(),
        workload: workload.to_string(),
        gateways: o.gateways.max(1),
        hit_rate: hits as f64 / total_blocks.max(1) as f64,
        ttft_mean_ms: ttft.mean() / 1e3,
        ttft_p50_ms: ttft.pct(50.0) as f64 / 1e3,
        ttft_p99_ms: ttft.pct(99.0) as f64 / 1e3,
        e2e_mean_ms: e2e.mean() / 1e3,
        e2e_p99_ms: e2e.pct(99.0) as f64 / 1e3,
        throughput_rps: ran.len() as f64 / span.max(1e-9),
        max_mean_load: loads.iter().copied().fold(0.0, f64::max) / mean.max(1e-9),
        decisions: s
            .gws
            .iter()
            .flat_map(|g| g.sc.metrics.decisions.snapshot())
            .map(|(_, n)| n)
            .sum(),
        mispredictions: s
            .gws
            .iter()
            .map(|g| g.sc.metrics.mispredictions.get())
            .sum(),
        session_moves: turns.moved as f64 / turns.continued.max(1) as f64,
        missed: Misses {
            first: share(turns.missed_first),
            stayed: share(turns.missed_stayed),
            moved: share(turns.missed_moved),
        },
        shed: s.shed.iter().filter(|&&x| x).count() as u64,
        queued: s.from_queue.iter().filter(|&&x| x).count() as u64,
        queue_peak_bytes: s.queue_peak_bytes,
        classes,
        locality_lost: share(
            ran.iter()
                .map(|&i| s.held_anywhere[i].saturating_sub(s.hit[i]))
                .sum(),
        ),
        request_hits: (0..n).map(|i| (!s.shed[i]).then_some(s.hit[i])).collect(),
    }
}

/// The requests `ran` by their place in a session, in arrival order: how many continue
/// one, how many of those ran on another pod than the session's previous request, and
/// the prompt blocks each kind missed.
#[derive(Default)]
struct SessionTurns {
    continued: u64,
    moved: u64,
    missed_first: u64,
    missed_stayed: u64,
    missed_moved: u64,
}

fn session_turns(
    reqs: &[Request],
    ran: &[usize],
    arrive: &[f64],
    pod_of: &[usize],
    hit: &[u64],
) -> SessionTurns {
    let mut order: Vec<usize> = ran.to_vec();
    order.sort_by(|&a, &b| arrive[a].total_cmp(&arrive[b]));
    let mut last: HashMap<u64, usize> = HashMap::new();
    let mut t = SessionTurns::default();
    for i in order {
        let Some(sess) = reqs[i].session else {
            continue;
        };
        let missed = (reqs[i].chain.len() as u64).saturating_sub(hit[i]);
        match last.insert(sess, pod_of[i]) {
            None => t.missed_first += missed,
            Some(prev) if prev == pod_of[i] => {
                t.continued += 1;
                t.missed_stayed += missed;
            }
            Some(_) => {
                t.continued += 1;
                t.moved += 1;
                t.missed_moved += missed;
            }
        }
    }
    t
}

/// Figures per (priority, tenant) class, in class order.
fn class_figures(s: &Sim<'_>, a: &SimAdmission) -> Vec<ClassFigures> {
    let mut by: std::collections::BTreeMap<(i32, u32), (ClassFigures, Vec<u64>)> =
        Default::default();
    for i in 0..s.reqs.len() {
        let (priority, tenant) = a.class(i);
        let (c, ttft) = by.entry((priority, tenant)).or_insert_with(|| {
            (
                ClassFigures {
                    priority,
                    tenant,
                    ..Default::default()
                },
                Vec::new(),
            )
        });
        c.requests += 1;
        if s.shed[i] {
            c.shed += 1;
        } else {
            c.served += 1;
            ttft.push((s.ttft[i] * 1e6) as u64);
        }
        if s.from_queue[i] {
            c.dispatched_saturated += 1;
        }
        if s.contested[i] {
            c.dispatched_contested += 1;
        }
    }
    by.into_values()
        .map(|(mut c, t)| {
            let mut t = Samples(t);
            c.ttft_mean_ms = t.mean() / 1e3;
            c.ttft_p99_ms = t.pct(99.0) as f64 / 1e3;
            c
        })
        .collect()
}

/// The simulator's default pod: 10k prefill tokens/s, 10 ms decode steps, batch 16.
pub fn default_cost() -> CostModel {
    CostModel {
        prefill_tps: 10_000.0,
        decode_ms: 10.0,
        max_batch: 16,
    }
}
