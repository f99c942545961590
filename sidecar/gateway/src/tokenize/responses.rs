//! OpenAI Responses bodies as the chat request vLLM renders for them
//! (`OnlineRenderer.render_responses`: `construct_input_messages`, `construct_tool_dicts`
//! and `ResponsesRequest.build_chat_params` in vLLM's `entrypoints/openai/responses/`), so
//! precise routing of `/v1/responses` computes the tokens the engine will.
//!
//! The conversion, as vLLM does it: truthy `instructions` become the first system message;
//! a string `input` one user message; of an item list, a message with a `role` is handed
//! on as it is (vLLM's chat parser then reads its `input_text`/`output_text` parts), except
//! an assistant's, which keeps only its text (a string, or its first part's) and fills the
//! content of the assistant message before it when that has none; a `function_call` (its
//! name prefixed by its namespace) or `custom_tool_call` (its input as `{"input": …}`)
//! joins the tool calls of the assistant message before it, or starts one; a `reasoning`
//! item (its first content text, else its first summary text) sets that message's
//! `reasoning` when unset, or starts one; a `function_call_output` or
//! `custom_tool_call_output` becomes a `tool` message. Function tools (namespaces flattened
//! to `namespace__name`) become chat tools; tools the model is never shown are dropped. A
//! last assistant message or reasoning item still `in_progress` or `incomplete` is
//! continued (`continue_final_message`); `reasoning.effort` reaches the template and
//! switches `enable_thinking` unless the caller set it. Encrypted reasoning, custom tools,
//! item references and the other item types vLLM refuses or handles by its own state are
//! refused here, and the request keeps its text chain; so is a continued response
//! (`previous_response_id`, whose history only its engine holds: `route/precise.rs`).

use minijinja::value::{Value, ValueKind};

use super::agent::{attr, bad, items, kind_of, map, unsupported};
use super::{ModelTokenizer, TokenizeError};

/// vLLM's separator of a namespaced tool's flat name.
const NAMESPACE_SEPARATOR: &str = "__";

fn str_of(v: &Value, key: &str) -> Option<String> {
    attr(v, key).and_then(|s| s.as_str().map(str::to_owned))
}

fn role_of(m: &Value) -> Option<String> {
    str_of(m, "role")
}

/// A message under construction: keys in insertion order, as the Python dict vLLM builds.
type Msg = Vec<(String, Value)>;

fn get<'m>(m: &'m Msg, key: &str) -> Option<&'m Value> {
    m.iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

fn set(m: &mut Msg, key: &str, v: Value) {
    match m.iter_mut().find(|(k, _)| k == key) {
        Some(e) => e.1 = v,
        None => m.push((key.to_owned(), v)),
    }
}

/// `None` or absent, as Python's `dict.get(key) is None` sees it.
fn unset(m: &Msg, key: &str) -> bool {
    get(m, key).is_none_or(|v| v.is_none())
}

/// One converted message: one vLLM built (its keys), or an item handed on as it is.
enum Out {
    Built(Msg),
    Item(Value),
}

impl Out {
    /// The message, when it is an assistant message vLLM built (only those are merged
    /// into: an assistant item is always rebuilt, never handed on).
    fn assistant(&mut self) -> Option<&mut Msg> {
        match self {
            Out::Built(m) if get(m, "role").and_then(|r| r.as_str()) == Some("assistant") => {
                Some(m)
            }
            _ => None,
        }
    }

    fn into_value(self) -> Value {
        match self {
            Out::Built(m) => m.into_iter().map(|(k, v)| (Value::from(k), v)).collect(),
            Out::Item(v) => v,
        }
    }
}

/// The tool call of a `function_call` or `custom_tool_call` item.
fn tool_call(item: &Value, kind: &str) -> Result<Value, TokenizeError> {
    let id = attr(item, "call_id")
        .filter(|i| i.kind() == ValueKind::String)
        .ok_or_else(|| bad("a tool call item needs a `call_id`"))?;
    let name = str_of(item, "name").ok_or_else(|| bad("a tool call item needs a `name`"))?;
    let (name, arguments) = if kind == "function_call" {
        let name = match str_of(item, "namespace").filter(|n| !n.is_empty()) {
            Some(ns) => format!("{ns}{NAMESPACE_SEPARATOR}{name}"),
            None => name,
        };
        let args = attr(item, "arguments")
            .filter(|a| a.kind() == ValueKind::String)
            .ok_or_else(|| bad("a function call's `arguments` is a string"))?;
        (name, args)
    } else {
        // vLLM wraps the input as the JSON text `{"input": …}`; the chat path parses a
        // call's arguments back into an object, so the object is handed on directly.
        let input = attr(item, "input")
            .filter(|i| i.kind() == ValueKind::String)
            .unwrap_or_else(|| Value::from(""));
        (name, map(vec![("input", input)]))
    };
    Ok(map(vec![
        ("id", id),
        (
            "function",
            map(vec![("name", Value::from(name)), ("arguments", arguments)]),
        ),
        ("type", Value::from("function")),
    ]))
}

