#!/usr/bin/env bash
# The GPU suite on the GPU machine, in phases so that each device call stays under its time limit:
#   bash tests/gpu/run_all.sh tests    # pytest -m gpu tests/gpu
#   bash tests/gpu/run_all.sh ops      # pool bandwidth, launch.bench ag_gemm and gemm_rs over the shape table
#                                      # (launch/cli/shapes.py)
#   bash tests/gpu/run_all.sh graphs   # the same (and tp_mlp) with every variant a CUDA-graph replay
#   bash tests/gpu/run_all.sh model    # launch.kfactor sweep and launch.tp_mlp
#   bash tests/gpu/run_all.sh all
# $OUT (default ./out) gets two files: results_<phase>.tgz (JSON, PNG, traces, logs, written under $RES,
# default /tmp/overlap_res, outside $OUT because the device tool returns only a few files per call) and
# summary.txt; a short table is printed last. The GPU count comes from nvidia-smi.
# Every launcher gets an explicit output under $RES (--out, kfactor --out-dir): without one a launcher
# writes into runs/<launcher>-<UTC time>/ of the working directory, and results/ only on request.
set -uo pipefail
PHASE=${1:-all}
source tests/gpu/env.sh
OUT=${OUT:-$PWD/out}; RES=${RES:-/tmp/overlap_res}; mkdir -p "$RES" "$OUT"
# nvshmem4py is not installed on the GPU machine: carry its wheel in .whl/ (docs/GPU_RUNS.md).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
NGPU=$(nvidia-smi -L | wc -l)
SUMMARY=$OUT/summary.txt
echo "phase=$PHASE gpus=$NGPU commit=${OVERLAP_GIT_COMMIT:-?}" | tee -a "$SUMMARY"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader | tee -a "$SUMMARY"
status=0

launch() {  # name, limit_s, module, args...: run one torchrun job, keep its JSON and log
  local name=$1 limit=$2 module=$3; shift 3
  local cmd="torchrun --standalone --nproc-per-node $NGPU -m $module $*"
  local out="--out $RES/$name.json"
  [[ $module == tp_overlap.launch.kfactor ]] && out=""   # kfactor writes into --out-dir
  echo "== $cmd" | tee -a "$SUMMARY"
  OVERLAP_COMMAND="$cmd" timeout "$limit" $cmd $out > "$RES/$name.log" 2>&1 \
    || { status=1; echo "!! $name failed (rc=$?)" | tee -a "$SUMMARY"; tail -20 "$RES/$name.log" >> "$SUMMARY"; }
  grep -E '^\|' "$RES/$name.log" >> "$SUMMARY"
}

if [[ $PHASE == tests || $PHASE == all ]]; then   # ~300 s on 2 x H200
  timeout 480 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider --junitxml="$RES/gpu_tests.xml" \
    > "$RES/gpu_tests.log" 2>&1 || status=1
  tail -3 "$RES/gpu_tests.log" | sed 's/^/tests: /' | tee -a "$SUMMARY"
  grep -E "^(FAILED|ERROR)" "$RES/gpu_tests.log" | cut -c1-300 >> "$SUMMARY"
fi
if [[ $PHASE == ops || $PHASE == all ]]; then      # ~3 min on 2 x H200
  launch pool_bw_torch 60 tp_overlap.launch.bench --op pool_bw --backend torch
  launch pool_bw_nvshmem 60 tp_overlap.launch.bench --op pool_bw --backend nvshmem --sizes-mb 1,16,64
  launch pool_bw_ipc 60 tp_overlap.launch.bench --op pool_bw --backend ipc --sizes-mb 1,16,64
  launch ag_gemm 200 tp_overlap.launch.bench --op ag_gemm
  launch gemm_rs 200 tp_overlap.launch.bench --op gemm_rs
fi
if [[ $PHASE == graphs || $PHASE == all ]]; then   # every variant as a CUDA-graph replay (device time)
  launch ag_gemm_graphs 200 tp_overlap.launch.bench --op ag_gemm --cuda-graphs
  launch gemm_rs_graphs 200 tp_overlap.launch.bench --op gemm_rs --cuda-graphs --sm-margins 16,32
  launch tp_mlp_graphs 150 tp_overlap.launch.tp_mlp --cuda-graphs --model llama8b,llama70b --tokens 4096,16384 --trace-dir "$RES"
fi
if [[ $PHASE == model || $PHASE == all ]]; then
  # exit status 1 of kfactor = the k < max-k gate failed (named in its log), not a crash
  launch kfactor 300 tp_overlap.launch.kfactor --tokens 1024,4096,16384 \
    --sweep method=decomposed,fused,epilogue_reduce --sweep sm_margin=0,32 --sweep chunks_per_rank=1 --reps 10 \
    --out-dir "$RES" --write-config "$RES/tuned_tp$NGPU.yaml"
  launch tp_mlp 300 tp_overlap.launch.tp_mlp --model llama8b,llama70b --tokens 4096,16384 --trace-dir "$RES"
fi
tar -czf "$OUT/results_$PHASE.tgz" -C "$RES" .
echo; cat "$SUMMARY"
exit $status
