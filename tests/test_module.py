"""Tests of tbegen.TableBatchedEmbeddingBags (tbegen/module.py) against PyTorch.

The forward is compared with nn.EmbeddingBag; training steps with nn.EmbeddingBag(sparse=True) +
torch.optim (SGD, Adagrad, SparseAdam), with a float64 implementation of the formula where torch
has no such optimizer (rowwise_adagrad), and with autograd for the dense-gradient mode ("none").
Tables are tiny so that the CPU suite is fast; each optimizer's extension is built once per
session (cached in $TBEGEN_BUILD_DIR). GPU variants are marked `cuda` and skipped without a GPU.
"""

from __future__ import annotations

import copy
import io
import math
from typing import List

import pytest
import torch
from torch import nn

import tbegen
from tbegen.module import TableBatchedEmbeddingBags
from tbegen.spec import find_spec, load_spec

from conftest import SPECS as CONFTEST_SPECS

# The shipped optimizers this file compares with torch; the generic tests (forward, per-sample
# weight gradient, state_dict, views, set_learning_rate) also run for any spec added to optimizers/
# later, as long as all its hyperparameters have defaults.
KNOWN = ["sgd", "adagrad", "rowwise_adagrad", "adam", "none"]
SPECS = {name: load_spec(path) for name, path in CONFTEST_SPECS.items()}
OPTIMIZERS = sorted(n for n, s in SPECS.items() if not any(h.required for h in s.hyperparameters))
WITH_LR = [n for n in OPTIMIZERS if any(h.name == "learning_rate" for h in SPECS[n].hyperparameters)]
TABLES = [(40, 8), (25, 12), (16, 4)]
HAS_CUDA = torch.cuda.is_available()
# torch.optim's sparse paths warn about sparse invariant checks; not our concern here
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def test_every_shipped_optimizer_is_covered():
    assert set(KNOWN) <= set(OPTIMIZERS)


@pytest.fixture(scope="session", autouse=True)
def built_extensions(prebuilt):
    """Every optimizer's extension, built once per session (in parallel, by conftest's `prebuilt`)
    and loaded into this process."""
    for name in OPTIMIZERS:
        TableBatchedEmbeddingBags([(4, 4)], optimizer=name)


# ---- helpers ----------------------------------------------------------------------------------


def make_emb(optimizer, tables=TABLES, device="cpu", **kw) -> TableBatchedEmbeddingBags:
    return TableBatchedEmbeddingBags(tables, optimizer=optimizer, device=device, **kw)


