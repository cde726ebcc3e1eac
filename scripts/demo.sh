#!/usr/bin/env bash
# Install tierkv and replay a real request trace (Mooncake conversation trace, 12,031 requests) through
# L1 -> L2 -> L3 (files in a temp dir) on CPU, beside the no-cache, L1-only and Belady-optimal baselines.
#
# Page size 512 (the trace's own block size) rather than the default 16: the file backend stores one file
# per page, and at 16 tokens a page the full trace would write ~6 million files. Everything else is the
# command's defaults: L1 500k tokens, L2 4M tokens, LRU, write_through, Llama-3-8B for the TTFT model.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
TRACE="${1:-../shared/data/traces/conversation_trace.jsonl}"
L3_DIR="$(mktemp -d)"
trap 'rm -rf "$L3_DIR"' EXIT
tierkv replay "$TRACE" --page-size 512 --l3 "file:$L3_DIR" \
    --json "${TIERKV_DEMO_JSON:-/tmp/tierkv-demo.json}" --plot "${TIERKV_DEMO_PLOT:-/tmp/tierkv-demo.png}"
