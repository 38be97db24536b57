#!/usr/bin/env python3
"""Runs a script or module with fbgemm_gpu imported from a subset of its libraries (the GPU
machine's FBGEMM_GPU bundle keeps only the training libraries: ../shared/tools/fbgemm-anchor).
fbgemm_gpu loads every library its package lists; here a listed library that is absent is
skipped instead of failing the import, as the referee (bench_tbe.py) does.

    python3 benchmarks/with_fbgemm_subset.py -m pytest -m cuda tests/test_torchrec.py
    torchrun --nproc_per_node=1 benchmarks/with_fbgemm_subset.py examples/torchrec_training.py
"""

import os
import runpy
import sys

import torch


def import_fbgemm_subset() -> list:
    skipped = []
    load = torch.ops.load_library

    def load_if_present(path):
        if not os.path.exists(path):
            skipped.append(os.path.basename(str(path)))
            return
        load(path)

    torch.ops.load_library = load_if_present
    try:
        import fbgemm_gpu  # noqa: F401
    finally:
        torch.ops.load_library = load
    return skipped


if __name__ == "__main__":
    skipped = import_fbgemm_subset()
    print(f"with_fbgemm_subset: fbgemm_gpu imported; skipped absent libraries {skipped}", flush=True)
    args = sys.argv[1:]
    if args[:1] == ["-m"]:
        sys.argv = [args[1]] + args[2:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")
