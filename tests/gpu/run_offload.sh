#!/usr/bin/env bash
# Activation offload on ONE GPU (issue 19): the CUDA path's correctness, eager and inside a CUDA graph
# (tests/gpu/check_offload.py, PASS/FAIL lines), then launch.offload_bench within $OFFLOAD_BUDGET_S seconds
# (default 200). Expected run time on one H200: ~1 min for the checks, <= the budget for the benchmark
# (~3-4 min), so ~4-5 min in all; every step is under `timeout`.
# $OUT (default ./out) gets three files: summary.txt, offload_bench.json (written as it goes) and
# offload_logs.tgz (full logs).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; RES=${RES:-/tmp/offload_res}; mkdir -p "$OUT" "$RES"
[ -f .commit ] && export OVERLAP_GIT_COMMIT=$(cat .commit)
BUDGET=${OFFLOAD_BUDGET_S:-200}
SUMMARY=$OUT/summary.txt
status=0
{
  echo "commit=${OVERLAP_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo ?)} budget=${BUDGET}s"
  timeout 20 nvidia-smi --query-gpu=name,pci.bus_id,memory.total,memory.used,clocks.sm --format=csv,noheader
  timeout 10 nvidia-smi topo -m 2>/dev/null | head -4
  ls /sys/devices/system/node 2>/dev/null | grep -c '^node' | sed 's/^/numa nodes: /'
  grep MemAvailable /proc/meminfo
} > "$SUMMARY" 2>&1

timeout 150 python3 -m tests.gpu.check_offload > "$RES/check_offload.log" 2>&1 || status=1
grep -E "^(PASS|FAIL|SKIP)|checks passed" "$RES/check_offload.log" | cut -c1-400 | tee -a "$SUMMARY"

cmd="python3 -m launch.offload_bench --time-budget-s $BUDGET"
echo "== $cmd" | tee -a "$SUMMARY"
OVERLAP_COMMAND="$cmd" timeout $((BUDGET + 60)) $cmd --out "$OUT/offload_bench.json" > "$RES/offload_bench.log" 2>&1 \
  || { status=1; echo "!! offload_bench failed or timed out (rc=$?)" | tee -a "$SUMMARY"; }
grep -vE "^\[overlap\]" "$RES/offload_bench.log" | tail -90 >> "$SUMMARY"
grep -E "^\|.*(none|keep|recompute|offload_all|planner)|target|note:" "$RES/offload_bench.log" | cut -c1-300
tail -3 "$RES/offload_bench.log"

tar czf "$OUT/offload_logs.tgz" -C "$RES" . 2>/dev/null
exit $status
