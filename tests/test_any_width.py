"""Embedding widths that are not multiples of 4 (any D from 1 to 4096).

- CPU kernels against each spec's float64 reference (tbegen.harness) at widths 1, 3, 5, 7, 33,
  127, 4095 and 4096 and on mixed layouts whose output columns start at odd offsets: forward,
  per-sample-weight gradient and fused backward, sum/mean/none, weighted or not, fp32/fp16/bf16
  weights, for optimizers with per-element states, per-row states and row reductions (a rowwise
  optimizer divides by the true D: the reference computes its row means over D columns);
- the lane-split mode (the CUDA kernels' division of a row, run on the CPU) at those widths, which
  for such layouts emulates the any-width kernels' column split;
- the module and the FBGEMM-compatible class at odd widths against PyTorch, and the limits;
- CUDA (marked `cuda`, skipped without a GPU): the any-width kernels against the references and
  against the CPU, the choice between the two kernel families, and the 4-wide path on the same
  data.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tbegen import harness
from tbegen.fbgemm_compat import ComputeDevice, EmbeddingLocation, EmbOptimType
from tbegen.fbgemm_compat import SplitTableBatchedEmbeddingBagsCodegen as Compat
from tbegen.layout import MAX_DIM, POOLING, make_layout
from tbegen.module import TableBatchedEmbeddingBags
from tbegen.spec import load_spec

from conftest import SPECS
from test_module import TorchTables, assert_close, make_batch, rowwise_adagrad_reference

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

# per-element states (adagrad, adam), per-row states with row means (rowwise_adagrad,
# partial_rowwise_adam), row norms and temporaries (lamb), none (sgd)
OPTIMIZERS = [n for n in ("sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam", "lamb") if n in SPECS]

# Mixed widths: output columns start at 0, 1, 4, 9, 16, 49 (odd offsets), table offsets odd too.
ODD_TABLES = ((30, 1), (20, 3), (10, 5), (7, 7), (9, 33))
# Widths that are multiples of 4 except one: output offsets 8, 13, 25 (one odd table moves the rest).
MIXED_TABLES = ((20, 8), (15, 5), (12, 12), (7, 4))


def odd_cases():
    """The grid of odd-width cases (small row counts: the widest rows are 4096 columns)."""
    c = []
    # pooling x weighted, each weight dtype under both poolings and with and without weights
    grid = (("sum", False, torch.float32), ("sum", True, torch.float16), ("sum", True, torch.bfloat16),
            ("mean", False, torch.bfloat16), ("mean", True, torch.float32), ("mean", True, torch.float16))
    for k, (pooling, weighted, dt) in enumerate(grid):
        c.append(harness.Case(tables=ODD_TABLES, pooling=pooling, weighted=weighted, weights_dtype=dt,
                              B=8, max_L=4, hot=12, seed=501 + k))
    c.append(harness.Case(tables=((12, 127), (9, 33)), pooling="mean", weighted=True, index_dtype=torch.int32,
                          B=8, max_L=4, hot=12, seed=520))
    c.append(harness.Case(tables=((5, 4095), (4, 4096), (6, 3)), pooling="sum", weighted=True, B=4, max_L=3,
                          hot=6, steps=2, seed=521))
    c.append(harness.Case(tables=((5, 4095),), pooling="mean", weights_dtype=torch.float16, B=4, max_L=3, hot=4,
                          steps=2, seed=522))
    for dt in (torch.float32, torch.bfloat16):
        c.append(harness.Case(tables=((20, 7), (10, 7)), pooling="none", weighted=True, weights_dtype=dt, B=6,
                              max_L=4, hot=8, seed=523 + (dt == torch.bfloat16)))
    c.append(harness.Case(tables=MIXED_TABLES, feature_table_map=(0, 1, 1, 2, 3, 0), pooling="mean", weighted=True,
                          B=8, max_L=4, hot=12, seed=530))
    c.append(harness.Case(tables=((6, 2), (6, 2), (5, 4)), pooling="sum", weighted=True, B=8, max_L=4, hot=8,
                          seed=531))  # total_D and max_D multiples of 4, widths not
    c.append(harness.Case(tables=ODD_TABLES, pooling="sum", weights_dtype=torch.float16, stochastic_rounding=True,
                          B=8, max_L=4, hot=12, seed=532))
    return c


CASES = [
    pytest.param(name, case, id=f"{name}-{case.id}")
    for name in OPTIMIZERS
    for case in odd_cases()
]


# Every other spec: four of those cases (weighted sum over bf16 weights, weighted mean over fp16,
# 4095 and 4096 wide rows, a mixed layout with shared tables).
OTHER_CASES = [
    pytest.param(name, case, id=f"{name}-{case.id}")
    for name in sorted(set(SPECS) - set(OPTIMIZERS))
    for case in [c for c in odd_cases() if c.seed in (503, 506, 521, 530)]
]


@pytest.mark.parametrize("name,case", CASES + OTHER_CASES)
def test_cpu_odd_widths_match_reference(load_ops, name, case):
    spec, ops = load_ops(name)
    result = harness.run_case(spec, ops, case, device="cpu")
    assert not result.failures, "\n".join(result.failures)


def test_odd_widths_are_checked_not_trusted(load_ops):
    """The comparison can fail at odd widths: a reference whose row mean leaves out the last
    column (a kernel that treated a 5-wide row as 4 wide would do this) is caught."""
    spec, ops = load_ops("rowwise_adagrad")
    wrong = dataclasses.replace(
        spec, reference=dataclasses.replace(spec.reference, code=spec.reference.code.replace(
            "momentum += ((g + l2 * w) ** 2).mean(dim=1)",
            "momentum += ((g + l2 * w) ** 2)[:, : D - 1].mean(dim=1)")),
    )
    assert wrong.reference.code != spec.reference.code
    result = harness.run_case(wrong, ops, harness.Case(tables=((20, 5), (10, 3)), B=8, seed=3))
    assert any("momentum" in f for f in result.failures), result.failures


LANE_CASES = [
    pytest.param(name, case, id=f"{name}-{case.id}")
    for name in sorted(SPECS)
    for case in (
        harness.Case(tables=ODD_TABLES, pooling="sum", weighted=True, B=8, max_L=4, hot=40, seed=540),
        harness.Case(tables=((5, 4095), (4, 4096)), pooling="mean", B=4, max_L=3, hot=4, steps=2, seed=541),
        harness.Case(tables=((6, 2), (6, 2), (5, 4)), pooling="sum", B=8, max_L=4, hot=8, seed=542),
    )
]


@pytest.mark.parametrize("name,case", LANE_CASES)
def test_lane_split_odd_widths(load_ops, name, case):
    """The any-width kernels' column split (lane l owns columns l, l + 32, ...), emulated on the
    CPU, agrees with the CPU kernel."""
    spec, ops = load_ops(name)
    result = harness.run_lane_split_case(spec, ops, case)
    assert not result.failures, "\n".join(result.failures)


# ---- narrow (fp16/bf16) and int states at odd widths ---------------------------------------------
# The any-width CUDA kernels copy narrow per-element states to float scratch and store them back
# with stochastic rounding, read narrow per-row states through load_state / store_state and carry
# int per-row states, as the 4-wide kernels do; on the CPU the same specs and layouts run the CPU
# kernel and the column-split emulation.

# per-row state (rowwise_adagrad), per-element states (adam), an int per-row state beside float
# per-row states (rowwise_adagrad_with_counter)
STATE_OPTIMIZERS = [n for n in ("rowwise_adagrad", "adam", "rowwise_adagrad_with_counter") if n in SPECS]


def state_cases(name):
    """Odd-width cases with every float state bf16 (then fp16), and for a spec with int states one
    with its float states left float32: the int state alone."""
    spec = load_spec(str(SPECS[name]))
    floats = [s.name for s in spec.states if not s.is_int]
    bf16 = tuple((n, torch.bfloat16) for n in floats)
    fp16 = tuple((n, torch.float16) for n in floats)
    c = [
        harness.Case(tables=ODD_TABLES, pooling="sum", weighted=True, B=8, max_L=4, hot=12, seed=610,
                     state_dtypes=bf16),
        harness.Case(tables=((5, 4095), (4, 4096), (6, 3)), pooling="mean", weighted=True,
                     weights_dtype=torch.bfloat16, B=4, max_L=3, hot=6, steps=2, seed=611, state_dtypes=bf16),
        harness.Case(tables=MIXED_TABLES, feature_table_map=(0, 1, 1, 2, 3, 0), pooling="mean",
                     weights_dtype=torch.float16, B=8, max_L=4, hot=12, seed=612, state_dtypes=fp16),
    ]
    if any(s.is_int for s in spec.states):
        c.append(harness.Case(tables=ODD_TABLES, pooling="sum", weighted=True, B=8, max_L=4, hot=12, steps=3,
                              seed=613))
    return c


STATE_CASES = [
    pytest.param(name, case, id=f"{name}-{case.id}")
    for name in STATE_OPTIMIZERS
    for case in state_cases(name)
]


@pytest.mark.parametrize("name,case", STATE_CASES)
def test_cpu_odd_widths_narrow_and_int_states_match_reference(load_ops, name, case):
    spec, ops = load_ops(name)
    result = harness.run_case(spec, ops, case, device="cpu")
    assert not result.failures, "\n".join(result.failures)
    # the states really were stored narrow / as int64 (the cases are not float32 runs in disguise)
    _, states = harness.initial_state(spec, make_layout(case.tables, case.feature_table_map), case,
                                      torch.Generator().manual_seed(0))
    overrides = dict(case.state_dtypes)
    for s in spec.states:
        assert states[s.name].dtype == (torch.int64 if s.is_int else overrides.get(s.name, torch.float32))
    if any(s.is_int for s in spec.states):
        assert all(result.errors[s.name] == 0.0 for s in spec.states if s.is_int)


@pytest.mark.parametrize("name,case", STATE_CASES)
def test_lane_split_odd_widths_narrow_and_int_states(load_ops, name, case):
    """The column split, emulated on the CPU, with narrow and int states (each lane's copy of an
    int per-row state must agree, as of a float one)."""
    spec, ops = load_ops(name)
    result = harness.run_lane_split_case(spec, ops, case)
    assert not result.failures, "\n".join(result.failures)


def test_odd_width_int_state_is_checked_exactly(load_ops):
    """At odd widths a wrong int state is caught exactly (the comparison is not vacuous there)."""
    spec, ops = load_ops("rowwise_adagrad_with_counter")
    case = state_cases("rowwise_adagrad_with_counter")[-1]
    wrong = dataclasses.replace(spec, reference=dataclasses.replace(
        spec.reference, code=spec.reference.code.replace("torch.full_like(prev_iter, step)",
                                                         "torch.full_like(prev_iter, step + 1)")))
    assert wrong.reference.code != spec.reference.code
    failures = harness.run_case(wrong, ops, case).failures
    assert any("int state prev_iter" in f for f in failures), failures


def test_module_odd_widths_bf16_state_and_int_state():
    """The module at odd widths with a bf16 state beside an int64 state: dtypes kept through
    training, deterministic run to run, close to the float32-state run, and the int state exact
    (each touched row's prev_iter is the step that last touched it)."""
    tables = [(30, 3), (20, 7), (10, 33)]
    kw = dict(optimizer="rowwise_adagrad_with_counter", pooling="sum", seed=5, learning_rate=0.1)
    runs = [TableBatchedEmbeddingBags(tables, state_dtypes={"momentum": "bf16"}, **kw) for _ in range(2)]
    wide = TableBatchedEmbeddingBags(tables, **kw)
    gen = torch.Generator().manual_seed(3)
    batches = [make_batch(wide, 6, gen, weighted=False) for _ in range(3)]
    for m in runs + [wide]:
        for step, (ind, off, _) in enumerate(batches, start=1):
            out = m(ind, off)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(step)))
    a, b = runs
    assert a.optimizer_state("momentum").dtype == torch.bfloat16
    assert a.optimizer_state("prev_iter").dtype == torch.int64
    assert torch.equal(a.weights, b.weights)
    assert all(torch.equal(a.optimizer_state(s), b.optimizer_state(s)) for s in ("momentum", "prev_iter", "row_counter"))
    ref = wide.optimizer_state("momentum")
    assert (a.optimizer_state("momentum").float() - ref).abs().max() <= 0.03 * ref.abs().max()
    # prev_iter: the last step that touched each row, in every run
    last = torch.zeros(wide.layout.total_hash_size, dtype=torch.int64)
    F, B = len(tables), 6
    for step, (ind, off, _) in enumerate(batches, start=1):
        for f in range(F):
            rows = ind[off[f * B] : off[(f + 1) * B]].long() + wide.layout.table_key_base[f]
            last[rows] = step
    for m in runs + [wide]:
        assert torch.equal(m.optimizer_state("prev_iter"), last)


