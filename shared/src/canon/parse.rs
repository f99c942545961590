//! Reading a request body into the canonical form's types with serde, borrowing its
//! strings: the definition of what a body means. The completions token-list fast path
//! (`skim.rs`) is tried first and must answer exactly what this would.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::agent::Input;
use super::format::{CanonError, Content, Endpoint, Message, Prompt, Request, MAX_MESSAGES};

#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    prompt: Option<PromptField<'a>>,
    #[serde(borrow, default)]
    messages: Option<Messages<'a>>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt_cache_key: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    metadata: Option<Metadata<'a>>,
    // Messages
    #[serde(borrow, default)]
    system: Option<Content<'a>>,
    // Responses
    #[serde(borrow, default)]
    instructions: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    input: Option<InputField<'a>>,
    #[serde(borrow, default)]
    previous_response_id: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Metadata<'a> {
    #[serde(borrow, default)]
    user_id: Option<Cow<'a, str>>,
}

/// Responses `input`: a string, or at most [`MAX_MESSAGES`] items kept raw (the rest
/// read past and reported, as for chat messages).
struct InputField<'a> {
    input: Input<'a>,
    overflow: bool,
}

impl<'de: 'a, 'a> Deserialize<'de> for InputField<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = InputField<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or a list of input items")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(InputField {
                    input: Input::Text(Cow::Borrowed(v)),
                    overflow: false,
                })
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(InputField {
                    input: Input::Text(Cow::Owned(v.to_owned())),
                    overflow: false,
                })
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(InputField {
                    input: Input::Text(Cow::Owned(v)),
                    overflow: false,
                })
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while items.len() < MAX_MESSAGES {
                    match seq.next_element::<&'de RawValue>()? {
                        Some(m) => items.push(m),
                        None => {
                            return Ok(InputField {
                                input: Input::Items(items),
                                overflow: false,
                            })
                        }
                    }
                }
                let mut overflow = false;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    overflow = true;
                }
                Ok(InputField {
                    input: Input::Items(items),
                    overflow,
                })
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// `messages`, at most [`MAX_MESSAGES`] of them materialized; the rest are read past
/// without allocating, and the overflow is reported.
struct Messages<'a> {
    list: Vec<Message<'a>>,
    overflow: bool,
}

impl<'de: 'a, 'a> Deserialize<'de> for Messages<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for V<'a> {
            type Value = Messages<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of messages")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut list = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while list.len() < MAX_MESSAGES {
                    match seq.next_element::<Message<'a>>()? {
                        Some(m) => list.push(m),
                        None => {
                            return Ok(Messages {
                                list,
                                overflow: false,
                            })
                        }
                    }
                }
                let mut overflow = false;
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    overflow = true;
                }
                Ok(Messages { list, overflow })
            }
        }
        d.deserialize_seq(V(std::marker::PhantomData))
    }
}

/// `prompt` in any of its four shapes, decoded without serde's buffering of untagged
/// enums (which would copy every string and number of a large prompt).
enum PromptField<'a> {
    Text(Cow<'a, str>),
    Tokens(Vec<u32>),
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptField<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor(std::marker::PhantomData))
    }
}

struct PromptVisitor<'a>(std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for PromptVisitor<'a> {
    type Value = PromptField<'a>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string, a list of strings, a list of token ids or a list of lists")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(PromptField::Text(Cow::Borrowed(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(PromptField::Text(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(PromptField::Text(Cow::Owned(v)))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        // The first element decides the shape: a token id starts a token list; a string
        // or a list starts a batch, routed by that first prompt.
        let first = match seq.next_element_seed(FirstSeed(std::marker::PhantomData))? {
            None => return Ok(PromptField::Tokens(Vec::new())),
            Some(f) => f,
        };
        match first {
            FirstItem::Token(t) => {
                let mut toks = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20) + 1);
                toks.push(t);
                while let Some(t) = seq.next_element::<u32>()? {
                    toks.push(t);
                }
                Ok(PromptField::Tokens(toks))
            }
            FirstItem::Prompt(p) => {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(p)
            }
        }
    }
}

