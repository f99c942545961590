//! Long completions prompts encoded in chunks the segment cache keeps, so a prompt that
//! extends one seen before (an agent's next turn sent as text, a shared document with a
//! new question) costs about its new text, not its whole length.
//!
//! A chunk ends just after a newline that a non-whitespace character follows, at least
//! [`MIN_CHUNK_BYTES`] after the previous cut. For the regex pre-tokenizers of byte-level
//! BPE tokenizers (GPT-2's, Llama 3's, DeepSeek's, o200k's patterns) no pre-token spans
//! such a place: newlines are taken by a whitespace or punctuation run that stops at the
//! next non-whitespace character, and a word never starts with a newline. So the chunks
//! encode independently, each after the first behind the special token that the chat
//! path's pieces use, and their ids join into the whole text's. The cut is decided by
//! the text before it and the one character after, so a prompt and its extension cut
//! their common part alike.
//!
//! That holds for those pre-tokenizers, not for every tokenizer: a tokenizer is chunked
//! only when its pre-tokenizer is made of `ByteLevel` (adding no prefix space), `Split`
//! and `Digits` steps, and
//! when a sample of prose, code, CJK, numbers and blank lines encodes the same both ways
//! at load. While it runs, every [`VERIFY_EVERY`]-th chunked prompt is also encoded
//! whole; one difference turns chunking off for that tokenizer for good (counted and
//! logged), and that request keeps the whole encoding.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde::Serialize;

/// The shortest chunk (the last of a text may be shorter). A prompt's new text costs
/// its own encode plus at most about this much of the old.
pub const MIN_CHUNK_BYTES: usize = 1024;

/// Prompts shorter than this are encoded whole: two chunks at least.
pub const MIN_CHUNKED_BYTES: usize = 2 * MIN_CHUNK_BYTES;

/// One chunked prompt in this many is also encoded whole and compared.
pub const VERIFY_EVERY: u64 = 32;

/// What the tokenizer's post-processor adds around a prompt encoded with special tokens.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Affix {
    pub prefix: Vec<u32>,
    pub suffix: Vec<u32>,
}

impl Affix {
    /// From the same probe encoded with and without special tokens: what surrounds the
    /// plain ids (None when they are not found whole inside, e.g. a post-processor that
    /// rewrites them).
    pub fn between(with: &[u32], without: &[u32]) -> Option<Affix> {
        if without.is_empty() || without.len() > with.len() {
            return None;
        }
        let at = with.windows(without.len()).position(|w| w == without)?;
        Some(Affix {
            prefix: with[..at].to_vec(),
            suffix: with[at + without.len()..].to_vec(),
        })
    }
}

/// Whether a tokenizer.json `pre_tokenizer` is one the cut is safe for.
pub fn pre_tokenizer_ok(p: &serde_json::Value) -> bool {
    match p["type"].as_str() {
        // A prefix space is added to every piece the tokenizer encodes apart, which a
        // chunk is and the same text inside the whole is not.
        Some("ByteLevel") => p["add_prefix_space"] == false,
        // Each match its own piece; the other behaviours join a delimiter to a neighbour.
        Some("Split") => p["behavior"] == "Isolated" && p["invert"] != true,
        Some("Digits") => true,
        Some("Sequence") => p["pretokenizers"]
            .as_array()
            .is_some_and(|s| !s.is_empty() && s.iter().all(pre_tokenizer_ok)),
        _ => false,
    }
}

/// Byte ranges of `text`'s chunks, in order, covering it.
pub fn cuts(text: &str, min: usize) -> Vec<(usize, usize)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    for nl in memchr::memchr_iter(b'\n', bytes) {
        let cut = nl + 1;
        if cut - start < min {
            continue;
        }
        // The character after the newline: whitespace (some of it multi-byte) leaves
        // the cut for a later newline.
        let next_is_word = match bytes.get(cut) {
            Some(b) if b.is_ascii() => !b.is_ascii_whitespace(),
            Some(_) => text[cut..]
                .chars()
                .next()
                .is_some_and(|c| !c.is_whitespace()),
            None => false,
        };
        if next_is_word {
            out.push((start, cut));
            start = cut;
        }
    }
    if start < text.len() {
        out.push((start, text.len()));
    }
    out
}

/// A sample that crosses every kind of cut the rule allows, for the load-time check.
pub fn sample() -> String {
    let mut s = String::new();
    let parts = [
        "The router keeps a map of which pod holds which prefix.\nIt weighs that against load.\n",
        "fn main() {\n    let x = vec![1, 2, 3];\n\tprintln!(\"{x:?}\");\n}\n\n",
        "数据在这里。缓存命中率很高。\n次の行です。\r\n",
        "12345 67890 3.14159\n- item one\n* item two\n# Heading\n",
        "   leading spaces\n\n\nafter blank lines\n\"quoted\" (paren) [bracket]\n",
        "x-anthropic-billing-header: cc_version=2;\nüber naïve café\n<tag>\n",
    ];
    while s.len() < 6 * MIN_CHUNK_BYTES {
        for p in parts {
            s.push_str(p);
        }
    }
    s
}

