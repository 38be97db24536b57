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

import io
import warnings

import pytest
import torch

from tbegen import TableBatchedEmbeddingBags, harness, int8
from tbegen.layout import make_layout
from tbegen.spec import load_spec

from conftest import SPECS

HAS_CUDA = torch.cuda.is_available()
ALL = {name: load_spec(str(path)) for name, path in SPECS.items()}
# every fused optimizer takes int8 rows (the dense-gradient mode is refused: below)
FUSED = sorted(n for n, s in ALL.items() if not s.dense_gradient)
# a few for the slower variants (where TBEGEN_TEST_OPTIMIZERS leaves them)
FEW = [n for n in ("sgd", "rowwise_adagrad", "adam", "lamb") if n in ALL]
# the fallback where it leaves none of them: an optimizer without whole-table stages (the cached
# tests need one: whole-table stages and managed_caching tables do not go together)
PLAIN = FEW or sorted(n for n in FUSED if not ALL[n].table_stages)


def plain(k: int = 0) -> str:
    """PLAIN[k] (or its last), or the test is skipped when TBEGEN_TEST_OPTIMIZERS leaves none."""
    if not PLAIN:
        pytest.skip("TBEGEN_TEST_OPTIMIZERS leaves no optimizer without whole-table stages")
    return PLAIN[min(k, len(PLAIN) - 1)]
# odd widths, a column offset that is not a multiple of 4, a shared table (feature 3 reads table 0)
TABLES = ((30, 8), (20, 5), (12, 33))
FTM = (0, 1, 2, 0)
# even widths (emainplace pairs column j with j + D/2), two of them 2 mod 4
EVEN_TABLES = ((30, 8), (20, 6), (12, 34))


@pytest.fixture(scope="module", autouse=True)
def _extensions(prebuilt):
    return prebuilt


def hyper_for(spec):
    """The spec's defaults, with a learning rate large enough to move codes in one step."""
    hyper = harness.default_hyperparameters(spec, {})
    if "learning_rate" in hyper:
        hyper["learning_rate"] = 0.3
    return hyper


def make(name, device="cpu", tables=None, ftm=FTM, pooling="sum", seed=5, **kw):
    spec = ALL[name]
    if tables is None:  # (a spec that pairs columns j and j + D/2 needs even widths)
        tables = EVEN_TABLES if spec.table_pairs else TABLES
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
    emb = make("sgd") if "sgd" in ALL else make(plain())
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
    name = plain()
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


def assert_requantized(t, after, r, what="updated"):
    """The int8 rows `after` (uint8 [n, D + 8]) are the float64 rows `r` quantized, up to the float32
    rounding of the update: fresh qparams from each row's min and max, codes at most one apart from
    the reference's (95% identical), every element within one quantization step of `r`."""
    D = r.size(1)
    scale, bias = int8.qparams(after)
    lo, hi = r.min(1).values, r.max(1).values
    # fresh qparams from the updated row: bias its min, scale (max - min) / 255 (to float32 rounding
    # of the update: 1e-5 of the row's magnitude)
    mag = r.abs().max(1).values + 1e-30
    assert ((bias.double() - lo).abs() <= 1e-5 * mag).all(), f"table {t}: bias is not the {what} row's min"
    assert ((scale.double() - (hi - lo) / 255).abs() <= 1e-5 * mag / 255 + 1e-5 * scale.double()).all(), \
        f"table {t}: scale is not the {what} row's range / 255"
    # the codes are the reference row quantized (round to nearest even): up to float32 rounding
    # of the update, which can move a value across a rounding boundary, by one code at most
    codes, ref_codes = after[:, :D].int(), int8.quantize_rows(r.float())[:, :D].int()
    assert (codes - ref_codes).abs().max() <= 1, f"table {t}: a code is more than one from the reference's"
    assert (codes == ref_codes).double().mean() >= 0.95, f"table {t}: codes differ from the reference's"
    # every element within one quantization step of the reference's updated value
    err = (int8.dequantize_rows(after, torch.float64) - r).abs()
    step_size = scale.double()[:, None] * (1 + 1e-4) + 1e-6 * mag[:, None]
    assert (err <= step_size).all(), (
        f"table {t}: {int((err > step_size).sum())} element(s) further than one quantization step from the "
        f"reference (worst {float((err / step_size).max()):.3f} steps)")


