//! Chat and text prompts chained as the model's own token ids: a route request that
//! carries a prompt body (the filter sends one for models configured so) is rendered
//! and tokenized with the model's tokenizer (`tokenize`) and chained in token mode, in
//! the namespace the bridge gives the engine's blocks (model, adapter, cache_salt) — so
//! the lookup meets the engine's KV events block for block. When the sidecar cannot
//! (no tokenizer for the model, a multimodal message, a template error), the request
//! keeps its text chain and is routed by predicted residency, as without a body; each
//! outcome is counted (`kvroute_precise_prompts_total`). A Responses turn that continues a
//! stored response (`previous_response_id`) keeps its text chain: its prompt begins with
//! history only the engine that stored it holds, and its binding routes it there.
//!
//! Tokenizing costs about a millisecond per 4 KB of new text (a chat turn's earlier
//! messages and a long text prompt's earlier chunks come from the segment cache) and
//! holds many times its input in memory while it runs, and the text is the client's: a
//! body over the largest field the budget allows, or one arriving while the budget's
//! bytes are all tokenizing, is routed by its text chain instead (`too_large`, `busy`;
//! `tokenize::Budget`), so a flood of huge chats can neither turn the sidecar's routing
//! into a CPU queue nor grow its memory past the budget's bound.

use kvroute_shared::protocol::{PromptApi, PromptBody, RouteRequest};
use kvroute_shared::{Mode, Namespace};

use crate::state::Sidecar;

/// The request with its token chain, or None (counted) to route it as sent.
pub fn precise(sc: &Sidecar, req: &RouteRequest) -> Option<RouteRequest> {
    let body = req.prompt_body.as_ref()?;
    let outcome = match sc.tokenize_budget.take(body.fields.get().len()) {
        Ok(_permit) => tokens_of(sc, req, body),
        Err(r) => Err(r.reason()),
    };
    match outcome {
        Ok(r) => {
            sc.metrics.precise.inc("tokens", 1);
            Some(r)
        }
        Err(reason) => {
            sc.metrics.precise.inc(reason, 1);
            None
        }
    }
}

fn tokens_of(
    sc: &Sidecar,
    req: &RouteRequest,
    body: &PromptBody,
) -> Result<RouteRequest, &'static str> {
    // A continued response's prompt starts with a history only its engine holds (the
    // response binding finds that engine); its new items alone chain nothing real.
    if body.api == Some(PromptApi::Responses) && req.previous_response.is_some() {
        return Err("continued_response");
    }
    let toks = sc.tokenizers();
    let t = toks.get(&req.model).ok_or("no_tokenizer")?;
    let ids = t
        .tokenize_api(body.chat, body.api, body.fields.get())
        .map_err(|e| e.reason())?;
    let block_size = sc.config().block_size(&req.model, Mode::Tokens);
    let ns = Namespace {
        mode: Mode::Tokens,
        block_size,
        model: &req.model,
        adapter: &req.adapter,
        cache_salt: &body.cache_salt,
    };
    Ok(RouteRequest {
        model: req.model.clone(),
        adapter: req.adapter.clone(),
        mode: Mode::Tokens,
        block_size,
        chain: ns.chain_tokens(&ids),
        prompt_tokens: u32::try_from(ids.len()).unwrap_or(u32::MAX),
        request_id: req.request_id.clone(),
        session: req.session.clone(),
        previous_response: req.previous_response.clone(),
        role: req.role,
        dry_run: req.dry_run,
        explain: req.explain,
        prompt_body: None,
        admission: req.admission.clone(),
    })
}
