// The JS package computes exactly what the filter and the native CLI compute:
// - the protocol's test vectors, read from docs/protocol.md (the normative table);
// - random token prompts, text prompts and chat/completions bodies, against the native
//   `kvroute-sidecar hash` (KVROUTE_SIDECAR_BIN, built by `make test`).
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, writeFileSync, mkdtempSync } from "node:fs";
import { execFileSync } from "node:child_process";
import { tmpdir } from "node:os";
import { join } from "node:path";

import * as kv from "../node.mjs";

const root = new URL("../../../", import.meta.url);
const cli = process.env.KVROUTE_SIDECAR_BIN || new URL("target/debug/kvroute-sidecar", root).pathname;

// ---- the protocol's vectors -------------------------------------------------------

function vectors() {
  const doc = readFileSync(new URL("docs/protocol.md", root), "utf8");
  const rows = [];
  for (const line of doc.split("\n")) {
    const cells = line.trim().split("|").slice(1, -1).map((c) => c.trim().replace(/^`|`$/g, ""));
    if (cells.length !== 7 || !["tokens", "text"].includes(cells[0])) continue;
    const [mode, bs, model, adapter, salt, prompt, hashes] = cells;
    const want = hashes.split(",").map((h) => h.trim());
    rows.push({ mode, bs: Number(bs), model, adapter, salt, prompt, want });
  }
  return rows;
}

test("the protocol's test vectors (docs/protocol.md)", () => {
  const rows = vectors();
  assert.ok(rows.length >= 5, `found ${rows.length} vector rows in docs/protocol.md`);
  for (const r of rows) {
    let got;
    if (r.mode === "tokens") {
      const m = r.prompt.match(/^ids (\d+)\.\.(\d+)$/);
      assert.ok(m, `unknown token prompt ${r.prompt}`);
      const ids = Uint32Array.from({ length: Number(m[2]) - Number(m[1]) + 1 }, (_, i) => Number(m[1]) + i);
      got = kv.chainTokens(ids, r.model, r.adapter, r.salt, r.bs);
    } else {
      got = kv.chainText(r.prompt, r.model, r.adapter, r.salt, r.bs);
    }
    assert.deepEqual(got.slice(0, 2), r.want, JSON.stringify(r));
    assert.ok(got.every((h) => typeof h === "string" && /^\d+$/.test(h)), "hashes are decimal strings");
  }
});

test("hashes are u64 decimal strings, never rounded JS numbers", () => {
  const chain = kv.chainTokens(Uint32Array.from({ length: 4096 }, (_, i) => i * 7919), "m", "", "", 16);
  assert.equal(chain.length, 256);
  for (const h of chain) {
    const b = BigInt(h);
    assert.ok(b >= 0n && b < 1n << 64n);
    assert.equal(b.toString(), h);
  }
  assert.ok(chain.some((h) => BigInt(h) > BigInt(Number.MAX_SAFE_INTEGER)), "some exceed 2^53");
});

test("errors carry a stable reason label", () => {
  assert.throws(() => kv.chainTokens(new Uint32Array([1]), "m", "", "", 0), /^Error: bad_block_size:/);
  assert.throws(() => kv.chainRequest("/v1/embeddings", "{}", 16, 64, ""), /^Error: bad_path:/);
  assert.throws(() => kv.chainRequest("/v1/chat/completions", "{not json", 16, 64, ""), /^Error: \w+:/);
  assert.throws(() => kv.namespaceSeed("pixels", "m", "", "", 16), /^Error: bad_mode:/);
});

// ---- against the native CLI -------------------------------------------------------

let seed = 0x9e3779b9;
function rand() {
  seed ^= seed << 13; seed >>>= 0;
  seed ^= seed >>> 17;
  seed ^= seed << 5; seed >>>= 0;
  return seed / 0x100000000;
}
const pick = (a) => a[Math.floor(rand() * a.length)];
const PIECES = ["hello", " world", "é", "日本語のテキスト", "🙂🚀", "\n\n", "    ", "<|im_start|>", "{\"json\": true}", "fn main() {}", "\t", "\\", "\"", "Ω≈ç√"];
const text = (n) => Array.from({ length: n }, () => pick(PIECES)).join("");

function native(args, input) {
  const out = execFileSync(cli, ["hash", ...args], { input, encoding: "utf8" });
  return out.split("\n").filter((l) => l && !l.startsWith("#"));
}

test("agrees with the native CLI on random prompts", () => {
  const dir = mkdtempSync(join(tmpdir(), "kvroute-js-"));
  let compared = 0;
  for (let i = 0; i < 40; i++) {
    const bs = pick([1, 2, 4, 16, 64]);
    const model = pick(["m", "llama-3", "模型"]);
    const salt = pick(["", "", "tenant-a"]);
    const ids = Uint32Array.from({ length: Math.floor(rand() * 300) }, () => Math.floor(rand() * 0x100000000));
    const js = kv.chainTokens(ids, model, "", salt, bs);
    assert.deepEqual(js, native(["--model", model, "--salt", salt, "--block-size", String(bs), "--tokens", Array.from(ids).join(",") || ","]), `tokens #${i}`);
    compared++;
  }
  for (let i = 0; i < 30; i++) {
    const bs = pick([4, 16, 64]);
    const t = text(1 + Math.floor(rand() * 80));
    const js = kv.chainText(t, "m", "", "", bs);
    assert.deepEqual(js, native(["--model", "m", "--block-size", String(bs), "--text", t]), `text #${i}`);
    compared++;
  }
  for (let i = 0; i < 30; i++) {
    const bs = pick([4, 16, 64]);
    const chat = i % 3 !== 0;
    const body = chat
      ? {
          model: pick(["m", "m2"]),
          cache_salt: pick([undefined, "s1"]),
          tools: i % 4 === 0 ? [{ type: "function", function: { name: "f", parameters: { type: "object" } } }] : undefined,
          messages: Array.from({ length: 1 + Math.floor(rand() * 6) }, (_, j) => ({
            role: pick(["system", "user", "assistant", "tool"]),
            content: j % 5 === 4 ? [{ type: "text", text: text(3) }, { type: "image_url", image_url: { url: "https://example.com/x.png" } }] : text(1 + Math.floor(rand() * 20)),
          })),
        }
      : { model: "m", prompt: i % 2 ? text(20) : Array.from({ length: 50 }, () => Math.floor(rand() * 50000)) };
    const json = JSON.stringify(body);
    const path = chat ? "/v1/chat/completions" : "/v1/completions";
    const r = kv.chainRequest(path, json, bs, bs, "");
    const f = join(dir, `b${i}.json`);
    writeFileSync(f, json);
    assert.deepEqual(r.chain, native(["--block-size", String(bs), "--request", f, "--path", path]), `request #${i}: ${json.slice(0, 120)}`);
    assert.equal(r.mode, chat || typeof body.prompt === "string" ? "text" : "tokens");
    assert.equal(r.cacheSalt, body.cache_salt ?? "");
    compared++;
  }
  assert.equal(compared, 100);
});
