//! Heap bytes held, counted at the allocator: `kvroute-bench` installs [`Counting`]
//! around the sidecar's allocator so a benchmark can say exactly how many bytes a
//! structure keeps (a tokenizer, the segment cache) — resident-set readings cannot,
//! since an allocator keeps freed memory and reuses it at will.
//!
//! Counting is off unless a [`held_by`] measurement runs, so the timed benchmarks pay
//! one relaxed load per allocation. The delta over a window is exact whatever was
//! allocated before it: bytes live after minus bytes live before is what the window
//! allocated minus what it freed.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

static ON: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicIsize = AtomicIsize::new(0);
/// The highest `LIVE` reached while counting.
static PEAK: AtomicIsize = AtomicIsize::new(0);

/// A global allocator that counts bytes allocated minus freed while a measurement runs.
pub struct Counting<A>(pub A);

#[inline]
fn count(delta: isize) {
    if ON.load(Ordering::Relaxed) {
        let now = LIVE.fetch_add(delta, Ordering::Relaxed) + delta;
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to the wrapped allocator unchanged; only counters
// are updated beside it.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Counting<A> {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { self.0.alloc(l) };
        if !p.is_null() {
            count(l.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { self.0.alloc_zeroed(l) };
        if !p.is_null() {
            count(l.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { self.0.dealloc(p, l) };
        count(-(l.size() as isize));
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { self.0.realloc(p, l, new) };
        if !q.is_null() {
            count(new as isize - l.size() as isize);
        }
        q
    }
}

/// What `f` returns and the heap bytes it left allocated (what it allocated minus what
/// it freed). Only meaningful when the binary installs [`Counting`] (kvroute-bench
/// does); measurements must not overlap.
pub fn held_by<T>(f: impl FnOnce() -> T) -> (T, isize) {
    let before = LIVE.load(Ordering::Relaxed);
    ON.store(true, Ordering::Relaxed);
    let r = f();
    ON.store(false, Ordering::Relaxed);
    (r, LIVE.load(Ordering::Relaxed) - before)
}

/// What `f` returns and the most heap bytes it had allocated at once beyond what was
/// live before it (its peak), under the same conditions as [`held_by`].
pub fn peak_of<T>(f: impl FnOnce() -> T) -> (T, isize) {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    ON.store(true, Ordering::Relaxed);
    let r = f();
    ON.store(false, Ordering::Relaxed);
    (r, PEAK.load(Ordering::Relaxed) - before)
}
