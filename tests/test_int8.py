"""int8 rows (weights_dtype "int8"; docs/layout.md "int8 rows", docs/module.md).

CPU (default suite): the forward equals dequantize-then-pool; the per-sample-weight gradient
equals its reference on the dequantized rows; one fused step of every optimizer equals the float64
chain dequantize -> the spec's own reference update -> quantize, within one quantization step
(untouched rows bitwise unchanged); the qparams are the updated row's min and max; the update is
bitwise deterministic (also across thread counts); state_dict round trip; bad input and what is
not supported raise naming the problem.

CUDA (marked `cuda`, skipped without a GPU): the same step against the reference on the GPU,
hot rows through the segment kernels, CUDA against CPU, bitwise determinism on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from tbegen import TableBatchedEmbeddingBags, harness, int8
from tbegen.layout import make_layout
from tbegen.spec import load_spec

from conftest import SPECS

HAS_CUDA = torch.cuda.is_available()
ALL = {name: load_spec(str(path)) for name, path in SPECS.items()}
# every fused optimizer without whole-table stages takes int8 rows (the others are refused: below)
FUSED = sorted(n for n, s in ALL.items() if not s.dense_gradient and not s.table_stages)
# a few for the slower variants (where TBEGEN_TEST_OPTIMIZERS leaves them)
FEW = [n for n in ("sgd", "rowwise_adagrad", "adam", "lamb") if n in ALL]
# odd widths, a column offset that is not a multiple of 4, a shared table (feature 3 reads table 0)
TABLES = ((30, 8), (20, 5), (12, 33))
FTM = (0, 1, 2, 0)


@pytest.fixture(scope="module", autouse=True)
def _extensions(prebuilt):
    return prebuilt


def hyper_for(spec):
    """The spec's defaults, with a learning rate large enough to move codes in one step."""
    hyper = harness.default_hyperparameters(spec, {})
    if "learning_rate" in hyper:
        hyper["learning_rate"] = 0.3
    return hyper


def make(name, device="cpu", tables=TABLES, ftm=FTM, pooling="sum", seed=5, **kw):
    spec = ALL[name]
    return TableBatchedEmbeddingBags(tables, optimizer=spec, pooling=pooling, weights_dtype="int8", device=device,
                                     feature_table_map=ftm, seed=seed, **{**hyper_for(spec), **kw})


def random_batch(emb, B, gen, max_L=5, weighted=False, hot=0, index_dtype=torch.int64):
    """Feature-major bags with duplicates likely; `hot` extra occurrences of row 0 of feature 0."""
    F = emb.num_features
    lengths = torch.randint(0, max_L + 1, (F, B), generator=gen)
    lengths[0, 0] += hot
    parts = []
    for f in range(F):
        E = emb.tables[emb.layout.feature_table_map[f]][0]
        idx = torch.randint(0, E, (int(lengths[f].sum()),), generator=gen)
        if f == 0 and hot:
            idx[: hot] = 0
        parts.append(idx)
    indices = torch.cat(parts).to(index_dtype)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.reshape(-1).cumsum(0)]).to(index_dtype)
    psw = torch.rand(indices.numel(), generator=gen) * 2 - 0.5 if weighted else None
    return harness.Batch(indices, offsets, psw)


def on(batch, device):
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(batch.indices), move(batch.offsets), move(batch.per_sample_weights)


def dequantized_flat(emb) -> torch.Tensor:
    """The module's weights dequantized, float64, in the element layout (table_offsets)."""
    return torch.cat([int8.dequantize_rows(r.cpu(), torch.float64).reshape(-1) for r in emb.split_int8_rows()])


def states_of(emb):
    """Every optimizer state, per-table ones included (the reference reads them)."""
    names = [s.name for s in emb.spec.states] + [s.name for s in emb.spec.table_states]
    return {n: emb.optimizer_state(n).detach().cpu().clone() for n in names}


# ---- layout and quantization ------------------------------------------------------------------