enum FirstItem<'a> {
    Token(u32),
    Prompt(PromptField<'a>),
}

struct FirstSeed<'a>(std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> DeserializeSeed<'de> for FirstSeed<'a> {
    type Value = FirstItem<'a>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(FirstVisitor(std::marker::PhantomData))
    }
}

struct FirstVisitor<'a>(std::marker::PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for FirstVisitor<'a> {
    type Value = FirstItem<'a>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a token id, a string, or a list of token ids")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        u32::try_from(v)
            .map(FirstItem::Token)
            .map_err(|_| E::custom(format!("token id {v} does not fit in u32")))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        u32::try_from(v)
            .map(FirstItem::Token)
            .map_err(|_| E::custom(format!("token id {v} is not a u32")))
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(FirstItem::Prompt(PromptField::Text(Cow::Borrowed(v))))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(FirstItem::Prompt(PromptField::Text(Cow::Owned(
            v.to_owned(),
        ))))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(FirstItem::Prompt(PromptField::Text(Cow::Owned(v))))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut toks = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
        while let Some(t) = seq.next_element::<u32>()? {
            toks.push(t);
        }
        Ok(FirstItem::Prompt(PromptField::Tokens(toks)))
    }
}

/// Parse a request body sent to `endpoint`. Never panics; serde_json's recursion limit
/// bounds nesting depth.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Request<'_>, CanonError> {
    if endpoint == Endpoint::Completions {
        if let Some(r) = super::skim::token_completion(body) {
            return Ok(r);
        }
    }
    parse_with_serde(endpoint, body)
}

/// [`parse`] without the token-list fast path: the definition the fast path must match.
pub(crate) fn parse_with_serde(endpoint: Endpoint, body: &[u8]) -> Result<Request<'_>, CanonError> {
    let b: Body<'_> = serde_json::from_slice(body).map_err(|e| CanonError::Json(e.to_string()))?;
    let prompt = match endpoint {
        Endpoint::Completions => match b.prompt.ok_or(CanonError::Missing("prompt"))? {
            PromptField::Text(t) if t.is_empty() => return Err(CanonError::Empty),
            PromptField::Text(t) => Prompt::Text(t),
            PromptField::Tokens(t) if t.is_empty() => return Err(CanonError::Empty),
            PromptField::Tokens(t) => Prompt::Tokens(t),
        },
        Endpoint::ChatCompletions | Endpoint::Messages => {
            let messages = b.messages.ok_or(CanonError::Missing("messages"))?;
            if messages.overflow {
                return Err(CanonError::TooManyMessages);
            }
            let messages = messages.list;
            if messages.is_empty() {
                return Err(CanonError::Empty);
            }
            if endpoint == Endpoint::Messages {
                Prompt::Messages {
                    system: b.system,
                    tools: b.tools,
                    messages,
                }
            } else {
                Prompt::Chat {
                    tools: b.tools,
                    messages,
                }
            }
        }
        Endpoint::Responses => {
            let input = b.input.ok_or(CanonError::Missing("input"))?;
            if input.overflow {
                return Err(CanonError::TooManyMessages);
            }
            let empty = match &input.input {
                Input::Text(t) => t.is_empty(),
                Input::Items(i) => i.is_empty(),
            };
            // A chained turn may send nothing new but still names its conversation.
            if empty && b.previous_response_id.is_none() {
                return Err(CanonError::Empty);
            }
            Prompt::Responses {
                instructions: b.instructions,
                tools: b.tools,
                input: input.input,
            }
        }
    };
    let session = b
        .prompt_cache_key
        .or_else(|| b.metadata.and_then(|m| m.user_id))
        .or(b.user)
        .filter(|s| !s.is_empty());
    Ok(Request {
        model: b.model.unwrap_or(Cow::Borrowed("")),
        cache_salt: b.cache_salt.unwrap_or(Cow::Borrowed("")),
        stream: b.stream.unwrap_or(false),
        session,
        previous_response: b.previous_response_id.filter(|s| !s.is_empty()),
        prompt,
    })
}
