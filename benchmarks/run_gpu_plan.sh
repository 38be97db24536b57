#!/usr/bin/env bash
# The next GPU session's device calls (benchmarks/NOTES-gpu.md, "Next GPU session: the plan (written
# 2026-12-06 03:30 UTC, after landing16)"), one call per argument, from the repository root, so that
# the long command lines are not retyped (or mistyped) in a call that costs a tenth of the session's
# device time. Chain the calls within ~30 s (a warm machine keeps its build cache). In order of value:
#   bash benchmarks/run_gpu_plan.sh 1   # correctness: every CUDA test on the landed tree, sanitizers, FBGEMM_GPU
#                                       # differential tests (~9.5 min; carry .anchor and .whl; TorchRec is call 2's)
#   bash benchmarks/run_gpu_plan.sh 2   # the sweep beside FBGEMM on the defaults (issue 29), then TorchRec over NCCL
#                                       # (landing11's call 1 ran out of time before it) (~6 min)
#   bash benchmarks/run_gpu_plan.sh 3   # the cache (issue 27): the cache's cuda tests, then bench_cache at 20, 10, 5%,
#                                       # in-step and pipelined, the default (the exchange at 16 blocks since f6c76b7, the
#                                       # warm for LRU since b9c6633) beside TBEGEN_CACHE_EXCHANGE_BLOCKS=8 and =33 and
#                                       # the warm's way back (TBEGEN_CACHE_PREFETCH_WARM=0), the default again last
#                                       # (--control), and FBGEMM (~5 min; CACHE_OPTIMIZER=sgd for the other optimizer)
#   bash benchmarks/run_gpu_plan.sh 4   # issue 27's record: the referee's --placements run, sgd and rowwise_adagrad at
#                                       # 5, 10, 20%, after the CUDA tests of the cache
#   bash benchmarks/run_gpu_plan.sh 5   # issue 29: the long runs in series (TBEGEN_LONG_RUNS_BESIDE=0, 4249216) on the
#                                       # wide-row cells and controls, and the narrow segment kernel at 4 blocks
#                                       # (TBEGEN_SEGMENT_OCCUPANCY=1, a1e76fd) on narrow/skewed cells, each against the
#                                       # default, their cuda tests first; kernels per step and ncu in D=1024 (~8 min)
#   bash benchmarks/run_gpu_plan.sh 6   # issue 25: VBE's tests, then the offsets read through the plan's padding index
#                                       # (TBEGEN_VBE_PAD_IN_KERNELS=1) with step 3c in the run selection
#                                       # (TBEGEN_VBE_GATHER_IN_SELECT=1) against the defaults on bench_vbe's four cases,
#                                       # with each side's runtime calls per step (vbe_step_ops) (~6 min)
#   bash benchmarks/run_gpu_plan.sh 7   # issue 27's pipelined steps on the defaults (the exchange stream), tbegen alone
#                                       # with --profile (per-stream busy time, the host wait; ~5 min)
#   bash benchmarks/run_gpu_plan.sh 8   # issue 29: ncu of random 3 sgd's kernels with and without
#                                       # TBEGEN_SEGMENT_OCCUPANCY=1 (Duration, registers, achieved occupancy, grid), then
#                                       # kernels per step in the sub-ms cells L=1, T=1, B=512, random 2 (~4 min)
#   bash benchmarks/run_gpu_plan.sh 9   # issue 29: ncu of D=1024 sgd with and without TBEGEN_LONG_RUNS_BESIDE=0 (~3 min)
#   bash benchmarks/run_gpu_plan.sh 10  # issue 29: the sort without memsets and the long runs by one scan, each forced on
#                                       # in D=20, D=32, base (5.2M indices: their size rule's off side), and ncu of
#                                       # D=20 sgd with both on and off: what costs landing15's ~30 us (~5 min)
#   bash benchmarks/run_gpu_plan.sh 11  # issue 29: every kernel of a step (the 24 longest: the sort, the selections and
#                                       # the linearize beside the update kernels) in D=20, D=32, L=1, random 3 and base,
#                                       # sgd: where the backward's time goes outside the update kernels; and sgd's
#                                       # group kernel with its rows cached (TBEGEN_GROUP_ROWS_CACHED=1) on D=4-64, base,
#                                       # random 3, with ncu of D=20 sgd both ways (~6 min)
#   bash benchmarks/run_gpu_plan.sh 12  # issue 29: longer segments for the hottest rows' cells (TBEGEN_SEGMENT_LENGTH=512
#                                       # and =1024) on random 3, zipf 1.3, D=8/20/32: a hot row's finish sums fewer
#                                       # partial rows (random 3: ~325 a hot row, one warp, ~40 us on the side stream's
#                                       # critical path); other bits (deterministic), so against the float64 reference (~5 min)
#   bash benchmarks/run_gpu_plan.sh 13  # issue 25: TBEGEN_VBE_PAD_IN_KERNELS=1 alone against the defaults (11e2699: the kPad
#                                       # bounds read the offsets where the plan's padding index puts them, beside the
#                                       # bag's own pad entries), VBE's tests first (~5 min); call 6 times it with
#                                       # TBEGEN_VBE_GATHER_IN_SELECT=1
#   bash benchmarks/run_gpu_plan.sh 14  # issue 29: fp32 D=1024 after 7886445 (the occupancy kernels' update loops without
#                                       # local memory): its bitwise tests, the D=1024 cells beside FBGEMM with the 2-block
#                                       # kernels (TBEGEN_ANY_WIDTH_OCCUPANCY=0, unchanged) as the control, and the kernels
#                                       # per step (~6 min)
#   bash benchmarks/run_gpu_plan.sh 15  # issue 29: fp16 rows wider than 512 columns on the occupancy kernels
#                                       # (TBEGEN_ANY_WIDTH_OCCUPANCY_HALF=1, fd99a75: opt-in) with the summed row in shared
#                                       # memory past 48 KB, and with the scratch row (SHARED_ROW=0), on fp16 D=2048; fp16
#                                       # D=512 (4-wide kernels: untouched) as the control; its bitwise tests first (~9 min)
#   DRY_RUN=1 bash benchmarks/run_gpu_plan.sh 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15   # print the commands only (tests/test_gpu_plan.py reads
#                                                      # them: every script, flag, switch and sweep regex they name exists)
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

