#!/usr/bin/env bash
# Device call: build and run benchmarks/forward_variants.cu (timings, then ncu on C2 for a few
# variants, with NCU=1). Output under $OUT: variants.txt, ncu.txt.
set -u
OUT=${OUT:-/tmp/fv-out}
mkdir -p "$OUT"
TORCH_INC=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')/include
nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -I templates/include -I "$TORCH_INC" \
  benchmarks/forward_variants.cu -o /tmp/fv 2>&1 | grep -v "^$" | head -20
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader; /tmp/fv; } 2>&1 | tee "$OUT/variants.txt"
if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
  timeout ${NCU_TIMEOUT:-200} ncu --clock-control none -k "regex:forward_kernel|cand_kernel|bare_kernel" \
    --launch-skip ${NCU_SKIP:-0} --launch-count ${NCU_COUNT:-40} \
    --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
    /tmp/fv profile > "$OUT/ncu.txt" 2>&1
  echo "ncu exit $?"; grep -cE "^  [a-z_]+.*\(" "$OUT/ncu.txt"
fi