def test_buffer_layout_and_initial_rows():
    emb = make("sgd") if "sgd" in ALL else make(FUSED[0])
    layout = emb.layout
    assert emb.weights.dtype == torch.uint8 and emb.int8
    assert emb.weights.numel() == layout.weights_numel + 8 * layout.total_hash_size
    rows = emb.split_int8_rows()
    assert [tuple(r.shape) for r in rows] == [(E, D + 8) for E, D in TABLES]
    # packed: table t starts at byte table_offsets[t] + 8 * key_base[t] (row views into one buffer)
    for t, r in enumerate(rows):
        assert r.data_ptr() - emb.weights.data_ptr() == layout.table_offsets[t] + 8 * layout.table_key_base[t]
    # the initial weights are the float init quantized row by row: a float32 module with the same
    # seed holds the values before quantization
    ref = TableBatchedEmbeddingBags(TABLES, optimizer=emb.spec, feature_table_map=FTM, seed=5, **hyper_for(emb.spec))
    for q, w in zip(rows, ref.split_embedding_weights()):
        assert torch.equal(q, int8.quantize_rows(w))
        scale, bias = int8.qparams(q)
        assert torch.equal(bias, w.amin(1)) and (int8.dequantize_rows(q) - w).abs().max() <= scale.max() / 2 * 1.0001


def test_quantize_rows_rounds_to_nearest_even_and_handles_constant_rows():
    w = torch.tensor([[0.0, 0.5, 1.5, 255.0], [2.0, 2.0, 2.0, 2.0]])
    q = int8.quantize_rows(w)
    assert q[0, :4].tolist() == [0, 0, 2, 255]  # scale 1: 0.5 -> 0, 1.5 -> 2 (ties to even)
    assert q[1, :4].tolist() == [0, 0, 0, 0]
    scale, bias = int8.qparams(q)
    assert scale.tolist() == [1.0, 0.0] and bias.tolist() == [0.0, 2.0]
    assert torch.equal(int8.dequantize_rows(q), torch.tensor([[0.0, 0.0, 2.0, 255.0], [2.0] * 4]))


# ---- forward and the per-sample-weight gradient -------------------------------------------------


@pytest.mark.parametrize("pooling,weighted,index_dtype", [
    ("sum", False, torch.int64), ("sum", True, torch.int32), ("mean", True, torch.int64), ("none", True, torch.int64)])
def test_forward_equals_dequantize_then_pool(pooling, weighted, index_dtype):
    name = FEW[0] if FEW else FUSED[0]
    tables = ((30, 7), (20, 7), (12, 7)) if pooling == "none" else TABLES
    emb = make(name, tables=tables, pooling=pooling)
    gen = torch.Generator().manual_seed(11)
    batch = random_batch(emb, 7, gen, weighted=weighted, index_dtype=index_dtype)
    w = dequantized_flat(emb)
    psw = batch.per_sample_weights
    if psw is not None:
        psw = psw.clone().requires_grad_()
    out = emb(batch.indices, batch.offsets, psw)
    ref = harness.reference_forward(emb.layout, 7, pooling, w, batch)
    torch.testing.assert_close(out.detach().double(), ref, rtol=1e-5, atol=1e-6)
    if psw is not None:
        g = torch.randn(out.shape, generator=gen)
        out.backward(g)  # (also one update; the gradient is taken from the weights before it)
        ref_g = harness.reference_grad_psw(emb.layout, 7, pooling, w, batch, g)
        torch.testing.assert_close(psw.grad.double(), ref_g, rtol=1e-5, atol=1e-5)


# ---- one fused step against the float64 reference ------------------------------------------------


