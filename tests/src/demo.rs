//! The README's main demo: a realistic workload (multi-turn chat with a shared system
//! prompt, plus questions over shared documents) replayed through Envoy twice — with
//! kvroute, then with plain round-robin — on the same engines, caches emptied between
//! runs. TTFT is measured by the client (first streamed chunk); hit rate is what the
//! engines report (`cached_tokens`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};

use crate::bench::{Rng, Samples};

/// One request of a session.
#[derive(Clone, Debug)]
pub enum Call {
    Chat(Value),
    Completion(Value),
}

/// Requests that must run in order (a conversation, or questions over one document).
pub type Session = Vec<Call>;

#[derive(Clone, Copy, Debug)]
pub struct WorkloadOpts {
    pub users: usize,
    pub rounds: usize,
    pub docs: usize,
    pub questions: usize,
    pub seed: u64,
}

impl Default for WorkloadOpts {
    fn default() -> Self {
        WorkloadOpts {
            users: 32,
            rounds: 5,
            docs: 16,
            questions: 8,
            seed: 7,
        }
    }
}

const WORDS: &[&str] = &[
    "cluster", "gateway", "latency", "cache", "prefill", "decode", "token", "pod", "router",
    "engine", "request", "memory", "kernel", "batch", "queue", "policy", "index", "shard",
    "bitmap", "event", "stream", "tenant", "model", "adapter", "prompt", "context", "window",
    "budget", "replica", "region",
];

fn words(rng: &mut Rng, n: usize) -> String {
    (0..n)
        .map(|_| WORDS[rng.below(WORDS.len())])
        .collect::<Vec<_>>()
        .join(" ")
}

/// Build the workload: chat sessions (text, predicted residency) and document sessions
/// (token ids, engine events), shuffled together.
pub fn workload(o: WorkloadOpts) -> Vec<Session> {
    let mut rng = Rng(o.seed);
    let system = format!(
        "You are the support assistant of the ACME platform team. {}",
        words(&mut rng, 700)
    );
    let mut sessions = Vec::new();
    for _ in 0..o.users {
        let mut history = vec![json!({"role": "system", "content": system})];
        let mut s = Vec::new();
        for _ in 0..o.rounds {
            history.push(json!({"role": "user", "content": words(&mut rng, 40)}));
            s.push(Call::Chat(
                json!({"model": "m", "messages": history.clone(), "max_tokens": 16, "stream": true,
                                     "stream_options": {"include_usage": true}}),
            ));
            history.push(json!({"role": "assistant", "content": words(&mut rng, 60)}));
        }
        sessions.push(s);
    }
    for _ in 0..o.docs {
        let doc: Vec<u32> = (0..3000).map(|_| rng.below(100_000) as u32).collect();
        let mut s = Vec::new();
        for _ in 0..o.questions {
            let mut p = doc.clone();
            p.extend((0..48).map(|_| rng.below(100_000) as u32));
            s.push(Call::Completion(
                json!({"model": "m", "prompt": p, "max_tokens": 16, "stream": true,
                                           "stream_options": {"include_usage": true}}),
            ));
        }
        sessions.push(s);
    }
    // Fisher-Yates with the seeded generator.
    for i in (1..sessions.len()).rev() {
        let j = rng.below(i + 1);
        sessions.swap(i, j);
    }
    sessions
}

/// What a conversation's text is made of. Each kind tokenizes at its own bytes per
/// token (o200k, the engine simulator's default: prose ~4.5, code ~3, numbers ~2, CJK
/// ~1.5), which is what a text chain's blocks must be translated by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextKind {
    Prose,
    Code,
    Numbers,
    Cjk,
}

impl TextKind {
    pub const ALL: [TextKind; 4] = [
        TextKind::Prose,
        TextKind::Code,
        TextKind::Numbers,
        TextKind::Cjk,
    ];

