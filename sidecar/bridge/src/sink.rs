//! Where an engine-side publisher sends kvroute event batches: NATS (every gateway's
//! sidecar subscribes, so one publish reaches all) and/or `POST /v1/events` on listed
//! sidecars. Used by the vLLM/SGLang bridge and the simulated engine, so both publish
//! the same way. Sends are best effort: a lost batch shows up at the sidecar as a
//! sequence gap, which it already repairs (resync from the pod's dump, or drop).

use kvroute_shared::protocol::EventBatch;

use kvroute_service::NatsAuth;

pub struct EventSink {
    nats: Option<async_nats::Client>,
    sidecars: Vec<String>,
    /// Bearer token for sidecars whose TCP API requires one.
    sidecar_token: Option<String>,
    http: reqwest::Client,
}

impl EventSink {
    /// Connects to NATS in the background (retrying forever), so a publisher can start
    /// before NATS does.
    pub async fn connect(
        nats: Option<&str>,
        auth: &NatsAuth,
        sidecars: Vec<String>,
        sidecar_token: Option<String>,
    ) -> anyhow::Result<Self> {
        let nats = match nats {
            Some(url) => {
                let o = async_nats::ConnectOptions::new()
                    .name("kvroute-events")
                    .retry_on_initial_connect()
                    .max_reconnects(None);
                Some(auth.apply(o).await?.connect(url).await?)
            }
            None => None,
        };
        Ok(EventSink {
            nats,
            sidecar_token,
            sidecars: sidecars
                .into_iter()
                .map(|u| u.trim_end_matches('/').to_string())
                .collect(),
            http: reqwest::Client::new(),
        })
    }

    /// Send one batch everywhere; returns how many destinations refused or failed.
    pub async fn send(&self, b: &EventBatch) -> usize {
        let bytes = b.encode();
        let mut failed = 0;
        if let Some(nc) = &self.nats {
            if nc.publish(b.subject(), bytes.clone().into()).await.is_err() {
                failed += 1;
            }
        }
        for url in &self.sidecars {
            let mut req = self
                .http
                .post(format!("{url}/v1/events"))
                .header("content-type", "application/json")
                .body(bytes.clone());
            if let Some(t) = &self.sidecar_token {
                req = req.bearer_auth(t);
            }
            let ok = req.send().await.is_ok_and(|r| r.status().is_success());
            if !ok {
                failed += 1;
            }
        }
        failed
    }
}
