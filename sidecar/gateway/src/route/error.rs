//! Why a route request got no pod: typed, each with a stable label (the HTTP body's
//! `reason` and the `kvroute_route_errors_total` label) and an HTTP status.

use kvroute_shared::Mode;

use super::MAX_CHAIN;

/// Why a route request got no pod. `reason()` is the stable label (HTTP body, metric).
#[derive(Debug, Clone, PartialEq)]
pub enum RouteError {
    EmptyModel,
    ChainTooLong(usize),
    BlockSizeMismatch {
        given: u32,
        want: u32,
        mode: Mode,
        model: String,
    },
    NoPod {
        model: String,
        adapter: String,
    },
    /// Admission is on and every pod of the model that could serve is out only because
    /// its breaker is open (it answered 5xx): the client is told to come back when the
    /// first one closes, instead of being sent on to a failing engine.
    NoReadyPod {
        model: String,
        retry_after_s: u32,
    },
    /// The data plane named the pods to choose from and none of them can serve.
    OutsideSubset,
    /// The caller's deadline passed before the decision could be answered: nothing
    /// was committed (the filter has failed open by then and would never report it).
    DeadlinePassed,
    /// Admission is gated and no pod has room for the request now (see
    /// [`crate::admission::room`]): it should wait in the router's queue.
    Saturated,
}

impl RouteError {
    pub fn reason(&self) -> &'static str {
        match self {
            RouteError::EmptyModel | RouteError::ChainTooLong(_) => "bad_request",
            RouteError::BlockSizeMismatch { .. } => "block_size_mismatch",
            RouteError::NoPod { .. } => "no_pod",
            RouteError::NoReadyPod { .. } => "no_ready_pod",
            RouteError::OutsideSubset => "outside_subset",
            RouteError::DeadlinePassed => "deadline",
            RouteError::Saturated => "saturated",
        }
    }

    /// The HTTP status: the request is wrong (400), nothing can serve it (503), or its
    /// answer would come too late (504), or the fleet has no room for it now (429).
    pub fn status(&self) -> u16 {
        match self {
            RouteError::NoPod { .. }
            | RouteError::NoReadyPod { .. }
            | RouteError::OutsideSubset => 503,
            RouteError::Saturated => 429,
            RouteError::DeadlinePassed => 504,
            _ => 400,
        }
    }

    /// When to try again, for the errors a client is answered with (not failed open on).
    pub fn retry_after_s(&self) -> Option<u32> {
        match self {
            RouteError::NoReadyPod { retry_after_s, .. } => Some(*retry_after_s),
            _ => None,
        }
    }
}

impl std::fmt::Display for RouteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RouteError::EmptyModel => f.write_str("model must not be empty"),
            RouteError::ChainTooLong(n) => write!(f, "chain of {n} blocks exceeds {MAX_CHAIN}"),
            RouteError::BlockSizeMismatch {
                given,
                want,
                mode,
                model,
            } => write!(
                f,
                "block_size {given} does not match the {} block size {want} configured for model {model:?}: gateway and engines must agree",
                mode.as_str()
            ),
            RouteError::OutsideSubset => {
                f.write_str("no pod of the data plane's subset hint can serve the request")
            }
            RouteError::DeadlinePassed => {
                f.write_str("the caller's deadline passed before a decision; none was committed")
            }
            RouteError::Saturated => {
                f.write_str("no pod has room for the request now; it should wait its turn")
            }
            RouteError::NoReadyPod {
                model,
                retry_after_s,
            } => write!(
                f,
                "every pod of model {model:?} is failing (breakers open); retry after {retry_after_s} s"
            ),
            RouteError::NoPod { model, adapter } if adapter.is_empty() => {
                write!(f, "no live pod serves model {model:?}")
            }
            RouteError::NoPod { model, adapter } => {
                write!(f, "no live pod serves model {model:?} with adapter {adapter:?}")
            }
        }
    }
}