    /// About `bytes` bytes of this kind of text.
    pub fn text(self, rng: &mut Rng, bytes: usize) -> String {
        const PROSE: &[&str] = &[
            "the", "of", "and", "to", "a", "in", "is", "it", "you", "that", "he", "was", "for",
            "on", "are", "with", "as", "I", "his", "they", "be", "at", "one", "have", "this",
            "from", "or", "had", "by", "not", "but", "what", "some", "we", "can", "out", "other",
            "were", "all", "there", "when", "up", "use", "your", "how", "said", "an", "each",
            "she", "which", "do", "their", "time", "if", "will", "way", "about", "many", "then",
            "them", "would", "write", "like", "so", "these", "her", "long", "make", "thing", "see",
            "him", "two", "has", "look", "more", "day", "could", "go", "come", "did", "number",
            "sound", "no", "most", "people", "my", "over", "know", "water", "than", "call",
            "first",
        ];
        // Longer words, a quarter of the time: English prose runs ~4.5-5 bytes a token.
        const LONG: &[&str] = &[
            "because",
            "between",
            "important",
            "different",
            "information",
            "development",
            "government",
            "company",
            "system",
            "program",
            "question",
            "during",
            "without",
            "however",
            "another",
            "example",
            "problem",
            "service",
            "through",
            "around",
            "against",
            "understand",
            "experience",
            "community",
            "research",
            "education",
            "performance",
            "everything",
            "something",
            "possible",
            "together",
            "national",
        ];
        let mut s = String::with_capacity(bytes + 64);
        while s.len() < bytes {
            match self {
                TextKind::Prose => {
                    let n = 6 + rng.below(10);
                    for i in 0..n {
                        let w = if rng.below(4) == 0 {
                            LONG[rng.below(LONG.len())]
                        } else {
                            PROSE[rng.below(PROSE.len())]
                        };
                        if i == 0 {
                            let mut c = w.chars();
                            if let Some(f) = c.next() {
                                s.extend(f.to_uppercase());
                                s.push_str(c.as_str());
                            }
                        } else {
                            s.push(' ');
                            s.push_str(w);
                        }
                    }
                    s.push_str(if rng.below(5) == 0 { ", and " } else { ". " });
                }
                TextKind::Code => {
                    let (a, b, c) = (rng.below(1000), rng.below(100), rng.below(10_000));
                    s.push_str(&format!(
                        "let v{a} = cache_{b}.get(&k{c})?;\nif v{a}.len() > {b} {{ return Err(E::Full({c})); }}\n"
                    ));
                }
                TextKind::Numbers => {
                    s.push_str(&format!("{}.{:02}, ", rng.below(1_000_000), rng.below(100)));
                }
                TextKind::Cjk => {
                    for _ in 0..12 {
                        let c = 0x4E00 + rng.below(0x5000) as u32;
                        s.push(char::from_u32(c).unwrap_or('中'));
                    }
                    s.push('。');
                }
            }
        }
        s
    }
}

/// A multi-turn chat load: `users` conversations of `turns` turns, each opened with one
/// of `system_prompts` shared system prompts of ~`system_bytes`, each turn ~`turn_bytes`
/// from the user and as much written for the assistant, which [`run`] replaces with the
/// model's own answers as a chat client does. User `u` writes `kinds[u % len]`. Every
/// seed gives fresh prefixes (system prompts included).
#[derive(Clone, Copy, Debug)]
pub struct ChatLoad {
    pub users: usize,
    pub system_prompts: usize,
    pub turns: usize,
    pub system_bytes: usize,
    pub turn_bytes: usize,
    pub kinds: &'static [TextKind],
    pub seed: u64,
}

impl Default for ChatLoad {
    fn default() -> Self {
        ChatLoad {
            users: 24,
            system_prompts: 4,
            turns: 6,
            system_bytes: 4500,
            turn_bytes: 400,
            kinds: &[TextKind::Prose],
            seed: 1,
        }
    }
}