def assert_states_close(spec, after_states, ref_states):
    for s in spec.states + spec.table_states:
        a, r = after_states[s.name], ref_states[s.name]
        if a.dtype == torch.int64:
            assert torch.equal(a, r.to(torch.int64)), f"state {s.name}"
        else:
            torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-6 * (1 + float(r.abs().max())),
                                       msg=lambda m: f"state {s.name}: {m}")


def check_step(emb, batch, B, gen, device="cpu"):
    """One step of `emb` against dequantize -> the spec's reference -> quantize (float64). (Its
    whole-table stages, if any run at this step, must have run already: check_table_stages.)"""
    spec, layout = emb.spec, emb.layout
    rows_before = [r.cpu().clone() for r in emb.split_int8_rows()]
    w = dequantized_flat(emb)
    states = states_of(emb)
    step = emb.step + 1
    out = emb(*on(batch, device))
    assert not emb.run_table_stages(), "check_step: the step's whole-table stages ran in its forward"
    g = torch.randn(out.shape, generator=gen)
    out.backward(g.to(device))
    hyper = emb.hyperparameters
    ref_w, ref_states, touched = harness.reference_step(spec, layout, B, emb.pooling, w, states, batch, g, hyper, step)
    rows_after = [r.cpu() for r in emb.split_int8_rows()]
    for t, (E, D) in enumerate(layout.tables):
        base = layout.table_offsets[t]
        ref = ref_w[base : base + E * D].view(E, D)
        hit = touched[base : base + E * D].view(E, D).any(1)
        after = rows_after[t]
        # rows not in the batch: bitwise unchanged, codes and qparams
        assert torch.equal(after[~hit], rows_before[t][~hit]), f"table {t}: an untouched row changed"
        if hit.any():
            assert_requantized(t, after[hit], ref[hit])
    assert_states_close(spec, states_of(emb), ref_states)


def check_table_stages(emb, device="cpu") -> bool:
    """The whole-table stages of the next step (run_table_stages, as the next forward would run
    them) against dequantize -> the spec's `table_reference` -> quantize (float64): every row the
    reference changes is quantized again; the others keep their bytes. Whether a stage ran."""
    spec, layout = emb.spec, emb.layout
    rows_before = [r.cpu().clone() for r in emb.split_int8_rows()]
    w = dequantized_flat(emb)
    states = states_of(emb)
    step = emb.step + 1
    if not emb.run_table_stages():
        return False
    ref_w, ref_states = harness.reference_table_step(spec, layout, w, states, emb.hyperparameters, step)
    rows_after = [r.cpu() for r in emb.split_int8_rows()]
    for t, (E, D) in enumerate(layout.tables):
        base = layout.table_offsets[t]
        ref = ref_w[base : base + E * D].view(E, D)
        moved = (ref != w[base : base + E * D].view(E, D)).any(1)
        assert torch.equal(rows_after[t][~moved], rows_before[t][~moved]), \
            f"table {t}: a row that the whole-table stages leave unchanged changed"
        if moved.any():
            assert_requantized(t, rows_after[t][moved], ref[moved], what="whole-table stages'")
    assert_states_close(spec, states_of(emb), ref_states)
    return True


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("mean", True)])
def test_one_step_equals_dequantize_reference_requantize(name, pooling, weighted):
    emb = make(name, pooling=pooling)
    gen = torch.Generator().manual_seed(21)
    check_step(emb, random_batch(emb, 6, gen, weighted=weighted, hot=3), 6, gen)


# ---- whole-table stages (`table:`) on int8 rows ------------------------------------------------------

# (optimizer, hyperparameters, tables): each case's stages run at every step of the test
TABLE_STAGE_CASES = [
    c for c in [
        ("emainplace_rowwise_adagrad", dict(step_ema=1, step_start=0, step_ema_coef=0.25), EVEN_TABLES),
        ("emainplace_rowwise_adagrad", dict(step_ema=1, step_start=2, step_ema_coef=1.0, max_norm=0.3), EVEN_TABLES),
        # averaging at every step (which leaves the weights alone: rows keep their bytes), the
        # average swapped into the weights at every second one
        ("ensemble_rowwise_adagrad", dict(step_ema=1, step_swap=2, step_start=0, step_ema_coef=0.6), TABLES),
        ("ensemble_rowwise_adagrad", dict(step_ema=1, step_swap=1, step_start=1, step_ema_coef=0.25, step_mode=0),
         TABLES),
        # a reduce stage only (max_counter from the per-row counters; it reads no weights, and
        # leaves the int8 rows alone)
        ("rowwise_adagrad_with_counter", dict(max_counter_update_freq=1), TABLES),
    ] if c[0] in ALL
]


