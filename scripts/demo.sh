#!/usr/bin/env bash
# Install tierkv and replay a real request trace (Mooncake conversation trace, 12,031 requests, shipped in
# data/traces/) through L1 -> L2 -> L3 (files in a temp dir) on CPU, beside the no-cache, L1-only and
# Belady-optimal baselines. Everything it reads is inside this repository.
#
# Page size 512 (the trace's own block size) rather than the default 16: the trace's blocks are the unit of
# its sharing (the file backend writes one pack file per backup batch, whatever the page size). Everything
# else is the command's defaults: L1 500k tokens, L2 4M tokens, GDSF eviction, write_through, Llama-3-8B for the TTFT model.
# Usage: bash scripts/demo.sh [TRACE [REPLAY ARGS...]]. Environment: see scripts/setup_env.sh (TIERKV_VENV,
# TIERKV_TORCH_INDEX, TIERKV_SKIP_INSTALL); TIERKV_DEMO_OUT names the results folder (default: a new
# /tmp/tierkv-demo.XXXXXX per run, so concurrent runs never overwrite each other), TIERKV_DEMO_JSON /
# TIERKV_DEMO_PLOT name the report files themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
TIERKV_SETUP_FOR=demo
source scripts/setup_env.sh
TRACE="${1:-data/traces/conversation_trace.jsonl.gz}"
shift || true  # further arguments go to `tierkv replay` (e.g. --limit 1000)
OUT_DIR="${TIERKV_DEMO_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/tierkv-demo.XXXXXX")}"
mkdir -p "$OUT_DIR"
JSON="${TIERKV_DEMO_JSON:-$OUT_DIR/report.json}"
PLOT="${TIERKV_DEMO_PLOT:-$OUT_DIR/hit_ratio.png}"
L3_DIR="$(mktemp -d "${TMPDIR:-/tmp}/tierkv-demo-l3.XXXXXX")"
# The L3 holds one pack file per backup batch (thousands of files, GBs for the whole trace): the folder is
# renamed at once and removed in the background, detached from this shell.
cleanup() {
    if [ -d "$L3_DIR" ]; then
        local trash="$L3_DIR.deleting"
        mv "$L3_DIR" "$trash" 2>/dev/null || trash="$L3_DIR"
        echo "[demo] removing the L3 pack files in $trash in the background" >&2
        (setsid nohup rm -rf "$trash" >/dev/null 2>&1 &) || rm -rf "$trash"
    fi
}
trap cleanup EXIT
echo "[demo] replaying $TRACE through L1 -> L2 -> L3 (file:$L3_DIR); results go to $OUT_DIR" >&2
# `python -m` from the repository root runs this checkout's code whatever the venv has installed.
python -m tierkv replay "$TRACE" --page-size 512 --l3 "file:$L3_DIR" --json "$JSON" --plot "$PLOT" "$@"
echo "[demo] report: $JSON" >&2
echo "[demo] plot:   $PLOT" >&2
