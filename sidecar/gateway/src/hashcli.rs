//! `kvroute-sidecar hash`: print the chain of a prompt, so operators can check that the
//! gateway, the engines and the index agree on block size and namespace (the silent
//! mismatch is the commonest field failure of prefix-aware routers).

use std::fmt::Write as _;

use anyhow::{bail, Context};
use kvroute_shared::canon::{self, AdapterRule, Endpoint};
use kvroute_shared::{Mode, Namespace};

/// What to chain.
pub enum Input {
    Tokens(String),
    Text(String),
    /// A whole OpenAI request body, and the path it would be sent to.
    Request {
        body: Vec<u8>,
        path: String,
    },
}

pub struct HashArgs {
    pub model: String,
    pub block_size: u32,
    pub adapter: String,
    pub salt: String,
    pub input: Input,
    /// With `--request`: also print the canonical form.
    pub show_canonical: bool,
}

/// `hash --tokenizer DIR`: a request body (or a text prompt) as the engine tokenizes it,
/// printed as `{"tokens":[...],"chain":[...]}` — what the gateway's sidecar computes for a
/// model loaded with `--tokenizer`, to compare with the engine's own.
pub fn run_tokenized(
    args: &HashArgs,
    tokenizer: &std::path::Path,
    chat_template: Option<&std::path::Path>,
) -> anyhow::Result<String> {
    if args.block_size == 0 {
        bail!("--block-size must be > 0");
    }
    let mut t = crate::tokenize::ModelTokenizer::load(tokenizer, 0)?;
    if let Some(file) = chat_template {
        t = t.with_chat_template(file)?;
    }
    let (tokens, model, salt) = match &args.input {
        Input::Request { body, path } => {
            let Some(endpoint) = Endpoint::from_path(path) else {
                bail!("{path:?} is not a routed API path (/v1/completions, /v1/chat/completions, /v1/messages, /v1/responses)");
            };
            let v: serde_json::Value =
                serde_json::from_slice(body).context("the request body is not JSON")?;
            let model = v["model"].as_str().unwrap_or_default().to_owned();
            let salt = v["cache_salt"].as_str().unwrap_or_default().to_owned();
            (
                t.tokenize_for(kvroute_shared::protocol::PromptApi::from(endpoint), &v)?,
                model,
                salt,
            )
        }
        Input::Text(s) => (t.encode(s, true)?, String::new(), String::new()),
        Input::Tokens(_) => bail!("--tokenizer takes --request or --text"),
    };
    let model = if args.model.is_empty() {
        model
    } else {
        args.model.clone()
    };
    let salt = if args.salt.is_empty() {
        salt
    } else {
        args.salt.clone()
    };
    let chain = Namespace {
        mode: Mode::Tokens,
        block_size: args.block_size,
        model: &model,
        adapter: &args.adapter,
        cache_salt: &salt,
    }
    .chain_tokens(&tokens);
    Ok(format!(
        "{}\n",
        serde_json::json!({"model": model, "cache_salt": salt, "block_size": args.block_size,
                           "tokens": tokens, "chain": chain})
    ))
}

/// Parse `0,1,2` (also spaces, brackets) into token ids.
pub fn parse_tokens(s: &str) -> anyhow::Result<Vec<u32>> {
    s.split(|c: char| c == ',' || c.is_whitespace() || c == '[' || c == ']')
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .with_context(|| format!("token {t:?} is not a u32"))
        })
        .collect()
}

