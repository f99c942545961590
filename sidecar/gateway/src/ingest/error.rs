//! Why a well-formed batch was refused: typed, each with a stable label for the
//! `kvroute_event_batches_rejected_total` metric and the HTTP answer. The registry's
//! refusals (pod admission, stream position) are its own type, carried here.

use crate::registry::{StreamError, MAX_MODELS};

/// Why a well-formed batch was refused (decode errors are refused before this).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IngestError {
    /// The registry refused the batch's pod or its place in the pod's stream.
    Stream(StreamError),
    /// The sidecar indexes [`MAX_MODELS`] models already.
    TooManyModels(String),
    /// The model's index has no room for another pod.
    Full(String),
}

impl IngestError {
    pub fn reason(&self) -> &'static str {
        match self {
            IngestError::Stream(e) => e.reason(),
            IngestError::TooManyModels(_) => "model_cap",
            IngestError::Full(_) => "model_full",
        }
    }
}

impl From<StreamError> for IngestError {
    fn from(e: StreamError) -> Self {
        IngestError::Stream(e)
    }
}

impl std::fmt::Display for IngestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IngestError::Stream(e) => e.fmt(f),
            IngestError::TooManyModels(m) => {
                write!(
                    f,
                    "model {m:?} refused: the sidecar indexes {MAX_MODELS} models already"
                )
            }
            IngestError::Full(m) => f.write_str(m),
        }
    }
}