@pytest.mark.parametrize("name,hyper,tables", TABLE_STAGE_CASES,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(TABLE_STAGE_CASES)])
def test_table_stages_and_step_equal_dequantize_reference_requantize(name, hyper, tables):
    """Three steps, each: the whole-table stages against the float64 `table_reference` of the
    dequantized rows, quantized; then the fused step against the float64 `reference`, quantized."""
    emb = make(name, tables=tables, **hyper)
    gen = torch.Generator().manual_seed(23)
    ran = []
    for _ in range(3):
        ran.append(check_table_stages(emb))
        check_step(emb, random_batch(emb, 6, gen, weighted=True, hot=3), 6, gen)
    assert ran[1:] == [True, True], f"the whole-table stages ran at steps {ran} only"  # (step_start 2: not at 1)


def test_table_stages_keep_unchanged_rows_and_change_the_others():
    """ensemble_rowwise_adagrad at a step that only averages: the weights keep every byte; at a
    step that swaps the average in, rows change (and are valid int8 rows of the average)."""
    if "ensemble_rowwise_adagrad" not in ALL:
        pytest.skip("TBEGEN_TEST_OPTIMIZERS leaves out ensemble_rowwise_adagrad")
    emb = make("ensemble_rowwise_adagrad", step_ema=1, step_swap=2, step_start=0, step_ema_coef=0.5)
    before = emb.weights.clone()
    assert emb.run_table_stages()  # step 1: averages only
    assert torch.equal(emb.weights, before)
    ema = emb.optimizer_state("sparse_ema")
    assert ema.abs().sum() > 0
    gen = torch.Generator().manual_seed(4)
    batch = random_batch(emb, 4, gen)
    out = emb(batch.indices, batch.offsets)
    out.backward(torch.randn(out.shape, generator=gen))  # (step 1's update)
    assert emb.run_table_stages()  # step 2: averages, then swaps the average in
    assert not torch.equal(emb.weights, before)
    ema = emb.optimizer_state("sparse_ema")
    for t, (E, D) in enumerate(TABLES):
        off = emb.layout.table_offsets[t]
        ref = ema[off : off + E * D].view(E, D).double()
        assert_requantized(t, emb.split_int8_rows()[t], ref, what="swapped")


@pytest.mark.parametrize("name,hyper,width", [("adam", {}, 33), ("emainplace_rowwise_adagrad", dict(step_ema=1), 34)])
def test_update_is_bitwise_deterministic_across_runs_and_threads(name, hyper, width):
    if name not in ALL:
        pytest.skip(f"TBEGEN_TEST_OPTIMIZERS leaves out {name}")
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, max(2, threads), 1):
            torch.set_num_threads(n)
            emb = make(name, tables=((400, width), (300, 16)), ftm=None, **hyper)
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
    name = "rowwise_adagrad" if "rowwise_adagrad" in ALL else plain()
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
    emb = make(plain())
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
    spec = next(ALL[n] for n in FUSED if not ALL[n].table_pairs)
    for dt in ("int8", "uint8", torch.int8, torch.uint8):
        emb = TableBatchedEmbeddingBags([(4, 3)], optimizer=spec, weights_dtype=dt)
        assert emb.weights_dtype == torch.uint8 and emb.weights.numel() == 4 * (3 + 8)
    with pytest.raises(ValueError, match=r"weights_dtype must be .*\"int8\""):
        TableBatchedEmbeddingBags([(4, 3)], optimizer=spec, weights_dtype=torch.int16)
    with pytest.raises(ValueError, match="output_dtype must be"):
        TableBatchedEmbeddingBags([(4, 3)], optimizer=spec, weights_dtype="int8", output_dtype="int8")


