#!/usr/bin/env bash
# The next GPU session's three device calls (benchmarks/NOTES-gpu.md, "Next GPU session: the plan
# (written 2026-12-05 09:20 UTC)"), one call per argument, from the repository root, so that the
# long command lines are not retyped (or mistyped) in a call that costs a tenth of the session's
# device time:
#   bash benchmarks/run_gpu_plan.sh 1   # correctness: every CUDA test on the landed tree (~9.5 min; carry .anchor and .whl)
#   bash benchmarks/run_gpu_plan.sh 2   # the kernel A/Bs beside FBGEMM (issue 29) and the VBE table (issue 25) (~9 min)
#   bash benchmarks/run_gpu_plan.sh 3   # the cache (issue 27): the host-row probe, then bench_cache, the default beside
#                                       # TBEGEN_CACHE_EXCHANGE=0 and FBGEMM at 10, 20, 5% (~9 min; CACHE_OPTIMIZER=sgd)
#   bash benchmarks/run_gpu_plan.sh 4   # issue 27's record: the referee's --placements run, sgd and rowwise_adagrad at
#                                       # 5, 10, 20%, after the CUDA tests of the cache and what changed since landing9
#   bash benchmarks/run_gpu_plan.sh 5   # issue 27's 10% and 20% cells in bench_cache (in-step and pipelined, the default
#                                       # beside TBEGEN_CACHE_EXCHANGE=0 and FBGEMM), then TorchRec over NCCL (~9.5 min)
#   bash benchmarks/run_gpu_plan.sh 6   # issue 25's VBE table alone (bench_vbe beside FBGEMM's padded step, then the
#                                       # TBEGEN_VBE_GRAD_OFFSETS=1 A/B on mild and mild-large; ~5 min; landing10 ran out of time)
#   bash benchmarks/run_gpu_plan.sh 7   # issue 27's pipelined 20% step, tbegen alone with --profile (per-stream busy time,
#                                       # each range's GPU and host ms: what S, H and F of the chain cost; ~4 min)
#   DRY_RUN=1 bash benchmarks/run_gpu_plan.sh 1 2 3 4 5 6 7   # print the commands only (tests/test_gpu_plan.py reads them:
#                                                      # every script, flag, switch and sweep regex they name exists)
# Results under $OUT as the scripts called write them (run_gpu_landing.sh, run_gpu_ab.sh, run_gpu.sh).
set -u
OUT=${OUT:-/tmp/tbegen-gpu-out}
export OUT

run() {  # a command of the plan: printed (quoted as the shell reads it), and run unless DRY_RUN=1
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  [ "${DRY_RUN:-0}" = 1 ] || "$@"
}

# The A/Bs of call 2: each "ENV=VALUE[,ENV2=VALUE2]@REGEX" (REGEX over the sweep's "shape optimizer"
# names, benchmarks/sweep_gpu.py --list), joined by ';' for run_gpu_ab.sh's SWEEP_ABS.
SWEEP_ABS_LIST=(
  "TBEGEN_SEGMENT_LENGTH=64@^(D=1024|fp16 D=2048|D=512|base) "
  "TBEGEN_SEGMENT_LENGTH=64,TBEGEN_ANY_WIDTH_ITEMS=1@^D=1024 "
  "TBEGEN_ANY_WIDTH_PREFETCH=1,TBEGEN_SEGMENT_LENGTH=64,TBEGEN_ANY_WIDTH_ITEMS=1@^fp16 D=2048"
  "TBEGEN_SEGMENT_LANE_GROUPS=1@^(D=(4|8|20|32) |random 3 )"
  "TBEGEN_GROUP_ROWS_CACHED=1@^D=(4|8|20|32|64) "
  "TBEGEN_WIDTH_CLASSES=0@^random 2 "
  "TBEGEN_CLASS_STREAMS=0@^random 2 "
  "TBEGEN_LINEARIZE_SPREAD=1@^random 3 "
)
SWEEP_ABS=$(IFS=';'; echo "${SWEEP_ABS_LIST[*]}")
# call 3's bench_cache options: the three cache sizes, in-step and pipelined, the default (since
# landing9 the exchange) beside the two copies (TBEGEN_CACHE_EXCHANGE=0) and FBGEMM; CACHE_OPTIMIZER
# rowwise_adagrad or sgd (the bar wants both: one call each). (Landing9 ran 0.2,0.05 with
# the variants TBEGEN_CACHE_EXCHANGE=1, TBEGEN_CACHE_BACKING=host-huge and both.) And the per-row
# states in the rows' warps (TBEGEN_CACHE_EXCHANGE_STATES=1, opt-in: its default flips on a gain).
CACHE_VARIANTS="--variant TBEGEN_CACHE_EXCHANGE_STATES=1 --variant TBEGEN_CACHE_EXCHANGE=0"
CACHE_C2="--tables 32 --rows 1000000 --dim 128 --batch 16384 --pooling-factor 20"  # (run_gpu.sh's cache step has them)
CACHE_OPTS_PLAN="--cache 0.1,0.2,0.05 --optimizer ${CACHE_OPTIMIZER:-rowwise_adagrad} --pipelined $CACHE_VARIANTS --warmup 6 --iters 8"

