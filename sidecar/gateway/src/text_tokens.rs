//! Tokens per byte of a text chain, learned from the engines' own reports.
//!
//! A text-mode chain is cut into blocks of canonical bytes, but engines cache and report
//! tokens. How many tokens a byte stands for depends on the model's tokenizer, its chat
//! template and the text itself (English prose ~4.5 bytes a token, code and numbers
//! fewer, CJK ~1.5), so no constant is right. Every completion report of a text-mode
//! decision carries the engine's `prompt_tokens` for a prompt whose canonical length the
//! router knew: one sample of the ratio. This module keeps, per model and per pod, the
//! last [`RING`] samples and answers their median (robust to a stray report; what load is
//! counted in) and how far below it the low tenth of them lies, relative to it (the
//! estimate's error: how far an engine's `cached_tokens` may fall short before the router
//! calls its guess wrong). A pod that serves prose beside code, numbers or CJK has a wide
//! spread, and its prose prompts must not read as evictions.
//!
//! Sharper still is the conversation's own last report: a turn's cached prefix is the
//! previous turn's prompt, whose ratio that turn's report gave exactly. So each sample is
//! also kept under the last block of the reported chain, and a decision whose routing
//! prefix ends at such a block uses it (bounded: [`MAX_PREFIXES`], oldest first out).
//! Keying by a chain's first block too (a new conversation that opens like an earlier
//! one) was measured and left out: a shared system prompt followed by other languages
//! made that sample wrong often enough to double the false mispredictions.
//!
//! Until [`MIN_SAMPLES`] reports have arrived, the answer is the 4-bytes-a-token default
//! with a wide error ([`DEFAULT_REL_ERR`]), so nothing is judged a misprediction on the
//! default's account. Bounded: one ring of 64 `f32` per model and per pod, at most
//! [`MAX_MODELS`] models and [`MAX_PODS`] pods (a pod's ring goes with the pod).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::registry::{MAX_MODELS, MAX_PODS};

/// Samples kept per model and per pod.
pub const RING: usize = 64;
/// Samples before the learned ratio replaces the default.
pub const MIN_SAMPLES: usize = 8;
/// Tokens per byte before anything is learned (four bytes a token).
pub const DEFAULT_TOKENS_PER_BYTE: f64 = 0.25;
/// The default's error: wide, since real text runs from ~1 to ~7 bytes a token.
pub const DEFAULT_REL_ERR: f64 = 0.5;
/// Nor worse than this: a pod whose text spreads wider is still checked for evictions of
/// more than two thirds of what it was thought to hold.
const MAX_REL_ERR: f64 = 0.67;
/// The learned error never claims better than this (rounding of block-aligned caches,
/// the approximate canonical length).
const MIN_REL_ERR: f64 = 0.03;
/// Samples outside this range are broken reports, not text (0.05: 20 bytes a token;
/// 2.0: two tokens a byte).
const PLAUSIBLE: std::ops::RangeInclusive<f64> = 0.05..=2.0;
/// Conversations whose last ratio is kept (~40 bytes each).
pub const MAX_PREFIXES: usize = 1 << 16;
/// The error of a conversation's own last ratio: its new turn may be other text.
const PREFIX_REL_ERR: f64 = 0.1;
/// Prompts shorter than this say more about the chat template than about the text.
const MIN_SAMPLE_BYTES: u64 = 256;

/// What the router assumes about a model's (or pod's) text.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Estimate {
    pub tokens_per_byte: f64,
    /// Relative error of `tokens_per_byte`: 1 − (10th percentile / median).
    pub rel_err: f64,
    pub samples: usize,
    /// Learned from reports (else the default).
    pub learned: bool,
}

impl Estimate {
    pub const DEFAULT: Estimate = Estimate {
        tokens_per_byte: DEFAULT_TOKENS_PER_BYTE,
        rel_err: DEFAULT_REL_ERR,
        samples: 0,
        learned: false,
    };
}

#[derive(Clone)]
struct Ring {
    v: [f32; RING],
    n: usize,
    next: usize,
}

