// Drives a real headless Chromium (Debian's) through the sidecar's status page and
// checks it against the sidecar's own API. Run by tests/tests/status_page.rs, which
// starts the stack and passes:
//   KVROUTE_URL         the sidecar's origin, e.g. http://127.0.0.1:9000
//   KVROUTE_EXPECT      JSON: {"inspect": {"path", "model", "body", "pod", "depth"}}
//   KVROUTE_SCREENSHOT  where to write the PNG
// Exits non-zero with a message on the first mismatch; prints a JSON summary last.
import { chromium } from "playwright-core";
import assert from "node:assert/strict";

const origin = process.env.KVROUTE_URL;
const expect = JSON.parse(process.env.KVROUTE_EXPECT || "{}");
const shot = process.env.KVROUTE_SCREENSHOT;
const chromiumPath = process.env.CHROMIUM || "/usr/bin/chromium";
assert.ok(origin, "KVROUTE_URL is required");

const api = async (path, init) => {
  const r = await fetch(origin + path, init);
  assert.equal(r.status, 200, `${path}: HTTP ${r.status}`);
  return r.json();
};

const browser = await chromium.launch({
  executablePath: chromiumPath,
  // As on these machines: no sandbox as root, and no background traffic to Google.
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"],
});
const summary = {};
try {
  const page = await browser.newPage({ viewport: { width: 1500, height: 1100 } });
  const offsite = [];
  const errors = [];
  let pageBytes = 0;
  page.on("request", (r) => { if (!r.url().startsWith(origin)) offsite.push(r.url()); });
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
  page.on("response", async (r) => {
    if (r.status() >= 400 && r.status() !== 401) errors.push(`${r.status()} ${r.url()}`);
    if (new URL(r.url()).pathname.startsWith("/ui")) pageBytes += (await r.body().catch(() => Buffer.alloc(0))).length;
  });

  await page.goto(`${origin}/ui/`, { waitUntil: "load" });

  // Live data: the pod table fills, and the live dot turns on.
  const st = await api("/v1/status");
  await page.waitForFunction((n) => document.querySelectorAll("#pods tbody tr").length === n, st.pods.length, { timeout: 15000 });
  await page.waitForSelector("#live.on", { timeout: 15000 });

  // Pods: the same set, states and block counts as the API.
  const rows = await page.$$eval("#pods tbody tr", (trs) => trs.map((tr) => ({
    pod: tr.dataset.pod, state: tr.children[2].textContent, blocks: Number(tr.children[8].dataset.blocks),
  })));
  const st2 = await api("/v1/status");
  assert.deepEqual(rows.map((r) => r.pod).sort(), st2.pods.map((p) => p.pod).sort(), "pod rows");
  for (const p of st2.pods) {
    const r = rows.find((x) => x.pod === p.pod);
    assert.equal(r.state, p.state, `state of ${p.pod}`);
    assert.equal(r.blocks, p.blocks ?? 0, `blocks of ${p.pod}`);
  }

  // Counters: nothing routes meanwhile, so the page's total is the API's.
  const total = await page.$eval("#t-decisions", (e) => e.textContent.replace(/,/g, ""));
  assert.equal(Number(total), st2.counters.decisions, "decisions total");
  assert.ok(st2.counters.decisions > 0, "the stack made decisions");
  // Sessions' later turns: how many left their bound pod, in the bindings tile's title.
  const turns = st2.counters.session_turns || {};
  const later = (turns.stayed ?? 0) + (turns.moved ?? 0);
  assert.ok(later > 0, `the traffic has sessions' later turns: ${JSON.stringify(turns)}`);
  const bindingsTitle = await page.$eval("#t-bindings", (e) => e.title);
  assert.ok(bindingsTitle.includes(`moved off their pod: ${turns.moved ?? 0} of ${later}`), `bindings tile: ${bindingsTitle}`);
  // A rate needs two polls; after a few it is a number.
  await page.waitForFunction(() => /^\d/.test(document.querySelector("#t-rate").textContent), null, { timeout: 10000 });

  // Models and the cache agreement column.
  const models = await page.$$eval("#models tbody tr", (trs) => trs.map((tr) => ({ model: tr.dataset.model, agreement: tr.children[6].dataset.agreement })));
  assert.deepEqual(models.map((m) => m.model), st2.models.map((m) => m.model), "model rows");
  for (const a of st2.agreement) {
    const m = models.find((x) => x.model === a.model);
    assert.equal(Number(m.agreement), a.recent_ratio, `agreement of ${a.model}`);
  }

  // Recent decisions: the API's newest are in the table, with their chosen pods.
  const dec = await api("/v1/decisions?limit=25");
  assert.ok(dec.decisions.length > 0);
  const shown = await page.$$eval("#decisions tbody tr", (trs) => trs.map((tr) => ({ id: tr.dataset.decision, pod: tr.querySelector(".chosen").textContent })));
  for (const d of dec.decisions.slice(0, 10)) {
    const s = shown.find((x) => x.id === d.decision);
    assert.ok(s, `decision ${d.decision} shown`);
    assert.ok(s.pod.startsWith(d.pod), `decision ${d.decision}: ${s.pod} vs ${d.pod}`);
  }

  // The prefix inspector, on prompts one pod holds (token ids, and a chat the sidecar
  // tokenizes with the model's tokenizer and template).
  const inspections = [].concat(expect.inspect || []);
  summary.inspector = [];
  for (const ins of inspections) {
    await page.selectOption("#i-path", ins.path);
    await page.fill("#i-model", ins.model || "");
    await page.fill("#i-body", ins.body);
    await page.evaluate(() => { document.querySelector("#inspector-out").hidden = true; });
    await page.click("#inspector button[type=submit]");
    await page.waitForSelector("#inspector-out:not([hidden]), #inspector-error:not([hidden])", { timeout: 15000 });
    const err = await page.$eval("#inspector-error", (e) => (e.hidden ? "" : e.textContent));
    assert.equal(err, "", "inspector error");
    const bars = await page.$$eval("#inspector-bars .bar", (bs) => bs.map((b) => ({ pod: b.dataset.pod, depth: Number(b.dataset.depth) })));
    const held = bars.filter((b) => b.depth > 0);
    assert.deepEqual(held, [{ pod: ins.pod, depth: ins.depth }], `bars: ${JSON.stringify(bars)}`);
    assert.equal(await page.$eval("#inspector-chosen", (e) => e.textContent), ins.pod, "would route to");
    const explained = await page.$$eval("#inspector-explain tbody tr", (trs) => trs.length);
    assert.ok(explained >= 2, "the dry run explains every candidate");
    const text = await page.$eval("#inspector-summary", (e) => e.textContent);
    if (ins.tokenized) assert.ok(text.includes("tokenized by the sidecar"), text);
    summary.inspector.push({ path: ins.path, pod: ins.pod, depth: ins.depth, candidates: bars.length });
  }

  assert.deepEqual(offsite, [], "the page reached nothing but the sidecar");
  assert.deepEqual(errors, [], "no script errors");
  if (shot) {
    await page.evaluate(() => window.scrollTo(0, 0));
    await page.screenshot({ path: shot, fullPage: true });
  }
  summary.page_bytes = pageBytes;
  summary.pods = rows.length;
  summary.decisions = st2.counters.decisions;
  console.log(JSON.stringify(summary));
} finally {
  await browser.close();
}
