// kvroute status page: polls the sidecar's admin API (same origin, nothing else) and
// draws pods, counters, recent decisions; the prefix inspector chains a prompt in the
// browser with the wasm build of kvroute-shared, then asks the sidecar who holds it.

const POLL_MS = 1000;
const HISTORY = 60;
const $ = (id) => document.getElementById(id);
let token = sessionStorage.getItem("kvroute-token") || "";
let status = null;
let prev = null;
const series = { rate: [], errors: [] };
let kv = null; // the wasm-bindgen module, once loaded

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null) continue;
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c ?? "")));
  return e;
}

async function api(path, init = {}) {
  const headers = { ...(init.headers || {}) };
  if (token) headers.authorization = `Bearer ${token}`;
  const r = await fetch(path, { ...init, headers });
  if (r.status === 401) {
    $("token-form").hidden = false;
    throw new Error("the sidecar needs its admin token");
  }
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(body.error || `${path}: HTTP ${r.status}`);
  return body;
}

const fmt = (n, d = 0) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US", { maximumFractionDigits: d, minimumFractionDigits: d }));
const sum = (o) => Object.values(o || {}).reduce((a, b) => a + b, 0);

function spark(svg, values) {
  const max = Math.max(1, ...values);
  const pts = values.map((v, i) => `${(i / (HISTORY - 1)) * 120},${30 - (v / max) * 28 - 1}`).join(" ");
  svg.replaceChildren();
  const p = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  p.setAttribute("points", pts);
  svg.append(p);
}

function rows(tbody, list) {
  tbody.replaceChildren(...list);
}

function drawStatus(s, d) {
  $("meta").textContent = `replica ${s.replica} · up ${fmt(s.uptime_s)} s · policy v${s.policy_version}`;
  const c = s.counters;
  const errors = sum(c.route_errors);
  if (prev) {
    const dt = Math.max(0.001, (performance.now() - prev.t) / 1000);
    series.rate.push(Math.max(0, (c.decisions - prev.decisions) / dt));
    series.errors.push(Math.max(0, (errors - prev.errors) / dt));
    for (const k of Object.keys(series)) if (series[k].length > HISTORY) series[k].shift();
    $("t-rate").textContent = fmt(series.rate.at(-1), 1);
    $("t-errors").textContent = fmt(series.errors.at(-1), 1);
    spark($("s-rate"), series.rate);
    spark($("s-errors"), series.errors);
  }
  prev = { t: performance.now(), decisions: c.decisions, errors };
  $("t-decisions").textContent = fmt(c.decisions);
  $("t-errors").title = Object.entries(c.route_errors).map(([k, v]) => `${k}: ${v}`).join(", ") || "none";
  $("t-inflight").textContent = fmt(c.inflight);
  $("t-refused").textContent = `${fmt(sum(c.events_rejected))} / ${fmt(c.reports_rejected)}`;
  const b = s.bindings || {};
  $("t-bindings").textContent = `${fmt(b.session ?? 0)} / ${fmt(b.response ?? 0)} / ${fmt(b.prompt ?? 0)}`;
  // A session turn sent off its bound pod prefills its prompt again there.
  const st = c.session_turns || {};
  const back = (st.stayed ?? 0) + (st.moved ?? 0);
  const moved = back ? ` · later turns moved off their pod: ${fmt(st.moved ?? 0)} of ${fmt(back)} (${fmt((100 * (st.moved ?? 0)) / back, 1)}%)` : "";
  $("t-bindings").title = `at most ${fmt(b.max_per_kind ?? 0)} of each (${fmt((b.max_bytes ?? 0) / 1048576, 1)} MiB)${moved}`;

  const pk = c.picker_requests || {};
  const steered = pk.routed ?? 0;
  $("t-picker").textContent = `${fmt(steered)} / ${fmt(sum(pk) - steered)}`;
  $("t-picker").title = Object.entries(pk).map(([k, v]) => `${k}: ${v}`).join(", ") || "no picker requests";

  // Admission: requests waiting now (a model with any is saturated) and those refused.
  const ad = c.admission || {};
  const adm = s.admission || { enabled: false, queued: [] };
  const waiting = (adm.queued || []).reduce((n, q) => n + q.requests, 0);
  const refused = ["queue_full", "too_large", "shed", "expired", "displaced", "unclaimed"]
    .reduce((n, k) => n + (ad[k] ?? 0), 0);
  $("t-admission").textContent = adm.enabled ? `${fmt(waiting)} / ${fmt(refused)}` : "off";
  $("t-admission").title = adm.enabled
    ? [...(adm.queued || []).map((q) => `${q.model} priority ${q.priority} tenant ${q.tenant || "-"}: ${q.requests}`),
       ...Object.entries(ad).map(([k, v]) => `${k}: ${v}`),
       `tenants take turns with ${fmt(adm.peers || 0)} other replica(s)`].join("\n")
    : "admission is off (policy config)";

  const agreement = Object.fromEntries((s.agreement || []).map((a) => [a.model, a]));
  rows($("models").tBodies[0], s.models.map((m) => {
    const a = agreement[m.model];
    const ratio = a && a.recent_ratio !== null ? a.recent_ratio : null;
    return el("tr", { "data-model": m.model },
      el("td", {}, m.model),
      el("td", { class: "num" }, fmt(m.index_entries)),
      el("td", { class: "num" }, fmt(m.index_bytes / 1048576, 1)),
      el("td", { class: "num" }, fmt(m.live_pods)),
      el("td", { class: "num" }, fmt(m.draining_pods)),
      el("td", {}, `${m.block_size} / ${m.text_block_bytes}`),
      el("td", { class: ratio === null ? "" : ratio < 0.8 ? "bad" : "good", "data-agreement": ratio ?? "",
                 title: a?.template ? `chat template ${a.template}` : "" },
        ratio === null ? "no reports yet" : `${fmt(ratio * 100)}% of ${a.recent_reports}`
          + (ratio < 0.8 && a.template ? ` (template ${a.template})` : "")),
      el("td", {}, a ? `${a.agree} / ${a.over} / ${a.under}` : "–"));
  }));

  const recentTotal = {};
  for (const p of s.pods) recentTotal[p.model] = (recentTotal[p.model] || 0) + p.load.recent_blocks;
  rows($("pods").tBodies[0], s.pods.map((p) => {
    const t = p.tiers || { gpu: 0, cpu: 0, disk: 0 };
    const share = recentTotal[p.model] > 0 ? (100 * p.load.recent_blocks) / recentTotal[p.model] : 0;
    return el("tr", { "data-pod": p.pod },
      el("td", {}, p.pod),
      el("td", {}, p.model),
      el("td", { class: `state-${p.state}` }, p.state),
      el("td", {}, p.epoch ?? "–"),
      el("td", { class: "num" }, p.event_lag_s === null ? "–" : `${fmt(p.event_lag_s * 1000)} ms`),
      el("td", { class: "num" }, p.engine ? `${p.engine.running} / ${p.engine.waiting}` : "–"),
      el("td", { class: "num" }, `${p.load.inflight} / ${p.load.queued}`),
      el("td", { class: "num" }, fmt(p.load.pending_prefill_tokens)),
      el("td", { class: "num", "data-blocks": p.blocks ?? 0 }, `${fmt(t.gpu)} / ${fmt(t.cpu)} / ${fmt(t.disk)}`),
      el("td", { class: "num" }, `${fmt(share)}%`),
      el("td", { class: p.breaker_open ? "bad" : "" }, p.breaker_open ? "open" : "closed"));
  }));

  rows($("decisions").tBodies[0], d.decisions.map((x) => el("tr", { "data-decision": x.decision ?? "" },
    el("td", {}, new Date(x.at_ms).toLocaleTimeString()),
    el("td", {}, x.request_id ?? "–"),
    el("td", {}, x.model),
    el("td", { class: "num" }, x.chain_blocks),
    el("td", { class: "chosen" }, x.prefill_pod ? `${x.pod} (prefill ${x.prefill_pod})` : x.pod),
    el("td", {}, x.candidates.map((c) => `${c.pod}: ${c.matched_blocks}${c.cost === null ? "" : ` (${fmt(c.cost, 2)})`}`).join(" · ")))));
}

