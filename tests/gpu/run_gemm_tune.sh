#!/usr/bin/env bash
# One GPU (H200), one capped run: bf16 block tuning, then the bf16 and FP8 benchmarks, then the compiled
# correctness checks (FP8, stream-K's late contributors, split-K).
#   timeout 505 bash tests/gpu/run_gemm_tune.sh        # TOTAL_S (480): the whole run's wall-time bound
# Every step gets an absolute deadline inside TOTAL_S and its own timeout; a step that fails or times out
# keeps what it wrote and the next one still runs (marks for TOTAL_S = 480, scaled otherwise):
#   gemm_tune    until 250 s  compile phase (all candidates incl. 9 split-K, 12 processes) <= 120 s, then TP 2/4/8
#                             x M 1024..16384 x kn/nk (240 points, ~60-120 s), M = 1024 and 16384 first
#   gemm_bench   until 330 s  the new table vs cuBLAS, 240 points, 20 reps (~30 s)
#   fp8 bench    until 400 s  FP8 candidates vs torch._scaled_mm and bf16 cuBLAS, 120 points (~50 s)
#   check_fp8    until 440 s  quantisers, FP8 GEMM tails, chunk waits, stream-K incl. late contributors (~30 s)
#   check_splitk until 475 s  split-K: every candidate, both layouts, poisoned outputs, repeated and queued
#                             calls, tails, a capped grid, CUDA-graph replays (~30-60 s, mostly compiling)
# $OUT gets: summary.txt, gemm_blocks_h200.yaml (-> configs/gemm_blocks/h200.yaml), gemm_tune_h200.json,
# gemm_h200.json (-> results/), gemm_fp8_h200.json (-> results/), gemm_blocks_h200_fp8.yaml
# (-> configs/gemm_blocks/h200_fp8.yaml), check_fp8.log, check_splitk.log, logs.tgz. JSON and tables are
# rewritten after every point, so a step cut short still leaves what it measured.
set -uo pipefail
source tests/gpu/env.sh
OUT=${OUT:-$PWD/out}; LOGS=${LOGS:-/tmp/gemm_tune_logs}; mkdir -p "$OUT" "$LOGS"
TOTAL_S=${TOTAL_S:-480}
started=$(date +%s)
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
status=0

note() { echo "$*" | tee -a "$SUMMARY"; }
until_s() { echo $(( $1 * TOTAL_S / 480 - ($(date +%s) - started) )); }   # seconds left to a mark of the plan
step() {  # name, timeout_s, command...: run one step with its own timeout, log under $LOGS
  local name=$1 limit=$2; shift 2
  local begin=$(date +%s)
  if [ "$limit" -lt 15 ]; then note "== [$name] skipped: ${limit}s left"; status=1; return; fi
  note "== [$name] $* (timeout ${limit}s)"
  OVERLAP_COMMAND="$*" timeout --kill-after=5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  note "-- [$name] rc=$rc in $(( $(date +%s) - begin ))s"
  if [ $rc -ne 0 ]; then status=1; tail -15 "$LOGS/$name.log" | cut -c1-300 >> "$SUMMARY"; fi
}

note "commit=${OVERLAP_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo ?)} total=${TOTAL_S}s"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader 2>&1 | tee -a "$SUMMARY"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$SUMMARY"

# (a) block tuning: the tuner stops starting points at its own bound, 10 s before the step's timeout
left=$(until_s 250)
step gemm_tune "$left" python3 -m tp_overlap.launch.gemm_tune --tp 2,4,8 --time-budget-s $((left - 10)) \
  --out-table "$OUT/gemm_blocks_h200.yaml" --out "$OUT/gemm_tune_h200.json"
grep -E "^gemm_tune:|dropped|compile phase" "$LOGS/gemm_tune.log" | cut -c1-300 >> "$SUMMARY"

# (b) the new table's choice vs cuBLAS, both layouts, L2 flushed, interleaved, median of 20
table=$OUT/gemm_blocks_h200.yaml; [ -s "$table" ] || table=configs/gemm_blocks/h200.yaml
left=$(until_s 330)
step gemm_bench "$left" python3 -m tp_overlap.launch.gemm_bench --tp 2,4,8 --table "$table" --reps 20 \
  --time-budget-s $((left - 10)) --out "$OUT/gemm_h200.json"
grep -E "^(kn|nk):|shapes measured" "$LOGS/gemm_bench.log" >> "$SUMMARY"

# (c) FP8 block-scaled: every candidate checked against torch._scaled_mm, then timed; the fastest per shape
left=$(until_s 400)
step gemm_bench_fp8 "$left" python3 -m tp_overlap.launch.gemm_bench --fp8 --tp 2,4,8 --reps 20 \
  --time-budget-s $((left - 10)) --out "$OUT/gemm_fp8_h200.json" --write-table "$OUT/gemm_blocks_h200_fp8.yaml"
grep -E "^fp8:|shapes measured|failed" "$LOGS/gemm_bench_fp8.log" | cut -c1-300 >> "$SUMMARY"

# (d) compiled correctness: quantiser bytes, FP8 GEMM tails and chunk waits, stream-K with late contributors
step check_fp8 "$(until_s 440)" python3 -m tests.gpu.check_fp8
cp "$LOGS/check_fp8.log" "$OUT/check_fp8.log" 2>/dev/null
grep -E "^(PASS|FAIL)|checks passed" "$LOGS/check_fp8.log" | cut -c1-300 >> "$SUMMARY"

# (e) compiled split-K correctness: poisoned outputs, repeated and queued calls, tails, graphs
step check_splitk "$(until_s 475)" python3 -m tests.gpu.check_splitk
cp "$LOGS/check_splitk.log" "$OUT/check_splitk.log" 2>/dev/null
grep -E "^(PASS|FAIL)|checks passed" "$LOGS/check_splitk.log" | cut -c1-300 >> "$SUMMARY"

rm -f "$OUT"/*.tmp "$OUT"/*.tmp[0-9]*   # half-written files of a step killed by its timeout
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
note "total $(( $(date +%s) - started ))s, status=$status"
cat "$SUMMARY"
exit $status