# ---- the module ----------------------------------------------------------------------------------


def test_module_limits():
    layout = make_layout([(3, 1), (3, MAX_DIM)])
    assert layout.max_D == MAX_DIM == 4096 and layout.total_D == 4097
    with pytest.raises(ValueError, match="table 1 has dim 4097; embedding dims must be from 1 to 4096"):
        TableBatchedEmbeddingBags([(3, 5), (3, 4097)], optimizer="sgd")
    with pytest.raises(ValueError, match="table 0 has dim -3; embedding dims must be from 1 to 4096"):
        TableBatchedEmbeddingBags([(3, -3)], optimizer="sgd")


def test_operator_limits(load_ops):
    """The operators check widths themselves (callers other than the module build `features`)."""
    _, ops = load_ops("sgd")
    layout = make_layout([(4, 5)])
    w = torch.zeros(layout.weights_numel)
    ind, off = torch.tensor([1]), torch.tensor([0, 1])
    feats = layout.features_tensor()
    with pytest.raises(RuntimeError, match="embedding dims must be from 1 to 4096, got max_D = 4100"):
        ops.forward(w, feats, 5, 4100, ind, off, None, 0)
    feats[0, 2] = 0
    with pytest.raises(RuntimeError, match="feature 0 has D = 0; embedding dims must be from 1 to 4096"):
        ops.forward(w, feats, 5, 5, ind, off, None, 0)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_forward_and_psw_grad_odd_widths(pooling, dtype):
    emb = TableBatchedEmbeddingBags([(30, 3), (20, 7), (10, 1)], optimizer="sgd", pooling=pooling,
                                    weights_dtype=dtype, learning_rate=0.5, feature_table_map=[0, 1, 2, 1], seed=4)
    ref = TorchTables(emb, mode=pooling, sparse=False)
    gen = torch.Generator().manual_seed(6)
    ind, off, psw = make_batch(emb, 7, gen, weighted=True)
    psw_ours, psw_ref = psw.clone().requires_grad_(), psw.clone().requires_grad_()
    out = emb(ind, off, psw_ours)
    assert out.shape == (7, 3 + 7 + 1 + 7)
    expected = ref(ind, off, psw_ref)
    assert_close(out, expected, msg="forward")
    proj = torch.randn(out.shape, generator=gen)
    (out * proj).sum().backward()
    (expected * proj).sum().backward()
    assert_close(psw_ours.grad, psw_ref.grad, msg="per-sample-weight gradient")