async function poll() {
  try {
    const [s, d] = await Promise.all([api("/v1/status"), api("/v1/decisions?limit=25")]);
    status = s;
    drawStatus(s, d);
    $("live").classList.add("on");
  } catch (e) {
    $("live").classList.remove("on");
    $("meta").textContent = String(e.message || e);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

// ---- prefix inspector ------------------------------------------------------------

async function loadWasm() {
  if (kv) return kv;
  const m = await import("./kvroute.js");
  await m.default();
  kv = m;
  return kv;
}

function modelConfig(name) {
  const m = (status?.models || []).find((x) => x.model === name);
  if (!m) throw new Error(`the sidecar knows no model ${JSON.stringify(name)}`);
  return m;
}

async function inspect(ev) {
  ev.preventDefault();
  $("inspector-error").hidden = true;
  $("inspector-out").hidden = true;
  try {
    const k = await loadWasm().catch(() => {
      throw new Error("the wasm package is not in this build (run `make` to build it)");
    });
    const path = $("i-path").value;
    const raw = $("i-body").value.trim();
    let c;
    if (path === "tokens") {
      const model = $("i-model").value.trim();
      const ids = Uint32Array.from(raw.replace(/[\[\]]/g, "").split(/[\s,]+/).filter(Boolean).map((x) => {
        const n = Number(x);
        if (!Number.isInteger(n) || n < 0 || n > 0xffffffff) throw new Error(`not a token id: ${x}`);
        return n;
      }));
      const m = modelConfig(model);
      c = { mode: "tokens", model, adapter: "", blockSize: m.block_size, units: ids.length,
            chain: k.chainTokens(ids, model, "", "", m.block_size) };
    } else {
      let model = "";
      try { model = JSON.parse(raw).model || ""; } catch { /* chainRequest reports it */ }
      const m = modelConfig($("i-model").value.trim() || model);
      const r = k.chainRequest(path, raw, m.block_size, m.text_block_bytes, $("i-adapters").value);
      c = { mode: r.mode, model: r.model, adapter: r.adapter, blockSize: r.blockSize, units: r.units, chain: r.chain };
      const tm = (status?.models || []).find((x) => x.model === r.model);
      if (r.mode === "text" && tm?.tokenizer) {
        // The sidecar tokenizes this model's prompts (chat template + tokenizer): ask it
        // for the ids, and chain them here, as the gateway routes them.
        const t = await api("/v1/tokenize", { method: "POST", headers: { "content-type": "application/json" },
          body: `{"model":${JSON.stringify(r.model)},"path":${JSON.stringify(path)},"body":${raw}}` });
        const ids = Uint32Array.from(t.tokens);
        c = { mode: "tokens", model: r.model, adapter: r.adapter, blockSize: tm.block_size, units: ids.length,
              chain: k.chainTokens(ids, r.model, r.adapter, r.cacheSalt, tm.block_size), tokenized: true };
      }
    }
    $("inspector-summary").textContent =
      `${c.mode} mode${c.tokenized ? " (tokenized by the sidecar with the model's tokenizer and chat template)" : ""} · model ${c.model}${c.adapter ? ` · adapter ${c.adapter}` : ""} · ${c.units} ${c.mode === "tokens" ? "tokens" : "canonical bytes"} · ${c.chain.length} full blocks of ${c.blockSize}`;
    const body = `{"model":${JSON.stringify(c.model)},"chain":[${c.chain.join(",")}]}`;
    const look = await api("/v1/lookup", { method: "POST", headers: { "content-type": "application/json" }, body });
    let route = null;
    if (c.chain.length > 0) {
      const req = `{"model":${JSON.stringify(c.model)},"adapter":${JSON.stringify(c.adapter)},"mode":"${c.mode}","block_size":${c.blockSize},` +
        `"chain":[${c.chain.join(",")}],"prompt_tokens":${c.mode === "tokens" ? c.units : Math.ceil(c.units / 4)},"dry_run":true,"explain":true}`;
      route = await api("/v1/route", { method: "POST", headers: { "content-type": "application/json" }, body: req }).catch((e) => ({ error: e.message }));
    }
    drawInspector(c, look, route);
  } catch (e) {
    $("inspector-error").textContent = String(e.message || e);
    $("inspector-error").hidden = false;
  }
}

function drawInspector(c, look, route) {
  const n = Math.max(1, c.chain.length);
  const depth = {};
  for (const x of look.predicted) depth[x.pod] = { predicted: x.matched_blocks, confirmed: 0 };
  for (const x of look.confirmed) depth[x.pod] = { ...(depth[x.pod] || { predicted: 0 }), confirmed: x.matched_blocks };
  const pods = (status?.pods || []).filter((p) => p.model === c.model).map((p) => p.pod);
  for (const p of pods) depth[p] ||= { confirmed: 0, predicted: 0 };
  const chosen = route && !route.error ? route.pod : null;
  const order = Object.entries(depth).sort((a, b) => b[1].confirmed - a[1].confirmed || b[1].predicted - a[1].predicted || a[0].localeCompare(b[0]));
  $("inspector-bars").replaceChildren(...order.map(([pod, d]) => {
    const best = Math.max(d.confirmed, d.predicted);
    const fill = el("div", { class: d.confirmed >= d.predicted ? "fill" : "fill predicted" });
    fill.style.width = `${(100 * best) / n}%`;
    return el("div", { class: pod === chosen ? "bar chosen" : "bar", "data-pod": pod, "data-depth": d.confirmed, "data-predicted": d.predicted },
      el("span", { class: "name" }, pod), el("div", { class: "track" }, fill),
      el("span", {}, `${d.confirmed} of ${c.chain.length} blocks from engine events${d.predicted > d.confirmed ? `, ${d.predicted} predicted` : ""}`));
  }));
  $("inspector-choice").replaceChildren(chosen
    ? el("span", {}, "Would route to ", el("strong", { id: "inspector-chosen" }, chosen), ` (policy v${route.policy_version})`)
    : el("span", {}, route?.error ? `No route: ${route.error}` : "Nothing to route: the prompt is shorter than one block."));
  rows($("inspector-explain").tBodies[0], (route?.explain || []).map((x) => el("tr", { "data-pod": x.pod },
    el("td", {}, x.pod), el("td", { class: "num" }, x.matched), el("td", { class: "num" }, x.predicted),
    el("td", { class: "num" }, fmt(x.cost, 3)), el("td", {}, x.within_balance ? "yes" : "no"))));
  $("inspector-out").hidden = false;
}

$("inspector").addEventListener("submit", inspect);
$("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  token = $("token").value;
  sessionStorage.setItem("kvroute-token", token);
  $("token-form").hidden = true;
});
poll();