def make_batch(emb: TableBatchedEmbeddingBags, B: int, gen: torch.Generator, max_L: int = 5,
               weighted: bool = False, index_dtype=torch.int64, hot: bool = True):
    """Bags of 0..max_L indices drawn from a few rows (duplicates), every 4th bag empty, and a hot
    row (row 1 of feature 0 in every non-empty bag)."""
    bags: List[List[int]] = []
    for f, t in enumerate(emb.layout.feature_table_map):
        E = emb.layout.tables[t][0]
        pool = torch.randperm(E, generator=gen)[: max(2, E // 2)]
        for b in range(B):
            L = 0 if b % 4 == 3 else int(torch.randint(1, max_L + 1, (1,), generator=gen))
            picks = pool[torch.randint(0, len(pool), (L,), generator=gen)].tolist()
            if hot and f == 0 and L:
                picks.append(1)
            bags.append(picks)
    offsets = torch.zeros(len(bags) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor([len(x) for x in bags]), 0)
    indices = torch.tensor([i for bag in bags for i in bag], dtype=torch.int64)
    psw = torch.rand(len(indices), generator=gen) * 2 - 0.5 if weighted else None
    return indices.to(index_dtype), offsets.to(index_dtype), psw


class TorchTables(nn.Module):
    """The same lookup in plain PyTorch: one nn.EmbeddingBag per table, features concatenated."""

    def __init__(self, emb: TableBatchedEmbeddingBags, mode: str = "sum", sparse: bool = True,
                 dtype=torch.float32):
        super().__init__()
        self.ftm = emb.layout.feature_table_map
        self.mode = mode
        self.bags = nn.ModuleList(
            nn.EmbeddingBag.from_pretrained(w.detach().to(dtype).clone(), freeze=False, mode=mode, sparse=sparse,
                                            include_last_offset=True)
            for w in emb.split_embedding_weights()
        )

    def forward(self, indices, offsets, per_sample_weights=None):
        indices, offsets = indices.to(torch.int64), offsets.to(torch.int64)
        F = len(self.ftm)
        B = (len(offsets) - 1) // F
        outs = []
        for f, t in enumerate(self.ftm):
            off = offsets[f * B : (f + 1) * B + 1]
            lo, hi = int(off[0]), int(off[-1])
            psw = per_sample_weights[lo:hi] if per_sample_weights is not None else None
            if self.mode == "none":
                table = self.bags[t]
                w = nn.functional.embedding(indices[lo:hi], table.weight, sparse=table.sparse)
                outs.append(w * psw[:, None] if psw is not None else w)
            elif self.mode == "mean" and psw is not None:
                # nn.EmbeddingBag has no weighted mean: weighted sum / bag length, by hand
                table = self.bags[t]
                rows = nn.functional.embedding(indices[lo:hi], table.weight, sparse=table.sparse) * psw[:, None]
                lengths = off[1:] - off[:-1]
                bag_of = torch.repeat_interleave(torch.arange(B, device=rows.device), lengths)
                pooled = torch.zeros(B, rows.shape[1], dtype=rows.dtype, device=rows.device).index_add(0, bag_of, rows)
                outs.append(pooled / lengths.clamp(min=1)[:, None].to(rows.dtype))
            else:
                outs.append(self.bags[t](indices[lo:hi], off - lo, per_sample_weights=psw))
        return torch.cat(outs, dim=0 if self.mode == "none" else 1)


def assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=""):
    torch.testing.assert_close(actual.detach().cpu().to(expected.dtype), expected.detach().cpu(), rtol=rtol,
                               atol=atol, msg=lambda m: f"{msg}: {m}")


def split_weights(emb) -> List[torch.Tensor]:
    return [w.clone() for w in emb.split_embedding_weights()]


def train_steps(emb, steps: int, seed, B: int = 6, weighted: bool = False):
    """Runs `steps` steps on random data with a random linear loss; `seed` is an int or a
    torch.Generator (to continue a stream). Optimizer "none" is trained by plain SGD on the dense
    gradient. Returns the losses."""
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ind, off, psw = make_batch(emb, B, gen, weighted=weighted)
        dev = emb.weights.device
        out = emb(ind.to(dev), off.to(dev), psw.to(dev) if psw is not None else None)
        proj = torch.randn(out.shape, generator=gen).to(dev)
        loss = (out * proj).sum()
        loss.backward()
        if emb.dense_gradient:
            with torch.no_grad():
                emb.weights -= 0.1 * emb.weights.grad
            emb.weights.grad = None
        losses.append(loss.item())
    return losses


# ---- forward ----------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_forward_matches_embedding_bag(optimizer, pooling, weighted, index_dtype):
    emb = make_emb(optimizer, pooling=pooling, seed=3)
    ref = TorchTables(emb, mode=pooling)
    gen = torch.Generator().manual_seed(1)
    ind, off, psw = make_batch(emb, 7, gen, weighted=weighted, index_dtype=index_dtype)
    out = emb(ind, off, psw)
    assert out.shape == (7, sum(D for _, D in TABLES)) and out.dtype == torch.float32
    assert_close(out, ref(ind, off, psw), msg="forward")


@pytest.mark.parametrize("weighted", [False, True])
def test_forward_pooling_none(weighted):
    emb = make_emb("sgd", tables=[(30, 8), (20, 8)], pooling="none")
    ref = TorchTables(emb, mode="none")
    ind, off, psw = make_batch(emb, 5, torch.Generator().manual_seed(2), weighted=weighted)
    out = emb(ind, off, psw)
    assert out.shape == (len(ind), 8)
    assert_close(out, ref(ind, off, psw), msg="forward none")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_forward_half_weights(dtype):
    emb = make_emb("sgd", weights_dtype=dtype)
    assert emb.weights.dtype == dtype
    ref = TorchTables(emb, mode="sum")  # the rounded weights, in float32
    ind, off, psw = make_batch(emb, 6, torch.Generator().manual_seed(4), weighted=True)
    assert_close(emb(ind, off, psw), ref(ind, off, psw), msg="forward half")


def test_no_grad_forward_does_not_update():
    emb = make_emb("sgd", learning_rate=0.5)
    w0 = emb.weights.clone()
    ind, off, _ = make_batch(emb, 4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = emb(ind, off)
    assert not out.requires_grad
    assert emb.step == 0 and torch.equal(emb.weights, w0)


# ---- training steps against torch.optim -------------------------------------------------------

HYPER = {
    "sgd": dict(learning_rate=0.3),
    "adagrad": dict(learning_rate=0.2, eps=1e-6),
    "adam": dict(learning_rate=0.05, beta1=0.8, beta2=0.95, eps=1e-6),
}


class SparseAdamAfterCorrection(torch.optim.SparseAdam):
    """torch.optim.SparseAdam adds eps to sqrt(v) before the bias correction of v; tbegen's adam
    (like torch.optim.Adam) adds it to sqrt(v_hat). Giving SparseAdam eps * sqrt(1 - beta2^t) at
    step t makes the two the same formula. (Every table gets a gradient at every step in these
    tests, so SparseAdam's per-parameter step is the module's step.)"""

    def __init__(self, params, lr, betas, eps):
        super().__init__(params, lr=lr, betas=betas, eps=eps)
        self.base_eps, self.t = eps, 0

    def step(self, closure=None):
        self.t += 1
        for group in self.param_groups:
            group["eps"] = self.base_eps * math.sqrt(1 - group["betas"][1] ** self.t)
        return super().step(closure)


def torch_optimizer(name, params, h):
    if name == "sgd":
        return torch.optim.SGD(params, lr=h["learning_rate"])
    if name == "adagrad":
        # torch's Adagrad adds eps after the square root, like ours
        return torch.optim.Adagrad(params, lr=h["learning_rate"], eps=h["eps"], initial_accumulator_value=0.0)
    if name == "adam":
        return SparseAdamAfterCorrection(params, lr=h["learning_rate"], betas=(h["beta1"], h["beta2"]), eps=h["eps"])
    raise KeyError(name)


def compare_states(emb, opt, ref):
    """tbegen's per-table states against torch.optim's per-parameter state."""
    names = {"adagrad": {"accumulator": "sum"}, "adam": {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}}
    for t, states in enumerate(emb.split_optimizer_states()):
        torch_state = opt.state[ref.bags[t].weight]
        for ours, theirs in names.get(emb.optimizer, {}).items():
            assert_close(states[ours], torch_state[theirs], rtol=1e-5, atol=1e-7, msg=f"table {t} state {ours}")


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_training_matches_torch_optim(optimizer, pooling, weighted):
    h = HYPER[optimizer]
    emb = make_emb(optimizer, pooling=pooling, seed=5, **h)
    ref = TorchTables(emb, mode=pooling, sparse=True)
    opt = torch_optimizer(optimizer, ref.parameters(), h)
    gen = torch.Generator().manual_seed(11)
    for step in range(1, 4):
        ind, off, psw = make_batch(emb, 8, gen, weighted=weighted)
        proj = torch.randn(8, emb.layout.total_D, generator=gen)
        (emb(ind, off, psw) * proj).sum().backward()
        opt.zero_grad()
        (ref(ind, off, psw) * proj).sum().backward()
        opt.step()
        assert emb.step == step
        for t, (ours, theirs) in enumerate(zip(emb.split_embedding_weights(), ref.bags)):
            assert_close(ours, theirs.weight, msg=f"step {step} table {t} weights")
        compare_states(emb, opt, ref)


def rowwise_adagrad_reference(w, momentum, g, rows, h):
    """The brief's formula in float64 over the touched rows."""
    w, momentum, g = w.double().clone(), momentum.double().clone(), g.double()
    wr, gr = w[rows], g[rows]
    mode, wd = h["weight_decay_mode"], h["weight_decay"]
    l2 = wd if mode == 1 else 0.0
    momentum[rows] += ((gr + l2 * wr) ** 2).mean(1)
    mult = h["learning_rate"] / (momentum[rows].sqrt() + h["eps"])
    keep = 1 - mult * wd if mode == 1 else torch.full_like(mult, 1 - h["learning_rate"] * wd if mode == 2 else 1.0)
    new = keep[:, None] * wr - mult[:, None] * gr
    if h["max_norm"] > 0:
        norm = new.norm(dim=1, keepdim=True)
        new = torch.where(norm > h["max_norm"], new * (h["max_norm"] / norm), new)
    w[rows] = new
    return w, momentum


@pytest.mark.parametrize(
    "extra",
    [dict(), dict(weight_decay=0.1, weight_decay_mode=1), dict(weight_decay=0.1, weight_decay_mode=2, max_norm=0.4)],
    ids=["plain", "l2", "decoupled-maxnorm"],
)
def test_training_rowwise_adagrad_matches_formula(extra):
    h = dict(learning_rate=0.2, eps=1e-8, weight_decay=0.0, weight_decay_mode=0, max_norm=0.0)
    h.update(extra)
    emb = make_emb("rowwise_adagrad", pooling="mean", **h)
    assert emb.hyperparameters == h
    ref = TorchTables(emb, mode="mean", sparse=False)
    momentum = [torch.zeros(E, dtype=torch.float64) for E, _ in TABLES]
    gen = torch.Generator().manual_seed(12)
    for step in range(3):
        ind, off, psw = make_batch(emb, 8, gen, weighted=True)
        proj = torch.randn(8, emb.layout.total_D, generator=gen)
        (emb(ind, off, psw) * proj).sum().backward()
        ref.zero_grad()
        (ref(ind, off, psw) * proj).sum().backward()
        B = 8
        for t, bag in enumerate(ref.bags):
            touched = torch.unique(ind[off[t * B] : off[(t + 1) * B]])
            w, momentum[t] = rowwise_adagrad_reference(bag.weight.detach(), momentum[t], bag.weight.grad, touched, h)
            with torch.no_grad():
                bag.weight.copy_(w)
            states = emb.split_optimizer_states()[t]
            assert_close(states["momentum"], momentum[t], rtol=1e-5, atol=1e-9, msg=f"step {step} momentum")
            assert_close(emb.split_embedding_weights()[t], w, msg=f"step {step} table {t}")


# ---- per-sample-weight gradient ---------------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
def test_per_sample_weights_grad(optimizer, pooling):
    tables = [(30, 8), (20, 8)] if pooling == "none" else TABLES
    # a large learning rate: a gradient computed after the update would be visibly wrong
    kw = {"learning_rate": 1.0} if optimizer != "none" else {}
    emb = make_emb(optimizer, tables=tables, pooling=pooling, **kw)
    ref = TorchTables(emb, mode=pooling, sparse=False)
    gen = torch.Generator().manual_seed(21)
    for step in range(2):
        ind, off, psw = make_batch(emb, 6, gen, weighted=True)
        psw_ours, psw_ref = psw.clone().requires_grad_(), psw.clone().requires_grad_()
        out = emb(ind, off, psw_ours)
        proj = torch.randn(out.shape, generator=gen)
        (out * proj).sum().backward()
        (ref(ind, off, psw_ref) * proj).sum().backward()
        assert_close(psw_ours.grad, psw_ref.grad, msg=f"step {step} psw grad")
        # keep the reference in step with the module
        with torch.no_grad():
            for bag, w in zip(ref.bags, emb.split_embedding_weights()):
                bag.weight.copy_(w)
        if emb.dense_gradient:
            emb.weights.grad = None


def test_psw_without_grad_gets_none():
    emb = make_emb("sgd")
    ind, off, psw = make_batch(emb, 4, torch.Generator().manual_seed(0), weighted=True)
    emb(ind, off, psw).sum().backward()
    assert psw.grad is None and emb.step == 1


# ---- dense-gradient mode ----------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["sum", "mean", "none"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_none_mode_grad_matches_autograd(pooling, weighted, dtype):
    tables = [(30, 8), (20, 8)] if pooling == "none" else TABLES
    emb = make_emb("none", tables=tables, pooling=pooling, weights_dtype=dtype)
    assert isinstance(emb.weights, nn.Parameter) and emb.weights.requires_grad
    assert [id(p) for p in emb.parameters()] == [id(emb.weights)]
    ref = TorchTables(emb, mode=pooling, sparse=False, dtype=torch.float32)
    ind, off, psw = make_batch(emb, 6, torch.Generator().manual_seed(31), weighted=weighted)
    out = emb(ind, off, psw)
    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(32))
    (out * proj).sum().backward()
    (ref(ind, off, psw) * proj).sum().backward()
    grad = emb.weights.grad
    assert grad.shape == emb.weights.shape and grad.dtype == dtype
    expected = torch.cat([bag.weight.grad.flatten() for bag in ref.bags])
    if dtype == torch.float32:
        assert_close(grad, expected, rtol=1e-6, atol=1e-7, msg="dense grad")
    else:
        assert_close(grad, expected.to(dtype).float(), rtol=2**-10, atol=1e-4, msg="dense grad fp16")


def test_none_mode_with_torch_optimizer_equals_fused_sgd():
    """Dense gradient + torch.optim.SGD reproduces the fused sgd update."""
    dense, fused = make_emb("none", seed=7), make_emb("sgd", seed=7, learning_rate=0.25)
    opt = torch.optim.SGD(dense.parameters(), lr=0.25)
    gen = torch.Generator().manual_seed(41)
    for _ in range(3):
        ind, off, psw = make_batch(dense, 6, gen, weighted=True)
        proj = torch.randn(6, dense.layout.total_D, generator=gen)
        opt.zero_grad()
        (dense(ind, off, psw) * proj).sum().backward()
        opt.step()
        (fused(ind, off, psw) * proj).sum().backward()
    assert_close(dense.weights, fused.weights.detach(), rtol=1e-6, atol=1e-7, msg="none+SGD vs fused sgd")


def test_none_mode_frozen_weights_get_no_grad():
    emb = make_emb("none")
    emb.weights.requires_grad_(False)
    ind, off, psw = make_batch(emb, 4, torch.Generator().manual_seed(0), weighted=True)
    psw.requires_grad_()
    emb(ind, off, psw).sum().backward()
    assert emb.weights.grad is None and psw.grad is not None


# ---- state_dict ------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_state_dict_round_trip_is_bitwise(optimizer, dtype):
    kw = dict(weights_dtype=dtype, stochastic_rounding=True, seed=13)
    h = {"learning_rate": 0.07} if optimizer != "none" else {}
    straight = make_emb(optimizer, **kw, **h)
    train_steps(straight, 4, seed=99, weighted=True)

    first = make_emb(optimizer, **kw, **h)
    gen = torch.Generator().manual_seed(99)
    train_steps(first, 2, gen, weighted=True)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert saved["_extra_state"]["step"] == 2

    # a different seed and learning rate: both come back from the state_dict
    resumed = make_emb(optimizer, **dict(kw, seed=1234), **({"learning_rate": 0.5} if h else {}))
    resumed.load_state_dict(saved)
    assert resumed.step == 2 and resumed.seed == 13 and resumed.hyperparameters == first.hyperparameters
    train_steps(resumed, 2, gen, weighted=True)  # the same data stream as the uninterrupted run
    assert resumed.step == straight.step == 4
    assert torch.equal(resumed.weights, straight.weights)
    for s in resumed.spec.states:
        assert torch.equal(resumed.optimizer_state(s.name), straight.optimizer_state(s.name)), s.name


def test_state_dict_contents():
    emb = make_emb("adam", learning_rate=0.02)
    sd = emb.state_dict()
    assert set(sd) == {"weights", "states.exp_avg", "states.exp_avg_sq", "_extra_state"}
    extra = sd["_extra_state"]
    assert extra["optimizer"] == "adam" and extra["step"] == 0
    assert extra["hyperparameters"]["learning_rate"] == 0.02


def test_load_state_dict_rejects_other_layout():
    a = make_emb("sgd")
    b = make_emb("sgd", tables=[(40, 8), (25, 12), (17, 4)])
    with pytest.raises(RuntimeError, match="tables"):
        b.load_state_dict(a.state_dict())
    c = make_emb("adagrad")
    with pytest.raises(RuntimeError):
        c.load_state_dict(a.state_dict())


# ---- hyperparameters --------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", WITH_LR)
def test_set_learning_rate_takes_effect(optimizer):
    changed = make_emb(optimizer, learning_rate=0.3)
    changed.set_learning_rate(0.01)
    assert changed.hyperparameters["learning_rate"] == 0.01 == changed.get_learning_rate()
    direct = make_emb(optimizer, learning_rate=0.01)
    train_steps(changed, 2, seed=5)
    train_steps(direct, 2, seed=5)
    assert torch.equal(changed.weights, direct.weights)
    assert not torch.equal(changed.weights, make_emb(optimizer, learning_rate=0.01).weights)

    # a change between steps applies to the next backward
    changed.set_hyperparameters(learning_rate=0.2)
    train_steps(changed, 1, seed=6)
    train_steps(direct, 1, seed=6)
    assert not torch.equal(changed.weights, direct.weights)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_learning_rate_zero_freezes(optimizer):
    emb = make_emb(optimizer, learning_rate=0.0)
    w0 = emb.weights.clone()
    train_steps(emb, 2, seed=5)
    assert torch.equal(emb.weights, w0)
    emb.set_learning_rate(0.1)
    train_steps(emb, 1, seed=6)
    assert not torch.equal(emb.weights, w0)


def test_hyperparameters_defaults_and_copy():
    emb = make_emb("rowwise_adagrad", learning_rate=0.05, eps=1e-8)
    h = emb.hyperparameters
    assert h == dict(learning_rate=0.05, eps=1e-8, weight_decay=0.0, weight_decay_mode=0, max_norm=0.0)
    h["learning_rate"] = 9.0
    assert emb.hyperparameters["learning_rate"] == 0.05
    assert list(h) == [p.name for p in emb.spec.hyperparameters]
    assert make_emb("none").hyperparameters == {}
    # ints are accepted for floats and converted
    assert make_emb("sgd", learning_rate=1).hyperparameters["learning_rate"] == 1.0


def test_hyperparameter_errors():
    with pytest.raises(TypeError, match=r"unknown hyperparameter.*'lr'.*learning_rate \(float, default 0.01\)"):
        make_emb("rowwise_adagrad", lr=0.1)
    with pytest.raises(TypeError, match=r"did you mean 'pooling'"):
        make_emb("sgd", poolng="mean")
    with pytest.raises(TypeError, match="'learning_rate' of optimizer 'sgd' must be a float, got str"):
        make_emb("sgd", learning_rate="0.1")
    with pytest.raises(TypeError, match="must be a float"):
        make_emb("sgd", learning_rate=True)
    with pytest.raises(TypeError, match="'weight_decay_mode' .* must be an int, got float"):
        make_emb("rowwise_adagrad", weight_decay_mode=1.0)
    with pytest.raises(ValueError, match=r"must be one of \[0, 1, 2\], got 3"):
        make_emb("rowwise_adagrad", weight_decay_mode=3)
    with pytest.raises(ValueError, match="finite"):
        make_emb("adam", eps=float("nan"))
    with pytest.raises(TypeError, match="has no hyperparameters"):
        make_emb("none", learning_rate=0.1)
    emb = make_emb("adagrad")
    with pytest.raises(TypeError, match="unknown hyperparameter.*the hyperparameters of optimizer 'adagrad' are: learning_rate"):
        emb.set_hyperparameters(momentum=0.9)
    with pytest.raises(TypeError, match="must be a float"):
        emb.set_learning_rate("fast")
    with pytest.raises(TypeError, match="no learning_rate"):
        make_emb("none").set_learning_rate(0.1)
    assert emb.hyperparameters["learning_rate"] == 0.01  # failed calls change nothing


def test_missing_required_hyperparameter(tmp_path):
    spec = tmp_path / "needs_lr.yaml"
    spec.write_text(
        "name: needs_lr\n"
        "summary: SGD without a default learning rate.\n"
        "hyperparameters:\n"
        "  learning_rate: {type: float, doc: Step size.}\n"
        "element: |\n"
        "  w -= learning_rate * g;\n"
        "reference: |\n"
        "  w -= learning_rate * g\n"
    )
    # checked before anything is built
    with pytest.raises(TypeError, match=r"needs a value for the required hyperparameter\(s\) learning_rate"):
        TableBatchedEmbeddingBags([(4, 4)], optimizer=str(spec))


def test_unknown_optimizer():
    with pytest.raises(ValueError, match="available: .*rowwise_adagrad"):
        make_emb("adamw_typo")


# ---- argument and input errors ----------------------------------------------------------------


def test_construction_errors():
    with pytest.raises(ValueError, match="table 0 has dim 0; embedding dims must be from 1 to 4096"):
        make_emb("sgd", tables=[(10, 0)])
    with pytest.raises(ValueError, match="table 1 has dim 4097; embedding dims must be from 1 to 4096"):
        make_emb("sgd", tables=[(10, 6), (10, 4097)])
    with pytest.raises(TypeError, match=r"tables\[1\] must be a \(rows, dim\) pair"):
        make_emb("sgd", tables=[(10, 8), (10, 8, 3)])
    with pytest.raises(ValueError, match="at least one table"):
        make_emb("sgd", tables=[])
    with pytest.raises(ValueError, match=r"pooling must be one of \['mean', 'none', 'sum'\], got 'max'"):
        make_emb("sgd", pooling="max")
    with pytest.raises(ValueError, match="same dim"):
        make_emb("sgd", pooling="none")
    with pytest.raises(ValueError, match="weights_dtype must be"):
        make_emb("sgd", weights_dtype=torch.float64)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        make_emb("sgd", device="meta")
    with pytest.raises(ValueError, match="refers to table"):
        make_emb("sgd", feature_table_map=[0, 3])
    with pytest.raises(ValueError, match="max_segment_length_per_warp"):
        make_emb("sgd", max_segment_length_per_warp=0)
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            make_emb("sgd", device="cuda")
    assert make_emb("sgd", weights_dtype="bf16").weights.dtype == torch.bfloat16


def test_input_errors():
    emb = make_emb("sgd")  # 3 features
    ind, off, psw = make_batch(emb, 4, torch.Generator().manual_seed(0), weighted=True)
    with pytest.raises(TypeError, match="indices must be int32 or int64, got torch.float32"):
        emb(ind.float(), off)
    with pytest.raises(TypeError, match="offsets must be a torch.Tensor"):
        emb(ind, off.tolist())
    with pytest.raises(ValueError, match=r"offsets must have F \* B \+ 1 entries for F = 3 feature\(s\).*got 12"):
        emb(ind, off[:-1])
    with pytest.raises(ValueError, match="must be 1-D"):
        emb(ind[None], off)
    with pytest.raises(TypeError, match="per_sample_weights must be float32, got torch.float64"):
        emb(ind, off, psw.double())
    with pytest.raises(ValueError, match=r"one weight per index \(\d+\)"):
        emb(ind, off, psw[:-1])
    bad = ind.clone()
    bad[0] = 10_000
    with pytest.raises(RuntimeError, match="out of range"):
        emb(bad, off)
    # int32 indices with int64 offsets are accepted (both widened)
    torch.testing.assert_close(emb(ind.int(), off), emb(ind, off))
    emb.half()
    with pytest.raises(RuntimeError, match="weights_dtype at construction"):
        emb(ind, off)


# ---- step counter, retain_graph, several losses ----------------------------------------------


def test_each_backward_updates_once():
    emb = make_emb("sgd", learning_rate=0.1)
    ref = make_emb("sgd", learning_rate=0.1)
    ind, off, _ = make_batch(emb, 5, torch.Generator().manual_seed(3))
    out = emb(ind, off)
    loss = out.pow(2).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert emb.step == 2
    # two updates with the same (pre-update) gradient
    (ref(ind, off).pow(2).sum() * 2).backward()
    assert_close(emb.weights, ref.weights, rtol=1e-6, atol=1e-7, msg="retain_graph")
    # two losses on one output: still one backward through the output node
    out = emb(ind, off)
    (out.sum() + out.pow(2).sum()).backward()
    assert emb.step == 3
    # two forwards, one loss: two nodes, two updates
    (emb(ind, off).sum() + emb(ind, off).sum()).backward()
    assert emb.step == 5


# ---- feature_table_map ------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_feature_table_map(optimizer):
    ftm = [0, 1, 0, 2, 1]
    h = HYPER[optimizer]
    emb = make_emb(optimizer, feature_table_map=ftm, pooling="mean", **h)
    assert emb.num_features == 5 and emb.layout.total_D == 8 + 12 + 8 + 4 + 12
    assert [w.shape for w in emb.split_embedding_weights()] == [(40, 8), (25, 12), (16, 4)]
    ref = TorchTables(emb, mode="mean", sparse=True)
    opt = torch_optimizer(optimizer, ref.parameters(), h)
    gen = torch.Generator().manual_seed(51)
    for step in range(3):
        ind, off, _ = make_batch(emb, 6, gen)
        out = emb(ind, off)
        expected = ref(ind, off)
        assert_close(out, expected, msg="forward ftm")
        proj = torch.randn(out.shape, generator=gen)
        (out * proj).sum().backward()
        opt.zero_grad()
        (expected * proj).sum().backward()
        opt.step()
        for t, (ours, bag) in enumerate(zip(emb.split_embedding_weights(), ref.bags)):
            assert_close(ours, bag.weight, msg=f"step {step} table {t}")


# ---- an MLP on top ----------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_mlp_on_top(optimizer):
    h = HYPER[optimizer]
    emb = make_emb(optimizer, feature_table_map=[0, 1, 2, 0], **h)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(emb.layout.total_D, 16), nn.ReLU(), nn.Linear(16, 1))
    ref_emb, ref_mlp = TorchTables(emb, sparse=True), copy.deepcopy(mlp)
    opt = torch.optim.SGD(mlp.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref_mlp.parameters(), lr=0.05)
    ref_emb_opt = torch_optimizer(optimizer, ref_emb.parameters(), h)
    gen = torch.Generator().manual_seed(61)
    for step in range(4):
        ind, off, _ = make_batch(emb, 8, gen)
        label = torch.rand(8, 1, generator=gen)
        loss = nn.functional.binary_cross_entropy_with_logits(mlp(emb(ind, off)), label)
        ref_loss = nn.functional.binary_cross_entropy_with_logits(ref_mlp(ref_emb(ind, off)), label)
        opt.zero_grad()
        ref_opt.zero_grad()
        ref_emb_opt.zero_grad()
        loss.backward()
        ref_loss.backward()
        assert all(p.grad is not None for p in mlp.parameters())
        opt.step()
        ref_opt.step()
        ref_emb_opt.step()
        assert abs(loss.item() - ref_loss.item()) < 1e-5
    for p, q in zip(mlp.parameters(), ref_mlp.parameters()):
        assert_close(p, q, msg="mlp parameter")
    for t, (ours, bag) in enumerate(zip(emb.split_embedding_weights(), ref_emb.bags)):
        assert_close(ours, bag.weight, msg=f"table {t}")
    assert emb.step == 4
    # the fused embedding has no parameters, so model.parameters() is only the MLP's
    assert [id(p) for p in nn.ModuleList([emb, mlp]).parameters()] == [id(p) for p in mlp.parameters()]


