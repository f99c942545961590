// Node entry point: the wasm-bindgen package with its module already instantiated from
// the file beside it (browsers call the package's default export `init()` instead).
import { readFileSync } from "node:fs";
import { initSync } from "./pkg/kvroute.js";

initSync({ module: readFileSync(new URL("./pkg/kvroute_bg.wasm", import.meta.url)) });

export * from "./pkg/kvroute.js";
