//! How every kvroute NATS client proves who it is: user and password, a token, a
//! `.creds` file (JWT + nkey), a bare nkey seed, TLS with a private CA and a client
//! certificate. The sidecar and the bridge take the same flags, so an operator can give
//! each bridge a user that may publish only its own pod's subject (docs/security.md).

use std::path::PathBuf;

/// NATS credentials and TLS, as flags with `KVROUTE_NATS_*` twins.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct NatsAuth {
    #[arg(long, env = "KVROUTE_NATS_USER")]
    pub nats_user: Option<String>,
    #[arg(long, env = "KVROUTE_NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<String>,
    #[arg(long, env = "KVROUTE_NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<String>,
    /// NATS credentials file (.creds: a user JWT and its nkey seed).
    #[arg(long, env = "KVROUTE_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
    /// A file holding an nkey seed (`SU...`), for servers that list users by nkey.
    #[arg(long, env = "KVROUTE_NATS_NKEY")]
    pub nats_nkey: Option<PathBuf>,
    /// CA certificate for NATS over TLS (implies --nats-require-tls).
    #[arg(long, env = "KVROUTE_NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,
    /// Client certificate and key for mutual TLS.
    #[arg(long, env = "KVROUTE_NATS_TLS_CERT", requires = "nats_tls_key")]
    pub nats_tls_cert: Option<PathBuf>,
    #[arg(long, env = "KVROUTE_NATS_TLS_KEY", requires = "nats_tls_cert")]
    pub nats_tls_key: Option<PathBuf>,
    #[arg(long, env = "KVROUTE_NATS_REQUIRE_TLS")]
    pub nats_require_tls: bool,
}

impl NatsAuth {
    /// `o` with these credentials and TLS settings.
    pub async fn apply(
        &self,
        mut o: async_nats::ConnectOptions,
    ) -> anyhow::Result<async_nats::ConnectOptions> {
        if let (Some(u), Some(p)) = (&self.nats_user, &self.nats_password) {
            o = o.user_and_password(u.clone(), p.clone());
        }
        if let Some(t) = &self.nats_token {
            o = o.token(t.clone());
        }
        if let Some(c) = &self.nats_creds {
            o = o.credentials_file(c).await?;
        }
        if let Some(k) = &self.nats_nkey {
            let seed = std::fs::read_to_string(k)
                .map_err(|e| anyhow::anyhow!("reading nkey seed {}: {e}", k.display()))?;
            o = o.nkey(seed.trim().to_string());
        }
        if let Some(ca) = &self.nats_tls_ca {
            o = o.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&self.nats_tls_cert, &self.nats_tls_key) {
            o = o.add_client_certificate(cert.clone(), key.clone());
        }
        if self.nats_require_tls || self.nats_tls_ca.is_some() {
            o = o.require_tls(true);
        }
        Ok(o)
    }
}