def check_step(emb, batch, B, gen, device="cpu"):
    """One step of `emb` against dequantize -> the spec's reference -> quantize (float64)."""
    spec, layout = emb.spec, emb.layout
    rows_before = [r.cpu().clone() for r in emb.split_int8_rows()]
    w = dequantized_flat(emb)
    states = states_of(emb)
    out = emb(*on(batch, device))
    g = torch.randn(out.shape, generator=gen)
    out.backward(g.to(device))
    hyper = emb.hyperparameters
    ref_w, ref_states, touched = harness.reference_step(spec, layout, B, emb.pooling, w, states, batch, g, hyper, 1)
    rows_after = [r.cpu() for r in emb.split_int8_rows()]
    for t, (E, D) in enumerate(layout.tables):
        base = layout.table_offsets[t]
        ref = ref_w[base : base + E * D].view(E, D)
        hit = touched[base : base + E * D].view(E, D).any(1)
        after = rows_after[t]
        # rows not in the batch: bitwise unchanged, codes and qparams
        assert torch.equal(after[~hit], rows_before[t][~hit]), f"table {t}: an untouched row changed"
        if not hit.any():
            continue
        scale, bias = int8.qparams(after[hit])
        r = ref[hit]
        lo, hi = r.min(1).values, r.max(1).values
        # fresh qparams from the updated row: bias its min, scale (max - min) / 255 (to float32 rounding
        # of the update: 1e-5 of the row's magnitude)
        mag = r.abs().max(1).values + 1e-30
        assert ((bias.double() - lo).abs() <= 1e-5 * mag).all(), f"table {t}: bias is not the updated row's min"
        assert ((scale.double() - (hi - lo) / 255).abs() <= 1e-5 * mag / 255 + 1e-5 * scale.double()).all(), \
            f"table {t}: scale is not the updated row's range / 255"
        # the codes are the reference row quantized (round to nearest even): up to float32 rounding
        # of the update, which can move a value across a rounding boundary, by one code at most
        codes, ref_codes = after[hit][:, :D].int(), int8.quantize_rows(r.float())[:, :D].int()
        assert (codes - ref_codes).abs().max() <= 1, f"table {t}: a code is more than one from the reference's"
        assert (codes == ref_codes).double().mean() >= 0.95, f"table {t}: codes differ from the reference's"
        # every element within one quantization step of the reference's updated value
        err = (int8.dequantize_rows(after[hit], torch.float64) - r).abs()
        step_size = scale.double()[:, None] * (1 + 1e-4) + 1e-6 * mag[:, None]
        assert (err <= step_size).all(), (
            f"table {t}: {int((err > step_size).sum())} element(s) further than one quantization step from the "
            f"reference (worst {float((err / step_size).max()):.3f} steps)")
    after_states = states_of(emb)
    for s in spec.states:
        a, r = after_states[s.name], ref_states[s.name]
        if a.dtype == torch.int64:
            assert torch.equal(a, r.to(torch.int64)), f"state {s.name}"
        else:
            torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-6 * (1 + float(r.abs().max())),
                                       msg=lambda m: f"state {s.name}: {m}")


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("mean", True)])
def test_one_step_equals_dequantize_reference_requantize(name, pooling, weighted):
    emb = make(name, pooling=pooling)
    gen = torch.Generator().manual_seed(21)
    check_step(emb, random_batch(emb, 6, gen, weighted=weighted, hot=3), 6, gen)


def test_update_is_bitwise_deterministic_across_runs_and_threads():
    name = "adam" if "adam" in ALL else FUSED[0]
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, max(2, threads), 1):
            torch.set_num_threads(n)
            emb = make(name, tables=((400, 33), (300, 16)), ftm=None)
            gen = torch.Generator().manual_seed(3)
            for _ in range(3):
                batch = random_batch(emb, 64, gen, weighted=True, hot=20)
                out = emb(batch.indices, batch.offsets, batch.per_sample_weights)
                out.backward(torch.randn(out.shape, generator=gen))
            results.append((emb.weights.clone(), states_of(emb)))
    finally:
        torch.set_num_threads(threads)
    for w, st in results[1:]:
        assert torch.equal(w, results[0][0])
        assert all(torch.equal(st[k], results[0][1][k]) for k in st)


# ---- state_dict, loading weights ----------------------------------------------------------------


def test_state_dict_round_trip_and_training_continues_identically():
    name = "rowwise_adagrad" if "rowwise_adagrad" in ALL else FUSED[0]
    a = make(name)
    gen = torch.Generator().manual_seed(8)
    batches = [random_batch(a, 5, gen, weighted=True) for _ in range(3)]
    grads = [torch.randn(5, sum(TABLES[t][1] for t in FTM), generator=gen) for _ in range(3)]
    for batch, g in zip(batches[:2], grads[:2]):
        a(batch.indices, batch.offsets, batch.per_sample_weights).backward(g)
    sd = a.state_dict()
    assert sd["weights"].dtype == torch.uint8 and sd["_extra_state"]["weights_dtype"] == "uint8"
    b = make(name, seed=99)
    b.load_state_dict(sd)
    assert torch.equal(a.weights, b.weights) and b.step == a.step == 2
    for emb in (a, b):
        emb(batches[2].indices, batches[2].offsets, batches[2].per_sample_weights).backward(grads[2])
    assert torch.equal(a.weights, b.weights)
    assert all(torch.equal(x, y) for x, y in zip(states_of(a).values(), states_of(b).values()))
    # an int8 state_dict is not a float module's, nor the other way round
    f = TableBatchedEmbeddingBags(TABLES, optimizer=a.spec, feature_table_map=FTM)
    with pytest.raises(RuntimeError, match="weights_dtype"):
        f.load_state_dict(sd)


