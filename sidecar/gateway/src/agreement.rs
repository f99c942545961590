//! Routing that checks itself: per model, does the engine's own `cached_tokens` agree
//! with the prefix the index said the chosen pod held?
//!
//! Only decisions made from engine events (not predicted residency) are judged: they
//! claim to know the engine's cache, so a steady disagreement means the gateway and the
//! engines do not compute the same blocks — a tokenizer, chat template, block size or
//! `cache_salt` that differs from the engine's, which is otherwise silent. Each report
//! is one of three outcomes: `agree` (within one block: engines do not count the last
//! prompt token as cached), `over` (the router expected more than the engine had) or
//! `under` (the engine had more than the router knew). A model whose recent agreement
//! falls below [`WARN_BELOW`] gets a warning in the log, at most once a minute. A model
//! the sidecar tokenizes names its chat template (file and sha256) in the warning, the
//! API and the metric, so a template that renders differently from the engine's shows as
//! such at once.
//!
//! Written by [`crate::route::report_at`] (reports → here, one way); read by the admin
//! API and the metrics renderer.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Serialize;

/// Reports per model in the recent window.
const WINDOW: usize = 100;
/// Reports needed in the window before the ratio is judged.
const MIN_JUDGED: usize = 30;
/// Recent agreement below this logs a warning.
pub const WARN_BELOW: f64 = 0.8;
const WARN_EVERY: Duration = Duration::from_secs(60);
/// Models tracked (the index admits at most 64; the rest are not judged).
const MAX_MODELS: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Agree,
    Over,
    Under,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Agree => "agree",
            Outcome::Over => "over",
            Outcome::Under => "under",
        }
    }

    /// Judge one report: `expected` and `reported` cached tokens, `block` tokens a block.
    pub fn of(expected: u64, reported: u64, block: u64) -> Outcome {
        if expected > reported + block {
            Outcome::Over
        } else if reported > expected + block {
            Outcome::Under
        } else {
            Outcome::Agree
        }
    }
}

#[derive(Default)]
struct Window {
    recent: VecDeque<bool>,
    agreeing: usize,
    totals: [u64; 3],
    warned: Option<Instant>,
    /// The chat template of the latest judged report, when the sidecar tokenizes.
    template: Option<Arc<str>>,
}

/// One model's agreement, as the API shows it.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ModelAgreement {
    pub model: String,
    /// The chat template the sidecar renders this model's prompts with, if it does.
    pub template: Option<String>,
    pub agree: u64,
    pub over: u64,
    pub under: u64,
    /// Share of the last reports (up to 100) that agreed; None before any.
    pub recent_ratio: Option<f64>,
    pub recent_reports: usize,
}

#[derive(Default)]
pub struct Agreement {
    by_model: Mutex<HashMap<String, Window>>,
}

impl Agreement {
    /// One judged report of `model`, whose prompts the sidecar renders with `template`.
    pub fn record(&self, model: &str, template: Option<&Arc<str>>, o: Outcome, now: Instant) {
        let mut m = self.by_model.lock();
        if !m.contains_key(model) && m.len() >= MAX_MODELS {
            return;
        }
        let w = m.entry(model.to_owned()).or_default();
        if w.template.as_ref() != template {
            w.template = template.cloned();
        }
        w.totals[o as usize] += 1;
        let ok = o == Outcome::Agree;
        w.recent.push_back(ok);
        w.agreeing += ok as usize;
        if w.recent.len() > WINDOW {
            if let Some(true) = w.recent.pop_front() {
                w.agreeing -= 1;
            }
        }
        let n = w.recent.len();
        let ratio = w.agreeing as f64 / n as f64;
        if n >= MIN_JUDGED
            && ratio < WARN_BELOW
            && w.warned.is_none_or(|t| now.duration_since(t) >= WARN_EVERY)
        {
            w.warned = Some(now);
            tracing::warn!(
                model,
                template = w
                    .template
                    .as_deref()
                    .unwrap_or("none (the filter hashes tokens)"),
                agreement = format!("{:.0}%", ratio * 100.0),
                reports = n,
                over = w.totals[Outcome::Over as usize],
                under = w.totals[Outcome::Under as usize],
                "engines report different cached prefixes than the index expected for this \
                 model: check that the tokenizer, chat template, block size and cache_salt \
                 the gateway uses match the engines'"
            );
        }
    }

    pub fn snapshot(&self) -> Vec<ModelAgreement> {
        let m = self.by_model.lock();
        let mut v: Vec<_> = m
            .iter()
            .map(|(model, w)| ModelAgreement {
                model: model.clone(),
                template: w.template.as_deref().map(str::to_owned),
                agree: w.totals[Outcome::Agree as usize],
                over: w.totals[Outcome::Over as usize],
                under: w.totals[Outcome::Under as usize],
                recent_ratio: (!w.recent.is_empty())
                    .then(|| w.agreeing as f64 / w.recent.len() as f64),
                recent_reports: w.recent.len(),
            })
            .collect();
        v.sort_by(|a, b| a.model.cmp(&b.model));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_a_block_agrees() {
        // vLLM recomputes the last prompt token: a fully cached 4-block prompt reports 3.
        assert_eq!(Outcome::of(64, 48, 16), Outcome::Agree);
        assert_eq!(Outcome::of(64, 32, 16), Outcome::Over);
        assert_eq!(Outcome::of(0, 64, 16), Outcome::Under);
    }

    #[test]
    fn the_window_forgets_old_reports() {
        let a = Agreement::default();
        let now = Instant::now();
        for _ in 0..WINDOW {
            a.record("m", None, Outcome::Over, now);
        }
        let t: Arc<str> = "chat_template.jinja sha256:0123456789abcdef".into();
        for _ in 0..WINDOW / 2 {
            a.record("m", Some(&t), Outcome::Agree, now);
        }
        let s = &a.snapshot()[0];
        assert_eq!(s.template.as_deref(), Some(&*t));
        assert_eq!((s.agree, s.over, s.under), (50, 100, 0));
        assert_eq!(s.recent_reports, WINDOW);
        assert_eq!(s.recent_ratio, Some(0.5));
    }
}
