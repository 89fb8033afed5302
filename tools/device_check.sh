#!/usr/bin/env bash
# What only a machine with a CUDA GPU can check, as one short run on the device tool's H200 (never run there yet;
# its steps are bounded at 540 s in all, inside the device's 600 s a call). CI has no GPU: there
# these tests are skipped. Run from anywhere, with the machine's own
# python3 (torch and triton preinstalled, nothing downloadable), the packages taken from this checkout:
#
#   bash tools/device_check.sh            # results under $OUT (the device tool's) or /tmp/device_check
#
# 1. the compiled Triton kernels against the torch path, on sizes that run many programs at once;
# 2. the codec suite with chunks on the GPU (DeviceStagingCodec: Triton on the device, codes via the host);
# 3. DiLoCo's int8 outer step with the pseudo-gradient on the GPU against the host path;
# 4. tools/bench_quant.py: Triton's GB/s beside a CUDA copy_, and the CPU paths (torch and C++) with one
#    and with all cores (the 2-core CI machine could not measure the thread pool's scaling);
# 5. tools/bench_transports.py: the fp32 and int8 rings (C++ codec) with cores to spare: on the 2-core
#    machine each rank has one core, which is what bounds the unshaped int8 ring there.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-/tmp/device_check}
mkdir -p "$DEST"
PYTHONPATH=$(ls -d packages/*/src transports/*/src kernels/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH PYTHONUNBUFFERED=1
status=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $DEST/NAME.log, remember a failure
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date +%T), limit ${limit}s): $*"
    timeout "$limit" "$@" 2>&1 | tee "$DEST/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}

step env 30 "$PY" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
step pytest 180 "$PY" -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib -ra" \
    kernels/tests/test_kernels_triton.py kernels/tests/test_kernels_quant.py packages/core/tests/test_codecs.py \
    tests/test_outer_step_on_gpu.py -k "compiled or Cuda or gpu"
step bench_quant 150 env OPENPRIME_INT8_NATIVE=1 "$PY" tools/bench_quant.py --sizes-mib 64 256 --rounds 5 --native
step bench_transports 180 env OPENPRIME_INT8_NATIVE=1 "$PY" tools/bench_transports.py --transports gloo,tcp --world-sizes 2,4 --reps 3 --out "$DEST/bench_transports.md"
exit $status
