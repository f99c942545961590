//! kvroute-service: the little that kvroute's two native services — the gateway's
//! sidecar (`kvroute-sidecar`) and the engine-side bridge (`kvroute-bridge`) — have in
//! common, so that neither depends on the other:
//!
//! - [`bearer_matches`]: the one bearer-token check (the sidecar's admin token, the
//!   bridge's dump token);
//! - [`nats_auth`]: the NATS credentials and TLS flags every kvroute NATS client takes;
//! - [`Shutdown`] and [`DropGuard`]: how a service tells its background tasks to stop
//!   (passed into each task, so every task can be awaited after the signal);
//! - [`wait_for_signal`] and [`service_runtime`]: how both binaries start and stop;
//! - [`http_server`]: how both serve an HTTP API on a network socket (bounded
//!   connections, deadlines for each request head and body).

mod bearer;
pub mod http_server;
pub mod nats_auth;

pub use bearer::bearer_matches;

pub use nats_auth::NatsAuth;

use tokio::sync::watch;

/// A task's view of the service's shutdown: cheap to clone, one per task.
#[derive(Clone, Debug)]
pub struct Shutdown(watch::Receiver<bool>);

/// Stops every [`Shutdown`] made from it when dropped (or [`DropGuard::stop`]ped), so
/// whatever way a service exits, its tasks are told.
#[derive(Debug)]
pub struct DropGuard(watch::Sender<bool>);

impl Shutdown {
    /// A new shutdown and the guard that triggers it.
    pub fn new() -> (DropGuard, Shutdown) {
        let (tx, rx) = watch::channel(false);
        (DropGuard(tx), Shutdown(rx))
    }

    /// Resolves once shutdown has begun (at once if it has already).
    pub async fn wait(&mut self) {
        // `wait_for` also returns when the guard is gone, which means the same.
        let _ = self.0.wait_for(|stop| *stop).await;
    }

    /// Whether shutdown has begun.
    pub fn is_stopping(&self) -> bool {
        *self.0.borrow()
    }
}

impl DropGuard {
    /// Another handle for a task started later.
    pub fn subscribe(&self) -> Shutdown {
        Shutdown(self.0.subscribe())
    }

    /// Begin shutdown now.
    pub fn stop(&self) {
        let _ = self.0.send(true);
    }
}

impl Drop for DropGuard {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Logging (`KVROUTE_LOG`, default `info`, to stderr) and a multi-threaded runtime: how
/// both kvroute services start.
pub fn service_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVROUTE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

/// SIGTERM or SIGINT (the shutdown signal of kvroute's services).
pub async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_handle_sees_the_guard_stop_or_drop() {
        let (guard, mut a) = Shutdown::new();
        let mut b = guard.subscribe();
        assert!(!a.is_stopping());
        guard.stop();
        a.wait().await;
        b.wait().await;
        assert!(a.is_stopping());
        let (guard, mut c) = Shutdown::new();
        drop(guard);
        // A dropped guard is a shutdown too: waiting must not hang.
        tokio::time::timeout(std::time::Duration::from_secs(1), c.wait())
            .await
            .expect("a dropped guard ends the wait");
    }
}
