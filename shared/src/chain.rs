//! The cumulative block-hash chain: the cache key every kvroute component shares.
//!
//! `h[i]` names the whole prefix up to and including block `i`, not the block alone:
//! the same tokens after a different prefix have different KV, so they must hash
//! differently. The namespace seed folds in everything else that makes KV
//! incompatible (mode, block size, model, adapter, cache salt), so chains of
//! different namespaces never meet in the index.
//!
//! ```text
//! lp(x)   = u32le(len(x)) ++ x
//! ns_seed = xxh3_64(b"kvroute.v1" ++ u8(mode) ++ u32le(block_size) ++ lp(model) ++ lp(adapter) ++ lp(salt))
//! h[0]    = xxh3_64_with_seed(block 0, ns_seed)
//! h[i]    = xxh3_64_with_seed(block i, h[i-1])
//! ```
//!
//! Only full blocks are hashed. xxh3 is used (never ahash) because its output is
//! specified and identical on every platform, including wasm32.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// What the chained bytes are. The discriminant is part of the namespace seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Token ids, each hashed as 4 little-endian bytes; a block is `block_size` tokens.
    Tokens = 1,
    /// UTF-8 bytes of the canonical text form; a block is `block_size` bytes.
    Text = 2,
}

impl Mode {
    /// Bytes that one unit (token or byte) contributes to a block.
    pub const fn unit_bytes(self) -> usize {
        match self {
            Mode::Tokens => 4,
            Mode::Text => 1,
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Mode::Tokens => "tokens",
            Mode::Text => "text",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tokens" | "token" => Ok(Mode::Tokens),
            "text" => Ok(Mode::Text),
            other => Err(format!(
                "unknown mode {other:?} (expected \"tokens\" or \"text\")"
            )),
        }
    }
}

/// Everything besides the prompt itself that decides whether two KV blocks are
/// interchangeable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Namespace<'a> {
    pub mode: Mode,
    pub block_size: u32,
    pub model: &'a str,
    pub adapter: &'a str,
    pub cache_salt: &'a str,
}

impl Namespace<'_> {
    /// The seed of `h[0]`.
    pub fn seed(&self) -> u64 {
        let mut buf = Vec::with_capacity(
            10 + 1 + 4 + 12 + self.model.len() + self.adapter.len() + self.cache_salt.len(),
        );
        buf.extend_from_slice(b"kvroute.v1");
        buf.push(self.mode as u8);
        buf.extend_from_slice(&self.block_size.to_le_bytes());
        for part in [self.model, self.adapter, self.cache_salt] {
            // A field longer than u32::MAX cannot come through any body limit we accept;
            // saturating keeps the function total without a panic path.
            let len = u32::try_from(part.len()).unwrap_or(u32::MAX);
            buf.extend_from_slice(&len.to_le_bytes());
            buf.extend_from_slice(part.as_bytes());
        }
        xxh3_64(&buf)
    }

    /// Bytes in one full block.
    pub fn block_bytes(&self) -> usize {
        self.block_size as usize * self.mode.unit_bytes()
    }

    /// The whole chain of a token prompt (mode must be [`Mode::Tokens`]).
    pub fn chain_tokens(&self, tokens: &[u32]) -> Vec<u64> {
        let mut h = ChainHasher::new(self);
        h.push_tokens(tokens);
        h.finish()
    }

    /// The whole chain of a byte string (mode must be [`Mode::Text`]).
    pub fn chain_bytes(&self, bytes: &[u8]) -> Vec<u64> {
        let mut h = ChainHasher::new(self);
        h.update(bytes);
        h.finish()
    }
}

/// Incremental chain builder: takes the prompt in pieces of any size and keeps at most
/// one partial block, so a 1 MB prompt is never copied whole.
#[derive(Clone, Debug)]
pub struct ChainHasher {
    block_bytes: usize,
    prev: u64,
    /// The current partial block; never holds a full one between calls.
    pending: Vec<u8>,
    chain: Vec<u64>,
}

impl ChainHasher {
    pub fn new(ns: &Namespace<'_>) -> Self {
        // A zero block size is rejected by every config validator; treat it as one unit so
        // that this function stays total.
        let block_bytes = ns.block_bytes().max(ns.mode.unit_bytes());
        ChainHasher {
            block_bytes,
            prev: ns.seed(),
            pending: Vec::with_capacity(block_bytes),
            chain: Vec::new(),
        }
    }

    /// Continue a chain whose last full block hashed to `prev` (engine events name a
    /// parent block and carry only the new blocks' tokens).
    pub fn resume(ns: &Namespace<'_>, prev: u64) -> Self {
        let mut h = ChainHasher::new(ns);
        h.prev = prev;
        h
    }

    /// Reserve room for a prompt of about `units` tokens or bytes (a hint only).
    pub fn reserve_units(&mut self, bytes: usize) {
        self.chain.reserve(bytes / self.block_bytes);
    }

