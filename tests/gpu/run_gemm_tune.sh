#!/usr/bin/env bash
# One GPU (H200), one capped run: FP8 + stream-K correctness, block tuning, bf16 and FP8 benchmarks.
#   bash tests/gpu/run_gemm_tune.sh          # TUNE_BUDGET_S (240) and BENCH_BUDGET_S (60) set the budgets
# Expected ~5-6 min, at most ~7.6 min: check_fp8 <= 60 s, gemm_tune <= TUNE_BUDGET_S + 10 s (its own
# loop stops starting shapes 15 s before TUNE_BUDGET_S, leaving time for start-up and the last shape),
# each bench <= BENCH_BUDGET_S + 10 s (likewise). Every step has its own timeout; a step that fails or
# times out keeps what it wrote and the next one still runs. $OUT gets 8 files: summary.txt, check_fp8.log, the tuned tables
# gemm_blocks_h200.yaml (-> configs/gemm_blocks/h200.yaml) and gemm_blocks_h200_fp8.yaml
# (-> configs/gemm_blocks/h200_fp8.yaml), gemm_tune_h200.json, gemm_h200_tp2_4_8.json, gemm_fp8_h200.json,
# and logs.tgz (every log). JSON and tables are rewritten after every shape.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
OUT=${OUT:-$PWD/out}; LOGS=${LOGS:-/tmp/gemm_tune_logs}; mkdir -p "$OUT" "$LOGS"
[ -f .commit ] && export OVERLAP_GIT_COMMIT=$(cat .commit)
TUNE_BUDGET_S=${TUNE_BUDGET_S:-240}
BENCH_BUDGET_S=${BENCH_BUDGET_S:-60}
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
status=0
started=$(date +%s)

note() { echo "$*" | tee -a "$SUMMARY"; }
step() {  # name, timeout_s, command...: run one step with its own timeout, log under $LOGS
  local name=$1 limit=$2; shift 2
  local begin=$(date +%s)
  note "== [$name] $* (timeout ${limit}s)"
  OVERLAP_COMMAND="$*" timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  note "-- [$name] rc=$rc in $(( $(date +%s) - begin ))s"
  if [ $rc -ne 0 ]; then status=1; tail -15 "$LOGS/$name.log" | cut -c1-300 >> "$SUMMARY"; fi
}

note "commit=${OVERLAP_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo ?)} tune=${TUNE_BUDGET_S}s bench=${BENCH_BUDGET_S}s"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader 2>&1 | tee -a "$SUMMARY"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$SUMMARY"

# (a) correctness, compiled: quantiser bytes, FP8 GEMM vs dequantised product and _scaled_mm, chunk waits, stream-K
step check_fp8 60 python3 -m tests.gpu.check_fp8
cp "$LOGS/check_fp8.log" "$OUT/check_fp8.log"
grep -E "^(PASS|FAIL)|checks passed" "$LOGS/check_fp8.log" | cut -c1-300 >> "$SUMMARY"

# (b) block tuning: every candidate on every (shape, layout) of TP 2/4/8, interleaved with cuBLAS
step gemm_tune $((TUNE_BUDGET_S + 10)) python3 -m launch.gemm_tune --tp 2,4,8 --time-budget-s $((TUNE_BUDGET_S - 15)) \
  --out-table "$OUT/gemm_blocks_h200.yaml" --out "$OUT/gemm_tune_h200.json"
grep -E "^gemm_tune:|dropped" "$LOGS/gemm_tune.log" | cut -c1-300 >> "$SUMMARY"

# (c) the table's choice vs cuBLAS (both layouts), then FP8 vs torch._scaled_mm and bf16 cuBLAS
table=$OUT/gemm_blocks_h200.yaml; [ -s "$table" ] || table=configs/gemm_blocks/h200.yaml
step gemm_bench $((BENCH_BUDGET_S + 10)) python3 -m launch.gemm_bench --tp 2,4,8 --table "$table" --reps 10 \
  --time-budget-s $((BENCH_BUDGET_S - 10)) --out "$OUT/gemm_h200_tp2_4_8.json"
grep -E "^(kn|nk):|shapes measured" "$LOGS/gemm_bench.log" >> "$SUMMARY"
step gemm_bench_fp8 $((BENCH_BUDGET_S + 10)) python3 -m launch.gemm_bench --fp8 --tp 2,4,8 --reps 10 \
  --time-budget-s $((BENCH_BUDGET_S - 10)) --out "$OUT/gemm_fp8_h200.json" --write-table "$OUT/gemm_blocks_h200_fp8.yaml"
grep -E "^fp8:|shapes measured|failed" "$LOGS/gemm_bench_fp8.log" | cut -c1-300 >> "$SUMMARY"

rm -f "$OUT"/*.tmp "$OUT"/*.tmp[0-9]*   # half-written files of a step killed by its timeout
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
note "total $(( $(date +%s) - started ))s, status=$status"
cat "$SUMMARY"
exit $status
