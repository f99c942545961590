//! Every JSON example in docs/protocol.md parses as the type it is tagged with (or is
//! refused, when tagged `invalid:`), so the documentation cannot drift from the code.

use kvroute_shared::protocol::*;

fn check(ty: &str, json: &str) -> Result<(), String> {
    fn p<T: serde::de::DeserializeOwned>(j: &str) -> Result<T, String> {
        serde_json::from_str(j).map_err(|e| e.to_string())
    }
    match ty {
        "EventBatch" => EventBatch::decode(json.as_bytes())
            .map(|_| ())
            .map_err(|e| e.to_string()),
        "RouteRequest" => p::<RouteRequest>(json).map(|_| ()),
        "RouteResponse" => p::<RouteResponse>(json).map(|_| ()),
        "RouteQueued" => p::<RouteQueued>(json).map(|_| ()),
        "WaitRequest" => p::<WaitRequest>(json).map(|_| ()),
        "CompletionReport" => p::<CompletionReport>(json).map(|_| ()),
        "PodRegistration" => p::<PodRegistration>(json).map(|_| ()),
        "LoadDelta" => p::<LoadDelta>(json).map(|_| ()),
        "QueueState" => p::<QueueState>(json).map(|_| ()),
        "PolicyConfig" => {
            p::<PolicyConfig>(json).and_then(|c| c.validate().map_err(|e| e.join("; ")))
        }
        other => panic!("docs/protocol.md tags an unknown type {other}"),
    }
}

#[test]
fn every_documented_example_parses() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/protocol.md"))
        .expect("docs/protocol.md");
    let mut blocks = 0;
    let mut lines = doc.lines();
    while let Some(line) = lines.next() {
        let Some(tag) = line.strip_prefix("```json ") else {
            continue;
        };
        let body: Vec<&str> = lines
            .by_ref()
            .take_while(|l| !l.starts_with("```"))
            .collect();
        let json = body.join("\n");
        match tag.strip_prefix("invalid:") {
            Some(ty) => assert!(
                check(ty, &json).is_err(),
                "documented invalid {ty} was accepted:\n{json}"
            ),
            None => {
                if let Err(e) = check(tag, &json) {
                    panic!("documented {tag} does not parse: {e}\n{json}");
                }
            }
        }
        blocks += 1;
    }
    assert!(blocks >= 14, "found only {blocks} examples");
}

#[test]
fn defaults_round_trip_and_validate() {
    let c = PolicyConfig::default();
    c.validate().expect("defaults are valid");
    let back: PolicyConfig =
        serde_json::from_str(&serde_json::to_string(&c).expect("ser")).expect("de");
    assert_eq!(back, c);
    let errs = serde_json::from_str::<PolicyConfig>(
        r#"{"prefill_weight":-1,"stale_factor":0,"default_model":{"block_size":0},"saturation_waiting_over":-1}"#,
    )
    .expect("shape ok")
    .validate()
    .expect_err("invalid");
    assert_eq!(errs.len(), 4, "{errs:?}");
}

#[test]
fn batches_round_trip_and_bad_ones_say_why() {
    let b = EventBatch {
        v: 1,
        pod: "p:1".into(),
        model: "m".into(),
        epoch: "e".into(),
        seq: 3,
        ts: None,
        dump_url: None,
        events: vec![
            Event::Stored {
                tier: Tier::Cpu,
                parent: Some(u64::MAX),
                blocks: vec![1, u64::MAX],
                tokens: None,
            },
            Event::Removed {
                tier: Tier::Gpu,
                blocks: vec![2],
            },
            Event::Cleared,
            Event::Load {
                running: 1,
                waiting: 2,
                kv_usage: 0.5,
                capacity_blocks: None,
            },
        ],
    };
    assert_eq!(EventBatch::decode(&b.encode()), Ok(b));
    let cases: &[(&str, &str)] = &[
        ("{", "bad_json"),
        (
            r#"{"v":1,"pod":"","model":"m","epoch":"e","seq":1,"events":[]}"#,
            "missing_field",
        ),
        (
            r#"{"v":1,"pod":"p","model":"m","epoch":"e","seq":1,"events":[{"type":"load","kv_usage":7}]}"#,
            "bad_value",
        ),
        (
            r#"{"v":1,"pod":"p","model":"m","epoch":"e","seq":1,"events":[{"type":"stored","blocks":[1,2],"tokens":[1,2,3]}]}"#,
            "bad_value",
        ),
        (
            r#"{"v":1,"pod":"p","model":"m","epoch":"e","seq":-1,"events":[]}"#,
            "bad_json",
        ),
        (
            r#"{"v":1,"pod":"p","model":"m","epoch":"e","seq":1,"events":[{"type":"stored","blocks":[1.5]}]}"#,
            "bad_json",
        ),
        (
            r#"{"v":1,"pod":"p","model":"m","epoch":"e","seq":1,"events":[{"type":"stored","blocks":["0x10"]}]}"#,
            "bad_json",
        ),
    ];
    for (json, reason) in cases {
        let e = EventBatch::decode(json.as_bytes()).expect_err(json);
        assert_eq!(e.reason(), *reason, "{json}: {e}");
    }
    let unknown = EventBatch::decode(
        br#"{"v":1,"pod":"p","model":"m","epoch":"e","seq":1,"events":[{"type":"x"}]}"#,
    )
    .expect_err("unknown type");
    assert!(unknown.to_string().contains("unknown variant"), "{unknown}");
}

#[test]
fn binary_route_body_round_trips_and_refuses_garbage() {
    let r = RouteRequest {
        request_id: Some("r".into()),
        ..RouteRequest::tokens(
            "m",
            16,
            (0..1000u64)
                .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .collect(),
        )
    };
    let b = r.encode_binary();
    assert!(b.len() < 8_200 + 200);
    assert_eq!(RouteRequest::decode_binary(&b), Ok(r));
    for bad in [
        &b[..2],
        &b[..b.len() - 3],
        &[255u8, 255, 255, 255, b'{'][..],
    ] {
        assert!(RouteRequest::decode_binary(bad).is_err());
    }
}