def test_module_sgd_odd_widths_matches_torch_optim():
    emb = TableBatchedEmbeddingBags([(25, 5), (16, 1), (12, 127)], optimizer="sgd", pooling="mean",
                                    learning_rate=0.3, seed=8)
    ref = TorchTables(emb, mode="mean", sparse=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    gen = torch.Generator().manual_seed(9)
    for step in range(3):
        ind, off, psw = make_batch(emb, 8, gen, weighted=True)
        proj = torch.randn(8, emb.layout.total_D, generator=gen)
        (emb(ind, off, psw) * proj).sum().backward()
        opt.zero_grad()
        (ref(ind, off, psw) * proj).sum().backward()
        opt.step()
        for t, (ours, theirs) in enumerate(zip(emb.split_embedding_weights(), ref.bags)):
            assert_close(ours, theirs.weight, msg=f"step {step} table {t}")


def test_module_rowwise_adagrad_uses_the_true_width():
    """momentum += mean over the row's D columns of g^2: D = 5 divides by 5 (not by a padded 8)."""
    tables = [(20, 5), (10, 1), (8, 33)]
    h = dict(learning_rate=0.2, eps=1e-8, weight_decay=0.0, weight_decay_mode=0, max_norm=0.0)
    emb = TableBatchedEmbeddingBags(tables, optimizer="rowwise_adagrad", pooling="sum", seed=2, **h)
    ref = TorchTables(emb, mode="sum", sparse=False)
    momentum = [torch.zeros(E, dtype=torch.float64) for E, _ in tables]
    gen = torch.Generator().manual_seed(13)
    B = 8
    for step in range(3):
        ind, off, psw = make_batch(emb, B, gen, weighted=True)
        proj = torch.randn(B, emb.layout.total_D, generator=gen)
        (emb(ind, off, psw) * proj).sum().backward()
        ref.zero_grad()
        (ref(ind, off, psw) * proj).sum().backward()
        for t, bag in enumerate(ref.bags):
            touched = torch.unique(ind[off[t * B] : off[(t + 1) * B]])
            w, momentum[t] = rowwise_adagrad_reference(bag.weight.detach(), momentum[t], bag.weight.grad, touched, h)
            with torch.no_grad():
                bag.weight.copy_(w)
            assert_close(emb.split_optimizer_states()[t]["momentum"], momentum[t], rtol=1e-5, atol=1e-9,
                         msg=f"step {step} table {t} momentum")
            assert_close(emb.split_embedding_weights()[t], w, msg=f"step {step} table {t}")


def test_module_pooling_none_odd_width():
    emb = TableBatchedEmbeddingBags([(30, 7), (20, 7)], optimizer="sgd", pooling="none", seed=1)
    ref = TorchTables(emb, mode="none")
    ind, off, psw = make_batch(emb, 5, torch.Generator().manual_seed(2), weighted=True)
    out = emb(ind, off, psw)
    assert out.shape == (len(ind), 7)
    assert_close(out, ref(ind, off, psw), msg="forward none")


# ---- the FBGEMM-compatible class -------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD])
def test_fbgemm_compat_accepts_odd_widths(optimizer):
    """FBGEMM itself requires multiples of 4; the compatible class takes what the module takes,
    and trains as the module with the same tables does."""
    dims = [3, 5, 1, 33]
    specs = [(10, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for d in dims]
    name = "sgd" if optimizer == EmbOptimType.EXACT_SGD else "rowwise_adagrad"
    hyper = dict(learning_rate=0.1) if name == "sgd" else dict(learning_rate=0.1, eps=1e-6)
    compat = Compat(specs, optimizer=optimizer, **hyper)
    module = TableBatchedEmbeddingBags([(10, d) for d in dims], optimizer=name, **hyper)
    with torch.no_grad():
        for ours, theirs in zip(module.split_embedding_weights(), compat.split_embedding_weights()):
            ours.copy_(theirs)
    ref = TorchTables(module, mode="sum", sparse=False)
    gen = torch.Generator().manual_seed(4)
    for step in range(2):
        ind, off, psw = make_batch(module, 5, gen, weighted=True)
        out_c, out_m = compat(ind, off, psw), module(ind, off, psw)
        assert out_c.shape == (5, sum(dims))
        assert_close(out_c, ref(ind, off, psw), msg=f"step {step} forward against torch")
        assert torch.equal(out_c, out_m)
        proj = torch.randn(out_c.shape, generator=gen)
        (out_c * proj).sum().backward()
        (out_m * proj).sum().backward()
        for a, b in zip(compat.split_embedding_weights(), module.split_embedding_weights()):
            assert torch.equal(a, b)
        with torch.no_grad():
            for bag, w in zip(ref.bags, module.split_embedding_weights()):
                bag.weight.copy_(w)
    assert [tuple(w.shape) for w in compat.split_embedding_weights()] == [(10, d) for d in dims]


# ---- CUDA (the next GPU run) ---------------------------------------------------------------------

CUDA_CASES = [
    pytest.param(name, case, id=f"{name}-{case.id}")
    for name in sorted(SPECS)
    for case in odd_cases() + [
        # hot rows through the any-width segment kernels (one segment and several)
        harness.Case(tables=((50, 5), (20, 1031), (300, 127)), pooling="sum", weighted=True, hot=3000,
                     max_segment_length_per_warp=seg, seed=560 + seg)
        for seg in (1, 32, 1000)
    ] + [
        # widths over 1024 that are multiples of 4 (any-width path), and a large batch
        harness.Case(tables=((40, 2048), (25, 4096)), B=8, max_L=4, seed=570),
        harness.Case(tables=((5000, 33), (20000, 7)), B=16384, max_L=3, steps=2, hot=0, seed=571),
    ]
]


@cuda
@needs_cuda
@pytest.mark.parametrize("name,case", CUDA_CASES)
def test_cuda_odd_widths_match_reference(load_ops, name, case):
    spec, ops = load_ops(name)
    result = harness.run_case(spec, ops, case, device="cuda")
    assert not result.failures, "\n".join(result.failures)


def bits_equal(a, b):
    """Same dtype, shape and elements (torch.equal): the kernel-variant tests' comparison."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


def assert_switch_gives_default_bits(ops, spec, case, monkeypatch, switch, device="cuda", default="the default",
                                     variant="variant"):
    """The kernel-variant tests' comparison of an opt-in switch: two steps with `switch` at 1 give
    bitwise the weights, states and outputs of two steps with it at 0 (which changed the weights),
    twice the same, and unset gives the bits of 0 (`default`, `variant`: names for the messages)."""
    monkeypatch.setenv(switch, "0")
    out_d, w_d, st_d = _train(ops, spec, case, device)
    monkeypatch.setenv(switch, "1")
    out_v, w_v, st_v = _train(ops, spec, case, device)
    out_v2, w_v2, st_v2 = _train(ops, spec, case, device)
    gen = torch.Generator().manual_seed(case.seed)
    w0, _ = harness.initial_state(spec, make_layout(case.tables, case.feature_table_map), case, gen)
    assert not torch.equal(w_d, w0), "the two steps left the weights as they were"
    assert bits_equal(w_v, w_d), f"weights differ from {default}: max |diff| {(w_v.double() - w_d.double()).abs().max():.3g}"
    for k in st_d:
        assert bits_equal(st_v[k], st_d[k]), f"state {k} differs from {default}"
    for a, b in zip(out_v, out_d):
        assert bits_equal(a, b), "forward output differs (the second step's uses the updated weights)"
    assert bits_equal(w_v2, w_v) and all(bits_equal(st_v2[k], st_v[k]) for k in st_v), f"{variant} not deterministic"
    monkeypatch.delenv(switch)
    _, w_u, st_u = _train(ops, spec, case, device)
    assert bits_equal(w_u, w_d) and all(bits_equal(st_u[k], st_d[k]) for k in st_d), "unset differs from =0"


def _train(ops, spec, case, device, misalign=False, stochastic_rounding=False):
    """Two fused steps from the same start on `device`; returns the forward outputs, the weights and
    the states. With `misalign`, the weights are a view one element into a larger buffer (so not
    16-byte aligned); `stochastic_rounding`: the backward's flag (16-bit weights round stochastically
    with it; the case's seed draws the rounding)."""
    gen = torch.Generator().manual_seed(case.seed)
    layout = make_layout(case.tables, case.feature_table_map)
    weights, states = harness.initial_state(spec, layout, case, gen)
    hyper = harness.default_hyperparameters(spec, dict(case.hyper))
    if misalign:
        buf = torch.zeros(weights.numel() + 1, dtype=weights.dtype, device=device)
        w = buf[1:]
        w.copy_(weights)
    else:
        w = weights.clone().to(device)
    st = {k: v.clone().to(device) for k, v in states.items()}
    feats = layout.features_tensor(device)
    outs = []
    for step in (1, 2):
        batch = harness.random_batch(case, layout, gen)
        ind, off = batch.indices.to(device), batch.offsets.to(device)
        psw = batch.per_sample_weights.to(device) if batch.per_sample_weights is not None else None
        outs.append(ops.forward(w, feats, layout.total_D, layout.max_D, ind, off, psw, POOLING[case.pooling]).cpu())
        go = torch.randn(outs[-1].shape, generator=gen).to(device)
        ops.backward(go, w, feats, layout.total_D, layout.max_D, layout.total_hash_size, ind, off, psw,
                     POOLING[case.pooling], case.max_segment_length_per_warp, stochastic_rounding, case.seed,
                     *harness.state_args(spec, layout, st, device), *[hyper[h.name] for h in spec.hyperparameters],
                     step)
    return outs, w.cpu(), {k: v.cpu() for k, v in st.items()}


@cuda
@needs_cuda
@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
def test_cuda_any_width_path_agrees_with_cpu_and_is_deterministic(load_ops, name):
    spec, ops = load_ops(name)
    case = harness.Case(tables=ODD_TABLES, pooling="mean", weighted=True, B=32, max_L=6, hot=300, seed=580)
    out_c, w_c, st_c = _train(ops, spec, case, "cpu")
    out_g, w_g, st_g = _train(ops, spec, case, "cuda")
    out_g2, w_g2, st_g2 = _train(ops, spec, case, "cuda")
    for a, b in zip(out_g, out_c):
        assert_close(a, b, msg="forward")
    assert_close(w_g, w_c, rtol=1e-5, atol=1e-6, msg="weights")
    for k in st_c:
        assert_close(st_g[k], st_c[k], rtol=1e-5, atol=1e-7, msg=k)
    assert torch.equal(w_g, w_g2) and all(torch.equal(st_g[k], st_g2[k]) for k in st_g)
    assert all(torch.equal(a, b) for a, b in zip(out_g, out_g2))


CUDA_STATE_CASES = STATE_CASES + [
    pytest.param(name, harness.Case(tables=((50, 5), (20, 1031), (300, 127)), pooling="sum", weighted=True,
                                    hot=3000, max_segment_length_per_warp=seg, seed=620 + seg,
                                    state_dtypes=tuple((s.name, torch.bfloat16)
                                                       for s in load_spec(str(SPECS[name])).states if not s.is_int)),
                 id=f"{name}-hot-seg{seg}")
    for name in STATE_OPTIMIZERS
    for seg in (1, 1000)
]


@cuda
@needs_cuda
@pytest.mark.parametrize("name,case", CUDA_STATE_CASES)
def test_cuda_odd_widths_narrow_and_int_states_match_reference(load_ops, name, case):
    """The any-width kernels with narrow and int states (short runs, and hot rows through the
    segment kernels) against the float64 reference."""
    spec, ops = load_ops(name)
    result = harness.run_case(spec, ops, case, device="cuda")
    assert not result.failures, "\n".join(result.failures)


@cuda
@needs_cuda
@pytest.mark.parametrize("name", STATE_OPTIMIZERS)
@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_any_width_narrow_states_agree_with_cpu_and_are_deterministic(load_ops, name, narrow):
    """Both devices draw the same stochastic-rounding bits (slot, key, column), so narrow states
    differ by at most one ulp where the float32 values straddle a rounding threshold; int states
    agree exactly; two CUDA runs agree bitwise."""
    spec, ops = load_ops(name)
    case = harness.Case(tables=ODD_TABLES, pooling="mean", weighted=True, B=32, max_L=6, hot=300, seed=630,
                        state_dtypes=tuple((s.name, narrow) for s in spec.states if not s.is_int))
    out_c, w_c, st_c = _train(ops, spec, case, "cpu")
    out_g, w_g, st_g = _train(ops, spec, case, "cuda")
    out_g2, w_g2, st_g2 = _train(ops, spec, case, "cuda")
    assert_close(w_g, w_c, rtol=1e-4, atol=1e-5, msg="weights")
    ulp = 2.0**-7 if narrow == torch.bfloat16 else 2.0**-10
    for s in spec.states:
        k = s.name
        if s.is_int:
            assert st_g[k].dtype == torch.int64 and torch.equal(st_g[k], st_c[k]), k
            continue
        assert st_g[k].dtype == narrow
        diff = (st_g[k].double() - st_c[k].double()).abs()
        assert bool((diff <= 2 * ulp * st_c[k].double().abs() + 1e-6).all()), f"{k}: CPU and CUDA differ by {diff.max():.3g}"
    assert torch.equal(w_g, w_g2) and all(torch.equal(st_g[k], st_g2[k]) for k in st_g)


@cuda
@needs_cuda
@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad", "adam"])
def test_cuda_misaligned_weights_take_the_any_width_path(load_ops, name):
    """Widths that are multiples of 4 but a weights buffer that starts at an odd element: the host
    sends the call to the any-width kernels (the 4-wide loads would be misaligned), and the result
    matches the aligned buffer's (4-wide kernels) to rounding."""
    spec, ops = load_ops(name)
    case = harness.Case(tables=((40, 8), (30, 16), (20, 128)), pooling="sum", weighted=True, B=16, hot=40, seed=590)
    out_a, w_a, st_a = _train(ops, spec, case, "cuda")
    out_m, w_m, st_m = _train(ops, spec, case, "cuda", misalign=True)
    for a, b in zip(out_m, out_a):
        assert_close(a, b, msg="forward")
    assert_close(w_m, w_a, rtol=1e-5, atol=1e-6, msg="weights")
    for k in st_a:
        assert_close(st_m[k], st_a[k], rtol=1e-5, atol=1e-7, msg=k)


@cuda
@needs_cuda
def test_cuda_features_changed_in_place_switch_paths(load_ops):
    """The host remembers each features tensor's layout; an in-place change (which bumps the
    tensor's version) is seen: a layout made odd in place pools with the any-width kernels."""
    _, ops = load_ops("sgd")
    aligned, odd = make_layout([(10, 4), (10, 4)]), make_layout([(10, 3), (10, 5)])
    w = torch.randn(80, device="cuda")
    ind = torch.tensor([1, 2, 3], device="cuda")
    off = torch.tensor([0, 2, 3], device="cuda")
    feats = aligned.features_tensor("cuda")
    ops.forward(w, feats, 8, 4, ind, off, None, 0)
    feats.copy_(odd.features_tensor("cuda"))
    out = ops.forward(w, feats, 8, 5, ind, off, None, 0).cpu()
    wc = w.cpu()
    expected = torch.cat([wc[3:6] + wc[6:9], wc[30 + 3 * 5 : 30 + 4 * 5]])[None]
    assert_close(out, expected, msg="pooled after the in-place change")


@cuda
@needs_cuda
def test_cuda_inference_mode_features(load_ops):
    """Features made under inference_mode (no version counter) are read on every call."""
    _, ops = load_ops("sgd")
    layout = make_layout([(10, 3), (10, 5)])
    w = torch.randn(layout.weights_numel, device="cuda")
    ind, off = torch.tensor([1, 2], device="cuda"), torch.tensor([0, 1, 2], device="cuda")
    with torch.inference_mode():
        feats = layout.features_tensor("cuda")
        out = ops.forward(w, feats, 8, 5, ind, off, None, 0).cpu()
    wc = w.cpu()
    assert_close(out, torch.cat([wc[3:6], wc[30 + 10 : 30 + 15]])[None], msg="pooled")


@cuda
@needs_cuda
def test_cuda_checks_the_features_table(load_ops):
    """The CUDA operators check their host copy of the features table as the CPU ones do (the
    any-width kernels size their scratch by max_D, so a wider row must never reach them)."""
    spec, ops = load_ops("sgd")
    layout = make_layout([(4, 5)])
    w = torch.zeros(layout.weights_numel, device="cuda")
    ind, off = torch.tensor([1], device="cuda"), torch.tensor([0, 1], device="cuda")
    feats = layout.features_tensor("cuda")
    feats[0, 2] = 6
    with pytest.raises(RuntimeError, match="feature 0 has D = 6 > max_D = 5"):
        ops.forward(w, feats, 5, 5, ind, off, None, 0)
    feats[0, 2] = 5000
    with pytest.raises(RuntimeError, match="feature 0 has D = 5000; embedding dims must be from 1 to 4096"):
        ops.backward(torch.zeros(1, 5, device="cuda"), w, feats, 5, 5, 4, ind, off, None, 0, 32, False, 0,
                     *[0.1 for _ in spec.hyperparameters], 1)


@cuda
@needs_cuda
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_cuda_module_odd_widths_match_cpu(optimizer):
    kw = dict(seed=3, pooling="mean", feature_table_map=[0, 1, 2, 1], learning_rate=0.05)
    tables = [(40, 5), (25, 1), (16, 131)]
    cpu = TableBatchedEmbeddingBags(tables, optimizer=optimizer, **kw)
    gpu = TableBatchedEmbeddingBags(tables, optimizer=optimizer, device="cuda", **kw)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        ind, off, psw = make_batch(cpu, 6, gen, weighted=True)
        out_c, out_g = cpu(ind, off, psw), gpu(ind.cuda(), off.cuda(), psw.cuda())
        assert_close(out_g, out_c, msg="forward")
        proj = torch.randn(out_c.shape, generator=gen)
        (out_c * proj).sum().backward()
        (out_g * proj.cuda()).sum().backward()
    assert_close(gpu.weights, cpu.weights.detach(), msg="weights")
    for s in cpu.spec.states:
        assert_close(gpu.optimizer_state(s.name), cpu.optimizer_state(s.name), msg=s.name)
