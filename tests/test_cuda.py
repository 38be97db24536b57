"""The CUDA kernels on a GPU (`pytest -m cuda`; skipped where no GPU exists).

The same numerical grid as the CPU suite, against the same float64 references, plus what only
the GPU path has: hot rows far beyond max_segment_length_per_warp (the segment kernel and its
fixed-order second pass over the segments' partial sums), D up to 1024, batches of 65536, a weights buffer of more than 2^31
elements, a batch where every index is the same row, CPU/CUDA agreement, bitwise determinism,
stochastic rounding statistics and bad input. Results of the last GPU run: docs/gpu-results.md.
"""

import dataclasses

import pytest
import torch

from tbegen import harness
from tbegen.layout import make_layout
from tbegen.spec import load_spec

from conftest import SPECS

pytestmark = pytest.mark.cuda

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NAMES = sorted(SPECS)


def gpu_cases(spec):
    cases = harness.standard_cases(spec, dtypes=DTYPES)
    base = harness.Case(tables=((50, 64), (20, 1024), (300, 128)), pooling="sum", weighted=True, hot=3000, seed=900)
    for seg in (1, 4, 32, 1000):  # 1: every row through the block kernel; 1000: none
        cases.append(dataclasses.replace(base, max_segment_length_per_warp=seg, seed=900 + seg))
    cases.append(dataclasses.replace(base, pooling="mean", weights_dtype=torch.float16, stochastic_rounding=True, seed=950))
    cases.append(harness.Case(tables=((1000, 256), (3000, 1024)), B=64, max_L=8, all_same=True, seed=960))
    cases.append(harness.Case(tables=((5000, 32), (20000, 8), (100, 516)), B=65536, max_L=3, steps=2, hot=0, seed=970))
    # every row at most 64 columns: the forward's bag-per-lane-group kernel (forward_bag_groups_kernel),
    # with long bags (several passes of a group's lanes over the indices) and a batch whose bags do
    # not fill the last warp
    cases.append(harness.Case(tables=((300, 8), (100, 20), (50, 64), (40, 4)), B=37, max_L=70, pooling="mean",
                              weighted=True, hot=200, index_dtype=torch.int32, seed=980))
    cases.append(harness.Case(tables=((300, 32), (100, 12)), B=45, max_L=9, pooling="sum", weighted=True,
                              weights_dtype=torch.float16, seed=981))
    return cases


CASES = [
    pytest.param(name, case, id=f"{name}-{case.id}")
    for name in NAMES
    for case in gpu_cases(load_spec(str(SPECS[name])))
]


@pytest.mark.parametrize("name,case", CASES)
def test_cuda_matches_reference(load_ops, record_result, name, case):
    spec, ops = load_ops(name)
    result = harness.run_case(spec, ops, case, device="cuda")
    record_result(name, "cuda", result)
    assert not result.failures, "\n".join(result.failures)