/// The chunking state of one tokenizer.
#[derive(Debug)]
pub struct Chunking {
    pub affix: Affix,
    on: AtomicBool,
    chunked: AtomicU64,
    verified: AtomicU64,
    mismatches: AtomicU64,
}

/// For `/v1/status`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ChunkStats {
    pub on: bool,
    pub chunked: u64,
    pub verified: u64,
    pub mismatches: u64,
}

impl Chunking {
    pub fn new(affix: Affix) -> Chunking {
        Chunking {
            affix,
            on: AtomicBool::new(true),
            chunked: AtomicU64::new(0),
            verified: AtomicU64::new(0),
            mismatches: AtomicU64::new(0),
        }
    }

    pub fn on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Counts a chunked prompt; true when this one is to be checked against the whole.
    pub fn count(&self) -> bool {
        self.chunked
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(VERIFY_EVERY)
    }

    /// Records a check; a difference turns chunking off.
    pub fn checked(&self, same: bool) {
        self.verified.fetch_add(1, Ordering::Relaxed);
        if !same {
            self.mismatches.fetch_add(1, Ordering::Relaxed);
            self.on.store(false, Ordering::Relaxed);
        }
    }

    pub fn stats(&self) -> ChunkStats {
        ChunkStats {
            on: self.on(),
            chunked: self.chunked.load(Ordering::Relaxed),
            verified: self.verified.load(Ordering::Relaxed),
            mismatches: self.mismatches.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_fall_after_a_newline_before_a_non_space() {
        let t = "aaaa\nbbbb\n  cc\n\ndd\nee";
        let pieces: Vec<&str> = cuts(t, 3).iter().map(|&(a, b)| &t[a..b]).collect();
        // Not inside "\n  " nor between the newlines of "\n\n": after a whole run.
        assert_eq!(pieces, ["aaaa\n", "bbbb\n  cc\n\n", "dd\n", "ee"]);
        assert_eq!(pieces.concat(), t);
        // Short pieces wait for the minimum; a text without a place to cut is one chunk.
        assert_eq!(cuts(t, 100), vec![(0, t.len())]);
        assert_eq!(cuts("", 3), vec![]);
        assert_eq!(cuts("abc\n", 1), vec![(0, 4)]);
        // A multi-byte character after the newline: cut before a letter, not before an
        // ideographic space.
        let t = "ab\n数\u{3000}x\n\u{3000}y";
        let pieces: Vec<&str> = cuts(t, 1).iter().map(|&(a, b)| &t[a..b]).collect();
        assert_eq!(pieces, ["ab\n", "数\u{3000}x\n\u{3000}y"]);
    }

    #[test]
    fn a_prompt_and_its_extension_cut_their_common_part_alike() {
        let base = sample();
        let longer = format!("{base}and one more line\nwith a second\n");
        let a = cuts(&base, MIN_CHUNK_BYTES);
        let b = cuts(&longer, MIN_CHUNK_BYTES);
        assert!(a.len() >= 4);
        // Every chunk of the shorter text but its last is a chunk of the longer.
        assert_eq!(a[..a.len() - 1], b[..a.len() - 1]);
    }

    #[test]
    fn the_affix_is_what_surrounds_the_plain_ids() {
        assert_eq!(
            Affix::between(&[1, 7, 8, 2], &[7, 8]),
            Some(Affix {
                prefix: vec![1],
                suffix: vec![2]
            })
        );
        assert_eq!(Affix::between(&[7, 8], &[7, 8]), Some(Affix::default()));
        assert_eq!(Affix::between(&[1, 7, 9], &[7, 8]), None);
        assert_eq!(Affix::between(&[1], &[]), None);
    }

    #[test]
    fn only_regex_byte_level_pre_tokenizers_are_chunked() {
        let split = serde_json::json!({"type": "Split", "behavior": "Isolated", "invert": false});
        let ok = serde_json::json!({"type": "Sequence", "pretokenizers": [
            split, {"type": "Digits"}, {"type": "ByteLevel", "add_prefix_space": false}]});
        assert!(pre_tokenizer_ok(&ok));
        assert!(pre_tokenizer_ok(
            &serde_json::json!({"type": "ByteLevel", "add_prefix_space": false})
        ));
        for bad in [
            serde_json::json!({"type": "ByteLevel", "add_prefix_space": true}),
            serde_json::json!({"type": "ByteLevel"}),
            serde_json::json!({"type": "Metaspace"}),
            serde_json::json!(null),
            serde_json::json!({"type": "Sequence", "pretokenizers": []}),
            serde_json::json!({"type": "Sequence", "pretokenizers": [
                split, {"type": "Whitespace"}]}),
            serde_json::json!({"type": "Split", "behavior": "MergedWithNext"}),
        ] {
            assert!(!pre_tokenizer_ok(&bad), "{bad}");
        }
    }
}