# Call 5: the long runs' kernels in series (TBEGEN_LONG_RUNS_BESIDE=0) on the cells where one
# table's output-gradient rows nearly fill or exceed L2 (D=256-1024 fp32, fp16 D=512/2048: 8-64 MB a
# table against 50 MB) and on a few where they do not (base, zipf 1.3, random 3: the control that
# concurrency pays there); then each system's kernels per step in D=1024 with and without it.
# Beside it, the same hypothesis the other way at D=1024: one work list in key order for the hot
# rows' segments and the short runs (TBEGEN_ANY_WIDTH_ITEMS=1, the items kernel of the occupancy
# variant; last timed at D=1024 together with 64-occurrence segments, landing12: -1.4% geomean).
LONG_RUNS_CELLS="^(D=1024|D=512|D=256|fp16 D=512|fp16 D=2048|base|zipf 1.3|random 3) "
# ... and the 4-wide segment kernel at 4 blocks per multiprocessor for rows of up to 128 columns
# (TBEGEN_SEGMENT_OCCUPANCY=1, a1e76fd: NOTES-gpu "the 4-wide segment kernel's occupancy") on the
# narrow and skewed cells where that kernel is the longer stream (random 3: 114 us, 37.5%
# theoretical occupancy by registers at landing14).
SEGMENT_CELLS="^(random 3|D=20|D=32|D=8|zipf 1.3) "
# call 3's bench_cache options: the three cache sizes, in-step and pipelined, the default (since
# f6c76b7 the exchange at one block per 8 SMs, 16, in the fill and on the exchange stream alike;
# since b9c6633 the warm for LRU caches: landing14 pipelined 10% 30.87 -> 26.71 ms) beside half and
# twice that grid (TBEGEN_CACHE_EXCHANGE_BLOCKS=8, =33) and the deferral without the warm
# (TBEGEN_CACHE_PREFETCH_WARM=0, LFU's default and the way back), the default again after them
# (--control: landing14's pipelined 20% median read 16.86 and 19.45 ms for one code), and FBGEMM;
# CACHE_OPTIMIZER rowwise_adagrad or sgd.
# (CACHE_VARIANTS="" in the environment: the default and FBGEMM only, for a short call)
CACHE_VARIANTS=${CACHE_VARIANTS-"--variant TBEGEN_CACHE_EXCHANGE_BLOCKS=8 --variant TBEGEN_CACHE_EXCHANGE_BLOCKS=33 --variant TBEGEN_CACHE_PREFETCH_WARM=0 --control"}
# CACHE_ALGORITHM=lfu: both systems' LFU caches (bench_cache --algorithm; the default lru)
CACHE_OPTS_PLAN="--cache 0.2,0.1,0.05 --optimizer ${CACHE_OPTIMIZER:-rowwise_adagrad} --algorithm ${CACHE_ALGORITHM:-lru} --pipelined $CACHE_VARIANTS --warmup 6 --iters 8"

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
  run env BUILD_SPECS="rowwise_adagrad sgd" TEST_FILES="tests/test_cache.py tests/test_host_huge.py tests/test_cache_prefetch_warm.py tests/test_row_exchange.py tests/test_cache_lookup_stream.py tests/test_cache_early_deferral.py tests/test_prefetch_pipeline.py" \
    TEST_MARK=cuda TBEGEN_TEST_OPTIMIZERS="rowwise_adagrad sgd" TESTS_TIMEOUT=200 CACHE_TIMEOUT=400 \
    CACHE_OPTS="$CACHE_OPTS_PLAN" bash benchmarks/run_gpu.sh build tests cache
}

