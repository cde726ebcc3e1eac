# Sourced by scripts/*.sh: a venv with torch (CPU build on disk), tierkv and the servers tests start.
VENV="${TIERKV_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
if ! python -c "import torch" 2>/dev/null; then
    pip install -q torch==2.13.0
fi
pip install -q -e ".[test,plot]"
# Servers and libraries the storage tests start or load: redis-server, and libibverbs1, which the
# Mooncake binaries link even for TCP transport.
APT_NEEDED=""
command -v redis-server >/dev/null 2>&1 || APT_NEEDED="$APT_NEEDED redis-server"
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || APT_NEEDED="$APT_NEEDED libibverbs1"
if [ -n "$APT_NEEDED" ]; then
    if [ "$(id -u)" = 0 ]; then
        # shellcheck disable=SC2086
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $APT_NEEDED >/dev/null) \
            || echo "warning: could not install$APT_NEEDED; redis/mooncake tests will be skipped" >&2
    else
        echo "warning:$APT_NEEDED missing and not root; redis/mooncake tests will be skipped" >&2
    fi
fi
# Mooncake Store client + mooncake_master, CPU build (the CUDA build needs libcuda to import).
if [ "$(uname -m)" = x86_64 ] && ! python -c "import mooncake.store" 2>/dev/null; then
    pip install -q "mooncake-transfer-engine-non-cuda>=0.3.13" \
        || echo "warning: could not install mooncake-transfer-engine-non-cuda; mooncake tests will be skipped" >&2
fi
