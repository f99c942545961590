#!/usr/bin/env bash
# The main demo. Until the engine simulator lands it shows the operator's hash tool
# on an example request: the chain the filter computes for a chat conversation.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/kvroute-sidecar
echo "== kvroute: the block-hash chain of an example chat request (block size 64 bytes)"
cat docs/examples/chat.json
echo
$bin hash --block-size 64 --request docs/examples/chat.json --path /v1/chat/completions
echo "== the REFERENCE token vector: tokens 0..9, block size 4, model m"
$bin hash --model m --block-size 4 --tokens 0,1,2,3,4,5,6,7,8,9
