//! The endpoint picker: kvroute as the Gateway API Inference Extension's endpoint picker
//! (an Envoy `ext_proc` gRPC service), a second front door beside the wasm filter over
//! the same routing core. Envoy streams each request's headers and body to it; it turns
//! the body into a route exactly as the filter does (`kvroute-filter`'s `logic`, shared),
//! routes it with [`crate::route::route_within`] (the data plane's subset hint honoured),
//! and answers with the chosen endpoint and its fallbacks in the
//! `x-gateway-destination-endpoint` header and the `envoy.lb` dynamic metadata, always
//! equal. When the stream ends, the decision's report releases its load, naming the
//! endpoint that served it.
//!
//! - `exchange`: one request's messages as a state machine (no I/O), per body mode;
//! - `wire`: reading and building Envoy's messages;
//! - `server`: the tonic service, gRPC health, the listener.

mod exchange;
mod server;
mod wire;

pub use server::{serve, PickerSettings};
