"""A small click-through-rate model trained with tbegen's fused embedding tables.

Four sparse features look up embedding tables of very different sizes (100,000, 10,000, 1,000 and
50 rows; a multi-hot "history" feature and three single-valued ones), are sum-pooled, concatenated
and fed to an MLP that predicts a click. The data is synthetic with a planted signal: a fraction
of the rows of every table carry a hidden score, the true click logit is a bias plus the mean
score of each feature's rows, and the label is drawn from it. Row popularity is Zipf-like, so
frequent rows are learnt well and rare ones barely at all, as in real CTR data.

The embeddings are trained by tbegen's fused optimizer (the update happens inside
`loss.backward()`); the MLP by torch.optim.Adagrad. Then the very same batches are run through a
pure-PyTorch model (nn.EmbeddingBag(sparse=True) per table + the matching torch optimizer for the
embeddings, the same MLP initialisation and optimizer) and both loss trajectories are printed side
by side. They must agree to fp32 summation-order noise; the script exits with status 1 otherwise.

    python examples/ctr_training.py                          # rowwise_adagrad on the CPU
    python examples/ctr_training.py --optimizer adam --steps 400
    python examples/ctr_training.py --device cuda --json result.json

PyTorch counterparts: sgd -> torch.optim.SGD, adagrad -> torch.optim.Adagrad (eps added after the
square root, like tbegen), adam -> torch.optim.SparseAdam (lazy, like tbegen; it adds eps before
the bias correction of the second moment, so it is given a per-step rescaled eps that makes the two
identical, see SparseAdamAfterCorrection), rowwise_adagrad -> a few lines of torch ops below (torch has no rowwise Adagrad), none ->
tbegen's dense gradient and nn.EmbeddingBag's, both stepped by torch.optim.SGD.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, List

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import tbegen  # noqa: E402

# torch.optim's sparse code paths warn about sparse invariant checks on every step
warnings.filterwarnings("ignore", message="Sparse invariant checks")

# (rows, dim, max bag length) per feature; bag lengths are uniform in [1, max] (0 allowed for the
# history feature).
FEATURES = [
    (100_000, 32, 8),  # e.g. items in the user's history (multi-hot)
    (10_000, 32, 1),  # the ad
    (1_000, 16, 1),  # the advertiser
    (50, 8, 1),  # the page category
]
ZIPF = 1.05  # row popularity: rank k drawn with probability ~ (k + 1)^-ZIPF
PREDICTIVE = 0.3  # fraction of rows with a nonzero hidden score
SIGNAL = 1.5  # standard deviation of the hidden scores
BIAS = -1.0  # click logit with no signal (base rate about 27%)

DEFAULT_LR = {"sgd": 5.0, "adagrad": 0.1, "rowwise_adagrad": 0.1, "adam": 0.01, "none": 5.0}
MLP_LR = 0.02
# Agreement with PyTorch. After the first step the embedding tables must agree to fp32 rounding.
# Over a whole run, the difference of the two runs grows: fp32 summation-order noise is amplified
# by training (as between two PyTorch runs that differ only in summation order, e.g.
# nn.EmbeddingBag with sparse vs dense gradients), so the loss trajectories get a looser bound.
# (1e-4: Adagrad divides by |g| + eps, so an element whose summed gradient is near eps amplifies
# its fp32 rounding; a wrong update would be off by about the learning rate, 0.01 to 5.)
# printed after the comparison: how to read it
EXPLANATION = """
How to read this: both models start from the same weights and see the same batches. After one
step their embedding tables agree to float32 rounding: the fused update computes what
nn.EmbeddingBag + torch.optim compute. They do not add up a row's gradients in the same order,
though, and training amplifies those last-bit differences step after step (as it would between
two PyTorch runs that only sum in another order), so individual weights drift apart: the
difference "at the end" is large and expected. What must agree, and is checked against the
tolerances, is the training itself: the loss of every step, the loss averaged over each window,
and the held-out loss and AUC."""

FIRST_STEP_TOLERANCE = 1e-4  # max |weight difference| after step 1
TOLERANCE = 5e-3  # max |loss difference| of any one step
WINDOW_TOLERANCE = 1e-3  # max |difference| of the mean loss of any window (a tenth of the run)


# ---- synthetic data with a planted signal -------------------------------------------------------


def make_world(seed: int):
    """Hidden row scores and row popularity per feature."""
    gen = torch.Generator().manual_seed(seed)
    scores, popularity = [], []
    for rows, _, _ in FEATURES:
        s = torch.randn(rows, generator=gen) * SIGNAL
        s[torch.rand(rows, generator=gen) >= PREDICTIVE] = 0.0
        scores.append(s)
        p = (torch.arange(rows, dtype=torch.float64) + 1).pow(-ZIPF)
        popularity.append((p / p.sum())[torch.randperm(rows, generator=gen)])  # popular rows anywhere
    return scores, popularity


def make_batches(world, steps: int, B: int, seed: int):
    """`steps` batches: (indices, offsets [F*B+1], labels [B, 1], true logits [B])."""
    scores, popularity = world
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        all_idx, lengths, logit = [], [], torch.full((B,), BIAS)
        for (rows, _, max_L), s, p in zip(FEATURES, scores, popularity):
            low = 0 if max_L > 1 else 1
            L = torch.randint(low, max_L + 1, (B,), generator=gen)
            idx = torch.multinomial(p, int(L.sum()), replacement=True, generator=gen)
            bag_of = torch.repeat_interleave(torch.arange(B), L)
            total = torch.zeros(B).index_add_(0, bag_of, s[idx])
            logit += total / L.clamp(min=1)
            all_idx.append(idx)
            lengths.append(L)
        offsets = torch.zeros(len(FEATURES) * B + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.cat(lengths), 0)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)[:, None]
        batches.append((torch.cat(all_idx), offsets, labels, logit))
    return batches


# ---- the two models -------------------------------------------------------------------------------


def make_mlp(in_dim: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_dim, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))


class TorchEmbeddings(nn.Module):
    """The PyTorch baseline: one nn.EmbeddingBag per table, outputs concatenated."""

    def __init__(self, weights: List[torch.Tensor], sparse: bool):
        super().__init__()
        self.bags = nn.ModuleList(
            nn.EmbeddingBag.from_pretrained(w.detach().float().clone(), freeze=False, mode="sum", sparse=sparse,
                                            include_last_offset=True)
            for w in weights
        )

    def forward(self, indices, offsets):
        B = (len(offsets) - 1) // len(self.bags)
        outs = []
        for f, bag in enumerate(self.bags):
            off = offsets[f * B : (f + 1) * B + 1]
            lo = off[0]
            outs.append(bag(indices[lo : off[-1]], off - lo))
        return torch.cat(outs, dim=1)


class RowWiseAdagrad(torch.optim.Optimizer):
    """Rowwise Adagrad for sparse gradients in torch ops (tbegen's rowwise_adagrad, no decay):
    m[r] += mean_d(g[r]^2); w[r] -= lr / (sqrt(m[r]) + eps) * g[r] for every row r in the batch."""

    def __init__(self, params, lr: float, eps: float = 1e-8):
        super().__init__(params, dict(lr=lr, eps=eps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.coalesce()
                rows, g = grad.indices()[0], grad.values()
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros(p.shape[0], device=p.device)
                m = state["momentum"]
                m[rows] += g.pow(2).mean(1)
                p[rows] -= (group["lr"] / (m[rows].sqrt() + group["eps"]))[:, None] * g


class SparseAdamAfterCorrection(torch.optim.SparseAdam):
    """torch.optim.SparseAdam with tbegen's (and torch.optim.Adam's) placement of eps.

    SparseAdam computes lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps), i.e. it adds eps
    before the bias correction of v; tbegen computes lr * m_hat / (sqrt(v_hat) + eps). Passing
    SparseAdam eps * sqrt(1 - b2^t) at step t makes the two identical (here every table gets a
    gradient every step, so SparseAdam's per-table step counter is the global step)."""

    def __init__(self, params, lr: float, eps: float = 1e-8):
        super().__init__(params, lr=lr, eps=eps)
        self.tbegen_eps = eps
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        for group in self.param_groups:
            group["eps"] = self.tbegen_eps * math.sqrt(1.0 - group["betas"][1] ** self.steps)
        return super().step(closure)


def torch_embedding_optimizer(name: str, params, lr: float):
    if name == "sgd" or name == "none":
        return torch.optim.SGD(params, lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=1e-8, initial_accumulator_value=0.0)
    if name == "rowwise_adagrad":
        return RowWiseAdagrad(params, lr=lr, eps=1e-8)
    if name == "adam":
        return SparseAdamAfterCorrection(params, lr=lr, eps=1e-8)
    raise ValueError(f"no PyTorch counterpart for optimizer {name!r}")


# ---- training -----------------------------------------------------------------------------------


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(label: str, embeddings: nn.Module, mlp: nn.Module, optimizers, batches, device, progress_every: int,
          tables):
    """Trains on `batches`; returns (per-step losses, seconds, copies of `tables()` after step 1)."""
    losses: List[float] = []
    after_first = None
    loss_fn = nn.BCEWithLogitsLoss()
    sync(device)
    start = time.perf_counter()
    window_start = start
    for step, (indices, offsets, labels, _) in enumerate(batches, 1):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss = loss_fn(mlp(embeddings(indices, offsets)), labels)
        loss.backward()  # for tbegen this also updates the embedding tables
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
        if step == 1:
            after_first = [t.detach().clone() for t in tables()]
        if step % progress_every == 0 or step == len(batches):
            now = time.perf_counter()
            done = step - (step - 1) // progress_every * progress_every
            rate = done * len(labels) / (now - window_start)
            recent = losses[-progress_every:]
            print(f"  [{label}] step {step:5d}/{len(batches)}  loss {sum(recent) / len(recent):.4f}  "
                  f"{rate:9.0f} examples/s", flush=True)
            window_start = now
    sync(device)
    return losses, time.perf_counter() - start, after_first


@torch.no_grad()
def evaluate(embeddings, mlp, batches):
    """Held-out log loss and AUC."""
    logits = torch.cat([mlp(embeddings(i, o)).flatten() for i, o, _, _ in batches]).cpu()
    labels = torch.cat([y.flatten() for _, _, y, _ in batches]).cpu()
    loss = nn.functional.binary_cross_entropy_with_logits(logits, labels).item()
    return loss, auc(logits, labels)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[scores.argsort()] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return ((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)).item()


def windows(losses: List[float], size: int) -> List[float]:
    return [sum(losses[i : i + size]) / len(losses[i : i + size]) for i in range(0, len(losses), size)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizer", default="rowwise_adagrad", help="a spec name or YAML path (default rowwise_adagrad)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=None, help="embedding learning rate (default: per optimizer)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--weights-dtype", default="float32", choices=["float32", "float16", "bfloat16", "int8"],
                    help="int8: int8 rows, each with a float32 scale and bias (benchmarks/int8_loss_gap.py "
                         "compares them with float32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-compare", action="store_true", help="skip the pure-PyTorch run")
    ap.add_argument("--progress-every", type=int, default=250)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    name = Path(args.optimizer).stem
    lr = args.lr if args.lr is not None else DEFAULT_LR.get(name, 0.01)
    dtype = "int8" if args.weights_dtype == "int8" else getattr(torch, args.weights_dtype)

    # data: training batches, and held-out batches from the same world
    t0 = time.perf_counter()
    world = make_world(args.seed)
    batches = make_batches(world, args.steps, args.batch_size, seed=args.seed + 1)
    held_out = make_batches(world, 16, args.batch_size, seed=args.seed + 2)
    batches = [(i.to(device), o.to(device), y.to(device), z) for i, o, y, z in batches]
    held_out = [(i.to(device), o.to(device), y.to(device), z) for i, o, y, z in held_out]
    bayes = nn.functional.binary_cross_entropy_with_logits(
        torch.cat([z for *_, z in batches]), torch.cat([y.flatten().cpu() for _, _, y, _ in batches])).item()
    print(f"data: {args.steps} batches of {args.batch_size}, tables {[(E, D) for E, D, _ in FEATURES]}, "
          f"generated in {time.perf_counter() - t0:.1f} s; loss of the true probabilities: {bayes:.4f}")

    # tbegen model
    t0 = time.perf_counter()
    hyper = {} if name == "none" else {"learning_rate": lr}
    emb = tbegen.TableBatchedEmbeddingBags(
        tables=[(E, D) for E, D, _ in FEATURES], optimizer=args.optimizer, pooling="sum", weights_dtype=dtype,
        device=device, seed=args.seed, **hyper)
    print(f"tbegen: {emb.optimizer} ready in {time.perf_counter() - t0:.2f} s (extension build or cache load + init)")
    print(f"  the module rendered the spec {emb.spec.path} in memory (the same sources `tbegen render` writes to "
          f"generated/{emb.optimizer}/), compiled them once into the build cache {tbegen.build.build_root()} and "
          "loaded the library from there")
    mlp = make_mlp(emb.layout.total_D, args.seed).to(device)
    init_weights = [w.clone() for w in emb.split_embedding_weights()]
    init_mlp = copy.deepcopy(mlp)
    optimizers = [torch.optim.Adagrad(mlp.parameters(), lr=MLP_LR)]
    if emb.dense_gradient:
        optimizers.append(torch.optim.SGD(emb.parameters(), lr=lr))
    print(f"training with tbegen ({emb.optimizer}, embedding lr {lr}, {args.weights_dtype} weights, {device}):")
    ours, ours_s, ours_first = train("tbegen", emb, mlp, optimizers, batches, device, args.progress_every,
                                     emb.split_embedding_weights)
    ours_eval = evaluate(emb, mlp, held_out)

    result: Dict[str, object] = {
        "optimizer": emb.optimizer, "device": str(device), "steps": args.steps, "batch_size": args.batch_size,
        "embedding_lr": lr, "weights_dtype": args.weights_dtype, "true_probability_loss": bayes,
        "tbegen": {"losses": ours, "seconds": ours_s, "held_out_loss": ours_eval[0], "held_out_auc": ours_eval[1]},
    }
    window = max(1, args.steps // 10)  # steps per window of the printed trajectories
    first, last = windows(ours, window)[0], windows(ours, window)[-1]
    print(f"tbegen: loss {first:.4f} (first {window} steps) -> {last:.4f} (last {window}); "
          f"held-out loss {ours_eval[0]:.4f}, AUC {ours_eval[1]:.4f}; {ours_s:.1f} s "
          f"({args.steps * args.batch_size / ours_s:.0f} examples/s)")
    ok = last < first
    if not ok:
        print("FAILED: the loss did not go down")

    compare = not args.no_compare and name in DEFAULT_LR and dtype == torch.float32
    if compare:
        ref_emb = TorchEmbeddings(init_weights, sparse=name != "none").to(device)
        ref_mlp = init_mlp
        ref_opts = [torch.optim.Adagrad(ref_mlp.parameters(), lr=MLP_LR),
                    torch_embedding_optimizer(name, ref_emb.parameters(), lr)]
        print(f"training the same batches with PyTorch (nn.EmbeddingBag + {type(ref_opts[1]).__name__}):")
        theirs, theirs_s, theirs_first = train("torch", ref_emb, ref_mlp, ref_opts, batches, device,
                                               args.progress_every, lambda: [b.weight for b in ref_emb.bags])
        first_diff = max((a - b).abs().max().item() for a, b in zip(ours_first, theirs_first))
        theirs_eval = evaluate(ref_emb, ref_mlp, held_out)
        diff = max(abs(a - b) for a, b in zip(ours, theirs))
        window_diff = max(abs(a - b) for a, b in zip(windows(ours, window), windows(theirs, window)))
        weight_diff = max((w - bag.weight).abs().max().item()
                          for w, bag in zip(emb.split_embedding_weights(), ref_emb.bags))
        print(f"\n{'steps':>13}  {'tbegen':>8}  {'PyTorch':>8}  {'max |diff|':>10}")
        for k, (a, b) in enumerate(zip(windows(ours, window), windows(theirs, window))):
            lo, hi = k * window + 1, min((k + 1) * window, len(ours))
            d = max(abs(x - y) for x, y in zip(ours[lo - 1 : hi], theirs[lo - 1 : hi]))
            print(f"{lo:>6}-{hi:<6}  {a:8.4f}  {b:8.4f}  {d:10.2e}")
        print(f"held-out: tbegen loss {ours_eval[0]:.4f} AUC {ours_eval[1]:.4f}; "
              f"PyTorch loss {theirs_eval[0]:.4f} AUC {theirs_eval[1]:.4f}")
        print(f"time: tbegen {ours_s:.1f} s, PyTorch {theirs_s:.1f} s")
        print(f"max embedding weight difference after step 1: {first_diff:.2e} (tolerance {FIRST_STEP_TOLERANCE:g}); "
              f"at the end: {weight_diff:.2e}")
        print(f"max loss difference: per step {diff:.2e} (tolerance {TOLERANCE:g}), "
              f"per {window}-step window {window_diff:.2e} (tolerance {WINDOW_TOLERANCE:g})")
        print(EXPLANATION)
        result["pytorch"] = {"losses": theirs, "seconds": theirs_s, "held_out_loss": theirs_eval[0],
                             "held_out_auc": theirs_eval[1], "optimizer": type(ref_opts[1]).__name__}
        result["max_loss_difference"] = diff
        result["max_window_loss_difference"] = window_diff
        result["max_weight_difference_after_step_1"] = first_diff
        result["max_weight_difference"] = weight_diff
        if not (diff <= TOLERANCE and window_diff <= WINDOW_TOLERANCE and first_diff <= FIRST_STEP_TOLERANCE):
            print("FAILED: tbegen and PyTorch disagree beyond the tolerance")
            ok = False
    elif not args.no_compare:
        print("(no PyTorch comparison for this optimizer / weight dtype)")
    result["ok"] = ok
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
