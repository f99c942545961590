//! What the agent APIs' hostile-body tests share: JSON shaped like a body of an API
//! (its own words as strings and keys, nested at random) and a tokenizer whose template
//! prints every message, so a conversion that succeeds is also rendered.

use proptest::prelude::*;
use serde_json::{json, Value as J};

use super::ModelTokenizer;

/// Random JSON whose strings come from `words` and whose keys from `keys` (regexes).
pub fn arb_json(words: &'static str, keys: &'static str) -> impl Strategy<Value = J> {
    let leaf = prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::from),
        any::<i64>().prop_map(J::from),
        words.prop_map(J::from),
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(J::Array),
            proptest::collection::btree_map(keys, inner, 0..6)
                .prop_map(|m| J::Object(m.into_iter().collect())),
        ]
    })
}

/// A word-level tokenizer with a template that prints every message, loaded once.
pub fn printing_tokenizer() -> &'static ModelTokenizer {
    static T: std::sync::OnceLock<Option<ModelTokenizer>> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kvroute-testkit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let tj = json!({"version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [], "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1}, "unk_token": "[UNK]"}});
        std::fs::write(dir.join("tokenizer.json"), tj.to_string()).ok()?;
        let tpl = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
        std::fs::write(
            dir.join("tokenizer_config.json"),
            json!({"chat_template": tpl}).to_string(),
        )
        .ok()?;
        ModelTokenizer::load(&dir, 1 << 20).ok()
    })
    .as_ref()
    .expect("the test tokenizer loads")
}
