//! How much client text may be tokenizing at once, in bytes: tokenizing holds many
//! times its input in memory while it runs (`kvroute-bench tokenize` prints the peak per
//! input byte), so the sidecar's peak is bounded by the bytes in flight, not by how many
//! cores happen to run them. One budget serves every path that tokenizes client text
//! (route calls with a prompt body, `/v1/tokenize`); a request over the largest field the
//! budget allows, or one that finds the budget spent, is not tokenized (`too_large`,
//! `busy`) and a route goes on with its text chain.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The default bytes in flight (`--tokenize-budget-mb`).
/// At 88 bytes of heap per byte tokenizing (DeepSeek's tokenizer, `kvroute-bench
/// tokenize`), 3 MiB peaks near 270 MiB: one chat at the field cap and 1 MiB of others.
pub const DEFAULT_BUDGET_BYTES: usize = 3 << 20;
/// The largest fields tokenized at all, whatever the budget (about 500k tokens of text).
pub const MAX_FIELDS_BYTES: usize = 2 << 20;

#[derive(Debug)]
pub struct Budget {
    cap: AtomicUsize,
    in_flight: AtomicUsize,
}

impl Default for Budget {
    fn default() -> Budget {
        Budget::new(DEFAULT_BUDGET_BYTES)
    }
}

/// Why text was not tokenized (stable labels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// Larger than [`Budget::max_fields`].
    TooLarge,
    /// The budget is spent by requests already tokenizing.
    Busy,
}

impl Refused {
    pub fn reason(self) -> &'static str {
        match self {
            Refused::TooLarge => "too_large",
            Refused::Busy => "busy",
        }
    }
}

/// Bytes taken from the budget, given back when dropped.
#[must_use]
pub struct Permit<'a> {
    budget: &'a Budget,
    bytes: usize,
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.budget
            .in_flight
            .fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl Budget {
    pub fn new(cap: usize) -> Budget {
        Budget {
            cap: AtomicUsize::new(cap.max(1)),
            in_flight: AtomicUsize::new(0),
        }
    }

    /// Set at start (`--tokenize-budget-mb`).
    pub fn set_cap(&self, cap: usize) {
        self.cap.store(cap.max(1), Ordering::Release);
    }

    /// The largest fields one request may have tokenized: the budget, up to
    /// [`MAX_FIELDS_BYTES`] (a single request never exceeds the bound alone).
    pub fn max_fields(&self) -> usize {
        self.cap().min(MAX_FIELDS_BYTES)
    }

    pub fn cap(&self) -> usize {
        self.cap.load(Ordering::Acquire)
    }

    /// Take `bytes` of the budget for one tokenization.
    pub fn take(&self, bytes: usize) -> Result<Permit<'_>, Refused> {
        if bytes > self.max_fields() {
            return Err(Refused::TooLarge);
        }
        // At least one byte, so a flood of empty bodies is counted too.
        let (want, cap) = (bytes.max(1), self.cap());
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n + want <= cap).then_some(n + want)
            })
            .map(|_| Permit {
                budget: self,
                bytes: want,
            })
            .map_err(|_| Refused::Busy)
    }

    /// Bytes tokenizing now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_in_flight_never_pass_the_cap() {
        let b = Budget::new(10 << 20);
        assert_eq!(b.max_fields(), MAX_FIELDS_BYTES);
        let p: Vec<_> = (0..5).map(|_| b.take(2 << 20).expect("fits")).collect();
        assert_eq!(b.take(1).err(), Some(Refused::Busy));
        drop(p);
        assert_eq!(b.in_flight(), 0);
        assert_eq!(b.take((2 << 20) + 1).err(), Some(Refused::TooLarge));
        let small = Budget::new(1 << 20);
        assert_eq!(
            small.max_fields(),
            1 << 20,
            "the field cap follows the budget"
        );
        assert_eq!(small.take(1 << 20).map(|_| ()).err(), None);
    }
}