    /// Feed raw bytes (text mode, or token bytes already in u32le form).
    pub fn update(&mut self, mut bytes: &[u8]) {
        if !self.pending.is_empty() {
            let need = self.block_bytes - self.pending.len();
            let take = need.min(bytes.len());
            let (head, rest) = bytes.split_at(take);
            self.pending.extend_from_slice(head);
            bytes = rest;
            if self.pending.len() < self.block_bytes {
                return;
            }
            self.prev = xxh3_64_with_seed(&self.pending, self.prev);
            self.chain.push(self.prev);
            self.pending.clear();
        }
        let mut blocks = bytes.chunks_exact(self.block_bytes);
        for block in &mut blocks {
            self.prev = xxh3_64_with_seed(block, self.prev);
            self.chain.push(self.prev);
        }
        self.pending.extend_from_slice(blocks.remainder());
    }

    /// Feed token ids (token mode).
    pub fn push_tokens(&mut self, tokens: &[u32]) {
        self.chain
            .reserve((self.pending.len() + tokens.len() * 4) / self.block_bytes);
        // u32le is the ids' own memory layout on little-endian targets (wasm, x86, arm):
        // hash it in place. A per-token copy cost ~0.2 ms per 128k tokens in v8.
        #[cfg(target_endian = "little")]
        self.update(bytemuck::cast_slice(tokens));
        #[cfg(not(target_endian = "little"))]
        {
            let mut buf = [0u8; 1024];
            for chunk in tokens.chunks(buf.len() / 4) {
                let mut n = 0;
                for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
                    dst.copy_from_slice(&t.to_le_bytes());
                    n += 4;
                }
                self.update(buf.get(..n).unwrap_or_default());
            }
        }
    }

    /// Feed a single token id.
    pub fn push_token(&mut self, token: u32) {
        self.update(&token.to_le_bytes());
    }

    /// The full blocks hashed so far.
    pub fn chain(&self) -> &[u64] {
        &self.chain
    }

    /// Bytes of the trailing partial block (not part of the chain).
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    pub fn finish(self) -> Vec<u64> {
        self.chain
    }
}

/// How many leading blocks two chains share. Because every hash names its whole prefix,
/// chains agree on a prefix and nowhere after their first difference.
pub fn common_prefix_blocks(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns<'a>(
        mode: Mode,
        bs: u32,
        model: &'a str,
        adapter: &'a str,
        salt: &'a str,
    ) -> Namespace<'a> {
        Namespace {
            mode,
            block_size: bs,
            model,
            adapter,
            cache_salt: salt,
        }
    }

    #[test]
    fn reference_vectors() {
        let toks: Vec<u32> = (0..10).collect();
        let cases: [(&str, &str, &str, [u64; 2]); 4] = [
            ("m", "", "", [12505186680924831797, 7943115681171077851]),
            ("m", "a", "", [14521725862862998063, 12194196787045017334]),
            ("m", "", "s", [354002652557409732, 10636323012749482335]),
            ("m2", "", "", [16843217685244874434, 3919959493303384019]),
        ];
        for (model, adapter, salt, want) in cases {
            assert_eq!(
                ns(Mode::Tokens, 4, model, adapter, salt).chain_tokens(&toks),
                want
            );
        }
        let text = ns(Mode::Text, 16, "m", "", "")
            .chain_bytes(b"The quick brown fox jumps over the lazy dog");
        assert_eq!(text, [5154235071411025064, 2942950958069661582]);
    }

    #[test]
    fn pieces_equal_whole() {
        let n = ns(Mode::Text, 7, "m", "", "");
        let data: Vec<u8> = (0..200u8).collect();
        let whole = n.chain_bytes(&data);
        for split in [1usize, 3, 7, 8, 13] {
            let mut h = ChainHasher::new(&n);
            for piece in data.chunks(split) {
                h.update(piece);
            }
            assert_eq!(h.pending_bytes(), 200 % 7);
            assert_eq!(h.finish(), whole, "split {split}");
        }
    }

    #[test]
    fn tokens_one_by_one() {
        let n = ns(Mode::Tokens, 4, "m", "", "");
        let toks: Vec<u32> = (0..3000).collect();
        let mut h = ChainHasher::new(&n);
        for &t in &toks {
            h.push_token(t);
        }
        assert_eq!(h.finish(), n.chain_tokens(&toks));
    }

    #[test]
    fn common_prefix() {
        assert_eq!(common_prefix_blocks(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(common_prefix_blocks(&[], &[1]), 0);
        assert_eq!(common_prefix_blocks(&[1, 2], &[1, 2]), 2);
    }

    #[test]
    fn zero_block_size_is_total() {
        let n = ns(Mode::Tokens, 0, "m", "", "");
        assert_eq!(n.chain_tokens(&[1, 2]).len(), 2);
    }
}