/// What an assistant message item or output message says: its string content, or its
/// first part's text.
fn assistant_text(item: &Value) -> Result<Value, TokenizeError> {
    match attr(item, "content") {
        Some(c) if c.kind() == ValueKind::String => Ok(c),
        Some(c) if c.kind() == ValueKind::Seq => {
            let first = c.get_item_by_index(0).ok().filter(|f| !f.is_undefined());
            first
                .and_then(|f| attr(&f, "text"))
                .filter(|t| t.kind() == ValueKind::String)
                .ok_or_else(|| unsupported("an assistant message that starts with no text"))
        }
        _ => Err(unsupported("an assistant message without text")),
    }
}

/// `construct_chat_messages_with_tool_call`: the input items as chat messages.
fn input_messages(input: &[Value]) -> Result<Vec<Out>, TokenizeError> {
    let mut out: Vec<Out> = Vec::with_capacity(input.len());
    for item in input {
        if item.kind() != ValueKind::Map {
            return Err(bad("an input item is an object"));
        }
        let kind = kind_of(item);
        let role = role_of(item);
        match (kind.as_deref(), role.as_deref()) {
            (Some(k @ ("function_call" | "custom_tool_call")), _) => {
                let call = tool_call(item, k)?;
                match out.last_mut().and_then(Out::assistant) {
                    Some(prev) => {
                        let mut calls: Vec<Value> = match get(prev, "tool_calls") {
                            Some(c) if c.kind() == ValueKind::Seq => items(c)?,
                            Some(c) if !c.is_none() => {
                                return Err(unsupported("an assistant's tool_calls not a list"))
                            }
                            _ => Vec::new(),
                        };
                        calls.push(call);
                        set(prev, "tool_calls", Value::from(calls));
                    }
                    None => out.push(Out::Built(vec![
                        ("role".into(), Value::from("assistant")),
                        ("tool_calls".into(), Value::from(vec![call])),
                    ])),
                }
            }
            (Some("reasoning"), _) => {
                if attr(item, "encrypted_content").is_some_and(|e| e.is_true()) {
                    return Err(unsupported("encrypted reasoning"));
                }
                let first_text = |key: &str| {
                    attr(item, key)
                        .filter(|c| c.kind() == ValueKind::Seq)
                        .and_then(|c| c.get_item_by_index(0).ok())
                        .filter(|p| !p.is_undefined())
                        .and_then(|p| attr(&p, "text"))
                };
                let content_len = attr(item, "content").and_then(|c| c.len()).unwrap_or(0);
                let text = if content_len > 0 {
                    first_text("content")
                } else {
                    first_text("summary")
                }
                .filter(|t| t.kind() == ValueKind::String)
                .unwrap_or_else(|| Value::from(""));
                match out.last_mut().and_then(Out::assistant) {
                    Some(prev) if unset(prev, "reasoning") => set(prev, "reasoning", text),
                    _ => out.push(Out::Built(vec![
                        ("role".into(), Value::from("assistant")),
                        ("reasoning".into(), text),
                    ])),
                }
            }
            (Some("function_call_output" | "custom_tool_call_output"), _) => {
                out.push(Out::Built(vec![
                    ("role".into(), Value::from("tool")),
                    (
                        "content".into(),
                        attr(item, "output").unwrap_or_else(|| Value::from(())),
                    ),
                    (
                        "tool_call_id".into(),
                        attr(item, "call_id").unwrap_or_else(|| Value::from(())),
                    ),
                ]));
            }
            (None | Some("message"), Some("assistant")) => {
                let text = assistant_text(item)?;
                match out.last_mut().and_then(Out::assistant) {
                    Some(prev) if unset(prev, "content") => set(prev, "content", text),
                    _ => out.push(Out::Built(vec![
                        ("role".into(), Value::from("assistant")),
                        ("content".into(), text),
                    ])),
                }
            }
            (None | Some("message"), Some(_)) => out.push(Out::Item(item.clone())),
            _ => return Err(unsupported("a Responses input item of this type")),
        }
    }
    Ok(out)
}

