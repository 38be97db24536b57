#!/usr/bin/env python3
"""The managed-memory operators' argument checks one call at a time, each announced before it runs
(a crash then names its call). Run under cuda-gdb for the native stack of a crash:

    cuda-gdb -batch -ex run -ex bt --args python3 benchmarks/tools/diag_managed.py
"""
import torch

from tbegen import TableBatchedEmbeddingBags

emb = TableBatchedEmbeddingBags([(8, 4)], optimizer="sgd", device="cuda")
ops = emb._ops
t = ops.managed_empty(16, torch.float32, torch.device("cuda"))
print("managed_empty(16):", t.shape, ops.memory_kind(t), flush=True)
calls = [
    ("advise hbm", lambda: ops.managed_advise(t, 0, 16, "hbm")),
    ("advise out of range", lambda: ops.managed_advise(t, 8, 16, "host")),
    ("advise negative start", lambda: ops.managed_advise(t, -1, 4, "host")),
    ("advise device memory", lambda: ops.managed_advise(emb.weights, 0, 4, "host")),
    ("advise ok", lambda: ops.managed_advise(t, 0, 16, "host")),
    ("preferred location", lambda: ops.managed_preferred_location(t, 0, 16)),
    ("preferred location out of range", lambda: ops.managed_preferred_location(t, 8, 16)),
    ("empty on cpu", lambda: ops.managed_empty(4, torch.float32, torch.device("cpu"))),
    ("empty of 0", lambda: ops.managed_empty(0, torch.float32, torch.device("cuda")).numel()),
]
for name, call in calls:
    print(f"-- {name}", flush=True)
    try:
        print("   returned", call(), flush=True)
    except RuntimeError as e:
        print("   raised", str(e).splitlines()[0][:200], flush=True)
print("done", flush=True)