impl Default for Ring {
    fn default() -> Self {
        Ring {
            v: [0.0; RING],
            n: 0,
            next: 0,
        }
    }
}

impl Ring {
    fn push(&mut self, x: f64) {
        self.v[self.next] = x as f32;
        self.next = (self.next + 1) % RING;
        self.n = (self.n + 1).min(RING);
    }

    fn estimate(&self) -> Option<Estimate> {
        if self.n < MIN_SAMPLES {
            return None;
        }
        let mut s: Vec<f64> = self.v[..self.n].iter().map(|&x| x as f64).collect();
        let med = median(&mut s);
        // `s` is sorted now: its low tenth.
        let low = s[(s.len() - 1) / 10];
        Some(Estimate {
            tokens_per_byte: med,
            rel_err: (1.0 - low / med.max(1e-9)).clamp(MIN_REL_ERR, MAX_REL_ERR),
            samples: self.n,
            learned: true,
        })
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return 0.0;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[derive(Default)]
struct Inner {
    models: HashMap<String, Ring>,
    pods: HashMap<Arc<str>, Ring>,
    /// The last ratio reported for a chain, by the chain's last block.
    prefixes: HashMap<u64, f32>,
    /// Insertion order of `prefixes`, for its bound.
    order: std::collections::VecDeque<u64>,
}

/// Per model and per pod: tokens per canonical byte (one mutex, taken alone and briefly).
#[derive(Default)]
pub struct TextTokens {
    inner: Mutex<Inner>,
}

impl TextTokens {
    /// An engine reported `prompt_tokens` for a text-mode prompt of `prompt_bytes`
    /// canonical bytes, whose chain ends at block `last`, that the router sent to `pod`.
    pub fn record(
        &self,
        model: &str,
        pod: &str,
        last: Option<u64>,
        prompt_bytes: u64,
        prompt_tokens: u64,
    ) {
        if prompt_bytes < MIN_SAMPLE_BYTES || prompt_tokens == 0 {
            return;
        }
        let r = prompt_tokens as f64 / prompt_bytes as f64;
        if !PLAUSIBLE.contains(&r) {
            return;
        }
        let mut g = self.inner.lock();
        if let Some(k) = last {
            if g.prefixes.insert(k, r as f32).is_none() {
                g.order.push_back(k);
                while g.order.len() > MAX_PREFIXES {
                    if let Some(old) = g.order.pop_front() {
                        g.prefixes.remove(&old);
                    }
                }
            }
        }
        if g.models.contains_key(model) || g.models.len() < MAX_MODELS {
            g.models.entry(model.to_owned()).or_default().push(r);
        }
        if let Some(ring) = g.pods.get_mut(pod) {
            ring.push(r);
        } else if g.pods.len() < MAX_PODS {
            let mut ring = Ring::default();
            ring.push(r);
            g.pods.insert(Arc::from(pod), ring);
        }
    }

    /// The ratio last reported for the chain ending at `prefix` (the conversation's
    /// previous turn), else the pod's own estimate once it has enough samples (engines of
    /// one model may run other templates), else the model's, else the default.
    pub fn estimate(&self, model: &str, pod: Option<&str>, prefix: Option<u64>) -> Estimate {
        let g = self.inner.lock();
        if let Some(&r) = prefix.and_then(|k| g.prefixes.get(&k)) {
            return Estimate {
                tokens_per_byte: r as f64,
                rel_err: PREFIX_REL_ERR,
                samples: 1,
                learned: true,
            };
        }
        pod.and_then(|p| g.pods.get(p))
            .and_then(Ring::estimate)
            .or_else(|| g.models.get(model).and_then(Ring::estimate))
            .unwrap_or(Estimate::DEFAULT)
    }

    /// Every model's estimate (the status page).
    pub fn models(&self) -> Vec<(String, Estimate)> {
        let g = self.inner.lock();
        let mut v: Vec<(String, Estimate)> = g
            .models
            .iter()
            .map(|(m, r)| (m.clone(), r.estimate().unwrap_or(Estimate::DEFAULT)))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// A pod's own estimate, if it has learned one.
    pub fn of_pod(&self, pod: &str) -> Option<Estimate> {
        self.inner.lock().pods.get(pod).and_then(Ring::estimate)
    }

    /// The pod is gone: so are its samples.
    pub fn forget_pod(&self, pod: &str) {
        self.inner.lock().pods.remove(pod);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_holds_until_enough_reports_then_the_median_wins() {
        let t = TextTokens::default();
        for _ in 0..MIN_SAMPLES - 1 {
            t.record("m", "p", None, 4700, 1000);
        }
        assert_eq!(t.estimate("m", Some("p"), None), Estimate::DEFAULT);
        t.record("m", "p", None, 4700, 1000);
        let e = t.estimate("m", Some("p"), None);
        assert!(
            e.learned && (e.tokens_per_byte - 1000.0 / 4700.0).abs() < 1e-6,
            "{e:?}"
        );
        assert!(
            (e.rel_err - MIN_REL_ERR).abs() < 1e-9,
            "identical samples: the floor"
        );
    }

    #[test]
    fn a_stray_report_does_not_move_the_median_and_broken_ones_are_not_samples() {
        let t = TextTokens::default();
        for i in 0..20u64 {
            t.record("m", "p", None, 4000 + i, 1000);
        }
        let before = t.estimate("m", None, None);
        t.record("m", "p", None, 4000, 3000); // a stray (0.75 tokens a byte)
        t.record("m", "p", None, 4000, 1_000_000); // broken: 250 tokens a byte
        t.record("m", "p", None, 100, 50); // too short to say anything about the text
        let after = t.estimate("m", None, None);
        assert!((after.tokens_per_byte - before.tokens_per_byte).abs() < 2e-4);
        assert_eq!(after.samples, 21);
    }

    #[test]
    fn a_pod_with_its_own_samples_uses_them_others_the_models() {
        let t = TextTokens::default();
        for _ in 0..MIN_SAMPLES {
            t.record("m", "a", None, 4000, 1000);
            t.record("m", "b", None, 4000, 2000);
        }
        assert!((t.estimate("m", Some("a"), None).tokens_per_byte - 0.25).abs() < 1e-9);
        assert!((t.estimate("m", Some("b"), None).tokens_per_byte - 0.5).abs() < 1e-9);
        let model = t.estimate("m", Some("c"), None).tokens_per_byte;
        assert!((0.25..=0.5).contains(&model));
        t.forget_pod("b");
        assert!(t.of_pod("b").is_none());
    }

    #[test]
    fn mixed_text_widens_the_error() {
        let t = TextTokens::default();
        for i in 0..40u64 {
            // Prose (4.6 bytes a token) and code (3.2) interleaved.
            let tokens = if i % 2 == 0 { 1000 } else { 1437 };
            t.record("m", "p", None, 4600, tokens);
        }
        let e = t.estimate("m", None, None);
        assert!(e.rel_err > 0.1, "{e:?}");
    }

    #[test]
    fn a_conversations_own_last_ratio_wins_and_the_map_is_bounded() {
        let t = TextTokens::default();
        for _ in 0..MIN_SAMPLES {
            t.record("m", "p", None, 4000, 1000); // the pod: 0.25
        }
        t.record("m", "p", Some(42), 3000, 2000); // this conversation: CJK-like
        let e = t.estimate("m", Some("p"), Some(42));
        assert!((e.tokens_per_byte - 2.0 / 3.0).abs() < 1e-6 && e.rel_err == PREFIX_REL_ERR);
        assert!((t.estimate("m", Some("p"), Some(7)).tokens_per_byte - 0.2857).abs() < 0.05);
        for k in 0..(MAX_PREFIXES as u64 + 10) {
            t.record("m", "p", Some(1000 + k), 4000, 1000);
        }
        let g = t.inner.lock();
        assert_eq!(
            (g.prefixes.len(), g.order.len()),
            (MAX_PREFIXES, MAX_PREFIXES)
        );
        assert!(!g.prefixes.contains_key(&42), "the oldest went first");
    }
}
