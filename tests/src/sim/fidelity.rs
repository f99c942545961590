//! Whether the simulator's imitation of a real router decides as the real router did.
//! `kvroute-bench peers --dump` records, for every trace request a gateway served, when it
//! was sent, how long it ran, its trace chain and the pod that answered. Replaying one
//! real router's requests in the order it received them, each decision is put to the
//! imitation ([`Imitation::decide`]) with what every pod had in flight at that moment
//! (the requests sent before it and not yet finished: the router's own count, seen from
//! the client), and the imitation is then told the pod the real router chose
//! ([`Imitation::record`]), so its routed-prefix tree stays the real router's.
//!
//! A decision agrees when the imitation names the same pod, and agrees up to ties when
//! the real pod is one its rule ranks level with its pick (which of equals a router
//! takes is its detail, not its policy). The comparison is of policies on the same
//! inputs; how the pods' caches then behave is the engine model's part, not checked here.

use std::collections::BTreeMap;

use kvroute_shared::protocol::RouteRequest;
use kvroute_shared::Mode;
use kvroute_sidecar::policy::Ask;
use serde::Deserialize;

use super::baselines::candidates;
use super::{Imitation, Policy};

/// One line of a `peers --dump` file (fields it does not need are ignored). A recording
/// kept without chains (`tests/data/peers/`) has them filled in from its trace by `i`
/// ([`with_chains`]).
#[derive(Clone, Debug, Deserialize)]
pub struct Dumped {
    pub gateway: String,
    pub round: usize,
    /// The request's place in the trace as replayed (`bench::peers::trace_requests`).
    #[serde(default)]
    pub i: usize,
    pub sent_ms: f64,
    pub e2e_ms: f64,
    pub ok: bool,
    pub pod: String,
    #[serde(default)]
    pub chain: Vec<u64>,
    /// Tokens of text a trace block became (the tree's bound is in characters).
    #[serde(default = "default_block_tokens")]
    pub block_tokens: u32,
}

/// What `peers` makes of a trace block unless told otherwise.
fn default_block_tokens() -> u32 {
    crate::bench::peers::Opts::default().block_text
}

/// Rows whose chain was left out get their trace request's (`reqs[i]`); a row whose `i`
/// is past the trace is an error, not a silent empty prompt.
pub fn with_chains(rows: &mut [Dumped], reqs: &[crate::workload::Request]) -> anyhow::Result<()> {
    for r in rows.iter_mut().filter(|r| r.chain.is_empty()) {
        r.chain = reqs
            .get(r.i)
            .ok_or_else(|| anyhow::anyhow!("request {} is past the trace's {}", r.i, reqs.len()))?
            .chain
            .clone();
    }
    Ok(())
}

/// One gateway's run replayed through an imitation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Agreement {
    pub decisions: u64,
    pub agreed: u64,
    pub within_ties: u64,
    /// Requests the real router failed (no pod to compare; not replayed).
    pub failed: u64,
    /// Per branch of the imitation's rule: (decisions, agreed up to ties).
    pub by_case: BTreeMap<&'static str, (u64, u64)>,
}

/// The imitation of the router a `peers` gateway label names, if the simulator has one.
pub fn imitated(gateway: &str) -> Option<Policy> {
    use crate::peers::Kind;
    match Kind::parse(gateway)? {
        Kind::SmgCacheAware => Some(Policy::Sglang),
        Kind::VllmCacheAware => Some(Policy::VllmRouter),
        Kind::SmgPrefixHash | Kind::VllmKvAware => None,
    }
}

/// Replays one run (`rows`: one gateway, one round, any order) through `policy`'s
/// imitation. Pods are the candidates in name order, as the simulator orders pod ids.
pub fn replay(rows: &[Dumped], policy: Policy) -> Option<Agreement> {
    let mut imitation = Imitation::of(policy)?;
    let mut out = Agreement::default();
    let mut served: Vec<&Dumped> = rows.iter().filter(|r| r.ok && !r.pod.is_empty()).collect();
    out.failed = (rows.len() - served.len()) as u64;
    served.sort_by(|a, b| a.sent_ms.total_cmp(&b.sent_ms));
    let mut pods: Vec<&str> = served.iter().map(|r| r.pod.as_str()).collect();
    pods.sort_unstable();
    pods.dedup();
    // Requests sent so far and still running: (end, pod index).
    let mut running: Vec<(f64, usize)> = Vec::new();
    for r in served {
        running.retain(|&(end, _)| end > r.sent_ms);
        let mut inflight = vec![0u32; pods.len()];
        for &(_, p) in &running {
            inflight[p] += 1;
        }
        let cands = candidates(&inflight);
        let ask = Ask {
            prompt_blocks: u32::try_from(r.chain.len()).unwrap_or(u32::MAX),
            block_size: r.block_tokens,
            ..Ask::default()
        };
        let req = RouteRequest {
            mode: Mode::Text,
            ..RouteRequest::tokens("m", r.block_tokens, r.chain.clone())
        };
        let Some(real) = pods.iter().position(|p| *p == r.pod) else {
            continue;
        };
        let Some(d) = imitation.decide(&ask, &req, &cands) else {
            continue;
        };
        out.decisions += 1;
        out.agreed += u64::from(d.pick == real);
        let tied = d.equals.contains(&real);
        out.within_ties += u64::from(tied);
        let case = out.by_case.entry(d.case).or_default();
        case.0 += 1;
        case.1 += u64::from(tied);
        imitation.record(&r.chain, cands[real].key, r.block_tokens, pods.len());
        running.push((r.sent_ms + r.e2e_ms, real));
    }
    Some(out)
}

