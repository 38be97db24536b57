#!/usr/bin/env python3
"""A representative subset of the CUDA cases, small enough to run under compute-sanitizer
(memcheck, racecheck): every kernel (forward, per-sample-weight gradient, linearise, sort and
runs, the warp-per-row, segment and finishing updates), fp32/fp16/bf16, pooling sum/mean/none.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 benchmarks/sanitize_cases.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tbegen import build, harness  # noqa: E402
from tbegen.spec import find_spec, load_spec  # noqa: E402

CASES = [
    harness.Case(pooling="sum", weighted=True, hot=300, max_segment_length_per_warp=8, steps=2, seed=1),
    harness.Case(pooling="mean", weights_dtype=torch.float16, stochastic_rounding=True, steps=2, seed=2),
    harness.Case(tables=((40, 1024), (20, 260)), pooling="sum", weights_dtype=torch.bfloat16, hot=100,
                 max_segment_length_per_warp=4, steps=1, seed=3),
    harness.Case(tables=((64, 32), (32, 32)), pooling="none", weighted=True, index_dtype=torch.int32, steps=1, seed=4),
]

failures = 0
for name in sys.argv[1:] or ["rowwise_adagrad", "adam"]:
    spec = load_spec(str(find_spec(name)))
    ops = build.load_ops(spec, with_cuda=True)
    for case in CASES:
        r = harness.run_case(spec, ops, case, device="cuda")
        failures += bool(r.failures)
        print(f"{name} {case.id}: worst {r.worst:.3g} {'FAILED ' + str(r.failures) if r.failures else 'ok'}", flush=True)
torch.cuda.synchronize()
sys.exit(1 if failures else 0)
