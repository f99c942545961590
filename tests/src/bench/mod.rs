//! Benchmarks behind `kvroute-bench`. Each prints a human table as it goes and returns a
//! JSON object that the binary prints as its last line, so scripts can read the figures.
//! Ratios against baselines are measured in the same process on the same data.

pub mod filter;
pub mod heap;
pub mod index;
pub mod peers;
pub mod route;
pub mod tokenize;
pub mod trace;

use std::time::Instant;

/// Latency samples in nanoseconds.
#[derive(Default)]
pub struct Samples(pub Vec<u64>);

impl Samples {
    pub fn with_capacity(n: usize) -> Samples {
        Samples(Vec::with_capacity(n))
    }

    #[inline]
    pub fn time<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.0.push(t.elapsed().as_nanos() as u64);
        r
    }

    pub fn push(&mut self, ns: u64) {
        self.0.push(ns);
    }

    /// The p-th percentile (0..=100), nearest rank.
    pub fn pct(&mut self, p: f64) -> u64 {
        if self.0.is_empty() {
            return 0;
        }
        self.0.sort_unstable();
        let rank = ((p / 100.0) * self.0.len() as f64).ceil() as usize;
        self.0[rank.clamp(1, self.0.len()) - 1]
    }

    pub fn mean(&self) -> f64 {
        if self.0.is_empty() {
            return 0.0;
        }
        self.0.iter().sum::<u64>() as f64 / self.0.len() as f64
    }
}

/// A small deterministic PRNG (splitmix64) so runs are repeatable.
pub struct Rng(pub u64);

impl Rng {
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    #[inline]
    pub fn below(&mut self, n: usize) -> usize {
        (((self.next_u64() >> 32) * n as u64) >> 32) as usize
    }

    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}