@pytest.mark.parametrize("optimizer,kw,error,message", [
    # the dense-gradient mode: no update after which to re-quantize, and a float gradient to hold
    ("none", {}, NotImplementedError,
     r"optimizer 'none' \(dense-gradient mode\) cannot take int8 rows: it applies no update of its own, so "
     r"there is no step after which to re-quantize the rows, and the weights are an autograd parameter"),
    # (these two are refused whatever the weights dtype; int8 rows change nothing about it)
    ("emainplace_rowwise_adagrad", dict(tables=[(10, 4), (10, 5)]), ValueError,
     r"needs an even dim; table\(s\) \[1\] have dims \[5\]"),
    ("ensemble_rowwise_adagrad", dict(placements=["device", "managed_caching"]), NotImplementedError,
     r"whole-table stages, which managed_caching tables do not support yet"),
])
def test_unsupported_combinations_are_refused(optimizer, kw, error, message):
    if optimizer not in ALL:
        pytest.skip(f"TBEGEN_TEST_OPTIMIZERS leaves out {optimizer}")
    tables = kw.pop("tables", [(10, 4), (10, 8)])
    with pytest.raises(error, match=message):
        TableBatchedEmbeddingBags(tables, optimizer=optimizer, weights_dtype="int8", **kw)


@pytest.mark.parametrize("name", [n for n in ("emainplace_rowwise_adagrad", "ensemble_rowwise_adagrad") if n in ALL])
def test_bad_int8_table_update_calls_raise(name):
    """The whole-table stages' operator checks an int8 buffer as the forward does: every row's
    qparams must fit, and int8 rows are uint8 (a signed int8 tensor is no weights buffer)."""
    emb = make(name, tables=EVEN_TABLES, step_ema=1)
    states = [getattr(emb.states, s.name) for s in emb.spec.states]
    hyper = [emb.hyperparameters[h.name] for h in emb.spec.hyperparameters]

    def call(weights):
        return emb._ops.table_update(weights, emb.features, emb.layout.total_hash_size, False, 0, *states, *hyper, 1)

    # codes' worth of bytes only: the tables do not fit (with per-element states, whose size the
    # operator derives from the buffer's, the states' check says it first)
    short = r"does not fit in the weights buffer of \d+ elements \(int8 rows: D \+ 8 bytes"
    if any(s.per == "element" for s in emb.spec.states):
        short = r"must have \d+ elements \(one per weight element\)"
    with pytest.raises(RuntimeError, match=short):
        call(emb.weights[: emb.layout.weights_numel])
    with pytest.raises(RuntimeError, match=r"weights must be float32, float16, bfloat16 or uint8 \(int8 rows\), got"):
        call(emb.weights.view(torch.int8))
    assert call(emb.weights)  # (the same call with the module's own buffer runs)


def test_bad_int8_calls_raise():
    emb = make(plain())
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


# ---- managed_caching tables of int8 rows ------------------------------------------------------------
#
# The cache logic is torch operations on the module's device, so the CPU runs all of it: rows
# (codes and qparams, D + 8 bytes) loaded into slots, evicted, written back, read in the backing
# store when a batch overflows a cache. An int8 row's update depends on nothing but its values
# (no key-dependent random bits: int8 rows round to nearest), so cached training must be bitwise
# that of device placement.

CACHE_TABLES = ((40, 8), (25, 5), (16, 33))
CACHE_PLACEMENTS = ["managed_caching", "device", "managed_caching"]
# a cached table that is "compact" (its slots packed after every table) beside a "direct" one
# (slots continuing its rows): tbegen/cache.py
COMPACT_TABLES = ((40, 64), (2000, 4), (16, 4))