# ---- views, init, dtypes, determinism ----------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_split_views(optimizer):
    emb = make_emb(optimizer)
    weights = emb.split_embedding_weights()
    assert [tuple(w.shape) for w in weights] == TABLES
    for w, off in zip(weights, emb.layout.table_offsets):
        assert w.data_ptr() == emb.weights.data_ptr() + off * emb.weights.element_size()
    weights[1].fill_(0.5)  # writable, and the lookup sees it
    ind = torch.tensor([3, 7, 7], dtype=torch.int64)
    off = torch.tensor([0, 1, 1, 3, 3, 3, 3])  # B = 2; feature 1, bag 0 is rows [7, 7]
    out = emb(ind, off)
    assert torch.equal(out[0, 8:20], torch.full((12,), 1.0))
    states = emb.split_optimizer_states()
    assert len(states) == len(TABLES)
    for t, (E, D) in enumerate(TABLES):
        assert set(states[t]) == {s.name for s in emb.spec.states}
        for s in emb.spec.states:
            v = states[t][s.name]
            assert tuple(v.shape) == ((E, D) if s.per == "element" else (E,))
            assert v.dtype == (torch.int64 if s.is_int else torch.float32)
            assert torch.all(v == s.init)
            assert v.data_ptr() != 0 and v._base is emb.optimizer_state(s.name)


