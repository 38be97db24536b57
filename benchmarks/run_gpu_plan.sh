#!/usr/bin/env bash
# The next GPU session's device calls (benchmarks/NOTES-gpu.md, "Next GPU session: the plan (written
# 2026-12-05, after landing12)"), one call per argument, from the repository root, so that
# the long command lines are not retyped (or mistyped) in a call that costs a tenth of the session's
# device time. Chain the calls within ~30 s (a warm machine keeps its build cache). In order of value:
#   bash benchmarks/run_gpu_plan.sh 1   # correctness: every CUDA test on the landed tree, sanitizers, FBGEMM_GPU
#                                       # differential tests (~9.5 min; carry .anchor and .whl; TorchRec is call 2's)
#   bash benchmarks/run_gpu_plan.sh 2   # the sweep beside FBGEMM on the defaults (issue 29), then TorchRec over NCCL
#                                       # (landing11's call 1 ran out of time before it) (~6 min)
#   bash benchmarks/run_gpu_plan.sh 3   # the cache (issue 27): the exchange stream's cuda tests, then bench_cache at 20, 10,
#                                       # 5%, in-step and pipelined, the default (exchange stream, quarter grid) beside
#                                       # TBEGEN_CACHE_LOOKUP_STREAM=0 and TBEGEN_CACHE_EXCHANGE_BLOCKS=16, and FBGEMM
#                                       # (~8 min; CACHE_OPTIMIZER=sgd for the other optimizer)
#   bash benchmarks/run_gpu_plan.sh 4   # issue 27's record: the referee's --placements run, sgd and rowwise_adagrad at
#                                       # 5, 10, 20%, after the CUDA tests of the cache
#   bash benchmarks/run_gpu_plan.sh 5   # issue 29's next levers in the cells still under 1.0x (D=1024, random 2, B=512,
#                                       # T=1/T=4): the any-width occupancy kernels' tests and A/B against their way back,
#                                       # each system's kernels per step there, ncu on D=1024 sgd (~9 min)
#   bash benchmarks/run_gpu_plan.sh 6   # issue 25's VBE table (bench_vbe beside FBGEMM's padded step, vbe_step_ops with
#                                       # --python, the VBE tests), then the host-bound cases (narrow-skewed, skewed) again
#                                       # under bench_vbe's profiler: device time or host wait (~5 min)
#   bash benchmarks/run_gpu_plan.sh 7   # issue 27's pipelined steps on the defaults (the exchange stream), tbegen alone
#                                       # with --profile (per-stream busy time, the host wait; ~5 min)
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

# Call 5: the cells still under 1.0x FBGEMM's backward on landing11's H100 sweep (fp32 D=1024,
# random 2, B=512 adagrad, T=1 and T=4): the any-width occupancy kernels with the shared row (float
# rows' default since landing12: D=1024 sgd 8.785 -> 8.219 ms on the H100) beside their way back,
# TBEGEN_ANY_WIDTH_OCCUPANCY=0 (the 2-block kernels), their bitwise tests first; then each system's
# kernels per step in those cells (sweep_gpu.py --profile) and ncu on D=1024 sgd with and without
# the occupancy kernels. (D=1024 is the sweep's only fp32 cell on the prefetching kernels: no fp32
# row is wider, D=512 takes the 4-wide kernels. TBEGEN_SHORT_RUN_TICKETS=1, helper-39, lost at
# landing12 and was removed.)
PROFILE_CELLS="^(D=1024|random 2|B=512|T=1|T=4) "
VARIANT_ABS="TBEGEN_ANY_WIDTH_OCCUPANCY=0@^D=1024 "
VARIANT_TESTS="tests/test_any_width_occupancy.py"
# call 3's bench_cache options: the three cache sizes, in-step and pipelined, the default (since
# landing12: a prefetch's exchange on the cache's own stream at a quarter of the grid; pipelined 20%
# 18.27 -> 13.90 ms on the H100) beside its way back (TBEGEN_CACHE_LOOKUP_STREAM=0) and a smaller
# grid for both fills (TBEGEN_CACHE_EXCHANGE_BLOCKS=16: is a quarter still more than the link needs?),
# and FBGEMM; CACHE_OPTIMIZER rowwise_adagrad or sgd (the bar wants both).
CACHE_VARIANTS="--variant TBEGEN_CACHE_LOOKUP_STREAM=0 --variant TBEGEN_CACHE_EXCHANGE_BLOCKS=16"
CACHE_OPTS_PLAN="--cache 0.2,0.1,0.05 --optimizer ${CACHE_OPTIMIZER:-rowwise_adagrad} --pipelined $CACHE_VARIANTS --warmup 6 --iters 8"

