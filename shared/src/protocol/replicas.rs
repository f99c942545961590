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
    /// An add's prompt tip: `[blocks up to and including it, its hash]`, a block near
    /// the prompt's end. With `session`, the session's, so the receiver can tell what
    /// `pod` evicted of it when the session's next turn comes to it; without (token
    /// chains only), the conversation the prompt continues, bound under that block (the
    /// sidecar's prompt-followed conversations), so a conversation whose turns reach
    /// several replicas is followed by all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tip: Option<[u64; 2]>,
    /// The hash of the tip this conversation was bound under before the add (no session
    /// only), which receivers forget.
    #[serde(
        default,
        deserialize_with = "opt_u64",
        skip_serializing_if = "Option::is_none"
    )]
    pub tip_was: Option<u64>,
    /// An add's prompt as a sample of its chain: `[position, block hash]` pairs, the first
    /// and last blocks and evenly spaced ones between, positions increasing (at most
    /// [`MAX_CHAIN_MARKS`]). A chain hashes
    /// every block with all before it, so a prompt that matches a mark shares every block
    /// up to it: other replicas see how deep a prompt they route is being computed on
    /// `pod` before its engine reports it cached.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub marks: Vec<[u64; 2]>,
}

/// The most chain marks a load delta carries. A prompt that matches another's whole
/// chain (a session's next turn, a retry) is vouched for exactly, since the last block is
/// a mark; one that shares only part of it, to the deepest mark within. More marks vouch
/// for more of a partly shared prefix, and that cost the shared-prefix workload with four
/// gateways 1.7% of mean TTFT (16-128 marks alike; 8: none) for 1.5% on the overloaded
/// Mooncake trace (docs/policy.md).
pub const MAX_CHAIN_MARKS: usize = 8;

/// `chain` sampled for [`LoadDelta::marks`]: its first and last blocks and evenly spaced
/// ones between, at most [`MAX_CHAIN_MARKS`].
pub fn chain_marks(chain: &[u64]) -> Vec<[u64; 2]> {
    let n = chain.len();
    let k = n.min(MAX_CHAIN_MARKS);
    let mut out: Vec<[u64; 2]> = Vec::with_capacity(k);
    for j in 0..k {
        let pos = if k == 1 { 0 } else { j * (n - 1) / (k - 1) };
        if out.last().is_none_or(|m| m[0] < pos as u64) {
            out.push([pos as u64, chain[pos]]);
        }
    }
    out
}

/// How many blocks of `chain` the marks vouch for (the deepest mark it matches, plus
/// one); `None` if the marks are not a sample [`chain_marks`] could have made (empty,
/// too many, not from the first block, positions not increasing).
pub fn marks_depth(marks: &[[u64; 2]], chain: &[u64]) -> Option<u32> {
    if !marks_valid(marks) {
        return None;
    }
    let mut depth = 0;
    for &[pos, hash] in marks {
        match usize::try_from(pos).ok().and_then(|p| chain.get(p)) {
            Some(&h) if h == hash => depth = pos + 1,
            _ => break,
        }
    }
    Some(u32::try_from(depth).unwrap_or(u32::MAX))
}

/// Whether `marks` could be a [`chain_marks`] sample.
pub fn marks_valid(marks: &[[u64; 2]]) -> bool {
    !marks.is_empty()
        && marks.len() <= MAX_CHAIN_MARKS
        && marks[0][0] == 0
        && marks.windows(2).all(|w| w[0][0] < w[1][0])
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
    /// A delta that moves no load and binds nothing yet (in flight on `pod`); the
    /// sender sets the rest.
    pub fn new(replica: &str, id: &str, pod: &str, model: &str, op: LoadOp) -> LoadDelta {
        LoadDelta {
            replica: replica.to_owned(),
            id: id.to_owned(),
            pod: pod.to_owned(),
            model: model.to_owned(),
            op,
            prefill_tokens: 0,
            blocks: 0,
            prefix: None,
            inflight: true,
            session: None,
            response: None,
            bound_tokens: 0,
            tip: None,
            tip_was: None,
            marks: Vec::new(),
        }
    }

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
