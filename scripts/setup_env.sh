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
if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
            || echo "warning: could not install redis-server; redis tests will be skipped" >&2
    else
        echo "warning: redis-server missing and not root; redis tests will be skipped" >&2
    fi
fi