# call 4's tests: the cache's CUDA tests (the exchange through _run_tables, 4ef64b2) and landing9's
# four failures (fixed in 28c975a), with the four benchmarked optimizers only
CHECK_FILES="tests/test_cache.py tests/test_cache_fill_ops.py tests/test_cache_iota_streams.py tests/test_cache_key_sort.py \
tests/test_cache_prepare_ops.py tests/test_cache_syncs.py tests/test_cache_timeline.py tests/test_fbgemm_bounds_async.py \
tests/test_host_huge.py tests/test_host_huge_fork.py tests/test_row_copy.py tests/test_row_exchange.py"

call1() {
  run env BENCH=0 SWEEP=0 PROFILE= GROUPS_AB=0 NCU=0 CACHE_BENCH=0 DEADLINE=570 bash benchmarks/run_gpu_landing.sh
}

call2() {
  run env TEST_FILES="tests/test_group_state.py tests/test_vbe_backward_variant.py" SWEEP_ABS="$SWEEP_ABS" \
    VBE=1 VBE_AB=TBEGEN_VBE_GRAD_OFFSETS=1 NCU_ONLY="^D=1024 sgd" NCU_AB="TBEGEN_SEGMENT_LENGTH=64,TBEGEN_ANY_WIDTH_ITEMS=1" \
    PROFILE_ONLY="^(random 3|random 2) sgd" DEADLINE=560 bash benchmarks/run_gpu_ab.sh
}

call3() {
  [ "${DRY_RUN:-0}" = 1 ] || mkdir -p "$OUT"
  # (the probe's table is printed: the device tool returns 8 files, and landing9's JSON stayed behind)
  run timeout 120 python3 benchmarks/tools/host_rows_probe.py --gb 8 --kinds managed,host --json "$OUT/host_rows.json"
  run env BUILD_SPECS="rowwise_adagrad sgd" CACHE_TIMEOUT=400 CACHE_OPTS="$CACHE_OPTS_PLAN" bash benchmarks/run_gpu.sh build cache
}

call4() {
  run env BUILD_SPECS="sgd rowwise_adagrad adagrad adam" TEST_FILES="$CHECK_FILES" TEST_MARK=cuda TBEGEN_TEST_OPTIMIZERS="sgd rowwise_adagrad adagrad adam" \
    TESTS_TIMEOUT=150 REFEREE_TIMEOUT=330 bash benchmarks/run_gpu.sh build tests referee
}

call5() {
  run env BUILD_REST=0 BENCH=0 SWEEP=0 PROFILE= GROUPS_AB=0 NCU=0 SANITIZE=0 FBGEMM_DIFF=0 TEST_FILES=tests/test_cache_timeline.py \
    EXTRA_TESTS="-m cuda" CACHE_TIMEOUT=300 CACHE_OPTS="$CACHE_C2 --cache 0.1,0.2 --optimizer rowwise_adagrad --pipelined $CACHE_VARIANTS --warmup 6 --iters 8" \
    DEADLINE=585 bash benchmarks/run_gpu_landing.sh
}

call6() {
  run env BUILD_SPECS="sgd rowwise_adagrad" TEST_FILES="tests/test_vbe.py tests/test_vbe_backward_variant.py" \
    VBE=1 VBE_AB=TBEGEN_VBE_GRAD_OFFSETS=1 VBE_CASES=mild,mild-large DEADLINE=420 bash benchmarks/run_gpu_ab.sh
}

call7() {
  # (the profile's trace JSONs are large: left behind; profile-*.txt come back)
  run env BUILD_SPECS="rowwise_adagrad" CACHE_TIMEOUT=240 CACHE_TRACES=0 \
    CACHE_OPTS="--cache 0.2 --optimizer rowwise_adagrad --pipelined --profile --systems tbegen --warmup 6 --iters 8" \
    bash benchmarks/run_gpu.sh build cache
}

[ $# -gt 0 ] || { sed -n '2,20p' "$0"; exit 2; }
status=0
for call in "$@"; do
  case "$call" in
    1) call1 || status=1 ;;
    2) call2 || status=1 ;;
    3) call3 || status=1 ;;
    4) call4 || status=1 ;;
    5) call5 || status=1 ;;
    6) call6 || status=1 ;;
    7) call7 || status=1 ;;
    *) echo "run_gpu_plan.sh: no call '$call' (1 to 7)" >&2; exit 2 ;;
  esac
done
exit $status
