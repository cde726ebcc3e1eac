#!/usr/bin/env bash
# Build the venv bench/bench_tree_vs_sglang.py runs in: SGLang beside tierkv, sharing tierkv's torch.
#
# SGLang is installed without its dependencies (they pin a CUDA torch and much else the tree benchmark
# never touches); the venv sees tierkv's venv through a .pth file, so torch is not fetched again, and
# gets only the packages that importing sglang.srt.mem_cache.radix_cache pulls in.
#   TIERKV_SGLANG_VENV  where to build it (default .venv-sglang in the repository)
#   SGLANG_VERSION      the SGLang release to compare against (default 0.5.23, the README's figures)
# Then: PYTHONPATH=. "$TIERKV_SGLANG_VENV/bin/python" bench/bench_tree_vs_sglang.py
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh  # tierkv's venv (torch, tierkv), reused when it exists
TIERKV_SITE="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SGL_VENV="${TIERKV_SGLANG_VENV:-.venv-sglang}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
if [ ! -x "$SGL_VENV/bin/python" ]; then
    echo "[sglang] creating $SGL_VENV on top of $TIERKV_SITE" >&2
    python -m venv "$SGL_VENV"
fi
SGL_SITE="$("$SGL_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# addsitedir (not a bare path) so the .pth files there run too: tierkv's editable install among them
echo "import site; site.addsitedir('$TIERKV_SITE')" > "$SGL_SITE/tierkv-venv.pth"
echo "[sglang] installing sglang==$SGLANG_VERSION (no dependencies, ~40 MB)" >&2
"$SGL_VENV/bin/pip" install --no-deps "sglang==$SGLANG_VERSION"
# What the radix cache module imports, directly or through sglang.srt's package imports (triton is ~150 MB).
echo "[sglang] installing what sglang.srt.mem_cache.radix_cache imports: orjson psutil pybase64 triton msgspec" \
     "pyzmq ipython dill apache-tvm-ffi sentencepiece compressed-tensors gguf" >&2
"$SGL_VENV/bin/pip" install orjson psutil pybase64 triton msgspec pyzmq ipython dill apache-tvm-ffi \
    sentencepiece compressed-tensors gguf
PYTHONPATH=. "$SGL_VENV/bin/python" -c "import sys; sys.path.insert(0, 'bench'); import bench_tree_vs_sglang as b; b.import_sglang()"
echo "[sglang] ready: PYTHONPATH=. $SGL_VENV/bin/python bench/bench_tree_vs_sglang.py" >&2
