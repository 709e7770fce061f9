#!/usr/bin/env bash
# The whole GPU suite in one call on the GPU machine: tests, then benchmarks; JSON + logs under $OUT
# (or ./out), a short table last. Usage (from the repo root): bash tests/gpu/run_all.sh [pytest -k expr]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
# nvshmem4py is not installed on the GPU machine: carry its wheel in .whl/ (see README "GPU runs").
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
[ -f .commit ] && export OVERLAP_GIT_COMMIT=$(cat .commit)
NGPU=$(nvidia-smi -L | wc -l)
echo "gpus=$NGPU commit=${OVERLAP_GIT_COMMIT:-?}" | tee "$OUT/summary.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee -a "$OUT/summary.txt"

status=0
KEXPR=${1:-}
timeout 900 python3 -m pytest -m gpu tests/gpu -q -x ${KEXPR:+-k "$KEXPR"} --junitxml="$OUT/gpu_tests.xml" \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -25 || status=1
grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -1 | sed 's/^/tests: /' >> "$OUT/summary.txt"

bench() {  # name, then the launch.bench arguments
  local name=$1; shift
  local cmd="torchrun --standalone --nproc-per-node $NGPU -m launch.bench $*"
  echo "== $cmd" | tee -a "$OUT/summary.txt"
  OVERLAP_COMMAND="$cmd" timeout 600 $cmd --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || status=1
  grep -E '^\|' "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
bench pool_bw_torch --op pool_bw --backend torch
bench pool_bw_nvshmem --op pool_bw --backend nvshmem --sizes-mb 1,16,64
echo; cat "$OUT/summary.txt"
exit $status
