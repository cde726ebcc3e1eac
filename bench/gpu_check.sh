#!/usr/bin/env bash
# For a lent GPU, at most 5 minutes: the engine exactness tests on CUDA, the L1<->L2 copy benchmark and the
# engine benchmark (--quick) on CUDA, then one table. Usage: bash bench/gpu_check.sh [python]
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${1:-${PYTHON:-python}}"
WORK="${OUT:-$(mktemp -d)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEVICE="${TIERKV_GPU_CHECK_DEVICE:-cuda}"  # cpu: a dry run of this script on a machine without a GPU
export TIERKV_TEST_DEVICE="$DEVICE"

if [ "$DEVICE" != cpu ]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        echo "gpu_check: torch sees no CUDA device" >&2; exit 2; }
    "$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
fi

timeout 150 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$WORK/exact.xml" \
    tests/test_engine_exact.py tests/test_engine_l3.py tests/test_engine_scheduler.py > "$WORK/exact.log" 2>&1
tests_rc=$?
tail -3 "$WORK/exact.log"
timeout 60 "$PY" bench/copybench.py --device "$DEVICE" --mib "${TIERKV_GPU_CHECK_MIB:-512}" \
    --json "$WORK/copy.json" > "$WORK/copy.log" 2>&1
copy_rc=$?
timeout 75 "$PY" -m tierkv.engine.cli bench --quick --device "$DEVICE" --json "$WORK/engine.json" \
    > "$WORK/engine.log" 2>&1
engine_rc=$?

"$PY" - "$WORK" "$tests_rc" "$copy_rc" "$engine_rc" <<'PYEOF'
import json, os, sys
import xml.etree.ElementTree as ET
work, tests_rc, copy_rc, engine_rc = sys.argv[1], *map(int, sys.argv[2:])
rows = []
try:
    suite = ET.parse(os.path.join(work, "exact.xml")).getroot().iter("testsuite").__next__()
    total, bad = int(suite.get("tests")), int(suite.get("failures")) + int(suite.get("errors"))
    name = f"exactness tests ({os.environ['TIERKV_TEST_DEVICE']})"
    rows.append((name, f"{total - bad}/{total} passed", f"rc={tests_rc}"))
except Exception as exc:
    rows.append((f"exactness tests ({os.environ['TIERKV_TEST_DEVICE']})", "no result", f"rc={tests_rc} {exc}"))
try:
    for r in json.load(open(os.path.join(work, "copy.json"))):
        load = "-" if r["load_gbps"] is None else f"{r['load_gbps']:.1f}"
        rows.append((f"copy {r['case']}", f"write {r['write_gbps']:.1f} GB/s", f"load {load} GB/s"))
except Exception as exc:
    rows.append(("copy benchmark", "no result", f"rc={copy_rc} {exc}"))
try:
    results = json.load(open(os.path.join(work, "engine.json")))["results"]
    base = next(r for r in results if r["mode"] == "none")
    for r in results:
        if r["error"]:
            rows.append((f"engine {r['mode']}", "error", r["error"][:60]))
            continue
        rows.append((f"engine {r['mode']}", f"TTFT p50 {r['ttft_p50_s'] * 1e3:.1f} ms "
                     f"({base['ttft_p50_s'] / r['ttft_p50_s']:.2f}x)",
                     f"{r['throughput_tokens_per_s']:.0f} tok/s "
                     f"({r['throughput_tokens_per_s'] / base['throughput_tokens_per_s']:.2f}x)"))
except Exception as exc:
    rows.append(("engine benchmark", "no result", f"rc={engine_rc} {exc}"))
width = max(len(r[0]) for r in rows)
print(f"\n{'check':<{width}}  {'result':<36}  detail")
for name, result, detail in rows:
    print(f"{name:<{width}}  {result:<36}  {detail}")
sys.exit(1 if tests_rc or copy_rc or engine_rc else 0)
PYEOF
