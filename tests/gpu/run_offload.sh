#!/usr/bin/env bash
# Activation offload on ONE GPU, in one call of at most $TOTAL_S seconds (default 450, under the device
# tool's 8 minutes): the one-kernel swiglu against ATen's (tests/gpu/check_swiglu.py), the CUDA path's checks, eager and inside a CUDA graph, with every variant's peak
# against the step model (tests/gpu/check_offload.py, PASS/FAIL lines), then launch.offload_bench at
# realistic depth with the time left: llama8b 16 and 32 layers at M = 4096, llama70b 8 layers at M = 4096,
# llama8b 32 layers at M = 8192 (cheapest first; a point that does not fit the time left is skipped with a
# note). Per variant: peak and activation bytes at the peak, measured and predicted, step time measured
# and predicted, copy GB/s; the planner's budget sweep (auto, +0 %, +1 %, +5 %) for the Pareto plot.
#   bash tests/gpu/run_offload.sh          (POINTS=..., BUDGETS=..., TOTAL_S=... to change them)
# Expected on one H200: ~1 min of checks, ~3-4 min of benchmark, ~5 min in all.
# $OUT (default ./out) gets: summary.txt, swiglu_check.json, offload_bench.json (commit and command inside; rewritten after
# every point), offload_bench.png (peak and activation peak against step time) and offload_logs.tgz.
set -uo pipefail
source tests/gpu/env.sh
OUT=${OUT:-$PWD/out}; RES=${RES:-/tmp/offload_res}; mkdir -p "$OUT" "$RES"
TOTAL_S=${TOTAL_S:-450}
POINTS=${POINTS:-llama8b:16:4096,llama8b:32:4096,llama70b:8:4096,llama8b:32:8192}
BUDGETS=${BUDGETS:-auto,+0%,+1%,+5%}
SUMMARY=$OUT/summary.txt
status=0
{
  echo "commit=${OVERLAP_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo ?)} total=${TOTAL_S}s"
  timeout 20 nvidia-smi --query-gpu=name,pci.bus_id,memory.total,memory.used,clocks.sm --format=csv,noheader
  ls /sys/devices/system/node 2>/dev/null | grep -c '^node' | sed 's/^/numa nodes: /'
  grep MemAvailable /proc/meminfo
} > "$SUMMARY" 2>&1
cat "$SUMMARY"

start=$SECONDS
timeout 90 python3 -m tests.gpu.check_swiglu --json "$OUT/swiglu_check.json" > "$RES/check_swiglu.log" 2>&1 || status=1
grep -E "^(PASS|FAIL|SKIP)|checks passed" "$RES/check_swiglu.log" | cut -c1-500 | tee -a "$SUMMARY"
timeout 120 python3 -m tests.gpu.check_offload > "$RES/check_offload.log" 2>&1 || status=1
grep -E "^(PASS|FAIL|SKIP)|checks passed" "$RES/check_offload.log" | cut -c1-500 | tee -a "$SUMMARY"
echo "checks: $((SECONDS - start)) s" | tee -a "$SUMMARY"

# the benchmark gets what is left, less a margin for the last point's overrun and the tail of this script;
# it starts no point it cannot finish in its budget (estimated from measured layer times)
left=$((TOTAL_S - SECONDS - 25))
if [ "$left" -lt 60 ]; then
  echo "!! no time left for the benchmark (${left}s): skipped" | tee -a "$SUMMARY"; status=1
else
  cmd="python3 -m tp_overlap.launch.offload_bench --points $POINTS --budget $BUDGETS --time-budget-s $left"
  echo "== $cmd" | tee -a "$SUMMARY"
  # progress lines ("<point>: starting / planner / done at ... s") reach the console as they happen
  OVERLAP_COMMAND="$cmd" timeout $((left + 20)) $cmd --out "$OUT/offload_bench.json" \
    > "$RES/offload_bench.log" 2> >(tee "$RES/offload_bench.err" | grep --line-buffered -E ": (starting|done)|skipped" >&2)
  rc=$?
  [ "$rc" -ne 0 ] && { status=1; echo "!! offload_bench rc=$rc (124: cut by the outer timeout)" | tee -a "$SUMMARY"; }
  grep -vE "^\[overlap\]" "$RES/offload_bench.log" | grep -vE "^\| L[0-9]+\." | tail -200 >> "$SUMMARY"
  grep -E "^= |target|^note:|copies D2H|  heat:|^wrote" "$RES/offload_bench.log" | cut -c1-400
  tail -3 "$RES/offload_bench.err"
fi
[ -f "$OUT/offload_bench.png" ] || echo "!! no plot written" | tee -a "$SUMMARY"
echo "total: $SECONDS s" | tee -a "$SUMMARY"
tar czf "$OUT/offload_logs.tgz" -C "$RES" . 2>/dev/null
exit $status
