#!/usr/bin/env bash
# For a lent GPU, under 5 minutes: the engine exactness tests and the Triton copy tests on CUDA, the L1<->L2
# copy table (every io_backend / host layout / copy path against a flat pinned copy, both directions and
# layer-wise, 64/512/4096 tokens), the overlap slowdown, the engine table (>= 5 interleaved repeats per
# preset), and the largest preset again with L2 too small for the working set (L1 + L2 hold ~60 % of it), whose
# "L3 hits" column shows whether L3 is read where it pays. Usage: bash bench/gpu_check.sh [python]
# TIERKV_GPU_CHECK_DEVICE=cpu: a dry run on a machine without a GPU (tiny sizes; the figures mean nothing).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${1:-${PYTHON:-python}}"
WORK="${OUT:-$(mktemp -d)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEVICE="${TIERKV_GPU_CHECK_DEVICE:-cuda}"
export TIERKV_TEST_DEVICE="$DEVICE"
MODELS="${TIERKV_GPU_CHECK_MODELS:-large-llama,tiny-llama,medium-llama}"  # the largest first: it matters most

if [ "$DEVICE" != cpu ]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        echo "gpu_check: torch sees no CUDA device" >&2; exit 2; }
    "$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
    "$PY" -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton: not installed"
    SIZE_ARGS=(--device cuda)
    TRITON_TESTS=(tests/test_triton_copy.py::test_compiled_kernel_on_cuda_reads_and_writes_pinned_host_memory)
    ENGINE_ARGS=(--device cuda --models "$MODELS" --min-repeats 5 --budget-s 20)
    L3_ARGS=(--device cuda --models "${MODELS%%,*}" --workload quick --repeats 3 --min-repeats 3)
else
    SIZE_ARGS=(--tiny)
    TRITON_TESTS=(tests/test_triton_copy.py::test_cache_round_trip_on_the_kernel_path)
    ENGINE_ARGS=(--tiny)
    L3_ARGS=(--tiny)
fi

SECONDS=0
timeout 90 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$WORK/exact.xml" \
    tests/test_engine_exact.py tests/test_engine_attention.py tests/test_step_costs.py "${TRITON_TESTS[@]}" > "$WORK/exact.log" 2>&1
tests_rc=$?
echo "tests ($DEVICE): $(tail -1 "$WORK/exact.log")  [${SECONDS}s]"
timeout 90 "$PY" bench/bench_gpu_copy.py "${SIZE_ARGS[@]}" --json "$WORK/copy.json" > "$WORK/copy.log" 2>&1
copy_rc=$?
cat "$WORK/copy.log"; echo "[${SECONDS}s]"
timeout 100 "$PY" bench/bench_engine_repeats.py "${ENGINE_ARGS[@]}" --json "$WORK/engine.json" \
    > "$WORK/engine.log" 2>&1
engine_rc=$?
echo; cat "$WORK/engine.log"; echo "[${SECONDS}s]"
timeout 60 "$PY" bench/bench_engine_repeats.py "${L3_ARGS[@]}" --conversations 16 --l2-fraction 0.1 \
    --json "$WORK/engine_l3.json" > "$WORK/engine_l3.log" 2>&1
l3_rc=$?
echo; echo "L2 too small for the working set:"; cat "$WORK/engine_l3.log"; echo "[${SECONDS}s]"
echo "gpu_check: tests rc=$tests_rc, copy rc=$copy_rc, engine rc=$engine_rc, small-L2 engine rc=$l3_rc; logs in $WORK"
[ "$tests_rc" = 0 ] && [ "$copy_rc" = 0 ] && [ "$engine_rc" = 0 ] && [ "$l3_rc" = 0 ]
