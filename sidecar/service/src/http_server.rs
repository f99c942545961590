//! Serving an HTTP API on a socket anyone on the network may reach. axum's own `serve`
//! accepts every connection and keeps each until its peer closes it: a client that opens
//! connections without end, or holds them idle, or sends a request head a byte at a
//! time, takes one file descriptor each until the process has none left for the sockets
//! and files it needs. Here:
//!
//! - at most `max_connections` are served at once; more wait in the kernel's accept
//!   queue until one closes (so a flood costs a bounded number of files and a real
//!   client is delayed, not refused);
//! - a connection that has not sent a whole request head within `header_timeout` of
//!   being accepted or of its last answer is closed (hyper's own header timeout, which
//!   `axum::serve` leaves off), so the slots cannot be held by connections that do
//!   nothing;
//! - a request body that has not arrived whole within `body_timeout` of its head is cut
//!   off (the handler's read fails, answered 400, and the connection closes), so a
//!   complete head followed by a body sent a byte at a time cannot hold a slot either;
//! - HTTP/1.1 only: the APIs served this way have no HTTP/2 client, and an HTTP/2
//!   connection would sit idle between its streams with no such timeout.
//!
//! What happens to connections is reported to the caller's [`ConnEvent`] hook (the
//! services count it in their metrics).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower::ServiceExt;

use crate::Shutdown;

/// The bounds of one listener.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// Connections served at once.
    pub max_connections: usize,
    /// Time a connection has to send a whole request head, from its accept or its last
    /// answer.
    pub header_timeout: Duration,
    /// Time a request's body has to arrive whole, from its head.
    pub body_timeout: Duration,
}

/// What happened to a connection, for the caller's counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnEvent {
    /// Accepted at once.
    Accepted,
    /// Accepted after waiting for a slot (every slot was taken).
    Waited,
    /// Closed because it sent no whole request head in time (idle or dribbling).
    HeaderTimeout,
    /// A request whose body did not arrive whole in time.
    BodyTimeout,
    /// Closed on a protocol or I/O error.
    Error,
}

impl ConnEvent {
    /// The stable label of the event in metrics.
    pub fn label(self) -> &'static str {
        match self {
            ConnEvent::Accepted => "accepted",
            ConnEvent::Waited => "waited",
            ConnEvent::HeaderTimeout => "header_timeout",
            ConnEvent::BodyTimeout => "body_timeout",
            ConnEvent::Error => "error",
        }
    }
}

/// Serve `app` on `listener` within `limits` until `stop` fires, then let the
/// connections in progress finish. Handlers may read the peer's address as
/// `ConnectInfo<SocketAddr>`.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: ConnLimits,
    on: impl Fn(ConnEvent) + Send + Sync + 'static,
    mut stop: Shutdown,
) -> std::io::Result<()> {
    let on: Hook = Arc::new(on);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    loop {
        let (slot, waited) = match slots.clone().try_acquire_owned() {
            Ok(slot) => (slot, false),
            Err(_) => tokio::select! {
                slot = slots.clone().acquire_owned() => match slot {
                    Ok(slot) => (slot, true),
                    Err(_) => break,
                },
                _ = stop.wait() => break,
            },
        };
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    accept_error(e).await;
                    continue;
                }
            },
            _ = stop.wait() => break,
        };
        on(if waited {
            ConnEvent::Waited
        } else {
            ConnEvent::Accepted
        });
        let _ = tcp.set_nodelay(true);
        let late = on.clone();
        let body_timeout = limits.body_timeout;
        let service =
            app.clone()
                .map_request(move |mut req: axum::http::Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert(ConnectInfo::<SocketAddr>(peer));
                    req.map(|body| {
                        // A request without a body (most GETs) needs no timer.
                        if http_body::Body::is_end_stream(&body) {
                            return axum::body::Body::new(body);
                        }
                        axum::body::Body::new(Deadline {
                            body,
                            timer: Box::pin(tokio::time::sleep(body_timeout)),
                            on_late: Some(late.clone()),
                        })
                    })
                });
        let conn = builder.serve_connection(TokioIo::new(tcp), TowerToHyperService::new(service));
        let conn = graceful.watch(conn);
        let on = on.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                if e.is_timeout() {
                    on(ConnEvent::HeaderTimeout);
                } else if !cut_off(&e) {
                    on(ConnEvent::Error);
                }
            }
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// A request body that fails once its deadline passes before it has ended.
struct Deadline<B> {
    body: B,
    timer: Pin<Box<tokio::time::Sleep>>,
    /// Told once, when the deadline cuts the body off.
    on_late: Option<Hook>,
}

/// The caller's hook, shared by the accept loop, each connection and each body.
type Hook = Arc<dyn Fn(ConnEvent) + Send + Sync>;

/// The error a body cut off by its deadline reads as.
#[derive(Debug)]
struct BodyTimedOut;

impl std::fmt::Display for BodyTimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request body did not arrive in time")
    }
}

impl std::error::Error for BodyTimedOut {}

impl<B> http_body::Body for Deadline<B>
where
    B: http_body::Body<Data = bytes::Bytes> + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = bytes::Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.body).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if this.timer.as_mut().poll(cx).is_ready() {
            if let Some(on) = this.on_late.take() {
                on(ConnEvent::BodyTimeout);
            }
            return Poll::Ready(Some(Err(Box::new(BodyTimedOut))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// The connection ended because a body's deadline cut it off (already counted).
fn cut_off(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if c.is::<BodyTimedOut>() {
            return true;
        }
        cause = c.source();
    }
    false
}

/// An accept that failed. A peer that gave up during its handshake is its own problem;
/// anything else (out of file descriptors, out of memory) clears only as connections
/// close, so pause rather than spin on it.
async fn accept_error(e: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    tracing::warn!("accept failed: {e}");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(addr: SocketAddr) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /peer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        out
    }

    /// Handlers see the peer's address; the server stops on its shutdown and returns.
    #[tokio::test]
    async fn serves_with_the_peers_address_and_stops() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let app = axum::Router::new().route(
            "/peer",
            axum::routing::get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move {
                peer.ip().to_string()
            }),
        );
        let accepted = Arc::new(AtomicUsize::new(0));
        let seen = accepted.clone();
        let (guard, stop) = Shutdown::new();
        let limits = ConnLimits {
            max_connections: 2,
            header_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(5),
        };
        let server = tokio::spawn(serve(
            listener,
            app,
            limits,
            move |e| {
                if e == ConnEvent::Accepted || e == ConnEvent::Waited {
                    seen.fetch_add(1, Ordering::Relaxed);
                }
            },
            stop,
        ));
        for _ in 0..3 {
            let r = get(addr).await;
            assert!(r.starts_with("HTTP/1.1 200"), "{r}");
            assert!(r.ends_with("127.0.0.1"), "{r}");
        }
        assert_eq!(accepted.load(Ordering::Relaxed), 3);
        guard.stop();
        let done = tokio::time::timeout(Duration::from_secs(5), server).await;
        assert!(matches!(done, Ok(Ok(Ok(())))), "{done:?}");
    }
}
