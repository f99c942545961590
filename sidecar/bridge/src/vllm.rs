//! vLLM's (and SGLang's) KV event wire format, decoded into plain structs.
//!
//! Engines publish `KVEventBatch{ts, events, data_parallel_rank}` as msgpack over ZMQ.
//! msgspec encodes the same structs two ways depending on the engine version: as
//! positional arrays (`array_like`, events tagged by a leading name) or as maps (events
//! tagged by a `"type"` key); block hashes are integers (older, Python `hash()`) or bytes
//! (SHA-256). The dynamic [`rmpv::Value`] reads all of it, and each field is looked up by
//! position *or* name, so one decoder serves every version. Nothing here trusts the
//! payload: a wrong shape is an error naming the field, never a panic.

use kvroute_shared::protocol::Tier;
use rmpv::Value;
use xxhash_rust::xxh3::xxh3_64;

/// One decoded batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineBatch {
    pub ts: Option<f64>,
    pub events: Vec<EngineEvent>,
    pub dp_rank: Option<i64>,
}

/// A block's `extra_keys` besides the LoRA name.
#[derive(Clone, Debug, PartialEq)]
pub enum Extra {
    None,
    /// Only strings: on a request's first block, one string is its `cache_salt`.
    Strings(Vec<String>),
    /// Anything else (multimodal feature keys, prompt-embedding hashes).
    Opaque,
}

/// One engine event. Hashes are the engine's own, folded to u64 (see [`hash_key`]).
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        block_size: u32,
        lora: Option<String>,
        tier: Tier,
        /// Per block: what its engine hash covers besides the tokens and the LoRA name
        /// (multimodal inputs, the request's cache salt on its first block, prompt
        /// embeddings).
        extra: Vec<Extra>,
        /// KV cache group (hybrid models have several); `None` means the only one.
        group: Option<i64>,
    },
    Removed {
        hashes: Vec<u64>,
        tier: Tier,
        group: Option<i64>,
    },
    Cleared,
    /// A tag this decoder does not know (newer engines); skipped, counted by the caller.
    Unknown(String),
}

/// Decode one ZMQ payload.
pub fn decode(payload: &[u8]) -> Result<EngineBatch, String> {
    let mut rd = payload;
    let v = rmpv::decode::read_value(&mut rd).map_err(|e| format!("not msgpack: {e}"))?;
    if !rd.is_empty() {
        return Err(format!("{} trailing bytes after the batch", rd.len()));
    }
    let b = Fields::of(&v, &["ts", "events", "data_parallel_rank"], 0)
        .ok_or("batch is neither an array nor a map")?;
    let ts = b.get(0).and_then(Value::as_f64);
    let events = b
        .get(1)
        .and_then(Value::as_array)
        .ok_or("batch has no `events` list")?;
    let dp_rank = b.get(2).and_then(Value::as_i64);
    let events = events
        .iter()
        .enumerate()
        .map(|(i, e)| event(e).map_err(|m| format!("event {i}: {m}")))
        .collect::<Result<_, _>>()?;
    Ok(EngineBatch {
        ts,
        events,
        dp_rank,
    })
}

const STORED: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
];
const REMOVED: &[&str] = &["block_hashes", "medium", "group_idx"];

