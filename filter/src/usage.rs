//! Finding the engine's `usage` in a response we do not buffer.
//!
//! Responses (JSON or SSE) pass through chunk by chunk; the filter only keeps the last
//! few KiB, where both shapes put `usage` (the JSON body's last field, or the final SSE
//! `data:` event), and parses the last `"usage"` object found there at end of stream.
//! A chunk boundary inside the object is harmless because the window spans chunks.

use serde::Deserialize;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: Option<u32>,
    #[serde(default)]
    pub completion_tokens: Option<u32>,
    #[serde(default)]
    pub prompt_tokens_details: Option<Details>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Details {
    #[serde(default)]
    pub cached_tokens: Option<u32>,
}

impl Usage {
    pub fn cached_tokens(&self) -> Option<u32> {
        self.prompt_tokens_details.and_then(|d| d.cached_tokens)
    }
}

/// A bounded tail of the response body.
#[derive(Debug)]
pub struct Tail {
    buf: Vec<u8>,
    cap: usize,
}

impl Tail {
    pub fn new(cap: usize) -> Tail {
        Tail {
            buf: Vec::new(),
            cap,
        }
    }

    pub fn push(&mut self, chunk: &[u8]) {
        if chunk.len() >= self.cap {
            self.buf.clear();
            self.buf
                .extend_from_slice(chunk.get(chunk.len() - self.cap..).unwrap_or_default());
            return;
        }
        let total = self.buf.len() + chunk.len();
        if total > self.cap {
            self.buf.drain(..total - self.cap);
        }
        self.buf.extend_from_slice(chunk);
    }

    /// The last parseable `"usage":{...}` in the window.
    pub fn usage(&self) -> Option<Usage> {
        const KEY: &[u8] = b"\"usage\"";
        let mut end = self.buf.len();
        while let Some(at) = rfind(self.buf.get(..end)?, KEY) {
            if let Some(u) = self.buf.get(at + KEY.len()..).and_then(parse_after_key) {
                return Some(u);
            }
            end = at;
        }
        None
    }
}

fn rfind(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).rposition(|w| w == needle)
}

/// After `"usage"`: optional spaces, `:`, then an object (balanced braces, strings honoured).
fn parse_after_key(rest: &[u8]) -> Option<Usage> {
    let mut i = 0;
    while rest.get(i)?.is_ascii_whitespace() {
        i += 1;
    }
    if *rest.get(i)? != b':' {
        return None;
    }
    i += 1;
    while rest.get(i)?.is_ascii_whitespace() {
        i += 1;
    }
    let start = i;
    if *rest.get(i)? != b'{' {
        return None; // `"usage": null` in streaming chunks before the last one
    }
    let (mut depth, mut in_str, mut esc) = (0usize, false, false);
    while let Some(&b) = rest.get(i) {
        if in_str {
            match (esc, b) {
                (true, _) => esc = false,
                (false, b'\\') => esc = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
        } else {
            match b {
                b'"' => in_str = true,
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        return serde_json::from_slice(rest.get(start..=i)?).ok();
                    }
                }
                _ => {}
            }
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const JSON: &str = r#"{"id":"x","choices":[{"text":"usage \"usage\":{"}],"usage":{"prompt_tokens":40,"completion_tokens":7,"total_tokens":47,"prompt_tokens_details":{"cached_tokens":32}}}"#;

    #[test]
    fn json_body_in_any_chunking() {
        for split in [1usize, 3, 17, 1000] {
            let mut t = Tail::new(4096);
            for c in JSON.as_bytes().chunks(split) {
                t.push(c);
            }
            let u = t.usage().expect("usage found");
            assert_eq!(
                (u.prompt_tokens, u.completion_tokens, u.cached_tokens()),
                (Some(40), Some(7), Some(32))
            );
        }
    }

    #[test]
    fn sse_last_event_wins() {
        let sse = "data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\n\
                   data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n\
                   data: [DONE]\n\n";
        let mut t = Tail::new(300);
        for c in sse.as_bytes().chunks(7) {
            t.push(c);
        }
        let u = t.usage().expect("usage");
        assert_eq!((u.prompt_tokens, u.cached_tokens()), (Some(5), Some(0)));
    }

    #[test]
    fn window_is_bounded_and_absent_usage_is_none() {
        let mut t = Tail::new(256);
        for _ in 0..1000 {
            t.push(&[b'x'; 100]);
        }
        assert!(t.buf.len() <= 256);
        assert_eq!(t.usage(), None);
        t.push(b"\"usage\": {\"prompt_tokens\": 3");
        assert_eq!(t.usage(), None, "truncated object is not usage");
    }
}