def int8_data(emb, steps, B, seed, max_L=3, device="cpu"):
    """`steps` batches for `emb`'s features, each with its output gradient: (indices, offsets, psw, grad)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        batch = random_batch(emb, B, gen, max_L=max_L, weighted=True)
        grad = torch.randn(B, emb.layout.total_D, generator=gen)
        out.append((*on(batch, device), grad.to(device)))
    return out


def train_int8(emb, data, other=None, prefetch=False):
    """Trains `emb` on `data` (prefetching each next batch between a forward and its backward);
    with `other`, trains it alongside, the forward outputs bitwise equal at every step."""
    for k, (idx, offsets, psw, grad) in enumerate(data):
        out = emb(idx, offsets, psw)
        if other is not None:
            out_other = other(idx, offsets, psw)
            assert torch.equal(out, out_other), f"step {k + 1}: the forwards differ"
            out_other.backward(grad)
        if prefetch and k + 1 < len(data):
            emb.prefetch(data[k + 1][0], data[k + 1][1])
        out.backward(grad)
    return emb


def assert_same_int8_training(a, b):
    """Every int8 row (codes and qparams) and every state bitwise equal (caches written back first)."""
    for t, (x, y) in enumerate(zip(a.split_int8_rows(), b.split_int8_rows())):
        assert torch.equal(x.cpu(), y.cpu()), f"table {t}: the rows differ"
    for s in a.spec.states:
        assert torch.equal(a.optimizer_state(s.name).cpu(), b.optimizer_state(s.name).cpu()), f"state {s.name}"
    assert a.step == b.step


@pytest.mark.parametrize("name,algorithm,ftm,prefetch", [
    ("sgd", "lru", None, False),
    ("rowwise_adagrad", "lfu", FTM, False),   # a per-row state moves with its row; a shared cached table
    ("adam", "lru", None, True),              # per-element states move with their row; prefetching ahead
])
def test_cached_int8_tables_train_bitwise_like_device(name, algorithm, ftm, prefetch):
    if name not in ALL:
        pytest.skip(f"TBEGEN_TEST_OPTIMIZERS leaves out {name}")
    device = make(name, tables=CACHE_TABLES, ftm=ftm)
    # 12 slots for 40 and 16 rows, a batch reading up to 12 (18 with the shared table) rows of each:
    # evictions every batch
    cached = make(name, tables=CACHE_TABLES, ftm=ftm, placements=CACHE_PLACEMENTS, cache_rows=12,
                  cache_algorithm=algorithm)
    assert torch.equal(device.weights, cached.weights)
    data = int8_data(device, 8, B=4, seed=17)
    train_int8(cached, data, other=device, prefetch=prefetch)
    stats = cached.cache_stats()
    assert stats["evictions"] > 0 and stats["rows_written_back"] > 0 and 0 < stats["hits"] < stats["lookups"]
    # (a row moves with its codes and qparams: D + 8 bytes, besides its states)
    state_bytes = [sum(D * 4 if s.per == "element" else 4 for s in device.spec.states) for _, D in CACHE_TABLES]
    assert cached._cache.row_bytes == [D + 8 + state_bytes[t] for t, (_, D) in enumerate(CACHE_TABLES) if t != 1]
    assert_same_int8_training(device, cached)


@pytest.mark.parametrize("tables", [CACHE_TABLES, COMPACT_TABLES])
def test_cached_int8_batches_larger_than_the_cache(tables):
    """Batches with more distinct rows of a table than its cache holds: a direct table reads the
    rows that do not fit in its backing store, a compact one is written back and bypassed; the same
    bits as device placement either way, alternating with batches that fit."""
    name = plain(1)
    device = make(name, tables=tables, ftm=None)
    cached = make(name, tables=tables, ftm=None, placements=CACHE_PLACEMENTS, cache_rows=12)
    small = int8_data(device, 4, B=3, seed=19)
    large = int8_data(device, 3, B=8, max_L=6, seed=20)  # up to 48 distinct rows: more than 12 slots
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the bypass warning: test_cache.py checks it)
        train_int8(cached, [small[0], large[0], small[1], large[1], small[2], large[2], small[3]], other=device)
    stats = cached.cache_stats()
    assert stats["backing_lookups"] > 0 and stats["hits"] > 0
    assert (stats["bypasses"] > 0) == (not all(stats["direct"].values()))
    assert_same_int8_training(device, cached)


def saved_with_dirty_rows_continues_elsewhere(name, kw, cache_kw, cached, data, split, seed):
    """Trains the cached module `cached` on data[:split], saves its state_dict with dirty cached
    rows (state_dict writes them back), loads it into a fresh device-placed module and a fresh
    cached one (made with `seed`), and checks that each then trains on data[split:] bitwise as
    one module trained on all of `data`. Returns (the saved state_dict's buffer, that module)."""
    train_int8(cached, data[:split])
    assert cached.cache_stats()["dirty_rows"] > 0  # (no flush before saving: state_dict does it)
    buf = io.BytesIO()
    torch.save(cached.state_dict(), buf)
    reference = train_int8(make(name, **kw), data)
    for target in (make(name, seed=seed, **kw), make(name, seed=seed, **cache_kw, **kw)):
        buf.seek(0)
        target.load_state_dict(torch.load(buf))
        assert_same_int8_training(reference, train_int8(target, data[split:]))
    return buf, reference


def test_cached_int8_state_dict_round_trip_with_dirty_rows():
    """state_dict of a cached int8 module with dirty cached rows (written back first): loaded into
    a device-placed and into a cached module, training continues bitwise as without the round
    trip; loading into a cached module with dirty rows of its own: the loaded rows win."""
    name = plain(1)
    kw = dict(tables=CACHE_TABLES, ftm=FTM)
    cached = make(name, placements=CACHE_PLACEMENTS, cache_rows=12, **kw)
    data = int8_data(cached, 6, B=3, seed=27)
    buf, reference = saved_with_dirty_rows_continues_elsewhere(
        name, kw, dict(placements=CACHE_PLACEMENTS, cache_rows=12), cached, data, 3, seed=9)
    stale = train_int8(make(name, seed=4, placements=CACHE_PLACEMENTS, cache_rows=12, **kw), data[3:])
    assert stale.cache_stats()["dirty_rows"] > 0
    buf.seek(0)
    stale.load_state_dict(torch.load(buf))
    assert_same_int8_training(reference, train_int8(stale, data[3:]))
    assert_same_int8_training(reference, train_int8(cached, data[3:]))


def test_cached_int8_rows_read_and_written_through_the_views():
    """split_int8_rows and load_table_weights see and set every row of a cached table: the
    caches are written back and emptied first, so a write is what the next batch reads."""
    name = plain()
    emb = make(name, tables=CACHE_TABLES, ftm=None, placements=CACHE_PLACEMENTS, cache_rows=12)
    train_int8(emb, int8_data(emb, 2, B=3, seed=31))
    assert emb.cache_stats()["resident_rows"] > 0
    rows = emb.split_int8_rows()[0]  # (written back and emptied)
    assert emb.cache_stats()["resident_rows"] == 0
    rows[5].copy_(int8.quantize_rows(torch.full((1, 8), 0.5))[0])
    out = emb(torch.tensor([5]), torch.tensor([0, 1, 1, 1]))
    assert torch.equal(out[0, :8], torch.full((8,), 0.5))
    values = torch.randn(16, 33)
    emb.load_table_weights(2, values)
    assert torch.equal(emb.split_int8_rows()[2], int8.quantize_rows(values))


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
    name = "adam" if "adam" in ALL else plain()
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
    name = plain()
    dev = make(name, device="cuda")
    man = make(name, device="cuda", placements="managed")
    gen = torch.Generator().manual_seed(5)
    batch = random_batch(dev, 8, gen, weighted=True)
    g = torch.randn(8, dev.layout.total_D, generator=gen).cuda()
    for emb in (dev, man):
        emb(*on(batch, "cuda")).backward(g)
    assert torch.equal(dev.weights.cpu(), man.weights.cpu())


@cuda
@pytest.mark.parametrize("name,hyper,tables", TABLE_STAGE_CASES,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(TABLE_STAGE_CASES)])
def test_cuda_table_stages_and_step_equal_dequantize_reference_requantize(name, hyper, tables):
    """The whole-table stages' int8 kernel (a warp per row) and the fused step on the GPU, each
    against its float64 reference, quantized (as the CPU test)."""
    emb = make(name, device="cuda", tables=tables, **hyper)
    gen = torch.Generator().manual_seed(23)
    ran = []
    for _ in range(3):
        ran.append(check_table_stages(emb, device="cuda"))
        check_step(emb, random_batch(emb, 6, gen, weighted=True, hot=3), 6, gen, device="cuda")
    assert ran[1:] == [True, True], f"the whole-table stages ran at steps {ran} only"


