//! Property tests of the two promises everything else relies on: chains of a prompt and
//! of any extension agree on every full block of the shorter; and the chat form of k
//! messages is a byte prefix of the form of k+1 that content can never forge.

use kvroute_shared::canon::{canonical_bytes, parse, Endpoint};
use kvroute_shared::{common_prefix_blocks, ChainHasher, Mode, Namespace};
use proptest::prelude::*;

fn ns(mode: Mode, bs: u32) -> Namespace<'static> {
    Namespace {
        mode,
        block_size: bs,
        model: "m",
        adapter: "",
        cache_salt: "",
    }
}

fn chat_body(msgs: &[(String, String)]) -> String {
    let messages: Vec<_> = msgs
        .iter()
        .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
        .collect();
    serde_json::json!({"model": "m", "messages": messages}).to_string()
}

fn chat_bytes(msgs: &[(String, String)]) -> Vec<u8> {
    let body = chat_body(msgs);
    let req = parse(Endpoint::ChatCompletions, body.as_bytes()).expect("generated body parses");
    canonical_bytes(&req.prompt)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn extension_shares_every_full_block(
        prefix in proptest::collection::vec(any::<u32>(), 0..300),
        ext in proptest::collection::vec(any::<u32>(), 0..300),
        bs in 1u32..40,
    ) {
        let n = ns(Mode::Tokens, bs);
        let short = n.chain_tokens(&prefix);
        let mut long_tokens = prefix.clone();
        long_tokens.extend_from_slice(&ext);
        let long = n.chain_tokens(&long_tokens);
        prop_assert_eq!(short.len(), prefix.len() / bs as usize);
        prop_assert_eq!(common_prefix_blocks(&short, &long), short.len());
    }

    #[test]
    fn pieces_never_change_the_chain(data in proptest::collection::vec(any::<u8>(), 0..2000),
                                     cuts in proptest::collection::vec(0usize..2000, 0..8),
                                     bs in 1u32..64) {
        let n = ns(Mode::Text, bs);
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(data.len())).collect();
        cuts.sort_unstable();
        let mut h = ChainHasher::new(&n);
        let mut at = 0;
        for c in cuts.into_iter().chain(std::iter::once(data.len())) {
            h.update(&data[at..c]);
            at = c;
        }
        prop_assert_eq!(h.finish(), n.chain_bytes(&data));
    }

    #[test]
    fn any_namespace_change_changes_every_hash(
        tokens in proptest::collection::vec(any::<u32>(), 64..200),
        which in 0usize..5,
    ) {
        let base = Namespace { mode: Mode::Tokens, block_size: 8, model: "m", adapter: "", cache_salt: "" };
        let changed = match which {
            0 => Namespace { model: "m2", ..base },
            1 => Namespace { adapter: "lora", ..base },
            2 => Namespace { cache_salt: "tenant-b", ..base },
            3 => Namespace { block_size: 4, ..base },
            _ => Namespace { mode: Mode::Text, block_size: 32, ..base },
        };
        let a = base.chain_tokens(&tokens);
        let b = if which == 4 {
            // Same bytes, other mode: block_size 32 bytes = 8 tokens, so blocks align.
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            changed.chain_bytes(&bytes)
        } else {
            changed.chain_tokens(&tokens)
        };
        for x in &a {
            prop_assert!(!b.contains(x));
        }
    }

    #[test]
    fn chat_form_of_k_messages_prefixes_k_plus_1(
        msgs in proptest::collection::vec(("(system|user|assistant|tool)", ".{0,40}"), 1..8),
    ) {
        let msgs: Vec<(String, String)> = msgs;
        for k in 1..msgs.len() {
            let a = chat_bytes(&msgs[..k]);
            let b = chat_bytes(&msgs[..k + 1]);
            prop_assert!(b.starts_with(&a));
            prop_assert!(b.len() > a.len());
        }
    }

    #[test]
    fn content_cannot_forge_a_boundary(
        roles in ("(user|assistant)", "(user|assistant)"),
        a in ".{0,30}", b in ".{0,30}",
    ) {
        // One message whose content is the exact bytes that would frame two messages
        // must not collide with the two messages.
        let two = vec![(roles.0.clone(), a.clone()), (roles.1.clone(), b.clone())];
        let two_bytes = chat_bytes(&two);
        // The forged content: what follows the first record's header.
        let first_header_len = 5 + roles.0.len() + 5;
        let forged_content = String::from_utf8_lossy(&two_bytes[first_header_len..]).into_owned();
        let one = vec![(roles.0.clone(), forged_content)];
        prop_assert_ne!(chat_bytes(&one), two_bytes.clone());
        // And a different split of the same text is a different conversation.
        let merged = vec![(roles.0.clone(), format!("{a}{b}"))];
        prop_assert_ne!(chat_bytes(&merged), two_bytes);
    }
}

proptest! {
    /// A load delta's chain marks: at most 32, from the first block to the last, in
    /// order; a prompt sharing `k` blocks of the chain is vouched for no deeper than `k`
    /// and at least to the deepest mark before `k`; the whole chain to its end.
    #[test]
    fn chain_marks_vouch_for_no_more_than_is_shared(
        n in 1usize..400,
        k in 0usize..400,
        seed in any::<u64>(),
    ) {
        use kvroute_shared::protocol::{chain_marks, marks_depth, MAX_CHAIN_MARKS};
        let chain: Vec<u64> = (0..n as u64).map(|i| seed.wrapping_add(i)).collect();
        let marks = chain_marks(&chain);
        prop_assert!(!marks.is_empty() && marks.len() <= MAX_CHAIN_MARKS);
        prop_assert_eq!(marks[0][0], 0);
        prop_assert_eq!(marks[marks.len() - 1][0], n as u64 - 1);
        prop_assert!(marks.windows(2).all(|w| w[0][0] < w[1][0]));
        prop_assert_eq!(marks_depth(&marks, &chain), Some(n as u32));
        let k = k.min(n);
        let mut other = chain[..k].to_vec();
        other.extend((0..50u64).map(|i| !seed ^ i));
        let depth = marks_depth(&marks, &other).unwrap_or(u32::MAX) as usize;
        let floor = marks.iter().map(|m| m[0] as usize + 1).filter(|&d| d <= k).max().unwrap_or(0);
        prop_assert!(depth <= k && depth >= floor, "{} of {} shared: {}", k, n, depth);
        prop_assert_eq!(marks_depth(&[], &chain), None);
    }
}
