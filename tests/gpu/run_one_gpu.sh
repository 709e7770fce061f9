#!/usr/bin/env bash
# For a one-GPU machine: correctness smoke of every CUDA path (2 processes on one GPU) and the
# Triton-vs-cuBLAS GEMM table. JSON + logs under $OUT (default ./out).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
[ -f .commit ] && export OVERLAP_GIT_COMMIT=$(cat .commit)
status=0
timeout 420 python3 -m tests.gpu.smoke_one_gpu > "$OUT/smoke_one_gpu.log" 2>&1 || status=1
TP=${TP:-2}
if [[ -z ${SKIP_GEMM:-} ]]; then   # SKIP_GEMM=1: the smoke only
  cmd="python -m launch.gemm_bench --tp $TP"
  OVERLAP_COMMAND="$cmd" timeout 400 $cmd --out "$OUT/gemm_tp$TP.json" > "$OUT/gemm_tp$TP.log" 2>&1 || status=1
  grep -E "^\|" "$OUT/gemm_tp$TP.log"; tail -5 "$OUT/gemm_tp$TP.log" | grep -v "^|"
fi
grep -E "^rank|Error|error" "$OUT/smoke_one_gpu.log" | cut -c1-400 | head -60
exit $status