@cuda
@pytest.mark.parametrize("name,hyper", [(n, h) for n, h, _ in TABLE_STAGE_CASES[::2]])
def test_cuda_table_stages_equal_cpu(name, hyper):
    """CPU and GPU modules from the same rows, stages of one step: rows within one quantization
    step of each other (the stage's float32 arithmetic may round differently near a code
    boundary), states to float32 rounding; wide rows (D = 1000: 8 warps a block, 32 columns a
    lane)."""
    tables = ((300, 64), (200, 34), (50, 1000))
    cpu = make(name, tables=tables, ftm=None, **hyper)
    gpu = make(name, device="cuda", tables=tables, ftm=None, **hyper)
    gen = torch.Generator().manual_seed(43)
    for _ in range(3):
        assert cpu.run_table_stages() and gpu.run_table_stages()
        for rc, rg in zip(cpu.split_int8_rows(), gpu.split_int8_rows()):
            rg = rg.cpu()
            wc, wg = int8.dequantize_rows(rc, torch.float64), int8.dequantize_rows(rg, torch.float64)
            steps = torch.maximum(int8.qparams(rc)[0], int8.qparams(rg)[0]).double()[:, None]
            assert ((wc - wg).abs() <= steps * 1.01 + 1e-5).all()
        for s in cpu.spec.states:
            torch.testing.assert_close(gpu.optimizer_state(s.name).cpu(), cpu.optimizer_state(s.name), rtol=1e-5, atol=1e-6)
        batch = random_batch(cpu, 16, gen, weighted=True)
        g = torch.randn(16, cpu.layout.total_D, generator=gen)
        cpu(*on(batch, "cpu")).backward(g)
        gpu(*on(batch, "cuda")).backward(g.cuda())
        gpu.load_state_dict(cpu.state_dict())  # (resynchronised: each step compares one step's stages)


