#!/usr/bin/env bash
# Install tierkv and replay a real request trace through L1 -> L2 -> L3 (file) on CPU, printing a report.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
TRACE="${1:-../shared/data/traces/conversation_trace.jsonl}"
L3_DIR="$(mktemp -d)"
trap 'rm -rf "$L3_DIR"' EXIT
tierkv replay "$TRACE" --l3 "file:$L3_DIR" --json "${TIERKV_DEMO_JSON:-/tmp/tierkv-demo.json}"
