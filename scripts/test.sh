#!/usr/bin/env bash
# Install everything the test suite needs on a fresh machine, then run it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
# With a C compiler the install built the native CPU copy; its tests must then run, not skip.
if command -v cc >/dev/null 2>&1; then
    export TIERKV_REQUIRE_NATIVE=1
fi
# real-vLLM connector tests run from this suite with a second venv's python (built once, then reused)
export TIERKV_VLLM_PYTHON="$(bash scripts/setup_vllm.sh | tail -1)"
python -m pytest -q -p no:cacheprovider "$@"
