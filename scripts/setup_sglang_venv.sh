#!/usr/bin/env bash
# Build the SGLang venv: SGLang beside tierkv, sharing tierkv's torch. Two users:
#   bench/bench_tree_vs_sglang.py  (SGLang's RadixCache side by side with tierkv's tree), and
#   tests/test_sglang_backend.py   (tierkv's L3 as SGLang's HiCache storage backend, driven through SGLang's
#                                   own host pools and cache-controller storage calls, on CPU).
#
# SGLang is installed without its dependencies (they pin a CUDA torch and much else neither user touches);
# the venv sees tierkv's venv through a .pth file, so torch, redis-py and the Mooncake client are not fetched
# again, and gets only the packages that importing SGLang's radix cache, host pools and storage interface pulls
# in. No PyPI torchvision loads beside torch's CPU build, and SGLang imports torchvision at import time (for
# vision models), so the venv gets a stand-in torchvision whose every use raises.
#   TIERKV_SGLANG_VENV  where to build it (default .venv-sglang in the repository)
#   SGLANG_VERSION      the SGLang release (default 0.5.23: the README's figures, the backend's interface)
# Prints the venv's python as its last line. Then e.g.: PYTHONPATH=. "$TIERKV_SGLANG_VENV/bin/python" bench/bench_tree_vs_sglang.py
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh  # tierkv's venv (torch, tierkv), reused when it exists
TIERKV_SITE="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SGL_VENV="${TIERKV_SGLANG_VENV:-.venv-sglang}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
SGL_PY="$SGL_VENV/bin/python"
_sgl_say() { echo "[sglang] $*" >&2; }
# An existing venv that already imports what both users need is reused as it is.
_sgl_ready() {
    [ -x "$SGL_PY" ] && "$SGL_PY" - "$SGLANG_VERSION" >/dev/null 2>&1 <<'EOF'
import importlib.metadata, sys
assert importlib.metadata.version("sglang") == sys.argv[1]
import sglang.srt.mem_cache.radix_cache
import sglang.srt.mem_cache.pool_host.mha, sglang.srt.mem_cache.pool_host.mla
import sglang.srt.managers.cache_controller, sglang.srt.mem_cache.storage
EOF
}
if _sgl_ready; then
    _sgl_say "reusing $SGL_VENV (sglang $SGLANG_VERSION imports)"
    echo "$(cd "$SGL_VENV" && pwd)/bin/python"
    exit 0
fi
if [ ! -x "$SGL_PY" ]; then
    _sgl_say "creating $SGL_VENV on top of $TIERKV_SITE"
    python -m venv "$SGL_VENV"
fi
SGL_SITE="$("$SGL_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# addsitedir (not a bare path) so the .pth files there run too: tierkv's editable install among them
echo "import site; site.addsitedir('$TIERKV_SITE')" > "$SGL_SITE/tierkv-venv.pth"
_sgl_say "installing sglang==$SGLANG_VERSION (no dependencies, ~40 MB)"
"$SGL_VENV/bin/pip" install -q --no-deps "sglang==$SGLANG_VERSION"
# What SGLang's radix cache, host pools and cache controller import, directly or through sglang.srt's
# package imports (triton is ~150 MB).
SGL_DEPS=(orjson psutil pybase64 triton msgspec pyzmq ipython dill apache-tvm-ffi sentencepiece compressed-tensors gguf)
_sgl_say "installing what those SGLang modules import: ${SGL_DEPS[*]}"
# pip's resolver complains of SGLang's pins (CUDA torch, exact versions) it was told not to install: noise
"$SGL_VENV/bin/pip" install -q "${SGL_DEPS[@]}" 2>&1 | { grep -v "requires\|dependency conflicts" || true; }
if ! "$SGL_PY" -c "import torchvision.transforms" 2>/dev/null; then
    _sgl_say "writing a stand-in torchvision into $SGL_SITE (SGLang imports it; no PyPI build loads on CPU torch)"
    mkdir -p "$SGL_SITE/torchvision"
    cat > "$SGL_SITE/torchvision/__init__.py" <<'EOF'
"""A stand-in torchvision written by tierkv's scripts/setup_sglang_venv.sh.

SGLang imports torchvision.transforms and friends when it loads (for vision models that tierkv's tests and
benchmarks never run), and no torchvision from PyPI loads beside torch's CPU build. Any submodule imports;
any name in one is a placeholder class, and calling it raises ImportError.
"""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+tierkv.standin"


class _Placeholder(type):
    def __getattr__(cls, name):
        return cls

    def __call__(cls, *args, **kwargs):
        raise ImportError("torchvision here is tierkv's stand-in (scripts/setup_sglang_venv.sh)")


class Unavailable(metaclass=_Placeholder):
    pass


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("torchvision."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        return None


sys.meta_path.append(_Submodules())
sys.modules[__name__].__class__ = _Module
EOF
fi
if ! _sgl_ready; then
    _sgl_say "SGLang's modules still do not import in $SGL_VENV; the error:"
    "$SGL_PY" -c "import sglang.srt.mem_cache.pool_host.mha, sglang.srt.managers.cache_controller" >&2 || true
    exit 1
fi
SGL_PY="$(cd "$SGL_VENV" && pwd)/bin/python"
_sgl_say "ready: PYTHONPATH=. $SGL_PY bench/bench_tree_vs_sglang.py; TIERKV_SGLANG_PYTHON=$SGL_PY for the tests"
echo "$SGL_PY"
