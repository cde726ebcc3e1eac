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
# SGLang storage-backend tests run with a third venv's python: SGLang 0.5.23 on tierkv's CPU torch (~1 min and
# ~330 MB on a fresh machine, then reused). TIERKV_SGLANG=0 skips the build; where it fails, those tests skip
# (an empty TIERKV_SGLANG_PYTHON says "no SGLang venv").
export TIERKV_SGLANG_PYTHON=""
if [ "${TIERKV_SGLANG:-1}" != 0 ]; then
    if ! TIERKV_SGLANG_PYTHON="$(TIERKV_SKIP_INSTALL=1 bash scripts/setup_sglang_venv.sh | tail -1)"; then
        TIERKV_SGLANG_PYTHON=""
        echo "warning: the SGLang venv did not build; tests/test_sglang_backend.py will skip" >&2
    fi
fi
python -m pytest -q -p no:cacheprovider "$@"
