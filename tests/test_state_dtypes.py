"""Per-state storage dtype (docs/spec-language.md, `dtype` on a state; the module's
`state_dtypes`): fp16/bf16 storage, float32 arithmetic, stochastic rounding on store.

The numerical grid (tests/test_numerics.py) already runs every optimizer with all its states bf16
and with all of them fp16 against the float64 reference; this file checks the module's interface,
determinism, and that the rounding is stochastic (unbiased) rather than to nearest."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from tbegen import harness
from tbegen.module import TableBatchedEmbeddingBags, _check_state_dtypes
from tbegen.spec import load_spec, load_spec_text

from conftest import SPECS

TABLES = [(40, 8), (25, 12)]


def _batch(seed, tables=TABLES, B=6, L=3):
    g = torch.Generator().manual_seed(seed)
    idx = torch.cat([torch.randint(0, E, (B * L,), generator=g) for E, _ in tables])
    offsets = torch.arange(0, len(tables) * B * L + 1, L)
    return idx, offsets


def _train(module, steps=3, seed=0):
    for s in range(steps):
        idx, off = _batch(seed + s)
        out = module(idx, off)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + s)))


@pytest.mark.parametrize("name,state", [("rowwise_adagrad", "momentum"), ("adam", "exp_avg_sq")])
def test_override_is_stored_and_exported(name, state):
    m = TableBatchedEmbeddingBags(TABLES, optimizer=name, state_dtypes={state: torch.bfloat16})
    spec = load_spec(str(SPECS[name]))
    for s in spec.states:
        want = torch.bfloat16 if s.name == state else torch.float32
        assert m.optimizer_state(s.name).dtype == want
        assert m.state_dict()[f"states.{s.name}"].dtype == want
        assert all(t[s.name].dtype == want for t in m.split_optimizer_states())
    assert m.get_extra_state()["state_dtypes"][state] == "bfloat16"
    _train(m)
    assert m.optimizer_state(state).dtype == torch.bfloat16
    assert torch.isfinite(m.optimizer_state(state).float()).all()


def test_narrow_states_are_deterministic_and_close_to_float32():
    kw = dict(optimizer="adam", seed=3, learning_rate=0.05)
    a = TableBatchedEmbeddingBags(TABLES, state_dtypes={"exp_avg": "bf16", "exp_avg_sq": "bf16"}, **kw)
    b = TableBatchedEmbeddingBags(TABLES, state_dtypes={"exp_avg": "bf16", "exp_avg_sq": "bf16"}, **kw)
    f = TableBatchedEmbeddingBags(TABLES, **kw)
    for m in (a, b, f):
        _train(m, steps=4)
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(a.optimizer_state(k), b.optimizer_state(k))  # bitwise, run to run
        ref = f.optimizer_state(k)
        # bf16 keeps 8 bits: after 4 steps within a few ulps of the float32 run
        assert (a.optimizer_state(k).float() - ref).abs().max() <= 0.03 * ref.abs().max()
    assert torch.equal(a.weights, b.weights)


def test_stochastic_rounding_is_unbiased():
    """A bf16 accumulator of 256 (ulp 2) gains ~0.05 per step: rounded to nearest it would never
    move; stochastically rounded, its average over many rows tracks the float32 accumulator."""
    tables = [(4000, 4)]
    kw = dict(optimizer="rowwise_adagrad", learning_rate=0.0, seed=1)
    narrow = TableBatchedEmbeddingBags(tables, state_dtypes={"momentum": torch.bfloat16}, **kw)
    wide = TableBatchedEmbeddingBags(tables, **kw)
    for m in (narrow, wide):
        m.optimizer_state("momentum").fill_(256.0)
    idx = torch.arange(4000)
    off = torch.arange(0, 4001)
    for step in range(40):
        go = torch.full((4000, 4), 0.22)
        for m in (narrow, wide):
            m(idx, off).backward(go)
    gained_wide = (wide.optimizer_state("momentum") - 256).mean().item()
    gained_narrow = (narrow.optimizer_state("momentum").float() - 256).mean().item()
    assert gained_wide == pytest.approx(40 * 0.22 * 0.22, rel=1e-3)
    # the mean of 4000 rows' rounding noise has a standard deviation of about 0.031 (measured over
    # seeds 1-5: 1.90-1.99); 0.155 is five of them. Rounding to nearest would gain 0.
    assert gained_narrow == pytest.approx(gained_wide, abs=0.155)
    # and the rows did not all round the same way (the bits differ per row)
    assert len(torch.unique(narrow.optimizer_state("momentum"))) > 1


def test_bad_state_dtypes_are_refused():
    with pytest.raises(ValueError, match=r"state_dtypes names 'momentm', but optimizer 'rowwise_adagrad' has the states \['momentum'\]"):
        TableBatchedEmbeddingBags(TABLES, optimizer="rowwise_adagrad", state_dtypes={"momentm": torch.bfloat16})
    with pytest.raises(ValueError, match=r"state_dtypes\['momentum'\] must be torch.float32, torch.float16 or torch.bfloat16"):
        TableBatchedEmbeddingBags(TABLES, optimizer="rowwise_adagrad", state_dtypes={"momentum": torch.int8})
    with pytest.raises(TypeError, match="state_dtypes must be a dict"):
        TableBatchedEmbeddingBags(TABLES, optimizer="rowwise_adagrad", state_dtypes=[torch.bfloat16])


def test_converted_state_is_refused():
    m = TableBatchedEmbeddingBags(TABLES, optimizer="rowwise_adagrad", state_dtypes={"momentum": torch.bfloat16})
    m.states.momentum = m.states.momentum.float()
    idx, off = _batch(0)
    with pytest.raises(RuntimeError, match="state 'momentum' is torch.float32 but the module was built with it torch.bfloat16"):
        m(idx, off).sum().backward()


def test_state_dict_round_trip_keeps_the_narrow_dtype():
    m = TableBatchedEmbeddingBags(TABLES, optimizer="rowwise_adagrad", state_dtypes={"momentum": torch.float16})
    _train(m)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    n = TableBatchedEmbeddingBags(TABLES, optimizer="rowwise_adagrad", state_dtypes={"momentum": torch.float16})
    n.load_state_dict(torch.load(buf))
    assert n.optimizer_state("momentum").dtype == torch.float16
    assert torch.equal(n.optimizer_state("momentum"), m.optimizer_state("momentum"))


def test_spec_dtype_is_the_default():
    text = (SPECS["rowwise_adagrad"].read_text()
            .replace("momentum: {per: row, init: 0.0,", "momentum: {per: row, init: 0.0, dtype: bf16,"))
    assert "dtype: bf16" in text
    spec = load_spec_text(text, "rowwise_adagrad.yaml")
    assert spec.states[0].dtype == "bf16"
    assert _check_state_dtypes(spec, None) == {"momentum": torch.bfloat16}
    assert _check_state_dtypes(spec, {"momentum": torch.float32}) == {"momentum": torch.float32}
    case = harness.Case()
    assert harness.state_dtype(spec, case, "momentum") == torch.bfloat16


def test_harness_catches_a_state_rounded_wrongly(load_ops):
    """The narrow-state comparison can fail: a reference that moves the state by 2% is caught."""
    spec, ops = load_ops("rowwise_adagrad")
    wrong = dataclasses.replace(spec, reference=dataclasses.replace(
        spec.reference, code=spec.reference.code + "\nmomentum = momentum * 1.02\n"))
    case = harness.Case(state_dtypes=(("momentum", torch.bfloat16),), seed=5)
    assert not harness.run_case(spec, ops, case).failures
    assert any("momentum" in f for f in harness.run_case(wrong, ops, case).failures)