/// The text to print: for `--tokens`/`--text` one decimal hash a line; for `--request`
/// a header (as `#` comments) naming mode and namespace, then the hashes.
pub fn run(args: &HashArgs) -> anyhow::Result<String> {
    if args.block_size == 0 {
        bail!("--block-size must be > 0");
    }
    let mut out = String::new();
    let chain = match &args.input {
        Input::Tokens(s) => {
            let toks = parse_tokens(s)?;
            ns(args, Mode::Tokens, &args.model, &args.adapter).chain_tokens(&toks)
        }
        Input::Text(t) => {
            ns(args, Mode::Text, &args.model, &args.adapter).chain_bytes(t.as_bytes())
        }
        Input::Request { body, path } => {
            let ep = Endpoint::from_path(path).with_context(|| {
                format!("{path:?} is not /v1/completions or /v1/chat/completions")
            })?;
            let req = canon::parse(ep, body).map_err(|e| anyhow::anyhow!("{e}"))?;
            // The CLI's --model/--adapter override what the body names, so a body can be
            // checked against several deployments.
            let model = if args.model.is_empty() {
                req.model.to_string()
            } else {
                args.model.clone()
            };
            let mode = req.prompt.mode();
            let rule = AdapterRule::default();
            let (base, body_adapter) = rule.resolve(&model);
            let adapter = if args.adapter.is_empty() {
                body_adapter
            } else {
                args.adapter.as_str()
            };
            let salt = if args.salt.is_empty() {
                req.cache_salt.as_ref()
            } else {
                args.salt.as_str()
            };
            let n = Namespace {
                mode,
                block_size: args.block_size,
                model: base,
                adapter,
                cache_salt: salt,
            };
            let canonical = canon::canonical_bytes(&req.prompt);
            let _ = writeln!(out, "# mode: {}", mode.as_str());
            let _ = writeln!(
                out,
                "# model: {base:?} adapter: {adapter:?} cache_salt: {salt:?} block_size: {}",
                args.block_size
            );
            let unit = if mode == Mode::Tokens {
                "tokens"
            } else {
                "canonical bytes"
            };
            let units = req.prompt.units();
            let _ = writeln!(
                out,
                "# prompt: {units} {unit}, {} full blocks",
                units / args.block_size as usize
            );
            if args.show_canonical && mode == Mode::Text {
                let _ = writeln!(
                    out,
                    "# canonical form (escaped): {}",
                    canonical.escape_ascii()
                );
            }
            n.chain_bytes(&canonical)
        }
    };
    for h in chain {
        let _ = writeln!(out, "{h}");
    }
    Ok(out)
}

fn ns<'a>(args: &'a HashArgs, mode: Mode, model: &'a str, adapter: &'a str) -> Namespace<'a> {
    Namespace {
        mode,
        block_size: args.block_size,
        model,
        adapter,
        cache_salt: &args.salt,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(input: Input, bs: u32, model: &str, adapter: &str, salt: &str) -> HashArgs {
        HashArgs {
            model: model.into(),
            block_size: bs,
            adapter: adapter.into(),
            salt: salt.into(),
            input,
            show_canonical: false,
        }
    }

    #[test]
    fn reproduces_all_reference_vectors() {
        let t = || Input::Tokens("0,1,2,3,4,5,6,7,8,9".into());
        let cases = [
            (
                args(t(), 4, "m", "", ""),
                "12505186680924831797\n7943115681171077851\n",
            ),
            (
                args(t(), 4, "m", "a", ""),
                "14521725862862998063\n12194196787045017334\n",
            ),
            (
                args(t(), 4, "m", "", "s"),
                "354002652557409732\n10636323012749482335\n",
            ),
            (
                args(t(), 4, "m2", "", ""),
                "16843217685244874434\n3919959493303384019\n",
            ),
            (
                args(
                    Input::Text("The quick brown fox jumps over the lazy dog".into()),
                    16,
                    "m",
                    "",
                    "",
                ),
                "5154235071411025064\n2942950958069661582\n",
            ),
        ];
        for (a, want) in cases {
            assert_eq!(run(&a).expect("runs"), want);
        }
    }

    #[test]
    fn request_mode_names_its_form() {
        let body = br#"{"model":"m","prompt":[0,1,2,3,4,5,6,7,8,9],"cache_salt":"s"}"#.to_vec();
        let a = args(
            Input::Request {
                body,
                path: "/v1/completions".into(),
            },
            4,
            "",
            "",
            "",
        );
        let out = run(&a).expect("runs");
        assert!(out.starts_with("# mode: tokens\n"), "{out}");
        assert!(
            out.ends_with("354002652557409732\n10636323012749482335\n"),
            "{out}"
        );
        let bad = args(
            Input::Request {
                body: b"{".to_vec(),
                path: "/v1/completions".into(),
            },
            4,
            "",
            "",
            "",
        );
        assert!(run(&bad).is_err());
        assert!(parse_tokens("1,x").is_err());
        assert_eq!(parse_tokens("[1, 2,3]").expect("ok"), [1, 2, 3]);
    }
}