/// `should_continue_final_message`: the last item is an assistant message or a
/// reasoning item still being written.
fn continues_final(input: &[Value]) -> bool {
    let Some(last) = input.last() else {
        return false;
    };
    let kind = kind_of(last);
    let open = matches!(
        str_of(last, "status").as_deref(),
        Some("in_progress" | "incomplete")
    );
    open && match kind.as_deref() {
        Some("reasoning") => true,
        None | Some("message") => role_of(last).as_deref() == Some("assistant"),
        _ => false,
    }
}

/// `construct_tool_dicts`: the function tools the model is shown, as chat tools.
fn convert_tools(tools: &Value) -> Result<Option<Value>, TokenizeError> {
    if tools.kind() != ValueKind::Seq {
        return Err(bad("`tools` is a list"));
    }
    let mut out = Vec::new();
    let mut function = |t: &Value, name: Value| {
        let mut f = vec![
            ("name", name),
            (
                "description",
                attr(t, "description").unwrap_or_else(|| Value::from(())),
            ),
            (
                "parameters",
                attr(t, "parameters").unwrap_or_else(|| Value::from(())),
            ),
        ];
        for key in ["strict", "defer_loading"] {
            if let Some(v) = attr(t, key).filter(|v| !v.is_none()) {
                f.push((key, v));
            }
        }
        out.push(map(vec![
            ("type", Value::from("function")),
            ("function", map(f)),
        ]));
    };
    for t in items(tools)? {
        let name = attr(&t, "name").filter(|n| n.kind() == ValueKind::String);
        match kind_of(&t).as_deref() {
            Some("function") => function(
                &t,
                name.ok_or_else(|| bad("a function tool needs a `name`"))?,
            ),
            Some("namespace") => {
                let ns = name.ok_or_else(|| bad("a namespace tool needs a `name`"))?;
                let inner = attr(&t, "tools").ok_or_else(|| bad("a namespace lists `tools`"))?;
                for f in items(&inner)? {
                    if kind_of(&f).as_deref() == Some("function") {
                        let n = str_of(&f, "name").ok_or_else(|| bad("a tool needs a `name`"))?;
                        let flat = format!("{}{NAMESPACE_SEPARATOR}{n}", ns.as_str().unwrap_or(""));
                        function(&f, Value::from(flat));
                    }
                }
            }
            // vLLM shows a custom tool as a function of one string, with its own wording.
            Some("custom") => return Err(unsupported("custom tools")),
            // Hosted tools (web search, file search, MCP, ...) are never rendered.
            _ => {}
        }
    }
    Ok((!out.is_empty()).then(|| Value::from(out)))
}

impl ModelTokenizer {
    /// A Responses body (JSON) as the chat body vLLM renders.
    pub fn responses_to_chat(&self, body: &serde_json::Value) -> Result<Value, TokenizeError> {
        self.responses_to_chat_value(&Value::from_serialize(body))
    }

    /// A Responses body (its template fields) as the chat body vLLM renders.
    pub(super) fn responses_to_chat_value(&self, body: &Value) -> Result<Value, TokenizeError> {
        let mut messages: Vec<Value> = Vec::new();
        if let Some(i) =
            attr(body, "instructions").filter(|i| i.as_str().is_some_and(|s| !s.is_empty()))
        {
            messages.push(map(vec![("role", Value::from("system")), ("content", i)]));
        }
        let input = attr(body, "input").ok_or_else(|| bad("a Responses body needs `input`"))?;
        let mut continued = false;
        match input.kind() {
            ValueKind::String => {
                messages.push(map(vec![("role", Value::from("user")), ("content", input)]))
            }
            ValueKind::Seq => {
                let list = items(&input)?;
                continued = continues_final(&list);
                messages.extend(input_messages(&list)?.into_iter().map(Out::into_value));
            }
            _ => return Err(bad("`input` is a string or a list of items")),
        }
        let mut chat: Vec<(&str, Value)> = vec![("messages", Value::from(messages))];
        if let Some(tools) = attr(body, "tools").filter(|t| !t.is_none()) {
            if let Some(t) = convert_tools(&tools)? {
                chat.push(("tools", t));
            }
        }
        // `build_chat_params`: the caller's kwargs, then the request's own switches
        // (an effort of None or "auto" counts as unset).
        let mut kwargs: Vec<(String, Value)> = match attr(body, "chat_template_kwargs") {
            Some(k) if k.kind() == ValueKind::Map => items(&k)?
                .into_iter()
                .filter_map(|key| Some((key.as_str()?.to_owned(), k.get_item(&key).ok()?)))
                .filter(|(k, _)| k != "add_generation_prompt" && k != "continue_final_message")
                .collect(),
            Some(k) if !k.is_none() => return Err(bad("`chat_template_kwargs` is an object")),
            _ => Vec::new(),
        };
        let effort = attr(body, "reasoning")
            .and_then(|r| str_of(&r, "effort"))
            .filter(|e| e != "auto");
        if let Some(e) = effort {
            if !kwargs.iter().any(|(k, _)| k == "enable_thinking") {
                kwargs.push(("enable_thinking".into(), Value::from(e != "none")));
            }
            kwargs.retain(|(k, _)| k != "reasoning_effort");
            kwargs.push(("reasoning_effort".into(), Value::from(e)));
        }
        if !kwargs.is_empty() {
            let kwargs: Value = kwargs
                .into_iter()
                .map(|(k, v)| (Value::from(k), v))
                .collect();
            chat.push(("chat_template_kwargs", kwargs));
        }
        chat.push(("add_generation_prompt", Value::from(!continued)));
        chat.push(("continue_final_message", Value::from(continued)));
        Ok(map(chat))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Value as J};

