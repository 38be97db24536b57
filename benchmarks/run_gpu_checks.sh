#!/usr/bin/env bash
# The checks a landing run's later steps hold (benchmarks/run_gpu_landing.sh steps 4-5), alone, for a
# call with little device time left: build the four benchmarked optimizers, then compute-sanitizer
# memcheck and racecheck, the FBGEMM_GPU differential tests, TorchRec over NCCL on one rank, and
# the torch.compile reduce-overhead probe; each step capped (CHECK_DEADLINE seconds in all, default
# 280). Carry .anchor and .whl. Output under $OUT.
set -u
OUT=${OUT:-/tmp/tbegen-gpu-out}; mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=9.0 TBEGEN_BUILD_DIR=$PWD/build/tbegen-cache PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t_start=$(date +%s)
cap() { local left=$(( ${CHECK_DEADLINE:-280} - ($(date +%s) - t_start) )); [ $left -lt 5 ] && left=5; echo $(( $1 < left ? $1 : left )); }
say() { echo "== $* ($(( $(date +%s) - t_start )) s)" | tee -a "$OUT/checks.log"; }
date -u +"date: %Y-%m-%d %H:%M UTC" > "$OUT/checks.log"; echo "tree: ${TREE:-not given}" >> "$OUT/checks.log"
python3 .anchor/unpack_bundle.py .anchor/bundle /tmp/fbg_site > /dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
python3 -c "
from tbegen import build; from tbegen.spec import find_spec
build.prebuild([find_spec(n) for n in 'sgd rowwise_adagrad adagrad adam'.split()], with_cuda=True)" > /dev/null 2>&1
say "built"
for tool in memcheck racecheck; do
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout $(cap 40) compute-sanitizer --tool $tool --print-limit 20 \
    python3 benchmarks/sanitize_cases.py rowwise_adagrad adam 2>&1 | grep -E "SUMMARY|worst|Error" | tail -n 8 >> "$OUT/checks.log"
  say "compute-sanitizer $tool"
done
PYTHONPATH=/tmp/fbg_site:$PYTHONPATH TBEGEN_TEST_OPTIMIZERS="sgd rowwise_adagrad adagrad adam" timeout $(cap 60) \
  python3 -m pytest -q -p no:cacheprovider -rf --tb=line -m cuda tests/test_fbgemm_compat.py 2>&1 | tail -n 6 >> "$OUT/checks.log"
say "FBGEMM_GPU differential tests"
TRC=$PWD/benchmarks/fbgemm_subset:/tmp/site:/tmp/fbg_site:$PYTHONPATH
PYTHONPATH=$TRC timeout $(cap 90) python3 -m pytest -q -s -p no:cacheprovider -m cuda tests/test_torchrec.py \
  tests/test_torchrec_config.py 2>&1 | grep -E "passed|failed|largest|Error" | tail -n 12 >> "$OUT/checks.log"
say "TorchRec over NCCL, one rank"
timeout $(cap 90) python3 benchmarks/tools/compile_probe.py fixed no-partition-names 2>&1 | grep -E "^step|^== variant|^[0-9]+ steps|^  pointer|^variant|^pool check" | tail -n 24 >> "$OUT/checks.log"
say "compile probe"
cat "$OUT/checks.log"