/// Every gateway and round of a dump that has an imitation, replayed: (gateway, round,
/// agreement), in gateway then round order.
pub fn replay_dump(rows: &[Dumped]) -> Vec<(String, usize, Agreement)> {
    let mut runs: BTreeMap<(String, usize), Vec<Dumped>> = BTreeMap::new();
    for r in rows {
        runs.entry((r.gateway.clone(), r.round))
            .or_default()
            .push(r.clone());
    }
    runs.into_iter()
        .filter_map(|((g, round), rows)| {
            let a = replay(&rows, imitated(&g)?)?;
            Some((g, round, a))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(sent: f64, e2e: f64, pod: &str, chain: &[u64]) -> Dumped {
        Dumped {
            gateway: "smg cache_aware".into(),
            round: 0,
            sent_ms: sent,
            e2e_ms: e2e,
            ok: true,
            i: 0,
            pod: pod.into(),
            chain: chain.to_vec(),
            block_tokens: 64,
        }
    }

    #[test]
    fn a_router_that_follows_the_rule_agrees_and_one_that_does_not_is_caught() {
        // Pods a, b, c (name order). A new prompt to the fewest in flight (all idle: any
        // of the three is level); its follow-up while a still runs it stays on a; a
        // second new prompt while a is busy goes to b or c.
        let faithful = [
            row(0.0, 100.0, "a", &[1, 2, 3]),
            row(10.0, 100.0, "a", &[1, 2, 3, 4]),
            row(20.0, 5.0, "c", &[7, 8]),
            row(30.0, 5.0, "b", &[9]),
        ];
        let a = replay(&faithful, Policy::Sglang).expect("an imitation");
        assert_eq!((a.decisions, a.within_ties), (4, 4));
        // The imitation takes the first of equals (b over c for [7, 8]), the real router
        // took c: level under the rule, not the same pick.
        assert_eq!(a.agreed, 3);
        assert_eq!(a.by_case.get("match"), Some(&(1, 1)));
        assert_eq!(a.by_case.get("new"), Some(&(3, 3)));
        // A router that moved the follow-up off its prefix (a is not past the spill
        // margin with 1 in flight) is not what smg does.
        let moved = [
            row(0.0, 100.0, "a", &[1, 2, 3]),
            row(10.0, 100.0, "b", &[1, 2, 3, 4]),
            row(20.0, 5.0, "c", &[5]),
        ];
        let a = replay(&moved, Policy::Sglang).expect("an imitation");
        assert_eq!((a.decisions, a.within_ties), (3, 2));
        assert_eq!(a.by_case.get("match"), Some(&(1, 0)));
        // The replay recorded the real pod: the follow-up's blocks are b's now, so a
        // third turn on b is a match there.
        let third = [
            row(0.0, 100.0, "a", &[1, 2, 3]),
            row(10.0, 100.0, "b", &[1, 2, 3, 4]),
            row(20.0, 5.0, "b", &[1, 2, 3, 4, 5]),
        ];
        let a = replay(&third, Policy::Sglang).expect("an imitation");
        assert_eq!(a.by_case.get("match"), Some(&(2, 1)));
    }

    #[test]
    fn each_router_is_replayed_through_its_own_imitation() {
        let vllm = |r: Dumped| Dumped {
            gateway: "vllm-router cache_aware".into(),
            ..r
        };
        // Pod a runs 61 requests of one prompt, b one: within vLLM router's margin (60
        // apart, under 64) a follow-up stays on a; smg's margin (mean 31, 2√31 ≈ 11) is
        // long past (from the 14th request on a), so its imitation spills to b.
        let mut rows: Vec<Dumped> = (0..61)
            .map(|i| vllm(row(f64::from(i), 1e6, "a", &[1, 2, 3])))
            .collect();
        rows.push(vllm(row(70.0, 1e6, "b", &[9])));
        rows.push(vllm(row(80.0, 1.0, "a", &[1, 2, 3, 4])));
        let r = replay_dump(&rows);
        assert_eq!(r.len(), 1);
        let a = &r[0].2;
        assert_eq!(a.by_case.get("match"), Some(&(61, 61)));
        assert_eq!(a.decisions, a.within_ties);
        let smg: Vec<Dumped> = rows
            .iter()
            .map(|r| Dumped {
                gateway: "smg cache_aware".into(),
                ..r.clone()
            })
            .collect();
        let a = &replay_dump(&smg)[0].2;
        let spills = a.by_case.get("spill").copied().unwrap_or_default();
        assert!(spills.0 >= 1 && spills.1 == 0, "{a:?}");
        // kvroute's own runs have no imitation to check.
        assert!(replay_dump(&[Dumped {
            gateway: "kvroute predicted".into(),
            ..row(0.0, 1.0, "a", &[1])
        }])
        .is_empty());
    }

    #[test]
    fn a_recording_without_chains_takes_them_from_its_trace_by_place() {
        let req = |chain: Vec<u64>| crate::workload::Request {
            ts_ms: 0.0,
            input_tokens: 0,
            output_tokens: 0,
            chain,
            session: None,
        };
        let trace = [req(vec![1, 2]), req(vec![1, 2, 3])];
        let mut rows = [row(0.0, 1.0, "a", &[]), row(1.0, 1.0, "a", &[9])];
        rows[0].i = 1;
        with_chains(&mut rows, &trace).expect("in the trace");
        assert_eq!(rows[0].chain, vec![1, 2, 3]);
        assert_eq!(rows[1].chain, vec![9], "a recorded chain is kept");
        let mut past = [row(0.0, 1.0, "a", &[])];
        past[0].i = 2;
        assert!(with_chains(&mut past, &trace).is_err());
    }
}
