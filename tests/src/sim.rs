//! `kvroute-bench sim`: a deterministic discrete-event simulation of P engine pods
//! (virtual time, seeded) with the engine simulator's cost model and LRU block caches,
//! routed by the real kvroute index and policy (library calls) and by every baseline, on
//! the same requests. Pods' caches emit the events that feed each router's own index,
//! after a configurable delay and with configurable loss, so staleness is simulated too.
//!
//! Pod model (as `kvroute-engine-sim`): a request waits for a batch slot (FIFO, at most
//! `max_batch` running), then for the pod's prefill lane (prefill is serialized), then
//! decodes `output_tokens` steps of `decode_ms × (1 + 0.1 × running)`. TTFT is arrival to
//! end of prefill. The router's load projection is released when a request completes,
//! as the sidecar releases it on the completion report.

use std::cmp::Ordering as CmpOrdering;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet, VecDeque};

use kvroute_shared::protocol::{PolicyConfig, Tier};
use kvroute_sidecar::index::{ModelIndex, PodHandle};
use kvroute_sidecar::policy::{self, Ask, Candidate, LoadView};
use serde_json::json;

use crate::bench::{Rng, Samples};
use crate::cache::BlockCache;
use crate::engine::CostModel;
use crate::workload::Request;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Policy {
    Kvroute,
    Random,
    RoundRobin,
    LeastLoaded,
    ConsistentHash,
    Session,
    PrefixGreedy,
    Dynamo,
    Sglang,
}

impl Policy {
    pub const ALL: [Policy; 9] = [
        Policy::Kvroute,
        Policy::Random,
        Policy::RoundRobin,
        Policy::LeastLoaded,
        Policy::ConsistentHash,
        Policy::Session,
        Policy::PrefixGreedy,
        Policy::Dynamo,
        Policy::Sglang,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Kvroute => "kvroute",
            Policy::Random => "random",
            Policy::RoundRobin => "round-robin",
            Policy::LeastLoaded => "least-loaded",
            Policy::ConsistentHash => "consistent-hash",
            Policy::Session => "session",
            Policy::PrefixGreedy => "prefix-greedy",
            Policy::Dynamo => "dynamo",
            Policy::Sglang => "sglang",
        }
    }

    pub fn parse(s: &str) -> Option<Policy> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s || p.name().replace('-', "_") == s)
    }
}

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
}

/// Figures of one policy on one workload.
#[derive(Clone, Debug, Default)]
pub struct SimResult {
    pub policy: String,
    pub hit_rate: f64,
    pub ttft_mean_ms: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2e_mean_ms: f64,
    pub e2e_p99_ms: f64,
    pub throughput_rps: f64,
    pub max_mean_load: f64,
}

impl SimResult {
    pub fn json(&self) -> serde_json::Value {
        let r = |x: f64| (x * 1000.0).round() / 1000.0;
        json!({"policy": self.policy, "hit_rate": r(self.hit_rate), "ttft_mean_ms": r(self.ttft_mean_ms),
               "ttft_p50_ms": r(self.ttft_p50_ms), "ttft_p99_ms": r(self.ttft_p99_ms), "e2e_mean_ms": r(self.e2e_mean_ms),
               "e2e_p99_ms": r(self.e2e_p99_ms), "throughput_rps": r(self.throughput_rps), "max_mean_load": r(self.max_mean_load)})
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Ev {
    Arrive(usize),
    PrefillDone(usize, usize),
    DecodeDone(usize, usize),
    /// Index events of a pod become visible to the router (index into `pending_events`).
    Visible(usize),
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
    cache: BlockCache,
    waiting: VecDeque<usize>,
    prefill_queue: VecDeque<usize>,
    lane_busy: bool,
    running: usize,
    /// Router's projection (released at completion, like the sidecar).
    proj: LoadView,
    horizon: policy::PrefillHorizon,
    recent: policy::RecentWork,
    assigned: u64,
}

struct Sim<'a> {
    o: &'a SimOpts,
    reqs: &'a [Request],
    pods: Vec<Pod>,
    heap: BinaryHeap<At>,
    seq: u64,
    index: ModelIndex,
    handles: Vec<PodHandle>,
    pending_events: Vec<(usize, Vec<u64>, Vec<u64>)>,
    rng: Rng,
    rr: usize,
    sessions: HashMap<u64, usize>,
    /// In-flight requests per (routing prefix, pod), and each request's routing prefix.
    prefix_load: HashMap<u64, Vec<u32>>,
    prefix_of: Vec<Option<u64>>,
    // Per request: (arrival, pod, hit blocks, prefill end, prefill tokens projected).
    arrive: Vec<f64>,
    pod_of: Vec<usize>,
    hit: Vec<u64>,
    ttft: Vec<f64>,
    done: Vec<f64>,
    proj_tokens: Vec<u64>,
}

impl Sim<'_> {
    fn push(&mut self, t: f64, e: Ev) {
        self.seq += 1;
        self.heap.push(At(t, self.seq, e));
    }

