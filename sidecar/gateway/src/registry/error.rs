//! Why the registry refused a registration or a batch: typed, each with a stable label
//! (`reason()`) for metrics and HTTP answers.

use super::{MAX_PODS, MAX_SEQ_JUMP};

/// Why a pod registration was refused. `reason()` is the stable label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegisterError {
    EmptyModel,
    /// A string or list past its bound, or a dump URL that is not http(s).
    Invalid(String),
    BadPodId(String),
    /// The model already has the most pods one index holds.
    ModelFull(String),
}

impl RegisterError {
    pub fn reason(&self) -> &'static str {
        match self {
            RegisterError::EmptyModel | RegisterError::BadPodId(_) | RegisterError::Invalid(_) => {
                "bad_registration"
            }
            RegisterError::ModelFull(_) => "model_full",
        }
    }

    /// 409 when the registration is fine but the model has no room, else 400.
    pub fn status(&self) -> u16 {
        match self {
            RegisterError::ModelFull(_) => 409,
            _ => 400,
        }
    }
}

impl std::fmt::Display for RegisterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegisterError::EmptyModel => f.write_str("model must not be empty"),
            RegisterError::Invalid(m) => f.write_str(m),
            RegisterError::BadPodId(id) => write!(f, "pod id {id:?} must be IP:port"),
            RegisterError::ModelFull(m) => f.write_str(m),
        }
    }
}

/// Why a batch may not advance its pod's stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamError {
    /// The pod is not an `IP:port`.
    BadPod(String),
    /// The registry is full ([`MAX_PODS`]).
    TooManyPods(String),
    /// The batch's sequence number is more than [`MAX_SEQ_JUMP`] ahead of the last one
    /// seen in its epoch: refused, so nobody can push a pod's high-water mark to the end
    /// of the range and have its real batches dropped as duplicates.
    SeqJump {
        pod: String,
        last: u64,
        got: u64,
    },
    Unregistered(String),
    /// A pod on a loopback, unspecified, link-local or multicast address that no admin
    /// registered (its dump fetch would reach this host's own ports).
    LocalPod(String),
    Removed(String),
    ModelMismatch {
        pod: String,
        registered: String,
        got: String,
    },
}

impl StreamError {
    pub fn reason(&self) -> &'static str {
        match self {
            StreamError::BadPod(_) => "bad_pod",
            StreamError::TooManyPods(_) => "pod_cap",
            StreamError::SeqJump { .. } => "seq_jump",
            StreamError::Unregistered(_) => "unregistered_pod",
            StreamError::LocalPod(_) => "local_pod",
            StreamError::Removed(_) => "removed_pod",
            StreamError::ModelMismatch { .. } => "model_mismatch",
        }
    }
}

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamError::BadPod(p) => write!(f, "pod {p:?} must be IP:port"),
            StreamError::TooManyPods(p) => {
                write!(f, "pod {p} refused: the sidecar tracks {MAX_PODS} pods already")
            }
            StreamError::SeqJump { pod, last, got } => write!(
                f,
                "pod {pod}: seq {got} jumps more than {MAX_SEQ_JUMP} past {last} in one epoch"
            ),
            StreamError::Unregistered(p) => {
                write!(f, "pod {p} is not registered (require_registration is on)")
            }
            StreamError::LocalPod(p) => write!(
                f,
                "pod {p} is on a loopback, unspecified, link-local or multicast address: register it (PUT /v1/pods) or start with --learn-local-pods"
            ),
            StreamError::ModelMismatch {
                pod,
                registered,
                got,
            } => write!(
                f,
                "pod {pod} is registered for model {registered:?}, batch says {got:?}"
            ),
            StreamError::Removed(p) => write!(
                f,
                "pod {p} was removed; its events are refused until it restarts (new epoch) or is registered again"
            ),
        }
    }
}
