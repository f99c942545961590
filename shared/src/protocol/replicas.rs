//! Load deltas between sidecar replicas (`kvroute.load.<model>.<replica>`).

use serde::{Deserialize, Serialize};

use super::hashes::opt_u64;
use super::subject_token;

/// Load that one sidecar replica projected onto a pod, or released, broadcast on NATS
/// (`kvroute.load.<model>.<replica>`) so that replicas in front of the same pods see each other's
/// decisions instead of all piling onto the same "best" pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadDelta {
    /// The sending replica (receivers skip their own).
    pub replica: String,
    /// The decision's id (unique per replica); a release names the add it undoes.
    pub id: String,
    pub pod: String,
    pub model: String,
    pub op: LoadOp,
    #[serde(default)]
    pub prefill_tokens: u64,
    #[serde(default)]
    pub blocks: u64,
    /// The cached prefix the decision was routed by (its last block's hash), so every
    /// replica bounds a hot prefix's load across all gateways.
    #[serde(
        default,
        deserialize_with = "opt_u64",
        skip_serializing_if = "Option::is_none"
    )]
    pub prefix: Option<u64>,
    /// The decision runs on this pod (false for a prefill pod's share of a disaggregated
    /// request, which only adds prefill work).
    #[serde(default = "yes")]
    pub inflight: bool,
    /// An add's session binding (the key's hash with its model, see the sidecar's
    /// `affinity`): the session is on `pod`, credited with `bound_tokens`.
    #[serde(
        default,
        deserialize_with = "opt_u64",
        skip_serializing_if = "Option::is_none"
    )]
    pub session: Option<u64>,
    /// A release's response binding: the Responses id the engine gave, hashed likewise.
    #[serde(
        default,
        deserialize_with = "opt_u64",
        skip_serializing_if = "Option::is_none"
    )]
    pub response: Option<u64>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bound_tokens: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn yes() -> bool {
    true
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadOp {
    Add,
    Release,
}

/// Subject prefix of replicas' load deltas.
pub const LOAD_SUBJECT: &str = "kvroute.load";

impl LoadDelta {
    /// `kvroute.load.<model>.<replica>`: each replica publishes only under its own id,
    /// so NATS permissions can confine it, and receivers check the payload agrees.
    pub fn subject(&self) -> String {
        format!(
            "{LOAD_SUBJECT}.{}.{}",
            subject_token(&self.model),
            subject_token(&self.replica)
        )
    }
}

/// Subject prefix of replicas' queue states.
pub const QUEUE_SUBJECT: &str = "kvroute.queue";

/// One replica's admission queue for one model, as the other replicas need it to share
/// the fleet's turns between tenants (`kvroute.queue.<model>.<replica>`): every replica
/// holds its own requests, so without it a tenant's request waits for room that only its
/// own replica's completions free, and a light tenant behind four replicas waits four
/// times as long as behind one.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueState {
    pub replica: String,
    pub model: String,
    /// Per priority with requests waiting or leaving lately.
    #[serde(default)]
    pub bands: Vec<BandState>,
}

/// A priority's tenants at one replica.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BandState {
    pub priority: i32,
    #[serde(default)]
    pub tenants: Vec<TenantState>,
}

/// One tenant of a band at one replica.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TenantState {
    pub tenant: String,
    /// Its requests waiting there.
    #[serde(default)]
    pub waiting: u32,
    /// Its requests that have left that replica's queue (a counter since the replica
    /// started).
    #[serde(default)]
    pub left: u64,
    /// The same, decayed: about how many left over the last few seconds.
    #[serde(default)]
    pub recent: f64,
}

impl QueueState {
    /// `kvroute.queue.<model>.<replica>`, like [`LoadDelta::subject`].
    pub fn subject(&self) -> String {
        format!(
            "{QUEUE_SUBJECT}.{}.{}",
            subject_token(&self.model),
            subject_token(&self.replica)
        )
    }
}
