//! The engine's msgpack is network input: random bytes and random msgpack values of any
//! shape are decoded or refused, never a panic, and whatever decodes translates without
//! one (a fixed proptest budget, as a fuzz run inside `make test`).

use kvroute_bridge::translate::Translator;
use kvroute_bridge::vllm;
use proptest::prelude::*;
use rmpv::Value;

fn arb_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Nil),
        any::<bool>().prop_map(Value::Boolean),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        "[a-z_]{0,12}".prop_map(Value::from),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(Value::Binary),
        // The names vLLM uses, so maps look like real events often enough.
        prop::sample::select(vec![
            "BlockStored",
            "BlockRemoved",
            "AllBlocksCleared",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "events",
            "ts",
        ])
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::vec((inner.clone(), inner), 0..6).prop_map(Value::Map),
        ]
    })
}

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = rmpv::encode::write_value(&mut out, v);
    out
}

proptest! {
    #[test]
    fn random_bytes_are_refused_or_decoded(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(b) = vllm::decode(&bytes) {
            let mut t = Translator::new("10.0.0.1:8000", "m", 4, "e");
            let _ = t.on_batch(0, &b);
        }
    }

    #[test]
    fn random_msgpack_is_refused_or_translated(v in arb_value(), seq in any::<u64>()) {
        if let Ok(b) = vllm::decode(&encode(&v)) {
            let mut t = Translator::new("10.0.0.1:8000", "m", 4, "e");
            let _ = t.on_batch(seq, &b);
            let _ = t.on_batch(seq.wrapping_add(1), &b);
            let _ = t.dump();
        }
    }

    #[test]
    fn batches_shaped_like_vllms_with_random_fields(
        events in prop::collection::vec(arb_value(), 0..6),
        ts in any::<f64>(),
    ) {
        let batch = Value::Array(vec![Value::from(ts), Value::Array(events), Value::Nil]);
        if let Ok(b) = vllm::decode(&encode(&batch)) {
            let mut t = Translator::new("10.0.0.1:8000", "m", 4, "e");
            let _ = t.on_batch(0, &b);
        }
    }
}