def test_load_table_weights_quantizes_and_split_views():
    emb = make(FEW[0] if FEW else FUSED[0])
    values = torch.randn(20, 5, dtype=torch.float64)
    emb.load_table_weights(1, values)
    assert torch.equal(emb.split_int8_rows()[1], int8.quantize_rows(values.float()))
    # split_embedding_weights: dequantized float32 copies
    w = emb.split_embedding_weights()
    assert [tuple(x.shape) for x in w] == [(E, D) for E, D in TABLES] and w[1].dtype == torch.float32
    torch.testing.assert_close(w[1], int8.dequantize_rows(emb.split_int8_rows()[1]))
    assert (w[1] - values.float()).abs().max() <= int8.qparams(emb.split_int8_rows()[1])[0].max()
    # writing the stored rows through split_int8_rows changes what the forward reads
    emb.split_int8_rows()[0][3].copy_(int8.quantize_rows(torch.full((1, 8), 0.25))[0])
    out = emb(torch.tensor([3]), torch.tensor([0, 1, 1, 1, 1]))
    assert torch.equal(out[0, :8], torch.full((8,), 0.25))


# ---- bad input and what is not supported ----------------------------------------------------------


def test_weights_dtype_names():
    spec = ALL[FUSED[0]]
    for dt in ("int8", "uint8", torch.int8, torch.uint8):
        emb = TableBatchedEmbeddingBags([(4, 3)], optimizer=spec, weights_dtype=dt)
        assert emb.weights_dtype == torch.uint8 and emb.weights.numel() == 4 * (3 + 8)
    with pytest.raises(ValueError, match=r"weights_dtype must be .*\"int8\""):
        TableBatchedEmbeddingBags([(4, 3)], optimizer=spec, weights_dtype=torch.int16)
    with pytest.raises(ValueError, match="output_dtype must be"):
        TableBatchedEmbeddingBags([(4, 3)], optimizer=spec, weights_dtype="int8", output_dtype="int8")


@pytest.mark.parametrize("optimizer,kw,message", [
    ("none", {}, r"optimizer 'none' \(dense-gradient mode\) needs float weights"),
    ("emainplace_rowwise_adagrad", {}, r"whole-table stages, which int8 rows do not support yet"),
    ("ensemble_rowwise_adagrad", {}, r"whole-table stages, which int8 rows do not support yet"),
    ("rowwise_adagrad", dict(placements=["device", "managed_caching"]),
     r"int8 rows are not supported in 'managed_caching' tables yet \(table\(s\) \[1\]\)"),
])
def test_unsupported_combinations_are_refused(optimizer, kw, message):
    with pytest.raises(NotImplementedError, match=message):
        TableBatchedEmbeddingBags([(10, 4), (10, 8)], optimizer=optimizer, weights_dtype="int8", **kw)


def test_bad_int8_calls_raise():
    emb = make(FEW[0] if FEW else FUSED[0])
    with pytest.raises(ValueError, match=r"table 1 takes a float tensor of shape \[20, 5\]"):
        emb.load_table_weights(1, torch.zeros(20, 6))
    with pytest.raises(ValueError, match="table must be from 0 to 2"):
        emb.load_table_weights(3, torch.zeros(20, 5))
    with pytest.raises(TypeError, match="split_int8_rows"):
        TableBatchedEmbeddingBags([(4, 3)], optimizer=emb.spec).split_int8_rows()
    with pytest.raises(RuntimeError, match=r"out of range"):
        emb(torch.tensor([30]), torch.tensor([0, 1, 1, 1, 1]))
    # the operator checks that an int8 buffer holds every row's qparams
    ops = emb._ops  # (the build this process loaded: CPU-only, or CPU + CUDA on a GPU machine)
    short = emb.weights[: emb.layout.weights_numel]  # codes' worth of bytes only
    with pytest.raises(RuntimeError, match=r"does not fit in the weights buffer .*int8 rows"):
        ops.forward(short, emb.features, emb.layout.total_D, emb.layout.max_D, torch.tensor([0]),
                    torch.tensor([0, 1, 1, 1, 1]), None, 0, None, False)
    # int8 weights are uint8; a signed int8 buffer is no weights buffer
    with pytest.raises(RuntimeError, match=r"weights must be float32, float16, bfloat16 or uint8 \(int8 rows\)"):
        ops.forward(emb.weights.view(torch.int8), emb.features, emb.layout.total_D, emb.layout.max_D,
                    torch.tensor([0]), torch.tensor([0, 1, 1, 1, 1]), None, 0, None, False)


