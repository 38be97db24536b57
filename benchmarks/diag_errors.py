#!/usr/bin/env python3
"""Diagnostics for error paths on the GPU machine: each scenario in its own process, so that a
crash is reported instead of ending the run."""
import subprocess
import sys

PRELUDE = """
import sys, torch
sys.path.insert(0, '.')
from tbegen import build
from tbegen.spec import load_spec
from tbegen.layout import make_layout
spec = load_spec('optimizers/adagrad.yaml'); ops = build.load_ops(spec, with_cuda=True)
layout = make_layout([(10, 16)])
def run(dev):
    w = torch.randn(layout.weights_numel, device=dev); acc = torch.zeros_like(w)
    feats = layout.features_tensor(dev)
    ind = torch.tensor([1, 2, 10], device=dev); off = torch.tensor([0, 2, 3], device=dev)
    return w, acc, feats, ind, off
"""
SCENARIOS = {
    "cpu forward bad index": "w, acc, f, i, o = run('cpu')\ntry:\n    ops.forward(w, f, 16, 16, i, o, None, 0)\nexcept RuntimeError as e:\n    print('raised:', str(e).splitlines()[0])",
    "cpu check_batch error": "w, acc, f, i, o = run('cpu')\ntry:\n    ops.forward(w, f, 16, 16, i.float(), o, None, 0)\nexcept RuntimeError as e:\n    print('raised:', str(e).splitlines()[0])",
    "cuda check_batch error": "w, acc, f, i, o = run('cuda')\ntry:\n    ops.forward(w, f, 16, 16, i.float(), o, None, 0)\nexcept RuntimeError as e:\n    print('raised:', str(e).splitlines()[0])",
    "cuda forward bad index": "w, acc, f, i, o = run('cuda')\ntry:\n    ops.forward(w, f, 16, 16, i, o, None, 0)\nexcept RuntimeError as e:\n    print('raised:', str(e).splitlines()[0])",
    "cuda backward bad index": "w, acc, f, i, o = run('cuda')\ngo = torch.randn(2, 16, device='cuda')\ntry:\n    ops.backward(go, w, f, 16, 16, 10, i, o, None, 0, 32, False, 0, acc, 0.1, 1e-8, 1)\nexcept RuntimeError as e:\n    print('raised:', str(e).splitlines()[0])",
}
for name, body in SCENARIOS.items():
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", PRELUDE + body], capture_output=True, text=True)
    print(f"== {name}: rc {p.returncode}")
    print("\n".join(p.stdout.strip().splitlines()[-3:]))
    if p.returncode:
        print("\n".join(l for l in p.stderr.strip().splitlines() if "W1202" not in l)[-1500:])
