//! Finding the engine's `usage` in a response we do not buffer.
//!
//! Responses (JSON or SSE) pass through chunk by chunk; the filter only keeps the last
//! few KiB, where both shapes put `usage` (the JSON body's last field, or the final SSE
//! `data:` event), and parses the last `"usage"` object found there at end of stream.
//! A chunk boundary inside the object is harmless because the window spans chunks.

use serde::Deserialize;

/// `usage` in any of the three shapes: OpenAI completions and chat (`prompt_tokens`,
/// `prompt_tokens_details.cached_tokens`), OpenAI Responses (`input_tokens`,
/// `input_tokens_details.cached_tokens`) and Anthropic Messages (`input_tokens` *without*
/// the cached ones, `cache_read_input_tokens`, `cache_creation_input_tokens`). The
/// fields present tell them apart, so the report does not depend on the path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: Option<u32>,
    #[serde(default)]
    pub completion_tokens: Option<u32>,
    #[serde(default)]
    pub prompt_tokens_details: Option<Details>,
    #[serde(default)]
    pub input_tokens: Option<u32>,
    #[serde(default)]
    pub output_tokens: Option<u32>,
    #[serde(default)]
    pub input_tokens_details: Option<Details>,
    #[serde(default)]
    pub cache_read_input_tokens: Option<u32>,
    #[serde(default)]
    pub cache_creation_input_tokens: Option<u32>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Details {
    #[serde(default)]
    pub cached_tokens: Option<u32>,
}

impl Usage {
    /// The whole prompt's tokens, cached or not.
    pub fn prompt(&self) -> Option<u32> {
        self.prompt_tokens.or_else(|| {
            let input = self.input_tokens?;
            Some(
                input
                    .saturating_add(self.cache_read_input_tokens.unwrap_or(0))
                    .saturating_add(self.cache_creation_input_tokens.unwrap_or(0)),
            )
        })
    }

    /// The prompt's tokens the engine found cached.
    pub fn cached_tokens(&self) -> Option<u32> {
        self.prompt_tokens_details
            .or(self.input_tokens_details)
            .and_then(|d| d.cached_tokens)
            .or(self.cache_read_input_tokens)
    }

    pub fn completion(&self) -> Option<u32> {
        self.completion_tokens.or(self.output_tokens)
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

/// The first bytes of a response body, kept only for Responses requests: the response's
/// `id` (which a later turn names as `previous_response_id`) is the first `"id"` of the
/// JSON body and of the first SSE event (`response.created`).
#[derive(Debug, Default)]
pub struct Head {
    buf: Vec<u8>,
}

impl Head {
    pub const CAP: usize = 2048;

    pub fn push(&mut self, chunk: &[u8]) {
        let room = Self::CAP - self.buf.len();
        self.buf
            .extend_from_slice(chunk.get(..room.min(chunk.len())).unwrap_or_default());
    }

    /// The response id: the first `"id"` key's string value, if it is a plausible id
    /// (at most 256 bytes, printable ASCII).
    pub fn response_id(&self) -> Option<String> {
        const KEY: &[u8] = b"\"id\"";
        let at = self.buf.windows(KEY.len()).position(|w| w == KEY)?;
        let mut rest = self.buf.get(at + KEY.len()..)?;
        while rest.first()?.is_ascii_whitespace() {
            rest = rest.get(1..)?;
        }
        rest = rest.strip_prefix(b":")?;
        while rest.first()?.is_ascii_whitespace() {
            rest = rest.get(1..)?;
        }
        let body = rest.strip_prefix(b"\"")?;
        let end = body.iter().position(|&b| b == b'"')?;
        let id = body.get(..end)?;
        if id.is_empty()
            || id.len() > 256
            || !id.iter().all(|b| b.is_ascii_graphic() && *b != b'\\')
        {
            return None;
        }
        Some(String::from_utf8_lossy(id).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_api_s_usage_is_read() {
        let read = |s: &str| {
            let mut t = Tail::new(4096);
            t.push(s.as_bytes());
            let u = t.usage().expect("usage");
            (u.prompt(), u.cached_tokens(), u.completion())
        };
        // Anthropic Messages, streamed: message_start, then the full count in message_delta.
        let sse = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":0,\"output_tokens\":0}}}\n\n\
                   event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":40,\"cache_read_input_tokens\":960,\"output_tokens\":12}}\n\n";
        assert_eq!(read(sse), (Some(1000), Some(960), Some(12)));
        // OpenAI Responses (input_tokens is the whole prompt there).
        let json = r#"{"id":"resp_1","usage":{"input_tokens":1000,"input_tokens_details":{"cached_tokens":960},"output_tokens":5}}"#;
        assert_eq!(read(json), (Some(1000), Some(960), Some(5)));
        // Messages without cache details: input_tokens is the whole prompt.
        assert_eq!(
            read(r#"{"usage":{"input_tokens":7,"output_tokens":1}}"#),
            (Some(7), None, Some(1))
        );
    }

    /// Hostile response bytes, in random chunks: the scanners answer or not, never panic,
    /// and an id they return is always a plausible one.
    #[test]
    fn random_response_bytes_never_break_the_scanners() {
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let atoms: [&[u8]; 12] = [
            b"\"id\"",
            b"\"usage\"",
            b":",
            b"{",
            b"}",
            b"\"",
            b"\\",
            b" ",
            b"resp_1",
            b"\"input_tokens\":",
            b"7",
            b"\xff\xfe",
        ];
        for _ in 0..20_000 {
            let (mut head, mut tail) = (Head::default(), Tail::new(256 + (next() % 512) as usize));
            for _ in 0..(next() % 40) {
                let mut chunk = Vec::new();
                for _ in 0..(next() % 8) {
                    chunk.extend_from_slice(atoms[(next() % atoms.len() as u64) as usize]);
                }
                head.push(&chunk);
                tail.push(&chunk);
            }
            if let Some(id) = head.response_id() {
                assert!(
                    !id.is_empty() && id.len() <= 256 && id.bytes().all(|b| b.is_ascii_graphic())
                );
            }
            let _ = tail
                .usage()
                .map(|u| (u.prompt(), u.cached_tokens(), u.completion()));
        }
    }

    #[test]
    fn the_response_id_is_the_first_id() {
        let id = |chunks: &[&str]| {
            let mut h = Head::default();
            for c in chunks {
                h.push(c.as_bytes());
            }
            h.response_id()
        };
        assert_eq!(
            id(&[
                "{\"id\": \"resp_",
                "abc\",\"object\":\"response\",\"output\":[{\"id\":\"msg_1\"}]}"
            ]),
            Some("resp_abc".into())
        );
        let sse = "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_9\",\"status\":\"in_progress\"}}\n\n";
        assert_eq!(id(&[sse]), Some("resp_9".into()));
        assert_eq!(id(&["{\"id\":\"a\\\"b\"}"]), None, "escapes are not ids");
        assert_eq!(id(&[&format!("{{\"id\":\"{}\"}}", "x".repeat(300))]), None);
        assert_eq!(id(&[&" ".repeat(Head::CAP), "{\"id\":\"late\"}"]), None);
        assert_eq!(id(&["{\"id\":5}"]), None);
    }

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