# ---- CUDA -----------------------------------------------------------------------------------------

cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("name", FEW)
@pytest.mark.parametrize("pooling,weighted,hot,seg", [("sum", False, 3, 32), ("mean", True, 300, 4)])
def test_cuda_one_step_equals_dequantize_reference_requantize(name, pooling, weighted, hot, seg):
    """hot 300 with max_segment_length_per_warp 4: the hot row goes through the segment and finish
    kernels (several segments); the rest through the warp kernel."""
    emb = make(name, device="cuda", pooling=pooling, max_segment_length_per_warp=seg)
    gen = torch.Generator().manual_seed(31)
    check_step(emb, random_batch(emb, 6, gen, weighted=weighted, hot=hot), 6, gen, device="cuda")


@cuda
@pytest.mark.parametrize("name", FEW)
def test_cuda_equals_cpu(name):
    """Same seed, same batches: the initial rows are bitwise equal; after each step the forward
    agrees to float32 rounding and the rows to one quantization step (an update that lands near
    a rounding boundary may round to neighbouring codes on the two devices)."""
    tables = ((300, 64), (200, 33), (50, 1000))
    cpu = make(name, tables=tables, ftm=(0, 1, 2, 0))
    gpu = make(name, device="cuda", tables=tables, ftm=(0, 1, 2, 0))
    assert torch.equal(cpu.weights, gpu.weights.cpu())
    gen = torch.Generator().manual_seed(41)
    for _ in range(3):
        batch = random_batch(cpu, 16, gen, weighted=True, hot=40)
        out_c = cpu(*on(batch, "cpu"))
        out_g = gpu(*on(batch, "cuda"))
        torch.testing.assert_close(out_g.detach().cpu(), out_c.detach(), rtol=1e-4, atol=1e-4)
        g = torch.randn(out_c.shape, generator=gen)
        out_c.backward(g)
        out_g.backward(g.cuda())
        gpu.check_errors()
        for rc, rg in zip(cpu.split_int8_rows(), gpu.split_int8_rows()):
            wc, wg = int8.dequantize_rows(rc, torch.float64), int8.dequantize_rows(rg.cpu(), torch.float64)
            steps = torch.maximum(int8.qparams(rc)[0], int8.qparams(rg.cpu())[0]).double()[:, None]
            # (one code apart at most, plus the qparams' own float32 rounding differences)
            assert ((wc - wg).abs() <= steps * 1.01 + 1e-5).all()
        # resynchronise, so that the next step compares one step's update again
        gpu.load_state_dict(cpu.state_dict())


@cuda
def test_cuda_update_is_bitwise_deterministic():
    name = "adam" if "adam" in ALL else FUSED[0]
    results = []
    for _ in range(2):
        emb = make(name, device="cuda", tables=((400, 33), (300, 16), (20, 1000)), ftm=None, max_segment_length_per_warp=8)
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            batch = random_batch(emb, 64, gen, weighted=True, hot=200)
            out = emb(*on(batch, "cuda"))
            out.backward(torch.randn(out.shape, generator=gen).cuda())
        results.append(emb.weights.cpu())
    assert torch.equal(results[0], results[1])


@cuda
def test_cuda_managed_placement_trains_like_device():
    name = FEW[0] if FEW else FUSED[0]
    dev = make(name, device="cuda")
    man = make(name, device="cuda", placements="managed")
    gen = torch.Generator().manual_seed(5)
    batch = random_batch(dev, 8, gen, weighted=True)
    g = torch.randn(8, dev.layout.total_D, generator=gen).cuda()
    for emb in (dev, man):
        emb(*on(batch, "cuda")).backward(g)
    assert torch.equal(dev.weights.cpu(), man.weights.cpu())
