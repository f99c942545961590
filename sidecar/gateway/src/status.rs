//! The status snapshot: everything the status page shows, assembled in one read of the
//! registry, the indexes, the ledger's views and the counters. Read-only: building it
//! changes nothing (a page left open must not disturb routing).

use std::collections::BTreeMap;
use std::time::Instant;

use serde_json::{json, Value};

use crate::state::Sidecar;

/// One pod as the status page shows it: `pod_json` plus its tiers and event lag.
pub fn pod(sc: &Sidecar, p: &crate::registry::Pod, now: Instant) -> Value {
    let ix = sc.indexes.get(&p.reg.model);
    let handle = ix.as_ref().and_then(|ix| ix.handle(&p.id));
    let blocks = ix.as_ref().zip(handle).map(|(ix, h)| ix.pod_blocks(h));
    let tiers = ix.as_ref().zip(handle).map(|(ix, h)| ix.tier_counts(h));
    let load = p.load_view(sc.ledger().view(&p.id, None, now, &sc.config()), now);
    let state = if p.breaker_open(now) {
        "breaker_open"
    } else if p.stale {
        "stale"
    } else {
        "live"
    };
    json!({
        "pod": &*p.id, "model": p.reg.model, "role": p.reg.role, "adapters": p.reg.adapters,
        "labels": p.reg.labels, "capacity_blocks": p.reg.capacity_blocks, "dump_url": p.reg.dump_url,
        "registered": p.registered, "state": state, "epoch": p.epoch, "seq": p.last_seq,
        "stale": p.stale, "events_seen": p.events_seen, "blocks": blocks, "tiers": tiers,
        "event_lag_s": sc.metrics.event_lag(&p.id),
        "predicted_capacity_blocks": sc.predicted.capacity_of(&p.id),
        "eviction_pressure": sc.predicted.pressure_of(&p.id),
        "returning_evicted": sc.returns.pressure_of(&p.id),
        "text_tokens": sc.text_tokens.of_pod(&p.id),
        "last_seen_s": now.duration_since(p.last_seen).as_secs_f64(),
        "breaker_open": p.breaker_open(now),
        "engine": p.engine.map(|e| json!({"running": e.running, "waiting": e.waiting, "kv_usage": e.kv_usage})),
        "load": {"pending_prefill_tokens": load.pending_prefill_tokens, "decode_blocks": load.decode_blocks,
                  "inflight": load.inflight, "queued": load.queued,
                  "recent_blocks": (load.recent_blocks * 10.0).round() / 10.0,
                  "engine_kv_usage": p.engine.map(|e| e.kv_usage)},
    })
}

/// `GET /v1/status`.
pub fn snapshot(sc: &Sidecar) -> Value {
    let now = Instant::now();
    let cfg = sc.config();
    let pods = sc.registry().all();
    let pods_json: Vec<Value> = pods.iter().map(|p| pod(sc, p, now)).collect();

    let mut models: BTreeMap<String, Value> = BTreeMap::new();
    let mut index_bytes = sc.predicted.indexes.heap_bytes();
    for (m, ix) in sc.indexes.all() {
        let s = ix.stats();
        index_bytes += s.heap_bytes;
        models.insert(
            m.clone(),
            json!({"model": m, "index_entries": s.entries, "index_bytes": s.heap_bytes,
                   "index_max_blocks": s.max_blocks, "over_share": s.over_share,
                   "live_pods": s.live_pods, "draining_pods": s.draining_pods, "evicted": s.evicted}),
        );
    }
    // Models known only by a registration, a tokenizer or reports have no index yet.
    let toks = sc.tokenizers();
    let text = sc.text_tokens.models();
    let named = pods
        .iter()
        .map(|p| &p.reg.model)
        .chain(toks.models().map(|(m, _)| m))
        .chain(text.iter().map(|(m, _)| m));
    for name in named {
        models.entry(name.clone()).or_insert_with(|| {
            json!({"model": name, "index_entries": 0, "index_bytes": 0,
                   "live_pods": 0, "draining_pods": 0, "evicted": 0})
        });
    }
    let estimates: BTreeMap<_, _> = text.into_iter().collect();
    for (name, v) in models.iter_mut() {
        let mc = cfg.model(name);
        v["text_tokens"] = json!(estimates
            .get(name)
            .copied()
            .unwrap_or(crate::text_tokens::Estimate::DEFAULT));
        v["block_size"] = json!(mc.block_size);
        v["text_block_bytes"] = json!(mc.text_block_bytes);
        v["tokenizer"] = toks.get(name).map_or(Value::Null, |t| {
            json!({"dir": t.dir(), "chat_template": t.has_template(), "template": t.template_id().map(|t| &**t),
                   "segment_cache": t.caches_segments(), "cache": t.cache_stats(),
                   "prompt_chunks": t.chunk_stats()})
        });
    }

    let m = &sc.metrics;
    let decisions: u64 = m.decisions.snapshot().iter().map(|(_, n)| n).sum();
    let as_map = |v: Vec<(String, u64)>| v.into_iter().collect::<BTreeMap<_, _>>();
    // The admission queues per model, band and tenant: the largest first, at most 50.
    let mut queued = sc.waiting.depths();
    queued.sort_by_key(|q| std::cmp::Reverse(q.3));
    let queued: Vec<Value> = queued
        .into_iter()
        .take(50)
        .map(|(m, p, t, n)| json!({"model": m, "priority": p, "tenant": &*t, "requests": n}))
        .collect();
    // The replicas this one hears routing to the same pods (itself included) and its rank
    // among them: new prompts prefer every `size`-th pod from `rank` (`peer_home_weight`).
    let (rank, size) = sc.ledger().home_slot(now).unwrap_or((0, 1));
    json!({
        "replica": sc.ledger().replica(),
        "replica_set": {"size": size, "rank": rank},
        "uptime_s": now.duration_since(sc.started).as_secs_f64(),
        "policy_version": cfg.version,
        "counters": {
            "decisions": decisions,
            "route_errors": as_map(m.route_errors.snapshot()),
            "reports": m.reports.get(),
            "reports_rejected": m.reports_rejected.get(),
            "events_applied": m.events_applied.get(),
            "events_rejected": as_map(m.events_rejected.snapshot()),
            "mispredictions": m.mispredictions.get(),
            "predicted_in_flight": m.predicted_in_flight.get(),
            "precise_prompts": as_map(m.precise.snapshot()),
            "picker_requests": as_map(m.picker.snapshot()),
            "admission": as_map(m.admission.snapshot()),
            "replica_queues": as_map(m.replica_queues.snapshot()),
            "session_turns": as_map(m.session_turns.snapshot()),
            "inflight": sc.ledger().outstanding(),
        },
        "memory": {
            "max_index_bytes": sc.index_budget(),
            "index_bytes": index_bytes,
            "tokenize_budget_bytes": sc.tokenize_budget.cap(),
        },
        "bindings": sc.bindings.status(cfg.max_bindings),
        // Replicas whose queue states this one heard lately: their tenants' turns are
        // shared with its own (admission::fleet).
        "admission": {"enabled": cfg.admission.enabled, "queued": queued, "peers": sc.waiting.peers(now)},
        "agreement": sc.agreement.snapshot(),
        "models": models.into_values().collect::<Vec<_>>(),
        "pods": pods_json,
    })
}
