//! kvroute-sidecar: the native service next to each gateway pod.
//!
//! - [`index`]: cache facts — which pods hold which blocks (no I/O, no async).
//! - [`hashcli`]: the operator's chain printer.

pub mod hashcli;
pub mod index;
