"""Accuracy of int8 rows: the CTR model of examples/ctr_training.py trained with float32 and with
int8 embedding rows, on identical batches, from the same start, and the loss gap between them.

Both runs use the same synthetic world and batches, the same MLP initialisation and optimizer
(torch.optim.Adagrad) and the same embedding optimizer and learning rate. The int8 tables start
from the float32 tables' initial values quantized row by row (the module's own initialisation
with the same seed), and every update re-quantizes the updated rows (docs/module.md, "int8
rows"). Reported: the mean training loss over the whole run and over its last 10%, the held-out
log loss and AUC, and the gaps (int8 minus float32).

    python benchmarks/int8_loss_gap.py                              # rowwise_adagrad, CPU
    python benchmarks/int8_loss_gap.py --optimizer adam --steps 1000 --json gap.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import tbegen  # noqa: E402
from ctr_training import (  # noqa: E402
    DEFAULT_LR, FEATURES, MLP_LR, evaluate, make_batches, make_mlp, make_world, train, windows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", default="rowwise_adagrad")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=None, help="embedding learning rate (default: ctr_training's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress-every", type=int, default=250)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    name = Path(args.optimizer).stem
    lr = args.lr if args.lr is not None else DEFAULT_LR.get(name, 0.01)

    world = make_world(args.seed)
    batches = make_batches(world, args.steps, args.batch_size, seed=args.seed + 1)
    held_out = make_batches(world, 16, args.batch_size, seed=args.seed + 2)
    batches = [(i.to(device), o.to(device), y.to(device), z) for i, o, y, z in batches]
    held_out = [(i.to(device), o.to(device), y.to(device), z) for i, o, y, z in held_out]

    runs = {}
    mlp0 = None
    for dtype in ("float32", "int8"):
        emb = tbegen.TableBatchedEmbeddingBags(
            tables=[(E, D) for E, D, _ in FEATURES], optimizer=args.optimizer, pooling="sum", weights_dtype=dtype,
            device=device, seed=args.seed, learning_rate=lr)
        if mlp0 is None:
            mlp0 = make_mlp(emb.layout.total_D, args.seed)
        mlp = copy.deepcopy(mlp0).to(device)
        opts = [torch.optim.Adagrad(mlp.parameters(), lr=MLP_LR)]
        print(f"training with {dtype} embedding rows ({emb.optimizer}, lr {lr}, {device}):", flush=True)
        losses, seconds, _ = train(dtype, emb, mlp, opts, batches, device, args.progress_every, lambda: [])
        held_loss, held_auc = evaluate(emb, mlp, held_out)
        last = max(1, args.steps // 10)
        runs[dtype] = dict(losses=losses, seconds=seconds, mean_loss=sum(losses) / len(losses),
                           last_10pct_loss=sum(losses[-last:]) / last, held_out_loss=held_loss, held_out_auc=held_auc,
                           windows=windows(losses, last))

    f, q = runs["float32"], runs["int8"]
    gap = {k: q[k] - f[k] for k in ("mean_loss", "last_10pct_loss", "held_out_loss", "held_out_auc")}
    gap["max_window_loss"] = max(abs(a - b) for a, b in zip(q["windows"], f["windows"]))
    print(f"\n{args.optimizer}, {args.steps} steps of {args.batch_size}, {device}:")
    print(f"{'':24}{'float32':>10}{'int8':>10}{'int8 - fp32':>14}")
    for k, label in (("mean_loss", "mean training loss"), ("last_10pct_loss", "last 10% training loss"),
                     ("held_out_loss", "held-out log loss"), ("held_out_auc", "held-out AUC")):
        print(f"{label:24}{f[k]:10.4f}{q[k]:10.4f}{gap[k]:+14.4f}")
    print(f"{'largest window gap':24}{'':20}{gap['max_window_loss']:14.4f}")
    print(f"time: float32 {f['seconds']:.1f} s, int8 {q['seconds']:.1f} s")
    if args.json:
        for r in runs.values():
            r.pop("losses")
        Path(args.json).write_text(json.dumps(dict(optimizer=args.optimizer, steps=args.steps, batch_size=args.batch_size,
                                                   lr=lr, device=str(device), runs=runs, gap=gap), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