# Every entry of an optimizer's table of update kernels (include/tbegen/cuda_backward_kernels.cuh),
# through which the shared backward launches them: each weight dtype with each row-width class
# (kVecs 1, 2, 4, 8: max_D up to 128, 256, 512, 1024). gpu_cases covers kVecs 1 and 8 only.
TABLE_CASES = [
    harness.Case(tables=((40, width), (30, 12)), B=8, max_L=4, pooling="sum", weighted=True,
                 weights_dtype=dt, hot=60, seed=1000 + width + i)
    for i, dt in enumerate(DTYPES)
    for width in (100, 200, 400, 1000)
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", TABLE_CASES, ids=lambda c: c.id)
def test_every_kernel_table_entry_matches_reference(load_ops, record_result, name, case):
    spec, ops = load_ops(name)
    result = harness.run_case(spec, ops, case, device="cuda")
    record_result(name, "cuda", result)
    assert not result.failures, "\n".join(result.failures)


def _one_step(spec, ops, case, device, weights, states, batch, grad_output, step=1):
    layout = make_layout(case.tables, case.feature_table_map)
    hyper = harness.default_hyperparameters(spec, dict(case.hyper))
    w = weights.clone().to(device)
    st = {k: v.clone().to(device) for k, v in states.items()}
    psw = batch.per_sample_weights.to(device) if batch.per_sample_weights is not None else None
    harness.call_backward(spec, ops, "backward", case, layout, layout.features_tensor(device), hyper,
                          grad_output.to(device), w, st, batch.indices.to(device), batch.offsets.to(device), psw, step)
    return w.cpu(), {k: v.cpu() for k, v in st.items()}


def _problem(spec, case):
    gen = torch.Generator().manual_seed(case.seed)
    layout = make_layout(case.tables, case.feature_table_map)
    weights, states = harness.initial_state(spec, layout, case, gen)
    batch = harness.random_batch(case, layout, gen)
    rows = case.B if case.pooling != "none" else batch.indices.numel()
    cols = layout.total_D if case.pooling != "none" else layout.max_D
    grad_output = torch.randn(rows, cols, generator=gen)
    return weights, states, batch, grad_output


def _assert_switch_keeps_the_bits(spec, ops, case, monkeypatch, variable, value):
    """One CUDA step of `case`, then the same step with the environment switch `variable`=`value`
    (read by the host at every call): both must change the weights and give the same bits."""
    weights, states, batch, go = _problem(spec, case)
    default = _one_step(spec, ops, case, "cuda", weights, states, batch, go)
    monkeypatch.setenv(variable, value)
    switched = _one_step(spec, ops, case, "cuda", weights, states, batch, go)
    assert not torch.equal(default[0], weights), "the step changed nothing"
    assert torch.equal(default[0], switched[0]), "weights differ"
    for k in states:
        assert torch.equal(default[1][k], switched[1][k]), f"state {k} differs"


AGREE_CASES = [
    harness.Case(pooling="sum", weighted=True, hot=200, seed=11),
    harness.Case(pooling="mean", seed=12, index_dtype=torch.int32),
    harness.Case(tables=((64, 48), (80, 48)), pooling="none", weighted=True, seed=13),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", AGREE_CASES, ids=lambda c: c.id)
def test_cpu_and_cuda_agree(load_ops, name, case):
    spec, ops = load_ops(name)
    weights, states, batch, go = _problem(spec, case)
    w_cpu, st_cpu = _one_step(spec, ops, case, "cpu", weights, states, batch, go)
    w_gpu, st_gpu = _one_step(spec, ops, case, "cuda", weights, states, batch, go)
    # Both devices accumulate gradients in float32, in different orders; where the step is
    # ill-conditioned each may sit up to the reference's own sensitivity to that rounding away
    # from float64 (harness.gradient_sensitivity), so twice that is allowed between them.
    layout = make_layout(case.tables, case.feature_table_map)
    hyper = harness.default_hyperparameters(spec, dict(case.hyper))
    args = (spec, layout, case.B, case.pooling, weights, states, batch, go, hyper, 1)
    ref_w, ref_st, _ = harness.reference_step(*args)
    sens_w, sens_st = harness.gradient_sensitivity(*args, ref_w, ref_st)
    for what, gpu, cpu, sens in [("weights", w_gpu, w_cpu, sens_w)] + [
        (k, st_gpu[k], st_cpu[k], sens_st[k]) for k in st_cpu
    ]:
        diff = (gpu.double() - cpu.double()).abs()
        allowed = 1e-5 * cpu.double().abs() + 1e-6 + 2 * sens
        worst = int((diff - allowed).argmax())
        assert bool((diff <= allowed).all()), (
            f"{what}: CPU and CUDA differ by {diff[worst].item():.3g} at {worst} "
            f"(allowed {allowed[worst].item():.3g}; cpu {cpu[worst].item():.6g}, gpu {gpu[worst].item():.6g})")


DETERMINISM_CASES = [
    harness.Case(pooling="sum", weighted=True, hot=5000, max_segment_length_per_warp=32, seed=21),
    harness.Case(pooling="mean", weights_dtype=torch.float16, stochastic_rounding=True, hot=500, seed=22),
    harness.Case(tables=((64, 1024),), B=128, all_same=True, seed=23),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", DETERMINISM_CASES, ids=lambda c: c.id)
def test_cuda_is_deterministic(load_ops, name, case):
    spec, ops = load_ops(name)
    weights, states, batch, go = _problem(spec, case)
    first = _one_step(spec, ops, case, "cuda", weights, states, batch, go)
    for _ in range(2):
        again = _one_step(spec, ops, case, "cuda", weights, states, batch, go)
        assert torch.equal(again[0], first[0])
        for k in first[1]:
            assert torch.equal(again[1][k], first[1][k])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_is_unbiased_and_varies_by_step(load_ops, dtype):
    """sgd moves each weight by an amount far below its ulp: nearest rounding would leave it
    unchanged, stochastic rounding moves it up or down so that the mean over many steps (each
    step draws new bits) converges to the exact fp32 result."""
    spec, ops = load_ops("sgd")
    E, D = 64, 128
    layout = make_layout([(E, D)])
    feats = layout.features_tensor("cuda")
    gen = torch.Generator().manual_seed(5)
    w0 = (torch.rand(E * D, generator=gen) + 0.5).to(dtype)  # in [0.5, 1.5)
    indices = torch.arange(E, dtype=torch.int64, device="cuda")
    offsets = torch.arange(E + 1, dtype=torch.int64, device="cuda")  # B = E bags of one row
    go = torch.randn(E, D, generator=gen).cuda()
    lr = 1e-4
    exact = w0.float().cuda().view(E, D) - lr * go
    reps = 2000
    total = torch.zeros(E, D, dtype=torch.float64, device="cuda")
    results = []
    for step in range(1, reps + 1):
        w = w0.clone().cuda()
        ops.backward(go, w, feats, D, D, E, indices, offsets, None, 0, 32, True, 1234, lr, step)
        total += w.view(E, D).double()
        if step <= 2:
            results.append(w.clone())
    mean = total / reps
    ulp = (exact.abs() * (2.0**-10 if dtype == torch.float16 else 2.0**-7)).double()
    # standard error of a two-point distribution one ulp wide is <= ulp / (2 sqrt(reps))
    z = ((mean - exact.double()).abs() / (ulp / (2 * reps**0.5))).max().item()
    assert z < 6.0, f"mean of stochastically rounded results is off by {z:.1f} standard errors"
    assert not torch.equal(results[0], results[1]), "steps 1 and 2 drew the same rounding"
    # nearest rounding would not have moved most weights at all
    w = w0.clone().cuda()
    ops.backward(go, w, feats, D, D, E, indices, offsets, None, 0, 32, False, 1234, lr, 1)
    assert (w != w0.cuda()).float().mean().item() < 0.5


def test_weights_beyond_2_31_elements(load_ops):
    """A table that ends past element 2^31 of the flat buffer: offsets must be 64-bit."""
    spec, ops = load_ops("sgd")
    small = (1000, 64)
    big_rows = (2**31) // 128 + 4096
    layout = make_layout([small, (big_rows, 128)])
    assert layout.weights_numel > 2**31
    weights = torch.empty(layout.weights_numel, dtype=torch.float16, device="cuda")
    weights.uniform_(-1, 1)
    B = 8
    rows = torch.tensor([big_rows - 1, big_rows - 2, big_rows - 4095, 3, big_rows - 1], device="cuda")
    ind = torch.cat([torch.arange(B, device="cuda"), rows.repeat(B)]).to(torch.int64)
    offsets = torch.tensor([0] + list(range(1, B + 1)) + [B + 5 * (b + 1) for b in range(B)], device="cuda")
    feats = layout.features_tensor("cuda")
    out = ops.forward(weights, feats, layout.total_D, layout.max_D, ind, offsets, None, 0)
    big = weights[layout.table_offsets[1]:].view(big_rows, 128)
    expect = big[rows].float().sum(0)
    torch.testing.assert_close(out[:, 64:], expect.expand(B, 128), rtol=1e-5, atol=1e-5)
    before = big[rows].float().clone()
    go = torch.randn(B, layout.total_D, device="cuda")
    ops.backward(go, weights, feats, layout.total_D, layout.max_D, layout.total_hash_size, ind, offsets, None, 0, 32,
                 False, 0, 0.5, 1)
    g_sum = go[:, 64:].sum(0)
    counts = torch.tensor([2, 1, 1, 1, 2], device="cuda")  # row big_rows-1 appears twice per bag
    expected = (before - 0.5 * counts[:, None] * B * g_sum / B).half().float()
    torch.testing.assert_close(big[rows].float(), expected, rtol=2e-3, atol=2e-3)


def test_bad_indices_raise_and_change_nothing(load_ops):
    spec, ops = load_ops("adagrad")
    layout = make_layout([(10, 16)])
    w = torch.randn(layout.weights_numel, device="cuda")
    acc = torch.zeros_like(w)
    w0, acc0 = w.clone(), acc.clone()
    feats = layout.features_tensor("cuda")
    ind = torch.tensor([1, 2, 10], device="cuda")
    off = torch.tensor([0, 2, 3], device="cuda")
    with pytest.raises(RuntimeError, match="out of range"):
        ops.forward(w, feats, 16, 16, ind, off, None, 0)
    go = torch.randn(2, 16, device="cuda")
    with pytest.raises(RuntimeError, match="out of range"):
        ops.backward(go, w, feats, 16, 16, 10, ind, off, None, 0, 32, False, 0, acc, 0.1, 1e-8, 1)
    assert torch.equal(w, w0) and torch.equal(acc, acc0)
    bad_off = torch.tensor([0, 3, 2], device="cuda")
    with pytest.raises(RuntimeError, match="offsets"):
        ops.backward(go, w, feats, 16, 16, 10, torch.tensor([1, 2, 3], device="cuda"), bad_off, None, 0, 32, False, 0,
                     acc, 0.1, 1e-8, 1)
    assert torch.equal(w, w0) and torch.equal(acc, acc0)


# Narrow state storage (state_dtypes / a state's `dtype`): the CUDA kernels load fp16/bf16 states
# element by element and store them with stochastic rounding (common.h, store_state). The grid
# above already includes the bf16-state and fp16-state cases of harness.standard_cases; these add
# determinism and agreement with the CPU kernel, which draws the same random bits.
NARROW_NAMES = [n for n in NAMES if any(not s.is_int for s in load_spec(str(SPECS[n])).states)]


@pytest.mark.parametrize("name", NARROW_NAMES)
@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_narrow_states_cuda_deterministic_and_agree_with_cpu(load_ops, name, narrow):
    spec, ops = load_ops(name)
    case = harness.Case(pooling="sum", weighted=True, hot=300, seed=31,
                        state_dtypes=tuple((s.name, narrow) for s in spec.states if not s.is_int))
    weights, states, batch, go = _problem(spec, case)
    assert all(v.dtype == (torch.int64 if s.is_int else narrow) for s, v in zip(spec.states, states.values()))
    first = _one_step(spec, ops, case, "cuda", weights, states, batch, go)
    again = _one_step(spec, ops, case, "cuda", weights, states, batch, go)
    assert torch.equal(first[0], again[0])
    cpu = _one_step(spec, ops, case, "cpu", weights, states, batch, go)
    ulp = 2.0**-7 if narrow == torch.bfloat16 else 2.0**-10
    for s in spec.states:
        k = s.name
        if s.is_int:
            assert torch.equal(first[1][k], cpu[1][k]) and torch.equal(first[1][k], again[1][k]), k
            continue
        assert first[1][k].dtype == narrow and torch.equal(first[1][k], again[1][k])
        # the same bits on both devices: the stored values differ only where the float32 values
        # straddle a rounding threshold, by one ulp
        diff = (first[1][k].double() - cpu[1][k].double()).abs()
        assert bool((diff <= ulp * cpu[1][k].double().abs() + 1e-6).all()), f"{k}: CPU and CUDA differ by {diff.max():.3g}"



# Lane groups (cuda_kernels.cuh, backward_group_kernel): when some table is at most 64 columns
# wide and no row is wider than 256, a warp updates several narrow rows at once, one per group of
# lanes. A row must get the bits the whole-warp kernel (backward_warp_kernel) gives it: the same
# step is run with the group kernel and with TBEGEN_LANE_GROUPS=0, which makes the host launch
# the whole-warp kernel instead. Tables of several widths, so that a warp's runs change width
# within its 32 (rounds of different group sizes), hot rows (the segment kernel beside it).
# (Optimizers with per-element state take the group kernel for rows of up to 128 columns only
# (kVecs = 1): in the first case, the 256-column table's width class goes to the whole-warp kernel
# for them. cuda_backward_kernels.cuh, launch_backward.)
GROUP_CASES = [
    harness.Case(tables=((300, 8), (100, 16), (50, 256), (80, 128)), B=32, pooling="sum", weighted=True, hot=100, seed=41),
    harness.Case(tables=((300, 36), (100, 64), (50, 60)), B=32, pooling="mean", weights_dtype=torch.float16,
                 stochastic_rounding=True, seed=42),
    harness.Case(tables=((300, 4), (100, 32), (50, 128)), B=64, max_L=12, pooling="sum", weights_dtype=torch.bfloat16,
                 hot=600, seed=43),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", GROUP_CASES, ids=lambda c: c.id)
def test_lane_groups_give_the_whole_warp_bits(load_ops, monkeypatch, name, case):
    spec, ops = load_ops(name)
    _assert_switch_keeps_the_bits(spec, ops, case, monkeypatch, "TBEGEN_LANE_GROUPS", "0")


# Width classes (cuda_ops.cuh, backward_cuda): a batch whose rows need different numbers of 4-wide
# slices per lane (kVecs: 128, 256, 512 and 1024 columns) has its short runs updated by one launch
# per class, each at its own kVecs. A row must get the bits of the single launch at the widest
# row's kVecs (TBEGEN_WIDTH_CLASSES=0), with and without lane groups. Tables of every class, hot
# rows (the long runs' kernels go with the widest class's launch), a shared table.
WIDTH_CASES = [
    harness.Case(tables=((300, 8), (100, 256), (50, 128), (80, 512), (40, 36)), B=32, pooling="sum", weighted=True,
                 hot=100, seed=51),
    harness.Case(tables=((200, 64), (60, 1024), (90, 200)), B=32, max_L=12, pooling="mean",
                 weights_dtype=torch.float16, stochastic_rounding=True, hot=300, seed=52),
    harness.Case(tables=((300, 128), (100, 132)), feature_table_map=(0, 1, 0), B=48, pooling="sum",
                 weights_dtype=torch.bfloat16, seed=53),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", WIDTH_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("lane_groups", ["1", "0"], ids=["groups", "whole_warp"])
def test_width_classes_give_the_single_launch_bits(load_ops, monkeypatch, name, case, lane_groups):
    spec, ops = load_ops(name)
    monkeypatch.setenv("TBEGEN_LANE_GROUPS", lane_groups)
    _assert_switch_keeps_the_bits(spec, ops, case, monkeypatch, "TBEGEN_WIDTH_CLASSES", "0")


# The width classes' launches on streams of their own (cuda_ops.cuh, backward_cuda): the classes
# narrower than the widest run beside it, on a third stream. They update different tables' rows,
# so every row must get the bits of the launches one after another (TBEGEN_CLASS_STREAMS=0).
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", WIDTH_CASES, ids=lambda c: c.id)
def test_class_streams_give_the_one_stream_bits(load_ops, monkeypatch, name, case):
    spec, ops = load_ops(name)
    _assert_switch_keeps_the_bits(spec, ops, case, monkeypatch, "TBEGEN_CLASS_STREAMS", "0")


# The short runs' grid (cuda_backward_kernels.cuh, short_run_grid): one resident wave of blocks
# whose warps take groups of runs by ticket, or a grid sized by the bound on the runs (several
# waves, TBEGEN_SHORT_RUN_WAVES=0). Which warp updates a row must not change its bits. Batches of
# about 265,000 occurrences, so that one wave of the H200's blocks (132 multiprocessors) is
# smaller than the bounded grid; the second case has two width classes (two launches, on two
# streams) and a hot row (the long runs' segments, by ticket too).
WAVE_CASES = [
    harness.Case(tables=((200_000, 128), (150_000, 128)), B=8192, max_L=40, hot=0, seed=71),
    harness.Case(tables=((100_000, 64), (60_000, 256)), B=8192, max_L=40, pooling="mean",
                 weights_dtype=torch.float16, hot=5000, seed=72),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", WAVE_CASES, ids=lambda c: c.id)
def test_short_run_waves_give_the_same_bits(load_ops, monkeypatch, name, case):
    spec, ops = load_ops(name)
    _assert_switch_keeps_the_bits(spec, ops, case, monkeypatch, "TBEGEN_SHORT_RUN_WAVES", "0")


# The sort's digit width (cuda_sort.cuh): keys of 25 to 27 bits are sorted with 9-bit digits (three
# passes, not four). A stable sort has one result, so the step must give the bits of CUB's 8-bit
# sort (TBEGEN_SORT_DIGIT_BITS=8). A table of 20 million rows makes the keys 25 bits wide; 1024
# bags of up to 20 indices put the batch past CUB's single-tile sort; the hot row makes a long run.
SORT_CASES = [
    harness.Case(tables=((20_000_000, 4), (300, 8)), B=1024, max_L=20, hot=2000, seed=61),
]


@pytest.mark.parametrize("name", [n for n in ("sgd", "rowwise_adagrad", "adam") if n in NAMES])
@pytest.mark.parametrize("case", SORT_CASES, ids=lambda c: c.id)
def test_nine_bit_sort_gives_the_eight_bit_bits(load_ops, monkeypatch, name, case):
    spec, ops = load_ops(name)
    _assert_switch_keeps_the_bits(spec, ops, case, monkeypatch, "TBEGEN_SORT_DIGIT_BITS", "8")