@cuda
def test_cuda_table_stages_are_bitwise_deterministic():
    name = next((n for n, _, _ in TABLE_STAGE_CASES), None)
    if name is None:
        pytest.skip("TBEGEN_TEST_OPTIMIZERS leaves out the optimizers with whole-table stages")
    hyper = TABLE_STAGE_CASES[0][1]
    results = []
    for _ in range(2):
        emb = make(name, device="cuda", tables=((4000, 34), (300, 512)), ftm=None, **hyper)
        train_int8(emb, int8_data(emb, 3, B=64, seed=7, device="cuda"))
        results.append((emb.weights.cpu(), states_of(emb)))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(results[0][1][k], results[1][1][k]) for k in results[0][1])


# cached tables in managed memory, a device table, a managed one; rows of 2 mod 4 and odd widths
CUDA_CACHE_TABLES = ((4096, 128), (3000, 66), (2048, 33), (1000, 32))
CUDA_CACHE_PLACEMENTS = ["managed_caching", "device", "managed", "managed_caching"]


@cuda
@pytest.mark.parametrize("name,algorithm,prefetch", [(n, a, p) for n, a, p in
                                                      [("sgd", "lru", False), ("rowwise_adagrad", "lfu", True),
                                                       ("adam", "lru", True)] if n in ALL])
def test_cuda_cached_int8_tables_train_bitwise_like_device(name, algorithm, prefetch):
    """int8 rows in managed_caching tables on the GPU: bitwise the training of device placement
    (the kernels read and update the slots' rows as device rows; codes and qparams move together),
    with evictions, write-backs and, with prefetching ahead, rows loaded between a batch's
    forward and backward."""
    kw = dict(tables=CUDA_CACHE_TABLES, ftm=None, device="cuda")
    device = make(name, **kw)
    cached = make(name, placements=CUDA_CACHE_PLACEMENTS, cache_rows=1000, cache_algorithm=algorithm, **kw)
    # 64 bags of up to 8 rows per feature: at most 512 distinct rows of a table per batch
    data = int8_data(device, 6, B=64, max_L=8, seed=3, device="cuda")
    train_int8(cached, data, other=device, prefetch=prefetch)
    torch.cuda.synchronize()
    stats = cached.cache_stats()
    assert stats["evictions"] > 0 and stats["rows_written_back"] > 0 and 0 < stats["hit_rate"] < 1
    assert_same_int8_training(device, cached)


@cuda
def test_cuda_cached_int8_state_dict_round_trip_with_dirty_rows():
    name = plain(1)
    kw = dict(tables=CUDA_CACHE_TABLES, ftm=None, device="cuda")
    cached = make(name, placements=CUDA_CACHE_PLACEMENTS, cache_rows=600, **kw)
    data = int8_data(cached, 5, B=32, max_L=4, seed=5, device="cuda")
    _, reference = saved_with_dirty_rows_continues_elsewhere(
        name, kw, dict(placements=CUDA_CACHE_PLACEMENTS, cache_rows=600), cached, data, 2, seed=3)
    # and the module itself, moved to the CPU and back (its cache written back and rebuilt)
    cached.cpu()
    cached.cuda()
    assert_same_int8_training(reference, train_int8(cached, data[2:]))
