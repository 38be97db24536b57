#!/usr/bin/env bash
# Fills .whl/ with the pure-Python wheels that the GPU machine (Python 3.12, torch 2.11, FBGEMM_GPU
# 1.6.0 from the referee's bundle, no package registry) needs for the TorchRec step of
# benchmarks/run_gpu_landing.sh. TorchRec 1.6.1 is the release that pairs with FBGEMM_GPU 1.6.0
# (1.9.2 imports fbgemm_gpu.tbe.monitoring, which 1.6.0 lacks); checked on the CPU with torch 2.11,
# fbgemm-gpu-cpu 1.6.0 and torchrec 1.6.1: tests/test_torchrec.py passes (data-parallel tables need
# TorchRec 1.7 or later and are left out there, see tbegen/torchrec/kernel.py).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: -d .whl \
  torchrec==1.6.1 tensordict==0.15.3 torchmetrics==1.0.3 lightning-utilities pyre-extensions \
  typing-inspect mypy-extensions tqdm iopath portalocker cloudpickle pyvers
ls .whl