pub fn chat_load(o: ChatLoad) -> Vec<Session> {
    let mut rng = Rng(o.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let kinds = if o.kinds.is_empty() {
        &[TextKind::Prose][..]
    } else {
        o.kinds
    };
    let systems: Vec<String> = (0..o.system_prompts.max(1))
        .map(|i| {
            let k = kinds[i % kinds.len()];
            format!(
                "You are assistant {i} (run {}). {}",
                o.seed,
                k.text(&mut rng, o.system_bytes)
            )
        })
        .collect();
    (0..o.users)
        .map(|u| {
            let kind = kinds[u % kinds.len()];
            let mut history =
                vec![json!({"role": "system", "content": systems[u % systems.len()]})];
            let mut s = Vec::new();
            for _ in 0..o.turns {
                history.push(json!({"role": "user", "content": kind.text(&mut rng, o.turn_bytes)}));
                s.push(Call::Chat(
                    json!({"model": "m", "messages": history.clone(), "max_tokens": 16,
                    "stream": true, "stream_options": {"include_usage": true}}),
                ));
                history.push(
                    json!({"role": "assistant", "content": kind.text(&mut rng, o.turn_bytes)}),
                );
            }
            s
        })
        .collect()
}

/// What one request measured.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub ok: bool,
    pub ttft: Duration,
    pub e2e: Duration,
    pub pod: String,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// The text the model answered (streamed deltas joined), if it answered.
    pub reply: Option<String>,
    /// When it was sent, from the start of a timed replay (zero in other loads): with
    /// `e2e`, what each pod had in flight when a router chose.
    pub sent: Duration,
}

/// What a chat client sends as turn `k + 1`: its conversation with the model's own
/// answers in it. The `i`-th assistant message of a later call becomes the reply the
/// session's `i`-th call got (a call that got none keeps the text the load wrote). A
/// load that resent text the model never said would miss the cache on every assistant
/// turn, which no real client does.
fn with_replies<'a>(c: &'a Call, replies: &[Option<String>]) -> std::borrow::Cow<'a, Call> {
    let Call::Chat(body) = c else {
        return std::borrow::Cow::Borrowed(c);
    };
    if replies.iter().all(Option::is_none) {
        return std::borrow::Cow::Borrowed(c);
    }
    let mut body = body.clone();
    if let Some(msgs) = body["messages"].as_array_mut() {
        let assistants = msgs.iter_mut().filter(|m| m["role"] == "assistant");
        for (m, r) in assistants.zip(replies) {
            if let Some(r) = r {
                m["content"] = Value::String(r.clone());
            }
        }
    }
    std::borrow::Cow::Owned(Call::Chat(body))
}

/// What a response said: its `usage` (the last event that carries one) and the answer's
/// text (streamed deltas, chat or completions, joined; or a whole body's). Each event is
/// parsed once for both.
fn read_answer(body: &str) -> (Value, Option<String>) {
    let events: Vec<Value> = match serde_json::from_str::<Value>(body) {
        Ok(v) => vec![v],
        Err(_) => body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .collect(),
    };
    let usage = events
        .iter()
        .rev()
        .find(|v| v["usage"].is_object())
        .map_or(Value::Null, |v| v["usage"].clone());
    let pieces: Vec<&str> = events
        .iter()
        .filter_map(|v| {
            let c = &v["choices"][0];
            c["delta"]["content"]
                .as_str()
                .or_else(|| c["message"]["content"].as_str())
                .or_else(|| c["text"].as_str())
        })
        .collect();
    (usage, (!pieces.is_empty()).then(|| pieces.concat()))
}

async fn call(http: &reqwest::Client, base: &str, c: &Call) -> Outcome {
    let (path, body) = match c {
        Call::Chat(b) => ("/v1/chat/completions", b),
        Call::Completion(b) => ("/v1/completions", b),
    };
    let t0 = Instant::now();
    let Ok(resp) = http.post(format!("{base}{path}")).json(body).send().await else {
        return Outcome::default();
    };
    let ok = resp.status().is_success();
    let pod = resp
        .headers()
        .get("x-pod")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let mut resp = resp;
    let mut ttft = None;
    let mut buf = Vec::new();
    while let Ok(Some(chunk)) = resp.chunk().await {
        ttft.get_or_insert_with(|| t0.elapsed());
        buf.extend_from_slice(&chunk);
    }
    let e2e = t0.elapsed();
    let (usage, reply) = read_answer(&String::from_utf8_lossy(&buf));
    Outcome {
        ok,
        ttft: ttft.unwrap_or(e2e),
        e2e,
        pod,
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
        cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
        reply: reply.filter(|_| ok),
        sent: Duration::ZERO,
    }
}