    /// The router's load view of pod `k` at `now`.
    fn view(&self, k: usize, now: f64) -> LoadView {
        let mut v = self.pods[k].proj;
        v.pending_prefill_tokens = self.pods[k]
            .horizon
            .pending(now, self.o.config.prefill_tokens_per_s);
        // What the engine's `load` events report.
        v.queued = self.pods[k].waiting.len() as u32;
        v.recent_blocks = self.pods[k].recent.value(now, self.o.config.home_window_s);
        v
    }

    fn route(&mut self, p: Policy, i: usize, now: f64) -> usize {
        let r = &self.reqs[i];
        let n = self.pods.len();
        let inflight = |s: &Sim<'_>, k: usize| s.pods[k].proj.inflight;
        match p {
            Policy::Random => self.rng.below(n),
            Policy::RoundRobin => {
                self.rr += 1;
                self.rr % n
            }
            Policy::LeastLoaded => (0..n).min_by_key(|&k| (inflight(self, k), k)).unwrap_or(0),
            Policy::ConsistentHash | Policy::Session => {
                let key = match (p, r.session) {
                    (Policy::Session, Some(s)) => s,
                    _ => r.chain.first().copied().unwrap_or(i as u64),
                };
                if p == Policy::Session {
                    if let Some(&k) = self.sessions.get(&key) {
                        return k;
                    }
                }
                let total: u64 = (0..n).map(|k| inflight(self, k) as u64).sum();
                let cap = ((1.0 + self.o.config.balance_epsilon) * (total + 1) as f64 / n as f64)
                    .ceil() as u32;
                let mut order: Vec<usize> = (0..n).collect();
                order.sort_by_key(|&k| std::cmp::Reverse(policy::rendezvous(key, k as u64 + 1)));
                let k = order
                    .iter()
                    .copied()
                    .find(|&k| inflight(self, k) < cap.max(1))
                    .unwrap_or(order[0]);
                if p == Policy::Session {
                    self.sessions.insert(key, k);
                }
                k
            }
            Policy::PrefixGreedy | Policy::Dynamo | Policy::Sglang | Policy::Kvroute => {
                let mut out = Vec::new();
                self.index.lookup_slots(&r.chain, &mut out);
                let depth = |k: usize| {
                    out.iter()
                        .find(|m| m.0 == self.handles[k].slot)
                        .map_or(0, |m| m.1)
                };
                match p {
                    Policy::PrefixGreedy => {
                        let best = (0..n).map(depth).max().unwrap_or(0);
                        let ties: Vec<usize> = (0..n).filter(|&k| depth(k) == best).collect();
                        self.rr += 1;
                        ties[self.rr % ties.len()]
                    }
                    Policy::Dynamo => {
                        // overlap_weight · (active_prefill_tokens + ISL − overlap·bs)/bs + decode_blocks
                        let bs = self.o.block_tokens as f64;
                        (0..n)
                            .min_by(|&a, &b| {
                                let c = |k: usize| {
                                    let l = self.view(k, now);
                                    (l.pending_prefill_tokens as f64 + r.input_tokens as f64
                                        - depth(k) as f64 * bs)
                                        / bs
                                        + l.decode_blocks as f64
                                };
                                c(a).total_cmp(&c(b)).then(a.cmp(&b))
                            })
                            .unwrap_or(0)
                    }
                    Policy::Sglang => {
                        let loads: Vec<u32> = (0..n).map(|k| inflight(self, k)).collect();
                        let (mx, mn) = (
                            *loads.iter().max().unwrap_or(&0),
                            *loads.iter().min().unwrap_or(&0),
                        );
                        let imbalanced = mx.saturating_sub(mn) > 64 && mx as f64 > 1.5 * mn as f64;
                        let best = (0..n)
                            .max_by_key(|&k| (depth(k), std::cmp::Reverse(k)))
                            .unwrap_or(0);
                        let ratio = depth(best) as f64 / r.chain.len().max(1) as f64;
                        if imbalanced || ratio < 0.3 {
                            (0..n).min_by_key(|&k| (loads[k], k)).unwrap_or(0)
                        } else {
                            best
                        }
                    }
                    _ => {
                        let bs = self.o.block_tokens.max(1);
                        let deepest = (0..n).map(depth).max().unwrap_or(0) as usize;
                        let pkey = deepest.checked_sub(1).and_then(|d| r.chain.get(d)).copied();
                        let pl = pkey.and_then(|p| self.prefix_load.get(&p)).cloned();
                        let cands: Vec<Candidate> = (0..n)
                            .map(|k| Candidate {
                                id: k,
                                key: k as u64 + 1,
                                matched: depth(k),
                                predicted: 0,
                                tiers: None,
                                stale: false,
                                load: LoadView {
                                    prefix_inflight: pl.as_ref().map_or(0, |v| v[k]),
                                    ..self.view(k, now)
                                },
                            })
                            .collect();
                        self.prefix_of[i] = pkey;
                        let ask = Ask {
                            prompt_blocks: (r.chain.len() as u32).max(r.input_tokens.div_ceil(bs)),
                            block_size: bs,
                            tie_key: policy::tie_key(
                                &r.chain,
                                out.first().map_or(0, |m| m.1 as usize),
                            )
                            .unwrap_or(i as u64),
                            seed: i as u64,
                            load_only: false,
                        };
                        match policy::pick(&self.o.config, &ask, &cands) {
                            Some(rank) => rank.order[rank.pick].0,
                            None => 0,
                        }
                    }
                }
            }
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
                let cached =
                    (adm.hit_blocks as u64 * self.o.block_tokens as u64).min(r.input_tokens as u64);
                self.hit[i] = adm.hit_blocks as u64;
                let dur = self.o.cost.prefill_s(r.input_tokens as u64 - cached);
                if !(adm.stored.is_empty() && adm.removed.is_empty())
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

    fn run(&mut self, p: Policy) {
        for (i, r) in self.reqs.iter().enumerate() {
            self.push(r.ts_ms / 1e3, Ev::Arrive(i));
        }
        while let Some(At(now, _, ev)) = self.heap.pop() {
            match ev {
                Ev::Arrive(i) => {
                    self.arrive[i] = now;
                    let k = self.route(p, i, now);
                    self.pod_of[i] = k;
                    if let Some(pk) = self.prefix_of[i] {
                        let n = self.pods.len();
                        self.prefix_load.entry(pk).or_insert_with(|| vec![0; n])[k] += 1;
                    }
                    let r = &self.reqs[i];
                    let bs = self.o.block_tokens as u64;
                    // The router's view of the hit, for its projection (as the sidecar).
                    let mut out = Vec::new();
                    if p == Policy::Kvroute || p == Policy::Dynamo {
                        self.index.lookup_slots(&r.chain, &mut out);
                    }
                    let seen = out
                        .iter()
                        .find(|m| m.0 == self.handles[k].slot)
                        .map_or(0, |m| m.1 as u64);
                    let pt = (r.input_tokens as u64).saturating_sub(seen * bs);
                    self.proj_tokens[i] = pt;
                    let pod = &mut self.pods[k];
                    pod.proj.pending_prefill_tokens += pt;
                    pod.horizon.add(now, pt, self.o.config.prefill_tokens_per_s);
                    pod.proj.decode_blocks += r.chain.len() as u64;
                    pod.recent
                        .add(now, r.chain.len() as u64, self.o.config.home_window_s);
                    pod.proj.inflight += 1;
                    pod.assigned += 1;
                    pod.waiting.push_back(i);
                    self.try_start(k, now);
                }
                Ev::PrefillDone(k, i) => {
                    self.ttft[i] = now - self.arrive[i];
                    self.pods[k].lane_busy = false;
                    let steps = self.reqs[i].output_tokens.max(1) as f64;
                    let d = steps * self.o.cost.decode_step_s(self.pods[k].running);
                    self.push(now + d, Ev::DecodeDone(k, i));
                    self.try_start(k, now);
                }
                Ev::DecodeDone(k, i) => {
                    self.done[i] = now;
                    if let Some(pk) = self.prefix_of[i] {
                        if let Some(v) = self.prefix_load.get_mut(&pk) {
                            v[k] = v[k].saturating_sub(1);
                        }
                    }
                    let r = &self.reqs[i];
                    let pod = &mut self.pods[k];
                    pod.running -= 1;
                    pod.proj.pending_prefill_tokens = pod
                        .proj
                        .pending_prefill_tokens
                        .saturating_sub(self.proj_tokens[i]);
                    pod.horizon.release(
                        now,
                        self.proj_tokens[i],
                        self.o.config.prefill_tokens_per_s,
                    );
                    pod.proj.decode_blocks =
                        pod.proj.decode_blocks.saturating_sub(r.chain.len() as u64);
                    pod.proj.inflight = pod.proj.inflight.saturating_sub(1);
                    self.try_start(k, now);
                }
                Ev::Visible(id) => {
                    let (k, stored, removed) = std::mem::take(&mut self.pending_events[id]);
                    let h = self.handles[k];
                    let _ = self.index.remove(h, Tier::Gpu, &removed);
                    let _ = self.index.store(h, Tier::Gpu, &stored);
                }
            }
        }
    }
}

pub fn simulate(reqs: &[Request], o: &SimOpts, p: Policy) -> SimResult {
    let index = ModelIndex::new(u64::MAX / 2);
    let handles = (0..o.pods)
        .map(|k| {
            index.join(&format!("pod{k}")).unwrap_or(PodHandle {
                slot: k as u8,
                gen: 0,
            })
        })
        .collect();
    let n = reqs.len();
    let mut s = Sim {
        o,
        reqs,
        pods: (0..o.pods)
            .map(|_| Pod {
                cache: BlockCache::new(o.capacity_blocks),
                waiting: VecDeque::new(),
                prefill_queue: VecDeque::new(),
                lane_busy: false,
                running: 0,
                proj: LoadView::default(),
                horizon: policy::PrefillHorizon::default(),
                recent: policy::RecentWork::default(),
                assigned: 0,
            })
            .collect(),
        heap: BinaryHeap::new(),
        seq: 0,
        index,
        handles,
        pending_events: Vec::new(),
        rng: Rng(o.seed),
        rr: 0,
        sessions: HashMap::new(),
        prefix_load: HashMap::new(),
        prefix_of: vec![None; n],
        arrive: vec![0.0; n],
        pod_of: vec![0; n],
        hit: vec![0; n],
        ttft: vec![0.0; n],
        done: vec![0.0; n],
        proj_tokens: vec![0; n],
    };
    s.run(p);
    let total_blocks: u64 = reqs.iter().map(|r| r.chain.len() as u64).sum();
    let hits: u64 = s.hit.iter().sum();
    let mut ttft = Samples(s.ttft.iter().map(|t| (t * 1e6) as u64).collect());
    let mut e2e = Samples(
        s.done
            .iter()
            .zip(&s.arrive)
            .map(|(d, a)| ((d - a) * 1e6) as u64)
            .collect(),
    );
    let span = s.done.iter().copied().fold(0.0, f64::max)
        - s.arrive.iter().copied().fold(f64::INFINITY, f64::min);
    let loads: Vec<f64> = s.pods.iter().map(|p| p.assigned as f64).collect();
    let mean = loads.iter().sum::<f64>() / loads.len().max(1) as f64;
    SimResult {
        policy: p.name().to_string(),
        hit_rate: hits as f64 / total_blocks.max(1) as f64,
        ttft_mean_ms: ttft.mean() / 1e3,
        ttft_p50_ms: ttft.pct(50.0) as f64 / 1e3,
        ttft_p99_ms: ttft.pct(99.0) as f64 / 1e3,
        e2e_mean_ms: e2e.mean() / 1e3,
        e2e_p99_ms: e2e.pct(99.0) as f64 / 1e3,
        throughput_rps: n as f64 / span.max(1e-9),
        max_mean_load: loads.iter().copied().fold(0.0, f64::max) / mean.max(1e-9),
    }
}

/// What no router can beat: one infinite cache shared by all pods and no queueing. Its
/// hit rate is the ceiling; its TTFT (each request prefills only what that cache lacks)
/// is the floor. On the generated workloads the floor's p99 is the cold prefill of each
/// new group or conversation, which every policy pays.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bound {
    pub hit_rate: f64,
    pub ttft_mean_ms: f64,
    pub ttft_p99_ms: f64,
}

pub fn infinite_cache_bound(reqs: &[Request], o: &SimOpts) -> Bound {
    let mut seen = HashSet::new();
    let (mut hits, mut total) = (0u64, 0u64);
    let mut ttft = Samples(Vec::with_capacity(reqs.len()));
    for r in reqs {
        let hit = r.chain.iter().take_while(|b| seen.contains(*b)).count() as u64;
        hits += hit;
        total += r.chain.len() as u64;
        let cached = (hit * o.block_tokens as u64).min(r.input_tokens as u64);
        ttft.push((o.cost.prefill_s(r.input_tokens as u64 - cached) * 1e6) as u64);
        seen.extend(r.chain.iter().copied());
    }
    Bound {
        hit_rate: hits as f64 / total.max(1) as f64,
        ttft_mean_ms: ttft.mean() / 1e3,
        ttft_p99_ms: ttft.pct(99.0) as f64 / 1e3,
    }
}

/// Generated workloads after the shapes SGLang's, llm-d's and the multi-round QA benchmarks use, in blocks of `block_tokens` tokens.
pub fn generated(name: &str, block_tokens: u32, rate_rps: f64, seed: u64) -> Option<Vec<Request>> {
    let mut rng = Rng(seed);
    let mut id = seed << 40;
    let mut fresh = |n: u32| -> Vec<u64> {
        (0..n.div_ceil(block_tokens))
            .map(|_| {
                id += 1;
                crate::workload::id_hash(id)
            })
            .collect()
    };
    let mut reqs = Vec::new();
    match name {
        // SGLang generated shared prefix: 64 groups x 16 prompts, 2048-token system
        // prompt, 128-token question, 256 output tokens.
        "sglang-shared-prefix" => {
            let groups: Vec<Vec<u64>> = (0..64).map(|_| fresh(2048)).collect();
            for _ in 0..16 {
                for g in &groups {
                    let mut c = g.clone();
                    c.extend(fresh(128));
                    reqs.push(Request {
                        ts_ms: 0.0,
                        input_tokens: 2048 + 128,
                        output_tokens: 256,
                        chain: c,
                        session: None,
                    });
                }
            }
            shuffle(&mut reqs, &mut rng);
        }
        // llm-d's prefix-cache guide: 150 groups x 5 prompts, 6000 prefix, 1200 question, 1000 output.
        "llmd-prefix" => {
            let groups: Vec<Vec<u64>> = (0..150).map(|_| fresh(6000)).collect();
            for _ in 0..5 {
                for g in &groups {
                    let mut c = g.clone();
                    c.extend(fresh(1200));
                    reqs.push(Request {
                        ts_ms: 0.0,
                        input_tokens: 7200,
                        output_tokens: 1000,
                        chain: c,
                        session: None,
                    });
                }
            }
            shuffle(&mut reqs, &mut rng);
        }
        // Multi-round QA: 64 users x 6 rounds, a shared 1000-token system prompt, each
        // round adds a 100-token question and a 200-token answer to the history.
        "multiround-qa" => {
            let system = fresh(1000);
            let mut hist: Vec<Vec<u64>> = (0..64).map(|_| system.clone()).collect();
            for _round in 0..6 {
                let mut round = Vec::new();
                for (u, h) in hist.iter_mut().enumerate() {
                    h.extend(fresh(100));
                    let toks = h.len() as u32 * block_tokens;
                    round.push(Request {
                        ts_ms: 0.0,
                        input_tokens: toks,
                        output_tokens: 200,
                        chain: h.clone(),
                        session: Some(u as u64 + 1),
                    });
                    h.extend(fresh(200));
                }
                // Users take their turns in a different order each round.
                shuffle(&mut round, &mut rng);
                reqs.extend(round);
            }
        }
        _ => return None,
    }
    // Poisson arrivals.
    let mut t = 0.0;
    for r in reqs.iter_mut() {
        t += -(1.0 - rng.f64()).ln() / rate_rps * 1e3;
        r.ts_ms = t;
    }
    Some(reqs)
}

fn shuffle<T>(v: &mut [T], rng: &mut Rng) {
    for i in (1..v.len()).rev() {
        let j = rng.below(i + 1);
        v.swap(i, j);
    }
}

pub const WORKLOADS: [&str; 3] = ["sglang-shared-prefix", "llmd-prefix", "multiround-qa"];

/// Arrival rates that load 8 default pods to roughly two thirds of their capacity.
pub fn default_rate(name: &str) -> f64 {
    match name {
        "sglang-shared-prefix" => 10.0,
        "llmd-prefix" => 2.5,
        _ => 10.0,
    }
}

/// Run `policies` on `reqs`; print the table; return the results.
pub fn compare(label: &str, reqs: &[Request], o: &SimOpts, policies: &[Policy]) -> Vec<SimResult> {
    let results: Vec<SimResult> = policies.iter().map(|&p| simulate(reqs, o, p)).collect();
    let bound = infinite_cache_bound(reqs, o);
    println!(
        "{label}: {} requests, {} pods x {} blocks, infinite-cache hit-rate ceiling {:.3}, TTFT floor (that cache, no queueing) mean {:.1} ms, p99 {:.0} ms",
        reqs.len(),
        o.pods,
        o.capacity_blocks,
        bound.hit_rate,
        bound.ttft_mean_ms,
        bound.ttft_p99_ms
    );
    println!(
        "  {:<16} {:>8} {:>11} {:>10} {:>10} {:>11} {:>10} {:>9} {:>9}",
        "policy",
        "hit",
        "TTFT mean",
        "TTFT p50",
        "TTFT p99",
        "E2E mean",
        "E2E p99",
        "req/s",
        "max/mean"
    );
    for r in &results {
        println!(
            "  {:<16} {:>8.3} {:>9.1}ms {:>8.0}ms {:>8.0}ms {:>9.0}ms {:>8.0}ms {:>9.2} {:>9.2}",
            r.policy,
            r.hit_rate,
            r.ttft_mean_ms,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.e2e_mean_ms,
            r.e2e_p99_ms,
            r.throughput_rps,
            r.max_mean_load
        );
    }
    results
}

/// A grouped bar chart of mean and p99 TTFT per policy.
pub fn svg_bars(title: &str, results: &[SimResult]) -> String {
    let (w, h, ml, mb, mt) = (80.0 + 70.0 * results.len() as f64, 360.0, 60.0, 90.0, 40.0);
    let ymax = results.iter().map(|r| r.ttft_p99_ms).fold(1.0, f64::max) * 1.1;
    let y = |v: f64| h - mb - v / ymax * (h - mb - mt);
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" font-size="14" text-anchor="middle">{title}</text><line x1="{ml}" y1="{}" x2="{}" y2="{}" stroke="black"/>"#,
        w / 2.0,
        h - mb,
        w - 10.0,
        h - mb
    );
    for i in 0..=4 {
        let v = ymax / 4.0 * i as f64;
        s += &format!(
            r#"<text x="{}" y="{:.1}" text-anchor="end">{v:.0} ms</text>"#,
            ml - 4.0,
            y(v) + 4.0
        );
    }
    for (i, r) in results.iter().enumerate() {
        let x0 = ml + 10.0 + 70.0 * i as f64;
        for (j, (v, c)) in [(r.ttft_mean_ms, "#1f77b4"), (r.ttft_p99_ms, "#ff7f0e")]
            .iter()
            .enumerate()
        {
            s += &format!(
                r#"<rect x="{:.1}" y="{:.1}" width="24" height="{:.1}" fill="{c}"/>"#,
                x0 + 26.0 * j as f64,
                y(*v),
                (h - mb) - y(*v)
            );
        }
        s += &format!(
            r#"<text x="{:.1}" y="{}" transform="rotate(40 {:.1} {})">{}</text>"#,
            x0,
            h - mb + 14.0,
            x0,
            h - mb + 14.0,
            r.policy
        );
    }
    s += &format!(
        r##"<rect x="{ml}" y="{}" width="10" height="10" fill="#1f77b4"/><text x="{}" y="{}">TTFT mean</text><rect x="{}" y="{}" width="10" height="10" fill="#ff7f0e"/><text x="{}" y="{}">TTFT p99</text>"##,
        h - 20.0,
        ml + 14.0,
        h - 11.0,
        ml + 100.0,
        h - 20.0,
        ml + 114.0,
        h - 11.0
    );
    s + "</svg>\n"
}

/// Summary rows for docs: policy → (mean, p99, max/mean).
pub fn by_policy(results: &[SimResult]) -> BTreeMap<String, (f64, f64, f64)> {
    results
        .iter()
        .map(|r| {
            (
                r.policy.clone(),
                (r.ttft_mean_ms, r.ttft_p99_ms, r.max_mean_load),
            )
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
