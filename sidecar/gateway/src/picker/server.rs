//! The gRPC service: Envoy's `ExternalProcessor` (one stream per HTTP request, driven by
//! an [`Exchange`]) and gRPC health (`liveness`, `readiness` and the ext_proc service
//! name, as GIE's protocol asks), on their own listener, stopped by the sidecar's
//! shutdown.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use kvroute_filter::config::{FilterConfig, ModelSettings};
use kvroute_service::Shutdown;
use kvroute_shared::protocol::RouteResponse;
use kvroute_shared::Mode;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;

use super::exchange::{Exchange, RouteJob, Settings, Step};
use crate::admission::{Admitted, Shed, Verdict};
use crate::route::{self, RouteError};
use crate::state::Sidecar;

/// The ext_proc service's name, as health checks ask for it.
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// The largest message the picker decodes: Envoy hands over a body in chunks as large as
/// its buffer lets them grow (the shipped configurations allow 32 MiB), and a message
/// refused here ends the stream (the request fails open), so the cap is Envoy's buffer
/// plus framing; the picker still reads no more than `max_body_bytes` of a body.
const MAX_MESSAGE: usize = (32 << 20) + (64 << 10);
/// Chains longer than this are routed on the blocking pool (as the HTTP API does with
/// route calls over 64 KiB).
const HEAVY_CHAIN: usize = 8 << 10;

/// How the picker is set up (from `serve`'s flags).
#[derive(Clone, Debug)]
pub struct PickerSettings {
    /// The request keys, as the filter's configuration names them (paths, session and
    /// tenant headers, per-model `route_text` / `sidecar_tokenizes`, adapters, body cap).
    pub cfg: FilterConfig,
    /// A decision later than this after the body is whole is not committed (the data
    /// plane's message timeout should be a little longer).
    pub deadline: Duration,
}

#[derive(Clone)]
struct Picker {
    sc: Arc<Sidecar>,
    cfg: Arc<FilterConfig>,
    settings: Settings,
    deadline: Duration,
    stop: Shutdown,
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (tx, rx) = mpsc::channel(16);
        let me = self.clone();
        let stop = self.stop.clone();
        tokio::spawn(async move { me.exchange(request.into_inner(), tx, stop).await });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

impl Picker {
    /// One request's stream, until Envoy ends it (or the sidecar stops); then its
    /// decision's report, so the decision's load is released whatever happened.
    async fn exchange(
        self,
        mut inbound: Streaming<ProcessingRequest>,
        tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
        mut stop: Shutdown,
    ) {
        let mut ex = Exchange::new(self.cfg.clone(), self.settings.clone());
        'stream: loop {
            let msg = tokio::select! {
                m = inbound.message() => m,
                () = stop.wait() => break,
            };
            let msg = match msg {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    // A malformed frame, an oversized message, a reset: the stream is
                    // over, and Envoy's failure mode decides the request's fate.
                    tracing::debug!("picker stream ended: {e}");
                    self.sc.metrics.picker.inc("stream_error", 1);
                    break;
                }
            };
            let replies = match ex.on_message(msg) {
                Step::Reply(r) => r,
                Step::Route(job) => {
                    let model = job.req.model.clone();
                    match self.route(*job, &tx).await {
                        Picked::Decided(r) => ex.routed(&model, r, Instant::now()),
                        Picked::Refused(why) => {
                            let retry = self.sc.config().admission.retry_after_s;
                            ex.refused(why.label(), retry)
                        }
                    }
                }
            };
            if let Some(o) = ex.take_outcome() {
                self.sc.metrics.picker.inc(o.as_str(), 1);
            }
            for r in replies {
                if tx.send(Ok(r)).await.is_err() {
                    break 'stream;
                }
            }
        }
        if let Some(r) = ex.report(Instant::now()) {
            route::report(&self.sc, &r);
        }
    }

    /// Route a request; with admission on and the model saturated it waits in the
    /// queue, for as long as its band's TTL, while its stream lasts (the stream ending
    /// takes it out: the wait's `Claim` is dropped).
    async fn route(
        &self,
        job: RouteJob,
        tx: &mpsc::Sender<Result<ProcessingResponse, Status>>,
    ) -> Picked {
        let admission = self.sc.config().admission.enabled && job.subset.is_none();
        if !admission {
            return Picked::Decided(self.route_now(job).await);
        }
        let deadline = Some(SystemTime::now() + self.deadline);
        let sc = self.sc.clone();
        let model = job.req.model.clone();
        let admit = move || {
            let req = route::tokenized(&sc, job.req);
            sc.waiting.admit(&sc, req, deadline, Instant::now())
        };
        let admitted = match tokio::task::spawn_blocking(admit).await {
            Ok(a) => a,
            Err(_) => return Picked::Decided(Err(RouteError::DeadlinePassed)),
        };
        let (ticket, wait) = match admitted {
            Ok(Admitted::Routed(r)) => return Picked::Decided(Ok(r)),
            Ok(Admitted::Refused(why)) => return Picked::Refused(why),
            Err(e) => return Picked::Decided(Err(e)),
            Ok(Admitted::Queued { ticket, wait }) => (ticket, wait),
        };
        let waiting = self.sc.waiting.wait(&self.sc, &model, ticket);
        let mut stop = self.stop.clone();
        tokio::select! {
            v = waiting => match v {
                Verdict::Routed(r) => Picked::Decided(Ok(r)),
                Verdict::Refused(why) => Picked::Refused(why),
                Verdict::Failed(e) => Picked::Decided(Err(e)),
                // Unsteered, as the filter does.
                Verdict::Stopping => Picked::Decided(Err(RouteError::DeadlinePassed)),
            },
            () = tx.closed() => Picked::Decided(Err(RouteError::DeadlinePassed)),
            () = stop.wait() => Picked::Decided(Err(RouteError::DeadlinePassed)),
            () = tokio::time::sleep(wait + Duration::from_secs(1)) => {
                Picked::Decided(Err(RouteError::DeadlinePassed))
            }
        }
    }

    async fn route_now(&self, job: RouteJob) -> Result<RouteResponse, RouteError> {
        let deadline = Some(SystemTime::now() + self.deadline);
        let sc = self.sc.clone();
        // Tokenizing, and long chains, take milliseconds: off the async workers.
        let heavy = job.req.prompt_body.is_some() || job.req.chain.len() > HEAVY_CHAIN;
        let work = move || route::route_within(&sc, &job.req, deadline, job.subset.as_deref());
        if !heavy {
            return work();
        }
        match tokio::task::spawn_blocking(work).await {
            Ok(r) => r,
            Err(_) => Err(RouteError::DeadlinePassed),
        }
    }
}