fn event(v: &Value) -> Result<EngineEvent, String> {
    let tag = match v {
        Value::Array(a) => a.first().and_then(Value::as_str),
        Value::Map(m) => map_get(m, "type").and_then(Value::as_str),
        _ => None,
    }
    .ok_or("no event tag")?;
    match tag {
        "BlockStored" => {
            let f = Fields::of(v, STORED, 1).ok_or("bad BlockStored")?;
            let hashes = hash_list(f.get(0).or_else(|| f.named("hashes")), "block_hashes")?;
            let parent = match f.get(1).or_else(|| f.named("parent")) {
                None | Some(Value::Nil) => None,
                Some(h) => Some(hash_key(h).ok_or("parent_block_hash is not a hash")?),
            };
            let tokens = f
                .get(2)
                .and_then(Value::as_array)
                .ok_or("token_ids is not a list")?
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or("token_ids holds a non-u32")?;
            let block_size = f
                .get(3)
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .filter(|&b| b > 0)
                .ok_or("block_size is not a positive integer")?;
            let lora = f.get(6).and_then(Value::as_str).map(str::to_owned);
            let extra = match f.get(7) {
                None | Some(Value::Nil) => vec![Extra::None; hashes.len()],
                Some(Value::Array(per_block)) => per_block
                    .iter()
                    .map(|k| extra_of(k, lora.as_deref()))
                    .collect(),
                Some(_) => return Err("extra_keys is not a list".into()),
            };
            Ok(EngineEvent::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                lora,
                tier: tier(f.get(5)),
                extra,
                group: f.get(8).and_then(Value::as_i64),
            })
        }
        "BlockRemoved" => {
            let f = Fields::of(v, REMOVED, 1).ok_or("bad BlockRemoved")?;
            Ok(EngineEvent::Removed {
                hashes: hash_list(f.get(0).or_else(|| f.named("hashes")), "block_hashes")?,
                tier: tier(f.get(1)),
                group: f.get(2).and_then(Value::as_i64),
            })
        }
        "AllBlocksCleared" => Ok(EngineEvent::Cleared),
        other => Ok(EngineEvent::Unknown(other.to_owned())),
    }
}

/// An engine block hash as a u64 key: integers as their 64-bit pattern, byte strings
/// (SHA-256) folded with xxh3 (only ever compared with each other).
pub fn hash_key(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|x| x as u64)),
        Value::Binary(b) => Some(xxh3_64(b)),
        _ => None,
    }
}

fn hash_list(v: Option<&Value>, name: &str) -> Result<Vec<u64>, String> {
    v.and_then(Value::as_array)
        .ok_or_else(|| format!("{name} is not a list"))?
        .iter()
        .map(|h| hash_key(h).ok_or_else(|| format!("{name} holds a non-hash")))
        .collect()
}

/// What this block's `extra_keys` entry holds besides the LoRA name.
fn extra_of(keys: &Value, lora: Option<&str>) -> Extra {
    match keys {
        Value::Nil => Extra::None,
        Value::Array(a) => {
            let mut strings = Vec::new();
            for k in a {
                match k.as_str() {
                    Some(s) if Some(s) == lora => {}
                    Some(s) => strings.push(s.to_owned()),
                    None => return Extra::Opaque,
                }
            }
            if strings.is_empty() {
                Extra::None
            } else {
                Extra::Strings(strings)
            }
        }
        _ => Extra::Opaque,
    }
}

fn tier(v: Option<&Value>) -> Tier {
    match v
        .and_then(Value::as_str)
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        None | Some("gpu") | Some("cuda") | Some("hbm") => Tier::Gpu,
        Some("cpu") | Some("cpu_tier") | Some("host") => Tier::Cpu,
        Some("disk") | Some("ssd") | Some("local_file") => Tier::Disk,
        Some(_) => Tier::Remote,
    }
}

