#!/usr/bin/env bash
# An A/B (or A/B/C) experiment on the GPU in one device call: build a few optimizers, run the CUDA
# tests that cover the change (TESTS, a pytest -k expression over tests/test_cuda.py), then the
# referee (.anchor/bench_tbe.py) once per variant, each in its own process with its own
# environment switches, so that the variants are timed in the same call on the same machine.
#
#   VARIANTS   one variant per line: NAME|SYSTEMS|CONFIGS|OPTS|ENV, e.g.
#                new|fbgemm,tbegen|C1,C2,C3|EXACT_SGD,ADAM|
#                old|tbegen|C1,C2,C3|EXACT_SGD,ADAM|TBEGEN_WIDTH_CLASSES=0 TBEGEN_SORT_DIGIT_BITS=8
#              (the speedup over FBGEMM counts only for a variant that ran FBGEMM in its process)
#              a sixth field, `base`, runs the variant on BASE_TREE's code (below)
#   BASE_TREE  another checkout inside the carried tree (e.g. build/ab-base, from `git worktree add`
#              or `git archive`), built beside the working tree into its own cache, so that a
#              variant can time the code before a change in the same call
#   TEST_FILES the test files TESTS selects from (default tests/test_cuda.py)
#   SPECS      optimizers to build (default: the four benchmarked and lamb)
#   PROFILE_CELL  CONFIGS:OPTS of a kernel profile (bench_tbe.py --profile) with the first
#              variant's environment; empty: none
#   NCU_CELL, NCU_KERNEL  ncu's view of one cell's kernel (benchmarks/bench.py, tbegen alone), e.g.
#              NCU_CELL=C2:sgd NCU_KERNEL="regex:backward_segment_kernel"; empty: none. NCU_SKIP
#              (default 2) matching launches are skipped, then NCU_LAUNCHES (default 1) profiled
#              (2 for both width classes' short-run launches of one C3 step)
# Carry .anchor. Output under $OUT: env.txt, variants.log, and <NAME>/results.jsonl per variant.
set -u
OUT=${OUT:-/tmp/tbegen-gpu-out}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=9.0 TBEGEN_BUILD_DIR=$PWD/build/tbegen-cache PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SPECS=${SPECS:-"sgd rowwise_adagrad adagrad adam lamb"}
LOG="$OUT/variants.log"
status=0
source benchmarks/tools/gpu_common.sh
gpu_env_header
unpack_fbgemm
if [ -n "${BASE_TREE:-}" ]; then
  # (both builds at once: each is mostly one long nvcc process per extension)
  (cd "$BASE_TREE" && TBEGEN_BUILD_DIR=$PWD/../base-cache PYTHONPATH=$PWD build_specs "$OUT/build-base.log" $SPECS) &
  base_build=$!
fi
build_specs "$LOG" $SPECS || status=1
if [ -n "${BASE_TREE:-}" ]; then
  wait $base_build || { status=1; echo "base build failed" | tee -a "$LOG"; tail -n 30 "$OUT/build-base.log" >> "$LOG"; }
fi
if [ -n "${TESTS:-}" ]; then
  xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 12")
  t0=$(date +%s)
  if ! TBEGEN_TEST_OPTIMIZERS="$SPECS" OMP_NUM_THREADS=2 timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider \
      $xdist ${TEST_FILES:-tests/test_cuda.py} -k "$TESTS" -rf --tb=short --maxfail=10 > "$OUT/pytest.tmp" 2>&1; then
    status=1
    head -c 20000 "$OUT/pytest.tmp" >> "$LOG"
  fi
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.tmp" | tail -n 12 | tee -a "$LOG"
  echo "== tests: $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
  rm -f "$OUT/pytest.tmp"
fi
first_env=""
while IFS='|' read -r name systems configs opts envs tree; do
  [ -z "$name" ] && continue
  [ -z "$first_env" ] && first_env="$envs "
  code=$PWD build=$TBEGEN_BUILD_DIR
  if [ "${tree:-}" = base ]; then code=$PWD/$BASE_TREE build=$(cd "$BASE_TREE/.." && pwd)/base-cache; fi
  echo "== variant $name ($systems; $configs; $opts; env: ${envs:-none}; code: $code)" | tee -a "$LOG"
  env $envs TBEGEN_BUILD_DIR=$build PYTHONPATH=/tmp/fbg_site:$code CUDA_MODULE_LOADING=LAZY timeout ${BENCH_TIMEOUT:-150} \
    python3 .anchor/bench_tbe.py --configs "$configs" --opts "$opts" --systems "$systems" --fast-init \
    --out "$OUT/$name" >> "$LOG" 2>&1 || status=1
  grep -E "^C[0-9] " "$LOG" | tail -n 24 | grep -E "tbegen" | tail -n 12
  rm -f "$OUT/$name/env.json"
done <<< "${VARIANTS:?VARIANTS: one NAME|SYSTEMS|CONFIGS|OPTS|ENV per line}"
if [ -n "${PROFILE_CELL:-}" ]; then
  echo "== profile $PROFILE_CELL (env: ${first_env:-none})" | tee -a "$LOG"
  env $first_env PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout ${PROFILE_TIMEOUT:-90} \
    python3 .anchor/bench_tbe.py --configs "${PROFILE_CELL%%:*}" --opts "${PROFILE_CELL##*:}" --systems tbegen \
    --fast-init --profile --iters 10 --out "$OUT/profile" >> "$LOG" 2>&1 || echo "profile failed" | tee -a "$LOG"
  rm -f "$OUT/profile/env.json"
fi
if [ -n "${NCU_CELL:-}" ] && command -v ncu >/dev/null; then
  echo "== ncu ${NCU_CELL} ${NCU_KERNEL:-regex:backward_(group|warp)_kernel}" | tee -a "$LOG"
  env $first_env CUDA_MODULE_LOADING=LAZY timeout ${NCU_TIMEOUT:-90} ncu --clock-control none \
    -k "${NCU_KERNEL:-regex:backward_(group|warp)_kernel}" --launch-skip ${NCU_SKIP:-2} --launch-count ${NCU_LAUNCHES:-1} --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
    --section InstructionStats --section SchedulerStats \
    python3 benchmarks/bench.py --configs "${NCU_CELL%%:*}" --opts "${NCU_CELL##*:}" --warmup 1 --iters 2 \
    --nsets 1 --out /tmp/ncu_bench >> "$LOG" 2>&1 || echo "ncu failed or timed out" | tee -a "$LOG"
fi
exit $status