def test_default_init():
    a, b = make_emb("sgd", seed=0), make_emb("adam", seed=0)
    assert torch.equal(a.weights, b.weights)  # init does not depend on the optimizer
    assert not torch.equal(a.weights, make_emb("sgd", seed=1).weights)
    for w, (E, D) in zip(a.split_embedding_weights(), TABLES):
        bound = math.sqrt(1.0 / D)
        assert w.abs().max() <= bound and w.abs().max() > 0.8 * bound
    # the counter-based generator of tbegen/init.py (tests/test_init.py checks it in depth)
    from tbegen.init import fill_uniform_

    expected = torch.cat([fill_uniform_(torch.empty(E * D), 0, t, D) for t, (E, D) in enumerate(TABLES)])
    assert torch.equal(a.weights, expected)
    half = make_emb("sgd", seed=0, weights_dtype=torch.bfloat16)
    assert torch.equal(half.weights, expected.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sr", [False, True])
def test_half_training_close_to_fp32(dtype, sr):
    emb = make_emb("rowwise_adagrad", weights_dtype=dtype, stochastic_rounding=sr, learning_rate=0.05)
    ref = make_emb("rowwise_adagrad", learning_rate=0.05)
    with torch.no_grad():
        ref.weights.copy_(emb.weights.float())
    train_steps(emb, 3, seed=71)
    train_steps(ref, 3, seed=71)
    eps = torch.finfo(dtype).eps
    diff = (emb.weights.float() - ref.weights).abs().max().item()
    assert diff <= 4 * eps * ref.weights.abs().max().item()
    # reproducible bit for bit, stochastic rounding included
    again = make_emb("rowwise_adagrad", weights_dtype=dtype, stochastic_rounding=sr, learning_rate=0.05)
    train_steps(again, 3, seed=71)
    assert torch.equal(again.weights, emb.weights)


def test_repr_and_properties():
    emb = make_emb("rowwise_adagrad", feature_table_map=[0, 0, 1, 2], learning_rate=0.05)
    text = repr(emb)
    assert "rowwise_adagrad" in text and "feature_table_map=[0, 0, 1, 2]" in text and "learning_rate=0.05" in text
    assert emb.optimizer == "rowwise_adagrad" and emb.tables == tuple(TABLES) and not emb.dense_gradient
    assert "weights" in dict(emb.named_buffers()) and list(emb.parameters()) == []
    assert tbegen.TableBatchedEmbeddingBags is TableBatchedEmbeddingBags


def test_optimizer_from_yaml_path_and_spec():
    path = find_spec("sgd")
    a = TableBatchedEmbeddingBags(TABLES, optimizer=str(path), learning_rate=0.2)
    b = TableBatchedEmbeddingBags(TABLES, optimizer=load_spec(path), learning_rate=0.2)
    train_steps(a, 1, seed=1)
    train_steps(b, 1, seed=1)
    assert torch.equal(a.weights, b.weights)


# ---- GPU ---------------------------------------------------------------------------------------


@cuda
@needs_cuda
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_matches_cpu(optimizer, dtype):
    kw = dict(weights_dtype=dtype, stochastic_rounding=False, seed=3, pooling="mean", feature_table_map=[0, 1, 2, 1])
    if optimizer != "none":
        kw["learning_rate"] = 0.05
    cpu, gpu = make_emb(optimizer, **kw), make_emb(optimizer, device="cuda", **kw)
    assert torch.equal(cpu.weights, gpu.weights.cpu())  # identical init
    gen = torch.Generator().manual_seed(0)
    ind, off, psw = make_batch(cpu, 6, gen, weighted=True)
    assert_close(gpu(ind.cuda(), off.cuda(), psw.cuda()), cpu(ind, off, psw), msg="cuda forward")
    train_steps(cpu, 3, seed=81, weighted=True)
    train_steps(gpu, 3, seed=81, weighted=True)
    if dtype == torch.float32:
        assert_close(gpu.weights, cpu.weights.detach(), msg="cuda weights")
    else:
        assert_close(gpu.weights.float(), cpu.weights.detach().float(), rtol=2**-9, atol=2**-12, msg="cuda fp16 weights")
    for s in cpu.spec.states:
        assert_close(gpu.optimizer_state(s.name), cpu.optimizer_state(s.name), msg=f"cuda state {s.name}")


@cuda
@needs_cuda
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_cuda_training_matches_torch_optim(optimizer):
    h = HYPER[optimizer]
    emb = make_emb(optimizer, device="cuda", **h)
    ref = TorchTables(emb, sparse=True).cpu()
    opt = torch_optimizer(optimizer, ref.parameters(), h)
    gen = torch.Generator().manual_seed(91)
    for _ in range(3):
        ind, off, psw = make_batch(emb, 8, gen, weighted=True)
        proj = torch.randn(8, emb.layout.total_D, generator=gen)
        (emb(ind.cuda(), off.cuda(), psw.cuda()) * proj.cuda()).sum().backward()
        opt.zero_grad()
        (ref(ind, off, psw) * proj).sum().backward()
        opt.step()
    for ours, bag in zip(emb.split_embedding_weights(), ref.bags):
        assert_close(ours, bag.weight, msg="cuda vs torch.optim")


@cuda
@needs_cuda
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_cuda_state_dict_round_trip(optimizer):
    kw = dict(device="cuda", weights_dtype=torch.bfloat16, stochastic_rounding=True)
    straight = make_emb(optimizer, **kw)
    train_steps(straight, 3, seed=7)
    a = make_emb(optimizer, **kw)
    train_steps(a, 3, seed=7)
    assert torch.equal(a.weights, straight.weights)  # deterministic on the GPU too
    sd = a.state_dict()
    cpu = make_emb(optimizer, weights_dtype=torch.bfloat16)
    cpu.load_state_dict(sd)  # a CUDA state_dict loads into a CPU module
    back = make_emb(optimizer, **kw)
    back.load_state_dict(cpu.state_dict())
    assert torch.equal(back.weights, a.weights) and back.step == 3
    for s in a.spec.states:
        assert torch.equal(back.optimizer_state(s.name), a.optimizer_state(s.name))


@cuda
@needs_cuda
def test_cuda_module_to_device():
    emb = make_emb("rowwise_adagrad", learning_rate=0.1)
    emb.cuda()
    assert emb.features.is_cuda and emb.optimizer_state("momentum").is_cuda
    train_steps(emb, 2, seed=3)
    assert emb.step == 2


# ---- output_dtype --------------------------------------------------------------------------------


def _output_dtype_case(device, output_dtype, optimizer, pooling="sum"):
    """A float32-output module and a narrow-output one, trained on the same batches; the narrow
    module's gradient is the float32 one rounded to its output dtype, which is what the float32
    module is given as well."""
    kw = dict(optimizer=optimizer, pooling=pooling, device=device, learning_rate=0.1, seed=3)
    wide = TableBatchedEmbeddingBags(TABLES, **kw)
    narrow = TableBatchedEmbeddingBags(TABLES, output_dtype=output_dtype, **kw)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        indices, offsets, psw = (x.to(device) for x in make_batch(wide, 5, gen, weighted=True))
        out_w, out_n = wide(indices, offsets, psw), narrow(indices, offsets, psw)
        assert out_n.dtype == output_dtype and out_w.dtype == torch.float32
        # the float32 sums, rounded to nearest
        assert torch.equal(out_n, out_w.to(output_dtype))
        grad = torch.randn(out_w.shape, generator=gen).to(device=device, dtype=output_dtype)
        out_n.backward(grad)
        out_w.backward(grad.float())
    assert torch.equal(wide.weights, narrow.weights)
    for s in wide.spec.states:
        assert torch.equal(wide.optimizer_state(s.name), narrow.optimizer_state(s.name)), s.name


@pytest.mark.parametrize("output_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("optimizer,pooling", [("rowwise_adagrad", "sum"), ("adam", "mean"), ("none", "sum")])
def test_output_dtype(output_dtype, optimizer, pooling):
    if optimizer == "none":
        # dense-gradient mode: the cast sits before the weights' gradient as well
        emb = TableBatchedEmbeddingBags(TABLES, optimizer="none", output_dtype=output_dtype)
        indices, offsets, psw = make_batch(emb, 5, torch.Generator().manual_seed(1), weighted=True)
        out = emb(indices, offsets, psw)
        assert out.dtype == output_dtype
        out.float().sum().backward()
        assert emb.weights.grad is not None and emb.weights.grad.dtype == torch.float32
        return
    _output_dtype_case("cpu", output_dtype, optimizer, pooling)


def test_output_dtype_names_and_errors():
    assert TableBatchedEmbeddingBags(TABLES, optimizer="sgd", output_dtype="bf16").output_dtype == torch.bfloat16
    assert "output_dtype=torch.float16" in repr(TableBatchedEmbeddingBags(TABLES, optimizer="sgd", output_dtype="fp16"))
    with pytest.raises(ValueError, match="output_dtype must be torch.float32, torch.float16 or torch.bfloat16"):
        TableBatchedEmbeddingBags(TABLES, optimizer="sgd", output_dtype=torch.int8)
    with pytest.raises(ValueError, match="output_dtype must be"):
        TableBatchedEmbeddingBags(TABLES, optimizer="sgd", output_dtype="fp8")


@cuda
@needs_cuda
@pytest.mark.parametrize("output_dtype", [torch.float16, torch.bfloat16])
def test_cuda_output_dtype(output_dtype):
    _output_dtype_case("cuda", output_dtype, "rowwise_adagrad")