/// What became of a picker request's route.
enum Picked {
    Decided(Result<RouteResponse, RouteError>),
    /// Admission refused it (answered 429).
    Refused(Shed),
}

/// Serve the picker on `listener` until `stop`; readiness follows [`Sidecar::ready`],
/// checked every second.
pub async fn serve(
    sc: Arc<Sidecar>,
    settings: PickerSettings,
    listener: tokio::net::TcpListener,
    stop: Shutdown,
) -> std::io::Result<()> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    let policy = sc.clone();
    let model_settings: Settings = Arc::new(move |model: &str, s: &ModelSettings| {
        let c = policy.config();
        ModelSettings {
            block_size: c.block_size(model, Mode::Tokens),
            text_block_bytes: c.block_size(model, Mode::Text),
            ..*s
        }
    });
    let max_message = MAX_MESSAGE.max(settings.cfg.max_body_bytes.saturating_add(64 << 10));
    let picker = Picker {
        sc: sc.clone(),
        cfg: Arc::new(settings.cfg),
        settings: model_settings,
        deadline: settings.deadline,
        stop: stop.clone(),
    };
    let mut tick = stop.clone();
    let mut stop = stop;
    let readiness = tokio::spawn(async move {
        loop {
            let status = match sc.ready() {
                Ok(()) => ServingStatus::Serving,
                Err(_) => ServingStatus::NotServing,
            };
            for name in ["readiness", EXT_PROC_SERVICE, ""] {
                reporter.set_service_status(name, status).await;
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = tick.wait() => break,
            }
        }
    });
    // Without TCP_NODELAY on each accepted connection, every answer waits on Nagle and the
    // data plane's delayed ACK: ~40 ms per request (`kvroute-bench filter`).
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let served = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(
            ExternalProcessorServer::new(picker)
                .max_decoding_message_size(max_message)
                .max_encoding_message_size(max_message),
        )
        .serve_with_incoming_shutdown(incoming, async move { stop.wait().await })
        .await;
    let _ = readiness.await;
    served.map_err(std::io::Error::other)
}
