//! Why a prompt could not be tokenized: typed, with a stable label for the
//! `kvroute_precise_prompts_total` metric.

/// Why a prompt could not be tokenized; `reason()` is the stable label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizeError {
    /// The model directory could not be loaded.
    Load(String),
    /// The model has no chat template.
    NoTemplate,
    /// The template failed (including its own `raise_exception`).
    Template(String),
    /// A message part the template cannot take as text (image, audio, ...).
    Multimodal,
    /// The request body is not a chat/completions body.
    BadRequest(String),
    Encode(String),
    /// A request shape whose engine-side conversion is not mirrored exactly (a Messages
    /// block vLLM handles by the clock or by state, the Responses API): routed by its
    /// text chain rather than by tokens that might be wrong.
    Unsupported(&'static str),
}

impl TokenizeError {
    pub fn reason(&self) -> &'static str {
        match self {
            TokenizeError::Load(_) => "tokenizer_load",
            TokenizeError::NoTemplate => "no_chat_template",
            TokenizeError::Template(_) => "template_error",
            TokenizeError::Multimodal => "multimodal",
            TokenizeError::BadRequest(_) => "bad_request",
            TokenizeError::Encode(_) => "encode_error",
            TokenizeError::Unsupported(_) => "unsupported",
        }
    }
}

impl std::fmt::Display for TokenizeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenizeError::Load(e) => write!(f, "cannot load the tokenizer: {e}"),
            TokenizeError::NoTemplate => f.write_str("the model directory has no chat template"),
            TokenizeError::Template(e) => write!(f, "chat template: {e}"),
            TokenizeError::Multimodal => {
                f.write_str("the messages have non-text parts; routed by prediction")
            }
            TokenizeError::BadRequest(e) => write!(f, "{e}"),
            TokenizeError::Encode(e) => write!(f, "encoding: {e}"),
            TokenizeError::Unsupported(what) => {
                write!(f, "{what} is not mirrored exactly; routed by prediction")
            }
        }
    }
}

impl std::error::Error for TokenizeError {}
