#!/usr/bin/env bash
# Every GPU check of the runtime and memory work in one run, for a machine with one CUDA GPU and a torch that
# sees it: the cuda-marked tests, the runtime and memory benchmarks against plain fp32, and one short search.
# Results (one text file per check) go to $OUT (default: device-results/). Each check has its own time limit,
# so a hang costs one check, not the run; the whole script took about 6 minutes on one H200 before the runtime
# and memory benchmarks gained their compiled rows (eager and compiled side by side, the compiled step saving
# codes; their compiles not yet timed on a GPU: each compiled memory row compiles a graph of its own). The checks
# run in the order of what they decide (the compiled step on CUDA first) and their limits add up to 960 s, within
# a lent GPU's 15 minutes only if the machine starts quickly: what is cut is the last. memory_settings: the
# device allocator's peak of every setting of bench_memory's suite (ResNet-18 w1.0 32 px b128 and w0.25 16 px b64
# among them), eager, torch.autocast(bfloat16) beside the policies (issue 67); gradient_codes: the same step with
# activation gradients handed on as codes (off CPU: an add's only) and float32, peak and time.
#
#   make device-wheels                   # here: optuna and what it needs, as wheels in .whl/ (for a GPU machine
#                                        # without them; Python 3.12, x86-64)
#   bash benchmarks/device_checks.sh     # there, from the repository root
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-results}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import optuna" 2>/dev/null; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "optuna is not importable and .whl/ holds no wheels: run 'make device-wheels' first" >&2
        exit 2
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/precsearch-site .whl/*.whl
    export PYTHONPATH=/tmp/precsearch-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

check() {  # check NAME SECONDS COMMAND...: run, keep its output, note its exit status
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit $limit s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local status=$?
    echo "$name: exit $status in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/$name.txt"
}

"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
    | tee "$OUT/summary.txt"
check cuda_tests 150 "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider tests
check memory 300 "$PYTHON" benchmarks/bench_memory.py --device cuda --width 1.0 --batch 128 \
    --compiled fp16,hfp8,all-low
check memory_settings 90 "$PYTHON" benchmarks/bench_memory.py --device cuda --suite
check gradient_codes 60 "$PYTHON" benchmarks/bench_memory.py --device cuda --width 0.25 --image-size 16 --batch 64 \
    --policies all-high,all-low --float32-activation-grads --time 5
check runtime 240 "$PYTHON" benchmarks/bench_runtime.py --device cuda --width 1.0 --batch 128 --steps 10 --warmup 3
check search 120 "$PYTHON" -m precsearch search resnet18:width=0.25 --trials 8 --proxy-steps 100 --device cuda \
    --out /tmp/precsearch-device-search --no-progress