/// Run every session through `base`, `concurrency` sessions at a time. `progress` is
/// called after each request.
pub async fn run(
    base: &str,
    sessions: &[Session],
    concurrency: usize,
    progress: impl Fn(usize, usize) + Send + Sync + 'static,
) -> Vec<Outcome> {
    run_via(&[base.to_string()], sessions, concurrency, progress).await
}

/// Gateway replicas behind one address, as a load balancer spreads requests over them:
/// each request goes to the next in turn, whatever its session.
#[derive(Clone)]
struct Spread {
    bases: Arc<[String]>,
    next: Arc<std::sync::atomic::AtomicUsize>,
}

impl Spread {
    fn new(bases: &[String]) -> Spread {
        Spread {
            bases: bases.into(),
            next: Arc::default(),
        }
    }

    fn pick(&self) -> &str {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.bases
            .get(n % self.bases.len().max(1))
            .map_or("", String::as_str)
    }
}

/// [`run`] through several gateway replicas, each request to the next ([`Spread`]).
pub async fn run_via(
    bases: &[String],
    sessions: &[Session],
    concurrency: usize,
    progress: impl Fn(usize, usize) + Send + Sync + 'static,
) -> Vec<Outcome> {
    let http = reqwest::Client::new();
    let total: usize = sessions.iter().map(|s| s.len()).sum();
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let progress = Arc::new(progress);
    let spread = Spread::new(bases);
    let results = futures::stream::iter(sessions.iter().cloned())
        .map(|s| {
            let (http, spread, done, progress) =
                (http.clone(), spread.clone(), done.clone(), progress.clone());
            async move {
                let mut out = Vec::new();
                let mut replies = Vec::new();
                for c in &s {
                    let o = call(&http, spread.pick(), &with_replies(c, &replies)).await;
                    if matches!(c, Call::Chat(_)) {
                        replies.push(o.reply.clone());
                    }
                    out.push(o);
                    let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                    progress(n, total);
                }
                out
            }
        })
        .buffer_unordered(concurrency)
        .collect::<Vec<_>>()
        .await;
    results.into_iter().flatten().collect()
}

/// One request of a timed replay: when it is due (from the replay's start), the session
/// it belongs to (a session's requests run in order: each waits for the one before it as
/// well as for its time), and the call.
#[derive(Clone, Debug)]
pub struct Timed {
    pub at: Duration,
    pub session: Option<u64>,
    pub call: Call,
}

/// Replay `items` against `base` on their clock (open loop across sessions, closed within
/// one), at most `max_in_flight` at once. Outcomes in `items` order.
pub async fn run_timed(base: &str, items: &[Timed], max_in_flight: usize) -> Vec<Outcome> {
    run_timed_via(&[base.to_string()], items, max_in_flight).await
}

/// [`run_timed`] through several gateway replicas, each request to the next ([`Spread`]).
pub async fn run_timed_via(
    bases: &[String],
    items: &[Timed],
    max_in_flight: usize,
) -> Vec<Outcome> {
    let http = reqwest::Client::new();
    let spread = Spread::new(bases);
    let mut sessions: BTreeMap<(bool, u64), Vec<usize>> = BTreeMap::new();
    for (i, t) in items.iter().enumerate() {
        let key = t.session.map_or((false, i as u64), |s| (true, s));
        sessions.entry(key).or_default().push(i);
    }
    let gate = Arc::new(tokio::sync::Semaphore::new(max_in_flight.max(1)));
    let start = tokio::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (_, idx) in sessions {
        let reqs: Vec<(usize, Duration, Call)> = idx
            .into_iter()
            .map(|i| (i, items[i].at, items[i].call.clone()))
            .collect();
        let (http, spread, gate) = (http.clone(), spread.clone(), gate.clone());
        tasks.spawn(async move {
            let mut out = Vec::new();
            for (i, at, c) in reqs {
                tokio::time::sleep_until(start + at).await;
                let Ok(_permit) = gate.acquire().await else {
                    break;
                };
                let sent = start.elapsed();
                let o = call(&http, spread.pick(), &c).await;
                out.push((i, Outcome { sent, ..o }));
            }
            out
        });
    }
    let mut all = vec![Outcome::default(); items.len()];
    while let Some(r) = tasks.join_next().await {
        for (i, o) in r.unwrap_or_default() {
            all[i] = o;
        }
    }
    all
}

