//! The `kvroute-sidecar` command: `hash` (chain a prompt, for operators) and `serve`.
//! The engine-side bridge is its own binary, `kvroute-bridge`.

use std::path::PathBuf;

#[global_allocator]
static GLOBAL: kvroute_sidecar::Allocator = kvroute_sidecar::Allocator;

use clap::{Args, Parser, Subcommand};
use kvroute_sidecar::hashcli::{self, HashArgs, Input};

#[derive(Parser)]
#[command(
    name = "kvroute-sidecar",
    version,
    about = "kvroute's KV-cache-aware routing sidecar"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once at start: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Print the block-hash chain of a prompt, one decimal u64 per line.
    Hash(HashCmd),
    /// Run the sidecar service.
    Serve(kvroute_sidecar::ServeArgs),
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["tokens", "text", "request"])))]
struct HashCmd {
    /// Model name (the namespace); with --request, defaults to the body's `model`.
    #[arg(long, default_value = "")]
    model: String,
    /// Tokens (or bytes, for text) per block: must match the engines'.
    #[arg(long)]
    block_size: u32,
    #[arg(long, default_value = "")]
    adapter: String,
    /// vLLM's cache_salt; with --request, defaults to the body's.
    #[arg(long, default_value = "")]
    salt: String,
    /// Token ids, comma-separated.
    #[arg(long)]
    tokens: Option<String>,
    /// A text prompt, chained as UTF-8 bytes.
    #[arg(long)]
    text: Option<String>,
    /// A whole OpenAI request body (JSON file, `-` for stdin).
    #[arg(long)]
    request: Option<PathBuf>,
    /// The endpoint the --request body is for.
    #[arg(long, default_value = "/v1/chat/completions")]
    path: String,
    /// With --request: print the canonical text form too.
    #[arg(long)]
    show_canonical: bool,
    /// A model directory (as `serve --tokenizer`): chain the model's token ids of the
    /// --request body (chat template applied) or --text prompt, printed as JSON
    /// `{"tokens":[...],"chain":[...]}`.
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<PathBuf>,
    /// With --tokenizer: this chat template instead of the directory's (as `serve
    /// --chat-template`).
    #[arg(long, value_name = "FILE", requires = "tokenizer")]
    chat_template: Option<PathBuf>,
    /// Print JSON (implied by --tokenizer).
    #[arg(long)]
    json: bool,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Serve(a) => kvroute_service::service_runtime()?.block_on(kvroute_sidecar::serve(
            a,
            kvroute_sidecar::wait_for_signal(),
        )),
        Cmd::Hash(h) => {
            let input = match (h.tokens, h.text, h.request) {
                (Some(t), _, _) => Input::Tokens(t),
                (_, Some(t), _) => Input::Text(t),
                (_, _, Some(p)) => {
                    let body = if p.as_os_str() == "-" {
                        let mut v = Vec::new();
                        std::io::Read::read_to_end(&mut std::io::stdin(), &mut v)?;
                        v
                    } else {
                        std::fs::read(&p)
                            .map_err(|e| anyhow::anyhow!("reading {}: {e}", p.display()))?
                    };
                    // A completions body has `prompt`; default the path from the body.
                    let path = if h.path == "/v1/chat/completions" && looks_like_completion(&body) {
                        "/v1/completions".to_string()
                    } else {
                        h.path
                    };
                    Input::Request { body, path }
                }
                _ => anyhow::bail!("one of --tokens, --text, --request is required"),
            };
            let args = HashArgs {
                model: h.model,
                block_size: h.block_size,
                adapter: h.adapter,
                salt: h.salt,
                input,
                show_canonical: h.show_canonical,
            };
            match &h.tokenizer {
                Some(dir) => print!(
                    "{}",
                    hashcli::run_tokenized(&args, dir, h.chat_template.as_deref())?
                ),
                None if h.json => {
                    let chain: Vec<u64> = hashcli::run(&args)?
                        .lines()
                        .filter(|l| !l.starts_with('#'))
                        .filter_map(|l| l.parse().ok())
                        .collect();
                    println!("{}", serde_json::json!({ "chain": chain }));
                }
                None => print!("{}", hashcli::run(&args)?),
            }
            Ok(())
        }
    }
}

fn looks_like_completion(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Probe {
        prompt: Option<serde::de::IgnoredAny>,
        messages: Option<serde::de::IgnoredAny>,
    }
    matches!(
        serde_json::from_slice::<Probe>(body),
        Ok(Probe {
            prompt: Some(_),
            messages: None
        })
    )
}
