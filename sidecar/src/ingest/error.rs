//! Why a well-formed batch was refused: typed, each with a stable label for the
//! `kvroute_event_batches_rejected_total` metric and the HTTP answer.

use super::{MAX_MODELS, MAX_PODS, MAX_SEQ_JUMP};

/// Why a well-formed batch was refused (decode errors are refused before this).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IngestError {
    /// The pod is not an `IP:port`.
    BadPod(String),
    /// The registry is full ([`MAX_PODS`]).
    TooManyPods(String),
    /// The sidecar indexes [`MAX_MODELS`] models already.
    TooManyModels(String),
    /// The batch's sequence number is more than [`MAX_SEQ_JUMP`] ahead of the last one
    /// seen in its epoch: refused, so nobody can push a pod's high-water mark to the end
    /// of the range and have its real batches dropped as duplicates.
    SeqJump {
        pod: String,
        last: u64,
        got: u64,
    },
    Unregistered(String),
    Removed(String),
    ModelMismatch {
        pod: String,
        registered: String,
        got: String,
    },
    Full(String),
}

impl IngestError {
    pub fn reason(&self) -> &'static str {
        match self {
            IngestError::BadPod(_) => "bad_pod",
            IngestError::TooManyPods(_) => "pod_cap",
            IngestError::TooManyModels(_) => "model_cap",
            IngestError::SeqJump { .. } => "seq_jump",
            IngestError::Unregistered(_) => "unregistered_pod",
            IngestError::Removed(_) => "removed_pod",
            IngestError::ModelMismatch { .. } => "model_mismatch",
            IngestError::Full(_) => "model_full",
        }
    }
}

impl std::fmt::Display for IngestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IngestError::BadPod(p) => write!(f, "pod {p:?} must be IP:port"),
            IngestError::TooManyPods(p) => {
                write!(f, "pod {p} refused: the sidecar tracks {MAX_PODS} pods already")
            }
            IngestError::TooManyModels(m) => {
                write!(f, "model {m:?} refused: the sidecar indexes {MAX_MODELS} models already")
            }
            IngestError::SeqJump { pod, last, got } => write!(
                f,
                "pod {pod}: seq {got} jumps more than {MAX_SEQ_JUMP} past {last} in one epoch"
            ),
            IngestError::Unregistered(p) => {
                write!(f, "pod {p} is not registered (require_registration is on)")
            }
            IngestError::ModelMismatch {
                pod,
                registered,
                got,
            } => {
                write!(
                    f,
                    "pod {pod} is registered for model {registered:?}, batch says {got:?}"
                )
            }
            IngestError::Full(m) => f.write_str(m),
            IngestError::Removed(p) => write!(
                f,
                "pod {p} was removed; its events are refused until it restarts (new epoch) or is registered again"
            ),
        }
    }
}
