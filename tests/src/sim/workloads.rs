//! The simulator's generated workloads: request streams shaped like the shared-prefix,
//! prefix-cache and multi-round QA benchmarks other routers publish, with Poisson
//! arrivals, in blocks of `block_tokens` tokens.

use crate::bench::Rng;
use crate::workload::Request;

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
            let c = Conversations {
                system: 1000,
                rounds: 6,
                question: (100, 100),
                answer: (200, 200),
            };
            reqs = c.generate(&mut fresh, &mut rng, block_tokens);
        }
        // Multi-turn chat, the shape of ShareGPT-style conversations: 64 users x 8
        // turns behind a short shared 200-token system prompt; each turn adds a
        // 100-500-token question and a 200-600-token answer. Unlike multi-round QA,
        // most of a later turn's prompt is its own conversation, held wherever that
        // conversation ran before; the shared part every pod can hold is small.
        "multiturn-chat" => {
            let c = Conversations {
                system: 200,
                rounds: 8,
                question: (100, 500),
                answer: (200, 600),
            };
            reqs = c.generate(&mut fresh, &mut rng, block_tokens);
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

/// 64 users holding conversations behind one shared system prompt, a round at a time:
/// each round adds a question and then an answer to every user's history (lengths in
/// tokens, drawn in 16-token steps when a range is given).
struct Conversations {
    system: u32,
    rounds: usize,
    question: (u32, u32),
    answer: (u32, u32),
}

impl Conversations {
    fn generate(
        &self,
        fresh: &mut impl FnMut(u32) -> Vec<u64>,
        rng: &mut Rng,
        block_tokens: u32,
    ) -> Vec<Request> {
        let draw = |rng: &mut Rng, (lo, hi): (u32, u32)| {
            if hi > lo {
                lo + 16 * rng.below(((hi - lo) / 16 + 1) as usize) as u32
            } else {
                lo
            }
        };
        let system = fresh(self.system);
        let mut hist: Vec<Vec<u64>> = (0..64).map(|_| system.clone()).collect();
        let mut reqs = Vec::new();
        for _ in 0..self.rounds {
            let mut round = Vec::new();
            for (u, h) in hist.iter_mut().enumerate() {
                h.extend(fresh(draw(rng, self.question)));
                let answer = draw(rng, self.answer);
                round.push(Request {
                    ts_ms: 0.0,
                    input_tokens: h.len() as u32 * block_tokens,
                    output_tokens: answer,
                    chain: h.clone(),
                    session: Some(u as u64 + 1),
                });
                h.extend(fresh(answer));
            }
            // Users take their turns in a different order each round.
            shuffle(&mut round, rng);
            reqs.extend(round);
        }
        reqs
    }
}

fn shuffle<T>(v: &mut [T], rng: &mut Rng) {
    for i in (1..v.len()).rev() {
        let j = rng.below(i + 1);
        v.swap(i, j);
    }
}

pub const WORKLOADS: [&str; 4] = [
    "sglang-shared-prefix",
    "llmd-prefix",
    "multiround-qa",
    "multiturn-chat",
];

/// Arrival rates that load 8 default pods to roughly two thirds of their capacity.
pub fn default_rate(name: &str) -> f64 {
    match name {
        "sglang-shared-prefix" => 10.0,
        "llmd-prefix" => 2.5,
        _ => 10.0,
    }
}
