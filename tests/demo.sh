#!/usr/bin/env bash
# The main demo (make demo): the whole stack on loopback — nats-server, kvroute-sidecar,
# 4 simulated engines, Envoy with the kvroute filter and a plain round-robin Envoy — and
# the same workload through both. Everything it starts is stopped when it ends.
set -euo pipefail
cd "$(dirname "$0")/.."
exec target/release/kvroute-stack demo --svg target/kvroute-demo-ttft.svg "$@"