/// The figures of one run.
#[derive(Clone, Debug)]
pub struct Summary {
    pub requests: usize,
    pub failed: usize,
    pub hit_rate: f64,
    pub ttft_mean_ms: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2e_p50_ms: f64,
    pub e2e_p99_ms: f64,
    pub max_load_share: f64,
    pub shares: BTreeMap<String, f64>,
    pub ttfts_ms: Vec<f64>,
}

pub fn summarize(o: &[Outcome]) -> Summary {
    let ok: Vec<&Outcome> = o.iter().filter(|x| x.ok).collect();
    let mut ttft = Samples(ok.iter().map(|x| x.ttft.as_micros() as u64).collect());
    let mut e2e = Samples(ok.iter().map(|x| x.e2e.as_micros() as u64).collect());
    let prompt: u64 = ok.iter().map(|x| x.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|x| x.cached_tokens).sum();
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for x in &ok {
        *counts.entry(x.pod.clone()).or_default() += 1;
    }
    let shares: BTreeMap<String, f64> = counts
        .iter()
        .map(|(k, v)| (k.clone(), *v as f64 / ok.len().max(1) as f64))
        .collect();
    let mut ttfts_ms: Vec<f64> = ttft.0.iter().map(|u| *u as f64 / 1e3).collect();
    ttfts_ms.sort_by(|a, b| a.total_cmp(b));
    Summary {
        requests: o.len(),
        failed: o.len() - ok.len(),
        hit_rate: cached as f64 / prompt.max(1) as f64,
        ttft_mean_ms: ttft.mean() / 1e3,
        ttft_p50_ms: ttft.pct(50.0) as f64 / 1e3,
        ttft_p99_ms: ttft.pct(99.0) as f64 / 1e3,
        e2e_p50_ms: e2e.pct(50.0) as f64 / 1e3,
        e2e_p99_ms: e2e.pct(99.0) as f64 / 1e3,
        max_load_share: shares.values().copied().fold(0.0, f64::max),
        shares,
        ttfts_ms,
    }
}

impl Summary {
    pub fn json(&self) -> Value {
        json!({"requests": self.requests, "failed": self.failed, "hit_rate": r3(self.hit_rate),
               "ttft_mean_ms": r3(self.ttft_mean_ms), "ttft_p50_ms": r3(self.ttft_p50_ms), "ttft_p99_ms": r3(self.ttft_p99_ms),
               "e2e_p50_ms": r3(self.e2e_p50_ms), "e2e_p99_ms": r3(self.e2e_p99_ms), "max_load_share": r3(self.max_load_share)})
    }
}

fn r3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

pub fn table(rows: &[(&str, &Summary)]) -> String {
    let mut s = format!(
        "{:<12} {:>8} {:>6} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10}\n",
        "policy",
        "requests",
        "failed",
        "hit rate",
        "TTFT p50",
        "TTFT p99",
        "E2E p50",
        "E2E p99",
        "max share"
    );
    for (name, x) in rows {
        s += &format!(
            "{:<12} {:>8} {:>6} {:>8.1}% {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>9.1}%\n",
            name,
            x.requests,
            x.failed,
            x.hit_rate * 100.0,
            x.ttft_p50_ms,
            x.ttft_p99_ms,
            x.e2e_p50_ms,
            x.e2e_p99_ms,
            x.max_load_share * 100.0
        );
    }
    for (name, x) in rows {
        let shares: Vec<String> = x
            .shares
            .iter()
            .map(|(p, v)| format!("{p} {:.0}%", v * 100.0))
            .collect();
        s += &format!("{name} load share: {}\n", shares.join(", "));
    }
    s
}