call4() {
  run env BUILD_SPECS="sgd rowwise_adagrad adagrad adam" TEST_FILES="$CHECK_FILES" TEST_MARK=cuda TBEGEN_TEST_OPTIMIZERS="sgd rowwise_adagrad adagrad adam" \
    TESTS_TIMEOUT=150 REFEREE_TIMEOUT=330 bash benchmarks/run_gpu.sh build tests referee
}

call5() {
  # (TBEGEN_TEST_OPTIMIZERS: the four specs run_gpu_ab.sh builds; unset, test_long_runs_beside would
  # parametrize, and the tests' prebuild compile, every spec: 18 CUDA builds on a machine without
  # call 1's build cache, far past TESTS_TIMEOUT)
  run env TEST_FILES="tests/test_long_runs_beside.py tests/test_segment_occupancy.py" TESTS_TIMEOUT=180 \
    TBEGEN_TEST_OPTIMIZERS="sgd rowwise_adagrad adagrad adam" \
    SWEEP_ABS="TBEGEN_LONG_RUNS_BESIDE=0@$LONG_RUNS_CELLS;TBEGEN_ANY_WIDTH_ITEMS=1@^D=1024 ;TBEGEN_SEGMENT_OCCUPANCY=1@$SEGMENT_CELLS" \
    PROFILE_ONLY="^D=1024 " DEADLINE=540 bash benchmarks/run_gpu_ab.sh
  # (no ncu here: tests up to 180 s, six sweep halves, the profile and three ncu runs would pass the
  # DEADLINE; ncu of D=1024 with the switch is call 9's)
}

call6() {
  # (issue 25: the VBE step's extras beside the padded step's, NOTES-gpu "VBE: the step's extras
  # beside the padded step's, cut": the index_select gone with TBEGEN_VBE_PAD_IN_KERNELS=1, step
  # 3c's launch with TBEGEN_VBE_GATHER_IN_SELECT=1; each side's VBE/pad in narrow-skewed
  # (host-bound), skewed, mild and mild-large (kernel-bound), and each side's launches and
  # allocations per step. The fused gather's A/B ran at landing14.)
  run env BUILD_SPECS="sgd rowwise_adagrad" TEST_FILES="tests/test_vbe.py tests/test_vbe_backward_variant.py" \
    VBE_AB=TBEGEN_VBE_PAD_IN_KERNELS=1,TBEGEN_VBE_GATHER_IN_SELECT=1 VBE_AB_OPS=1 \
    VBE_CASES=narrow-skewed,skewed,mild,mild-large VBE_TIMEOUT=150 DEADLINE=480 bash benchmarks/run_gpu_ab.sh
}

