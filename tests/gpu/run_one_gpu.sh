#!/usr/bin/env bash
# For a one-GPU machine: every CUDA code path with W = 2, 4, 8 processes sharing the GPU (ipc pool backend;
# correctness only: the ops, eager replays, capture idioms, torch.compile modes, reliability), the zero-SM
# wait check, the eager host cost (2 processes), and the correctness checks of the Gluon GEMM (its chunk wait and
# scatter), FP8, swiglu and offload. Each step runs under `timeout`; a failed step does not stop the others.
#   bash tests/gpu/run_one_gpu.sh                 (ONLY=smoke,zero_sm,... to run some; WORLDS=2,4,8)
# $OUT (default ./out) gets: summary.txt, smoke_one_gpu.json, smoke_model.json, zero_sm_wait.json, host_cost.json and
# logs.tgz (every log). At most 8 files, as the device tool returns.
set -uo pipefail
source tests/gpu/env.sh
OUT=${OUT:-$PWD/out}; LOGS=${LOGS:-/tmp/one_gpu_logs}; mkdir -p "$OUT" "$LOGS"
ONLY=${ONLY:-zero_sm,gluon,gluon_wait,gluon_scatter,gluon_reduce,fp8,swiglu,offload,host_cost,smoke,model}
SUMMARY=$OUT/summary.txt
status=0
echo "commit=${OVERLAP_GIT_COMMIT:-?} only=$ONLY $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)" \
  | tee "$SUMMARY"

step() {  # name, limit_s, command...: run it, keep its log, print its tail
  local name=$1 limit=$2; shift 2
  [[ ",$ONLY," == *",$name,"* ]] || return 0
  local start=$SECONDS
  echo "== $name (limit ${limit}s): $*" | tee -a "$SUMMARY"
  OVERLAP_COMMAND="$*" timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  [[ $rc -ne 0 ]] && status=1
  echo "   rc=$rc after $((SECONDS - start)) s" | tee -a "$SUMMARY"
  grep -vE "^\[rank|^W1201|^\s*$|OMP_NUM_THREADS|^\*+$" "$LOGS/$name.log" | tail -n 60 | cut -c1-600 | tee -a "$SUMMARY"
}

step zero_sm 45 python3 -m tests.gpu.check_zero_sm_wait --json "$OUT/zero_sm_wait.json"
step gluon 240 python3 -m tests.gpu.check_gluon_gemm
step gluon_wait 120 python3 -m tests.gpu.check_gluon_chunk_wait
step gluon_scatter 120 python3 -m tests.gpu.check_gluon_scatter
step gluon_reduce 120 python3 -m tests.gpu.check_gluon_reduce
step fp8 120 python3 -m tests.gpu.check_fp8
step swiglu 90 python3 -m tests.gpu.check_swiglu
step offload 90 python3 -m tests.gpu.check_offload
step host_cost 200 torchrun --standalone --nproc-per-node 2 -m tp_overlap.launch.host_cost --out "$OUT/host_cost.json"
step smoke 420 python3 -m tests.gpu.smoke_one_gpu --worlds "${WORLDS:-2,4,8}" --json "$OUT/smoke_one_gpu.json"
step model 420 python3 -m tests.gpu.smoke_model --worlds 2,4 --json "$OUT/smoke_model.json"
tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
exit $status
