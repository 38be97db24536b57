"""The references see int states as `tbegen validate` runs them and the kernels hold them: int64
tensors (tbegen/harness.py, `_reference_states`), with float64 as torch's default dtype while a
reference runs, so that an int state combined with a Python float stays float64. No build: the
float64 reference step alone."""

import pytest
import torch

from tbegen import harness
from tbegen.layout import make_layout
from tbegen.spec import load_spec_text

SPEC = """\
name: int_probe
summary: A per-row hit count scaling the step.
hyperparameters:
  learning_rate: {type: float, default: 0.5, doc: Step size.}
states:
  hits: {per: row, type: int, init: 0, doc: Updates of the row so far.}
row: |
  hits += 1;
  float scale = learning_rate * powf(0.5f, (float)hits);
element: |
  w -= scale * g;
reference: |
  if hits.dtype != torch.int64:
      raise TypeError(f"hits reached the reference as {hits.dtype}")
  hits = hits + 1
  scale = learning_rate * 0.5 ** hits
  if scale.dtype != torch.float64:
      raise TypeError(f"an int state with a Python float gave {scale.dtype}")
  w = w - scale[:, None] * g
"""


def _step(reference_tail: str = ""):
    spec = load_spec_text(SPEC.replace("  w = w - scale[:, None] * g\n", "  w = w - scale[:, None] * g\n" + reference_tail),
                          "int_probe.yaml")
    case = harness.Case(tables=((10, 4), (6, 3)), B=4, max_L=3, pooling="sum", seed=3)
    layout = make_layout(case.tables, case.feature_table_map)
    gen = torch.Generator().manual_seed(case.seed)
    weights, states = harness.initial_state(spec, layout, case, gen)
    batch = harness.random_batch(case, layout, gen)
    grad_output = torch.randn(case.B, layout.total_D, generator=gen)
    hyper = harness.default_hyperparameters(spec, {})
    w, st, touched = harness.reference_step(spec, layout, case.B, case.pooling, weights, states, batch,
                                            grad_output, hyper, 1)
    return layout, states, w, st, touched


def test_the_reference_gets_int_states_as_int64_and_float64_arithmetic():
    layout, before, w, st, touched = _step()
    assert st["hits"].dtype == torch.int64 and w.dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32  # (restored after the reference ran)
    rows = torch.zeros(layout.total_hash_size, dtype=torch.bool)
    for t, (E, D) in enumerate(layout.tables):
        base, kb = layout.table_offsets[t], layout.table_key_base[t]
        rows[kb : kb + E] = touched[base : base + E * D].view(E, D).any(1)
    assert rows.any() and not rows.all()
    assert torch.equal(st["hits"][rows], before["hits"][rows] + 1)
    assert torch.equal(st["hits"][~rows], before["hits"][~rows])


def test_a_float_left_in_an_int_state_is_rounded():
    # (validate reports such a reference; the harness still checks the kernel against integers)
    _, before, _, st, touched = _step("  hits = hits + 0.6\n")
    assert st["hits"].dtype == torch.int64
    assert int((st["hits"] - before["hits"]).max()) == 2  # (+1, then +0.6 rounded up)


def test_a_reference_failure_still_restores_the_default_dtype():
    with pytest.raises(harness.ReferenceFailure, match="int_probe.yaml:"):
        _step("  hits = hits.undefined_attribute\n")
    assert torch.get_default_dtype() == torch.float32