/// An SVG of the TTFT distributions (CDFs), one line per series.
pub fn svg_cdf(title: &str, series: &[(&str, &[f64], &str)]) -> String {
    let (w, h, ml, mb, mt, mr) = (720.0, 420.0, 60.0, 50.0, 40.0, 20.0);
    let xmax = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .fold(1.0_f64, f64::max)
        * 1.05;
    let x = |v: f64| ml + v / xmax * (w - ml - mr);
    let y = |p: f64| h - mb - p * (h - mb - mt);
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="22" font-size="15" text-anchor="middle">{title}</text>
<line x1="{ml}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{ml}" y1="{mt}" x2="{ml}" y2="{}" stroke="black"/>
<text x="{}" y="{}" text-anchor="middle">time to first token (ms)</text>
<text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">fraction of requests</text>
"#,
        w / 2.0,
        h - mb,
        w - mr,
        h - mb,
        h - mb,
        (ml + w - mr) / 2.0,
        h - 12.0,
        h / 2.0,
        h / 2.0
    );
    for i in 0..=5 {
        let v = xmax / 5.0 * i as f64;
        s += &format!(
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{v:.0}</text>"#,
            x(v),
            h - mb + 16.0
        );
        let p = i as f64 / 5.0;
        s += &format!(
            r#"<text x="{}" y="{:.1}" text-anchor="end">{p:.1}</text>"#,
            ml - 6.0,
            y(p) + 4.0
        );
    }
    for (k, (name, vals, color)) in series.iter().enumerate() {
        let n = vals.len().max(1) as f64;
        let pts: Vec<String> = vals
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{:.1},{:.1}", x(*v), y((i + 1) as f64 / n)))
            .collect();
        s += &format!(
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            pts.join(" ")
        );
        s += &format!(
            r#"<rect x="{}" y="{}" width="14" height="4" fill="{color}"/><text x="{}" y="{}">{name}</text>"#,
            w - 190.0,
            mt + 10.0 + 18.0 * k as f64,
            w - 170.0,
            mt + 15.0 + 18.0 * k as f64
        );
    }
    s + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_later_turn_carries_the_answers_the_session_got() {
        let body = json!({"model": "m", "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "written a1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "written a2"},
            {"role": "user", "content": "q3"}]});
        let c = Call::Chat(body);
        // The first call got an answer, the second none (it failed): the second keeps
        // the text the load wrote.
        let Call::Chat(sent) = with_replies(&c, &[Some("t0 t1 ".into()), None]).into_owned() else {
            panic!("a chat call stays a chat call");
        };
        assert_eq!(sent["messages"][2]["content"], "t0 t1 ");
        assert_eq!(sent["messages"][4]["content"], "written a2");
        assert_eq!(sent["messages"][5]["content"], "q3");
        // Nothing answered yet: the call is sent as written, not copied.
        assert!(matches!(
            with_replies(&c, &[]),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    #[test]
    fn the_answer_is_read_from_a_stream_or_a_whole_body() {
        let sse = "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n\
                   data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t0 \"}}]}\n\n\
                   data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t1 \"}}]}\n\n\
                   data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9}}\n\n\
                   data: [DONE]\n\n";
        let reply_text = |b: &str| read_answer(b).1;
        assert_eq!(reply_text(sse).as_deref(), Some("t0 t1 "));
        assert_eq!(
            read_answer(sse).0["prompt_tokens"],
            9,
            "usage from the same pass"
        );
        let whole = r#"{"choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}]}"#;
        assert_eq!(reply_text(whole).as_deref(), Some("hi"));
        assert_eq!(reply_text("data: [DONE]\n\n"), None);
        assert_eq!(reply_text(r#"{"error":{"message":"no"}}"#), None);
    }
}