fn map_get<'a>(m: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    m.iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// A struct encoded either positionally (from `offset`, after a tag) or as a map.
enum Fields<'a> {
    Pos(&'a [Value]),
    Map(&'a [(Value, Value)], &'static [&'static str]),
}

impl<'a> Fields<'a> {
    fn of(v: &'a Value, names: &'static [&'static str], offset: usize) -> Option<Self> {
        match v {
            Value::Array(a) => Some(Fields::Pos(a.get(offset..)?)),
            Value::Map(m) => Some(Fields::Map(m, names)),
            _ => None,
        }
    }

    /// Field `i` of the declared order; a nil or missing field is `None`.
    fn get(&self, i: usize) -> Option<&'a Value> {
        let v = match self {
            Fields::Pos(a) => a.get(i),
            Fields::Map(m, names) => map_get(m, names.get(i)?),
        }?;
        (!v.is_nil()).then_some(v)
    }

    /// A field under another name (SGLang's shorter spellings); maps only.
    fn named(&self, key: &str) -> Option<&'a Value> {
        match self {
            Fields::Pos(_) => None,
            Fields::Map(m, _) => map_get(m, key).filter(|v| !v.is_nil()),
        }
    }
}

/// The engine's own load, read from its Prometheus `/metrics` text: requests running and
/// waiting, and KV cache usage (0..1). vLLM (`vllm:num_requests_running`,
/// `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` or the older
/// `vllm:gpu_cache_usage_perc`) and SGLang (`sglang:num_running_reqs`,
/// `sglang:num_queue_reqs`, `sglang:token_usage`); values of several label sets are summed
/// (usage: the largest). `None` when the text names none of them.
pub fn engine_load(metrics: &str) -> Option<(u32, u32, f64)> {
    engine_load_of(metrics, None)
}

/// [`engine_load`] of one data-parallel rank: only the series vLLM labels
/// `engine="<rank>"` (each rank's engine core reports its own).
pub fn engine_load_of(metrics: &str, rank: Option<u16>) -> Option<(u32, u32, f64)> {
    let label = rank.map(|r| format!("engine=\"{r}\""));
    let (mut running, mut waiting, mut usage) = (None::<f64>, None::<f64>, None::<f64>);
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        let Some((key, value)) = line.rsplit_once(' ') else {
            continue;
        };
        if let Some(l) = &label {
            let labels = key.split_once('{').map_or("", |(_, rest)| rest);
            if !labels
                .split(',')
                .any(|kv| kv.trim().trim_end_matches('}') == l)
            {
                continue;
            }
        }
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        if !v.is_finite() || v < 0.0 {
            continue;
        }
        let name = key.split('{').next().unwrap_or(key).trim();
        let slot = match name {
            "vllm:num_requests_running" | "sglang:num_running_reqs" => &mut running,
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => &mut waiting,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                usage = Some(usage.map_or(v, |u| u.max(v)));
                continue;
            }
            _ => continue,
        };
        *slot = Some(slot.unwrap_or(0.0) + v);
    }
    if running.is_none() && waiting.is_none() && usage.is_none() {
        return None;
    }
    let count = |x: Option<f64>| x.unwrap_or(0.0).min(u32::MAX as f64) as u32;
    Some((
        count(running),
        count(waiting),
        usage.unwrap_or(0.0).clamp(0.0, 1.0),
    ))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).expect("encode to a Vec");
        out
    }

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    fn ints(x: &[u64]) -> Value {
        Value::Array(x.iter().map(|&i| Value::from(i)).collect())
    }

    /// The array form (msgspec `array_like`, older vLLM and SGLang).
    pub(crate) fn stored_array(hashes: &[u64], parent: Option<u64>, tokens: &[u64]) -> Value {
        Value::Array(vec![
            s("BlockStored"),
            ints(hashes),
            parent.map_or(Value::Nil, Value::from),
            ints(tokens),
            Value::from(4),
            Value::Nil,
            s("GPU"),
        ])
    }

    pub(crate) fn batch_array(events: Vec<Value>) -> Vec<u8> {
        encode(&Value::Array(vec![
            Value::from(1.5),
            Value::Array(events),
            Value::from(0),
        ]))
    }

    #[test]
    fn reads_the_positional_form() {
        let p = batch_array(vec![
            stored_array(&[11, 12], None, &[1, 2, 3, 4, 5, 6, 7, 8]),
            Value::Array(vec![s("BlockRemoved"), ints(&[11]), s("CPU")]),
            Value::Array(vec![s("AllBlocksCleared")]),
        ]);
        let b = decode(&p).expect("decodes");
        assert_eq!(b.ts, Some(1.5));
        assert_eq!(b.dp_rank, Some(0));
        assert_eq!(
            b.events,
            vec![
                EngineEvent::Stored {
                    hashes: vec![11, 12],
                    parent: None,
                    tokens: vec![1, 2, 3, 4, 5, 6, 7, 8],
                    block_size: 4,
                    lora: None,
                    tier: Tier::Gpu,
                    extra: vec![Extra::None, Extra::None],
                    group: None,
                },
                EngineEvent::Removed {
                    hashes: vec![11],
                    tier: Tier::Cpu,
                    group: None
                },
                EngineEvent::Cleared,
            ]
        );
    }

    #[test]
    fn reads_the_map_form_with_byte_hashes_lora_and_extra_keys() {
        let h1 = Value::Binary(vec![7; 32]);
        let h0 = Value::Binary(vec![9; 32]);
        let ev = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (
                s("block_hashes"),
                Value::Array(vec![h1.clone(), h1.clone()]),
            ),
            (s("parent_block_hash"), h0.clone()),
            (s("token_ids"), ints(&[1, 2, 3, 4, 5, 6, 7, 8])),
            (s("block_size"), Value::from(4)),
            (s("medium"), s("GPU")),
            (s("lora_name"), s("sql")),
            (
                s("extra_keys"),
                Value::Array(vec![
                    Value::Array(vec![s("sql")]),
                    Value::Array(vec![s("sql"), s("salt-or-image")]),
                ]),
            ),
            (s("group_idx"), Value::from(0)),
        ]);
        let p = encode(&Value::Map(vec![
            (s("ts"), Value::from(2.0)),
            (s("events"), Value::Array(vec![ev])),
        ]));
        let b = decode(&p).expect("decodes");
        let k1 = hash_key(&h1).expect("bytes hash");
        assert_eq!(
            b.events,
            vec![EngineEvent::Stored {
                hashes: vec![k1, k1],
                parent: hash_key(&h0),
                tokens: vec![1, 2, 3, 4, 5, 6, 7, 8],
                block_size: 4,
                lora: Some("sql".into()),
                tier: Tier::Gpu,
                extra: vec![Extra::None, Extra::Strings(vec!["salt-or-image".into()])],
                group: Some(0),
            }]
        );
    }

    #[test]
    fn engine_load_reads_vllm_and_sglang_metrics() {
        let vllm = "# HELP vllm:num_requests_running Number of requests in model execution.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.41\n\
            vllm:prompt_tokens_total{model_name=\"m\"} 1234.0\n";
        assert_eq!(engine_load(vllm), Some((5, 1, 0.41)));
        // One rank's own series only.
        assert_eq!(engine_load_of(vllm, Some(1)), Some((2, 0, 0.0)));
        assert_eq!(engine_load_of(vllm, Some(0)), Some((3, 1, 0.41)));
        assert_eq!(engine_load_of(vllm, Some(7)), None);
        let sglang = "sglang:num_running_reqs{model_name=\"m\"} 7\nsglang:num_queue_reqs{model_name=\"m\"} 2\nsglang:token_usage{model_name=\"m\"} 1.7\n";
        assert_eq!(engine_load(sglang), Some((7, 2, 1.0)));
        assert_eq!(engine_load("up 1\nvllm:num_requests_running NaN\n"), None);
        assert_eq!(engine_load("<html>not metrics</html>"), None);
    }

    #[test]
    fn signed_integer_hashes_keep_their_bits() {
        let v = Value::from(-5i64);
        assert_eq!(hash_key(&v), Some(-5i64 as u64));
    }

    #[test]
    fn bad_payloads_are_errors_that_name_the_problem() {
        assert!(decode(b"\xc1").is_err());
        assert!(decode(&encode(&Value::from(3))).is_err());
        let no_tag = batch_array(vec![Value::Array(vec![])]);
        assert!(decode(&no_tag)
            .err()
            .unwrap_or_default()
            .contains("event 0"));
        let bad_tokens = batch_array(vec![Value::Array(vec![
            s("BlockStored"),
            ints(&[1]),
            Value::Nil,
            Value::Array(vec![Value::from(-1)]),
            Value::from(4),
        ])]);
        assert!(decode(&bad_tokens)
            .err()
            .unwrap_or_default()
            .contains("token_ids"));
        let zero_bs = batch_array(vec![Value::Array(vec![
            s("BlockStored"),
            ints(&[1]),
            Value::Nil,
            ints(&[1, 2, 3, 4]),
            Value::from(0),
        ])]);
        assert!(decode(&zero_bs)
            .err()
            .unwrap_or_default()
            .contains("block_size"));
        // Declared lengths are not trusted: a 4-billion-element array header is an error,
        // not an allocation.
        assert!(decode(b"\xdd\xff\xff\xff\xff\xc0").is_err());
        assert!(decode(b"\x92\xcb\0\0\0\0\0\0\0\0\xdd\xff\xff\xff\xff").is_err());
        let mut trailing = batch_array(vec![]);
        trailing.push(0);
        assert!(decode(&trailing)
            .err()
            .unwrap_or_default()
            .contains("trailing"));
        // Unknown event kinds are not errors: newer engines add them.
        let newer = batch_array(vec![Value::Array(vec![s("BlockPinned")])]);
        assert_eq!(
            decode(&newer).map(|b| b.events),
            Ok(vec![EngineEvent::Unknown("BlockPinned".into())])
        );
    }
}
