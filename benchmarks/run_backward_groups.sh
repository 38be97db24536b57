#!/usr/bin/env bash
# The lane-group backward kernel (cuda_kernels.cuh, backward_group_kernel) on the GPU, in one
# device call: build a few optimizers, run the CUDA tests that take the group kernel for them
# (TESTS: a pytest -k expression), then the referee (.anchor/bench_tbe.py, FBGEMM and tbegen in
# one process) on the configurations in CONFIGS, with the group kernel and again with
# TBEGEN_LANE_GROUPS=0 (the whole-warp kernel; MODES="on" skips that), and a kernel profile of
# PROFILE_CELL (CONFIGS:OPTS, e.g. C1,C2:EXACT_SGD,ADAM), and ncu's view of NCU_CELL's update kernel.
# Carry .anchor. Output under $OUT: env.txt, groups.log, on/ and off/ (the referee's results).
set -u
OUT=${OUT:-/tmp/tbegen-gpu-out}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=9.0 TBEGEN_BUILD_DIR=$PWD/build/tbegen-cache PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SPECS=${SPECS:-"sgd rowwise_adagrad adagrad adam lamb"}
TESTS=${TESTS:-"(lane_groups and (-sgd] or rowwise_adagrad] or -adagrad] or -adam] or -lamb])) or (test_cuda_matches_reference and ([sgd- or [rowwise_adagrad- or [adagrad- or [adam- or [lamb-))"}
CONFIGS=${CONFIGS:-C3}
PROFILE_CELL=${PROFILE_CELL-C3:ADAM}
status=0
source benchmarks/gpu_common.sh
gpu_env_header
unpack_fbgemm
build_specs "$OUT/groups.log" $SPECS || status=1
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 12")
# (TBEGEN_TEST_OPTIMIZERS: the test session builds and parametrizes these optimizers only; without
# it, it builds every optimizer first, which took run R's whole test budget)
if ! TBEGEN_TEST_OPTIMIZERS="$SPECS" OMP_NUM_THREADS=2 timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider $xdist tests/test_cuda.py \
  -k "$TESTS" -rf --tb=short --maxfail=10 > "$OUT/pytest.tmp" 2>&1; then
  status=1
  head -c 20000 "$OUT/pytest.tmp" >> "$OUT/groups.log"
  # where the first bad access is, if any
  echo "== compute-sanitizer memcheck" >> "$OUT/groups.log"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 compute-sanitizer --tool memcheck --print-limit 5 \
    python3 benchmarks/sanitize_cases.py sgd 2>&1 | tail -n 60 >> "$OUT/groups.log"
fi
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.tmp" | tail -n 12
rm -f "$OUT/pytest.tmp"
for mode in ${MODES-on off}; do  # (MODES= skips the timing)
  flag=1; [ $mode = off ] && flag=0
  echo "== bench_tbe.py, TBEGEN_LANE_GROUPS=$flag" | tee -a "$OUT/groups.log"
  TBEGEN_LANE_GROUPS=$flag PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout ${BENCH_TIMEOUT:-120} \
    python3 .anchor/bench_tbe.py --configs "$CONFIGS" --opts "${OPTS:-EXACT_SGD,EXACT_ROWWISE_ADAGRAD,EXACT_ADAGRAD,ADAM}" \
    --systems fbgemm,tbegen --fast-init --out "$OUT/$mode" \
    >> "$OUT/groups.log" 2>&1 || status=1
  grep -E "^C[123] " "$OUT/groups.log" | tail -n 8
  rm -f "$OUT/$mode/env.json"
done
if [ -n "$PROFILE_CELL" ]; then
  echo "== profile $PROFILE_CELL" | tee -a "$OUT/groups.log"
  PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout ${PROFILE_TIMEOUT:-60} python3 .anchor/bench_tbe.py \
    --configs "${PROFILE_CELL%%:*}" --opts "${PROFILE_CELL##*:}" --systems fbgemm,tbegen --fast-init --profile --iters 10 \
    --out "$OUT/profile" >> "$OUT/groups.log" 2>&1 || echo "profile failed"
  mkdir -p "$OUT/on"; mv "$OUT/profile/profiles.json" "$OUT/on/profiles.json" 2>/dev/null
  mv "$OUT/profile/results.jsonl" "$OUT/on/profile_results.jsonl" 2>/dev/null; rm -rf "$OUT/profile"
fi
# ncu on one cell's short-run update kernel (tbegen alone, benchmarks/bench.py): NCU_CELL=C1:adagrad
if [ -n "${NCU_CELL:-}" ] && command -v ncu >/dev/null; then
  echo "== ncu ${NCU_CELL}" | tee -a "$OUT/groups.log"
  CUDA_MODULE_LOADING=LAZY timeout ${NCU_TIMEOUT:-90} ncu --clock-control none -k "regex:backward_(group|warp)_kernel" \
    --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section LaunchStats --section InstructionStats --section SchedulerStats \
    python3 benchmarks/bench.py --configs "${NCU_CELL%%:*}" --opts "${NCU_CELL##*:}" --warmup 1 --iters 2 \
    --nsets 1 --out /tmp/ncu_bench >> "$OUT/groups.log" 2>&1 || echo "ncu failed or timed out" | tee -a "$OUT/groups.log"
fi
exit $status