call7() {
  # (the profile's trace JSONs are large: left behind; profile-*.txt come back)
  run env BUILD_SPECS="rowwise_adagrad" CACHE_TIMEOUT=300 CACHE_TRACES=0 \
    CACHE_OPTS="--cache 0.2,0.05 --optimizer rowwise_adagrad --pipelined --profile --systems tbegen --warmup 6 --iters 8" \
    bash benchmarks/run_gpu.sh build cache
}

call8() {
  # (ncu of random 3 sgd's kernels, then again with the narrow segment kernel at 4 blocks a
  # multiprocessor: its Duration, Registers, Achieved Occupancy and Grid Size both ways; PROFILE_ONLY
  # in call 5 times the defaults only)
  # Then each system's kernels per step in the sub-millisecond cells under 1.1x (L=1, T=1, B=512,
  # random 2): kernel time against step time says which are host-bound on that machine's CPU.
  run env TEST_FILES= NCU_ONLY="^random 3 sgd" NCU_AB="TBEGEN_SEGMENT_OCCUPANCY=1" \
    PROFILE_ONLY="^(L=1|T=1|B=512|random 2) " DEADLINE=360 bash benchmarks/run_gpu_ab.sh
}

call9() {
  # (ncu of D=1024 sgd's kernels with and without the long runs in series: the two bands' L2 hit
  # rates and DRAM throughput, when call 5 showed a difference worth explaining)
  run env TEST_FILES= NCU_ONLY="^D=1024 sgd" NCU_AB="TBEGEN_LONG_RUNS_BESIDE=0" DEADLINE=300 bash benchmarks/run_gpu_ab.sh
}

call10() {
  # (issue 29: the size rule of f1441b3. Landing15: the sort without memsets and the long runs by one
  # scan, together, made 5.2M-index batches ~30 us slower; each alone on those cells, forced on
  # (their default is off above 2^20 indices), then ncu of D=20 sgd with both on against both off:
  # which kernel grows (linearize, zeroing OnesweepSort's scratch; or the scan over all n runs))
  run env TEST_FILES= \
    SWEEP_ABS="TBEGEN_SORT_NO_MEMSETS=1@^(D=20|D=32|base) ;TBEGEN_LONG_RUN_SCAN=1@^(D=20|D=32|base) " \
    NCU_ONLY="^D=20 sgd" NCU_AB="TBEGEN_SORT_NO_MEMSETS=1,TBEGEN_LONG_RUN_SCAN=1" DEADLINE=360 bash benchmarks/run_gpu_ab.sh
}

call11() {
  # (landing16's ncu of D=20 sgd: tbegen's update kernels 236 us (group) beside 166 + 19 us (segment,
  # finish) against FBGEMM's 213 + 136 in series, yet tbegen's backward 0.713 ms against FBGEMM's
  # 0.746: the rest of the step, its preparation (linearize, the sort's passes, the selections) is
  # where tbegen spends what its overlap saves. sweep_gpu's profile now keeps 24 kernels a system.)
  # Beside it, sgd's group kernel with the rows cached (TBEGEN_GROUP_ROWS_CACHED=1; the default for
  # optimizers with state since landing10, where sgd read -10% to +11% on a noisy H200 run): ncu of
  # D=20 sgd's group kernel wrote 4.36 M sectors to L2 against FBGEMM's warp_per_row's 3.06 M
  # (landing16), what partial-sector stores of 80-byte rows read and written evict-first would do.
  run env TEST_FILES= PROFILE_ONLY="^(D=20|D=32|L=1|random 3|base) sgd" \
    SWEEP_ABS="TBEGEN_GROUP_ROWS_CACHED=1@^(D=(4|8|20|32|64)|base|random 3) sgd" \
    NCU_ONLY="^D=20 sgd" NCU_AB="TBEGEN_GROUP_ROWS_CACHED=1" DEADLINE=420 bash benchmarks/run_gpu_ab.sh
}