    use super::super::testkit::{arb_json, printing_tokenizer};

    const WORDS: &str = "(message|function_call|function_call_output|custom_tool_call|custom_tool_call_output|reasoning|function|namespace|custom|user|assistant|developer|incomplete|in_progress|input_text|output_text|.{0,6})";
    const KEYS: &str = "(type|role|content|text|input|instructions|tools|name|namespace|call_id|arguments|output|summary|encrypted_content|status|parameters|reasoning|effort|chat_template_kwargs)";

    fn tokenizer() -> &'static ModelTokenizer {
        printing_tokenizer()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Any JSON a client sends to /v1/responses: converted or refused, never a panic,
        /// and a conversion is always a chat body with a message list.
        #[test]
        fn hostile_responses_bodies_are_converted_or_refused(body in arb_json(WORDS, KEYS), input in arb_json(WORDS, KEYS)) {
            let t = tokenizer();
            for b in [body.clone(), json!({"input": input, "tools": body})] {
                if let Ok(chat) = t.responses_to_chat(&b) {
                    prop_assert_eq!(chat.get_attr("messages").map(|m| m.kind()).ok(), Some(ValueKind::Seq));
                    let _ = t.tokenize_value(true, &chat, 0);
                }
            }
        }
    }

    /// The merges vLLM makes: a reasoning item, an output message and tool calls after it
    /// are one assistant message; a call's namespace prefixes its name; the last
    /// incomplete assistant message is continued; hosted tools are dropped.
    #[test]
    fn items_merge_into_the_assistant_message_as_vllm_builds_it() {
        let body = json!({
            "instructions": "be brief",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "reasoning", "id": "r", "summary": [{"type": "summary_text", "text": "s"}]},
                {"type": "message", "role": "assistant", "id": "m", "status": "completed",
                 "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
                {"type": "function_call", "call_id": "c", "name": "lookup", "namespace": "crm", "arguments": "{}"},
                {"type": "custom_tool_call", "call_id": "d", "name": "patch", "input": "x"},
                {"type": "function_call_output", "call_id": "c", "output": "done"},
                {"type": "message", "role": "assistant", "id": "n", "status": "incomplete",
                 "content": [{"type": "output_text", "text": "Sure", "annotations": []}]}
            ],
            "tools": [{"type": "function", "name": "f"}, {"type": "web_search"}],
            "reasoning": {"effort": "none"}
        });
        let chat = tokenizer().responses_to_chat(&body).expect("converted");
        let j: J = serde_json::to_value(&chat).expect("json");
        let m = &j["messages"];
        assert_eq!(m[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(m[2]["reasoning"], "s");
        assert_eq!(m[2]["content"], "ok");
        assert_eq!(m[2]["tool_calls"][0]["function"]["name"], "crm__lookup");
        assert_eq!(
            m[2]["tool_calls"][1]["function"]["arguments"],
            json!({"input": "x"})
        );
        assert_eq!(m[3]["role"], "tool");
        assert_eq!(m[4], json!({"role": "assistant", "content": "Sure"}));
        assert_eq!(j["tools"].as_array().map(Vec::len), Some(1));
        assert_eq!(j["continue_final_message"], true);
        assert_eq!(j["add_generation_prompt"], false);
        assert_eq!(
            j["chat_template_kwargs"],
            json!({"enable_thinking": false, "reasoning_effort": "none"})
        );
        for refused in [
            json!({"input": [{"type": "reasoning", "id": "r", "summary": [], "encrypted_content": "x"}]}),
            json!({"input": [{"type": "item_reference", "id": "m"}]}),
            json!({"input": "hi", "tools": [{"type": "custom", "name": "c"}]}),
        ] {
            assert!(matches!(
                tokenizer().responses_to_chat(&refused),
                Err(TokenizeError::Unsupported(_))
            ));
        }
    }
}