# call 4's tests: the cache's CUDA tests (the exchange through _run_tables, 4ef64b2) and landing9's
# four failures (fixed in 28c975a), with the four benchmarked optimizers only
CHECK_FILES="tests/test_cache.py tests/test_cache_fill_ops.py tests/test_cache_iota_streams.py tests/test_cache_key_sort.py \
tests/test_cache_prepare_ops.py tests/test_cache_syncs.py tests/test_cache_timeline.py tests/test_fbgemm_bounds_async.py \
tests/test_host_huge.py tests/test_host_huge_fork.py tests/test_row_copy.py tests/test_row_exchange.py"

call1() {
  run env BENCH=0 SWEEP=0 PROFILE= GROUPS_AB=0 NCU=0 CACHE_BENCH=0 DEADLINE=570 bash benchmarks/run_gpu_landing.sh
}

call2() {
  # (TEST_FILES: the spread linearize's bitwise tests, the default since landing11; the sweep, then
  # TorchRec over NCCL and its prefetch pipeline; the build is call 1's, warm)
  run env BENCH=0 SWEEP=1 PROFILE= GROUPS_AB=0 NCU=0 SANITIZE=0 FBGEMM_DIFF=0 CACHE_BENCH=0 \
    TEST_FILES=tests/test_linearize_spread.py SWEEP_TIMEOUT=200 DEADLINE=570 bash benchmarks/run_gpu_landing.sh
}

call3() {
  run env BUILD_SPECS="rowwise_adagrad sgd" TEST_FILES="tests/test_cache_lookup_stream.py tests/test_row_exchange.py" \
    TEST_MARK=cuda TBEGEN_TEST_OPTIMIZERS="rowwise_adagrad sgd" TESTS_TIMEOUT=120 CACHE_TIMEOUT=400 \
    CACHE_OPTS="$CACHE_OPTS_PLAN" bash benchmarks/run_gpu.sh build tests cache
}

call4() {
  run env BUILD_SPECS="sgd rowwise_adagrad adagrad adam" TEST_FILES="$CHECK_FILES" TEST_MARK=cuda TBEGEN_TEST_OPTIMIZERS="sgd rowwise_adagrad adagrad adam" \
    TESTS_TIMEOUT=150 REFEREE_TIMEOUT=330 bash benchmarks/run_gpu.sh build tests referee
}

call5() {
  run env TEST_FILES="$VARIANT_TESTS" TESTS_TIMEOUT=240 SWEEP_ABS="$VARIANT_ABS" PROFILE_ONLY="$PROFILE_CELLS" \
    NCU_ONLY="^D=1024 sgd" NCU_AB="TBEGEN_ANY_WIDTH_OCCUPANCY=0" DEADLINE=570 bash benchmarks/run_gpu_ab.sh
}

call6() {
  # (VBE_AB: the host-bound cases timed again under bench_vbe's profiler, BENCH_VBE_PROFILE=1: whether
  # narrow-skewed's VBE step over its padded one, 1.43-1.59x at landing12, is device time or host)
  run env BUILD_SPECS="sgd rowwise_adagrad" TEST_FILES="tests/test_vbe.py tests/test_vbe_backward_variant.py tests/test_torchrec_vbe.py" \
    VBE=1 VBE_AB=BENCH_VBE_PROFILE=1 VBE_CASES=narrow-skewed,skewed DEADLINE=420 bash benchmarks/run_gpu_ab.sh
}

call7() {
  # (the profile's trace JSONs are large: left behind; profile-*.txt come back)
  run env BUILD_SPECS="rowwise_adagrad" CACHE_TIMEOUT=300 CACHE_TRACES=0 \
    CACHE_OPTS="--cache 0.2,0.05 --optimizer rowwise_adagrad --pipelined --profile --systems tbegen --warmup 6 --iters 8" \
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
