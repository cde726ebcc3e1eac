#!/usr/bin/env bash
# Install tierkv and replay a real request trace (Mooncake conversation trace, 12,031 requests, shipped in
# data/traces/) through L1 -> L2 -> L3 (files in a temp dir) on CPU, beside the no-cache, L1-only and
# Belady-optimal baselines. Everything it reads is inside this repository.
#
# Page size 512 (the trace's own block size) rather than the default 16: the file backend stores one file
# per page, and at 16 tokens a page the full trace would write ~6 million files. Everything else is the
# command's defaults: L1 500k tokens, L2 4M tokens, LRU, write_through, Llama-3-8B for the TTFT model.
# Usage: bash scripts/demo.sh [TRACE [REPLAY ARGS...]]. Environment: see scripts/setup_env.sh (TIERKV_VENV, TIERKV_TORCH_INDEX, TIERKV_SKIP_INSTALL);
# TIERKV_DEMO_JSON / TIERKV_DEMO_PLOT name the report files.
set -euo pipefail
cd "$(dirname "$0")/.."
TIERKV_SETUP_FOR=demo
source scripts/setup_env.sh
TRACE="${1:-data/traces/conversation_trace.jsonl.gz}"
shift || true  # further arguments go to `tierkv replay` (e.g. --limit 1000)
L3_DIR="$(mktemp -d)"
trap 'rm -rf "$L3_DIR"' EXIT
# `python -m` from the repository root runs this checkout's code whatever the venv has installed.
python -m tierkv replay "$TRACE" --page-size 512 --l3 "file:$L3_DIR" \
    --json "${TIERKV_DEMO_JSON:-/tmp/tierkv-demo.json}" --plot "${TIERKV_DEMO_PLOT:-/tmp/tierkv-demo.png}" "$@"