call12() {
  # (the segment kernel is one wave of ~3168 warps on an H100; random 3's ~1.8 M long-run occurrences
  # are ~7000 segments of 256, 2-3 a warp, and its hottest rows' ~325 partial sums each are added in
  # order by one warp with 4-5 loads in flight: landing14's ncu 114 + 43 us, the step's longer stream.
  # 512 or 1024 halves or quarters the partial sums for 1-2 segments a warp. A different sum order:
  # tests/test_segment_length.py checks the float64 reference at several lengths; its files run first.)
  run env TEST_FILES=tests/test_segment_length.py TBEGEN_TEST_OPTIMIZERS="sgd rowwise_adagrad adagrad adam" \
    SWEEP_ABS="TBEGEN_SEGMENT_LENGTH=512@^(random 3|zipf 1.3|D=8|D=20|D=32) ;TBEGEN_SEGMENT_LENGTH=1024@^(random 3|zipf 1.3) " \
    DEADLINE=360 bash benchmarks/run_gpu_ab.sh
}

call13() {
  # (landing16: both VBE switches together made mild-large's forward 1.434 -> 1.521 ms; helper-52
  # traced the forward's share to the pad entries' DRAM round trip before the offsets' loads and
  # predicts 1.43-1.45 ms with 11e2699, the backward within 1% of the default's 3.26 ms; what is left
  # of call 6's backward excess is then TBEGEN_VBE_GATHER_IN_SELECT's)
  run env BUILD_SPECS="sgd rowwise_adagrad" TEST_FILES="tests/test_vbe.py tests/test_vbe_backward_variant.py" \
    VBE_AB=TBEGEN_VBE_PAD_IN_KERNELS=1 VBE_AB_OPS=1 VBE_CASES=mild-large,narrow-skewed,skewed,mild VBE_TIMEOUT=150 \
    DEADLINE=480 bash benchmarks/run_gpu_ab.sh
}

call14() {
  # (helper-54: adagrad's and adam's occupancy kernels reloaded their state pointers from the stack
  # in every step of the update's column loop, adam's warp kernel 128 local loads a 1024-column row;
  # predicted adagrad 9.941 -> 9.40-9.75 ms, adam 11.999 -> 10.9-11.6, sgd and rowwise_adagrad +-1%,
  # against landing16's sweep; the A/B's other side is the 2-block kernels, which did not change)
  run env TEST_FILES=tests/test_any_width_occupancy.py TBEGEN_TEST_OPTIMIZERS="sgd rowwise_adagrad adagrad adam" \
    PROFILE_ONLY="^D=1024 " SWEEP_ABS="TBEGEN_ANY_WIDTH_OCCUPANCY=0@^D=1024 " DEADLINE=420 bash benchmarks/run_gpu_ab.sh
}

call15() {
  # (helper-55's prediction: fp16 D=2048 2-6% faster, sgd 18.3 -> 17.2-18.0 ms, adagrad 20.5 ->
  # 19.3-20.2, adam 24.6 -> 23.2-24.3; the shared row may lose to the scratch row there: the 195 KB of
  # shared memory leaves L1 ~60 KB for the kernels' row prefetch, hence the second arm)
  run env TEST_FILES=tests/test_any_width_occupancy_half.py TBEGEN_TEST_OPTIMIZERS="sgd rowwise_adagrad adagrad adam" \
    SWEEP_ABS="TBEGEN_ANY_WIDTH_OCCUPANCY_HALF=1@^(fp16 D=2048|fp16 D=512) ;TBEGEN_ANY_WIDTH_OCCUPANCY_HALF=1,TBEGEN_ANY_WIDTH_SHARED_ROW=0@^fp16 D=2048 " \
    DEADLINE=570 bash benchmarks/run_gpu_ab.sh
}

[ $# -gt 0 ] || { sed -n '2,56p' "$0"; exit 2; }
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
    8) call8 || status=1 ;;
    9) call9 || status=1 ;;
    10) call10 || status=1 ;;
    11) call11 || status=1 ;;
    12) call12 || status=1 ;;
    13) call13 || status=1 ;;
    14) call14 || status=1 ;;
    15) call15 || status=1 ;;
    *) echo "run_gpu_plan.sh: no call '$call' (1 to 15)" >&2; exit 2 ;;
  esac
done
exit $status
