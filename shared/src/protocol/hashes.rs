//! Hashes on the wire: u64 as JSON numbers (canonical) or decimal strings (JavaScript
//! and jq round integers above 2^53, and a rounded hash is a silent miss). Negative
//! numbers, floats and other strings are refused.

use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

/// A u64 from a JSON number or a decimal string.
struct U64Visitor;

impl<'de> Visitor<'de> for U64Visitor {
    type Value = u64;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a u64 hash, as a JSON number or a decimal string")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        u64::try_from(v).map_err(|_| E::custom(format!("hash {v} is negative")))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<u64, E> {
        Err(E::custom(format!(
            "hash {v} is not an integer (send u64 hashes as integers or strings)"
        )))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
        v.parse()
            .map_err(|_| E::custom(format!("hash string {v:?} is not a decimal u64")))
    }
}

struct LenientU64(u64);
impl<'de> Deserialize<'de> for LenientU64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(U64Visitor).map(LenientU64)
    }
}

pub(super) fn u64_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Vec<u64>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a list of u64 hashes")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u64>, A::Error> {
            // size_hint comes from the peer: cap the up-front allocation.
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
            while let Some(LenientU64(h)) = seq.next_element()? {
                out.push(h);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(V)
}

pub(super) fn opt_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<LenientU64>::deserialize(d).map(|o| o.map(|x| x.0))
}
