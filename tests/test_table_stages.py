"""Whole-table stages (a spec's `table:`; docs/spec-language.md, "Whole-table stages"): the loader
and checker, the generated code, the harness's check against `table_reference`, and the module,
which runs them once per step before the step's first forward in training mode.

The numerical grid of both specs that use them (emainplace_rowwise_adagrad,
ensemble_rowwise_adagrad) runs in tests/test_numerics.py (CPU) and tests/test_cuda.py (GPU);
emainplace_rowwise_adagrad against FBGEMM's CPU module in tests/test_fbgemm_compat.py.
"""

import dataclasses
import textwrap

import pytest
import torch

from tbegen import codegen, harness
from tbegen.module import TableBatchedEmbeddingBags
from tbegen.spec import SpecError, load_spec_text

from conftest import HAS_CUDA

TOY = """\
name: toy
summary: A toy.
hyperparameters:
  every: {type: int, default: 2, doc: Period.}
  coef: {type: float, default: 0.5, doc: Coefficient.}
states:
  acc: {per: row, init: 0.0}
  avg: {per: element, init: 0.0}
update:
  - row: |
      acc += row_mean(g * g);
  - element: |
      w -= 0.1f * g / (sqrtf(acc) + 1.0f);
reference: |
  acc += (g * g).mean(dim=1)
  w -= 0.1 * g / (acc.sqrt() + 1)[:, None]
table:
  - when: every > 0 && step % every == 0
    element: |
{code}
table_reference: |
  if every > 0 and step % every == 0:
      avg = avg + coef * (w - avg)
"""


def toy(code: str) -> str:
    return TOY.replace("{code}", textwrap.indent(textwrap.dedent(code).strip("\n"), " " * 6))


def problems(code: str):
    with pytest.raises(SpecError) as info:
        load_spec_text(toy(code), "toy.yaml")
    return [str(p) for p in info.value.problems]


# ---- the loader and the checker ---------------------------------------------------------------------


def test_a_table_stage_loads_with_its_guard_and_reference():
    spec = load_spec_text(toy("avg += coef * (w - avg);"), "toy.yaml")
    (stage,) = spec.table_stages
    assert stage.when == "every > 0 && step % every == 0"
    assert not stage.pairs and not spec.table_pairs
    assert stage.loc.line == 20 and stage.source_field == "table[0].element"
    assert "avg = avg + coef" in spec.table_reference.code
    paired = load_spec_text(toy("if (col >= D / 2) avg = partner(w);"), "toy.yaml")
    assert paired.table_pairs


@pytest.mark.parametrize("code, message", [
    ("w -= g;", "toy.yaml:20:12: table[0].element: 'g': a whole-table stage has no gradient"),
    ("acc = w;", "toy.yaml:20:7: table[0].element: 'acc' is a per-row state: a whole-table stage reads it but "
                 "may not assign it"),
    ("w = partner(acc);", "toy.yaml:20:19: table[0].element: partner(acc): only `w` and per-element states have a "
                          "partner element"),
    ("w = partner(w + 1.0f);", "toy.yaml:20:11: table[0].element: call partner with one name"),
    ("partner(avg) = w;", "toy.yaml:20:7: table[0].element: partner(...) is read-only"),
    ("w = row_max(w);", "toy.yaml:20:11: table[0].element: row_max(...) is a row reduction; use it in a row stage "
                        "only (of `update`), not in a whole-table stage"),
    ("w = coeff * avg;", "toy.yaml:20:11: table[0].element: unknown name 'coeff' (did you mean 'coef'?)"),
    ("col = 1;", "toy.yaml:20:7: table[0].element: 'col' is read-only"),
    ("float partner = w;", "toy.yaml:20:13: table[0].element: 'partner' is already declared as a function or "
                           "constant of the language"),
])
def test_the_checker_rejects_misuse_in_a_table_stage(code, message):
    found = problems(code)
    assert any(p.startswith(message) for p in found), found


def test_partner_and_col_exist_in_table_stages_only():
    text = toy("avg = w;").replace("w -= 0.1f * g / (sqrtf(acc) + 1.0f);",
                                   "w -= 0.1f * (g + partner(w)) * (col > 0 ? 1.0f : 0.5f);")
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "toy.yaml")
    messages = [p.message for p in info.value.problems]
    assert any("partner(...) reads the paired element of the row; it exists in whole-table stages" in m
               for m in messages), messages
    assert any("'col' (the element's column) is bound in whole-table stages" in m for m in messages), messages


def test_a_table_needs_its_reference_and_a_reference_its_table():
    text = toy("avg = w;")
    without = text[: text.index("table_reference:")]
    with pytest.raises(SpecError, match="table_reference: missing: a spec with `table` stages needs"):
        load_spec_text(without, "toy.yaml")
    orphan = without[: without.index("table:")] + "table_reference: |\n  w = w\n"
    with pytest.raises(SpecError, match="table_reference: only with `table` element stages"):
        load_spec_text(orphan, "toy.yaml")
    with pytest.raises(SpecError, match="'g'"):
        load_spec_text(text.replace("avg = avg + coef * (w - avg)", "avg = g"), "toy.yaml")


def test_a_table_stage_guard_reads_hyperparameters_and_step_only():
    text = toy("avg = w;").replace("when: every > 0 && step % every == 0", "when: acc > 0.0f")
    with pytest.raises(SpecError, match="table\\[0\\].when: 'acc': a guard may read hyperparameters and `step` "
                                        "only \\(it decides, once per step, on the host"):
        load_spec_text(text, "toy.yaml")


def test_a_table_stage_is_element_code():
    text = toy("avg = w;").replace("    element: |\n      avg = w;", "    row: |\n      avg = w;")
    with pytest.raises(SpecError, match="a whole-table stage is `element:` code"):
        load_spec_text(text, "toy.yaml")


# ---- the generated code --------------------------------------------------------------------------------


def test_partner_calls_become_the_units_snapshot():
    code = "w = partner(w) + partner( avg ) /* partner(x) */;"
    assert codegen.rewrite_partner(code, ["other", "avg"]) == (
        "w = tbegen_u.partner_w(tbegen_e) + tbegen_u.partner_element(1, tbegen_e) /* partner(x) */;")


def test_the_guard_runs_on_the_host_and_gates_each_stage():
    spec = load_spec_text(toy("if (col >= D / 2) avg = partner(w);"), "toy.yaml")
    guard = codegen.emit_table_guard(spec)
    assert "return (every > 0 && step % every == 0);" in guard
    body = codegen.emit_table_body(spec, "toy.yaml")
    assert "if (every > 0 && step % every == 0) {" in body
    assert "tbegen_u.snapshot();" in body
    assert '#line 20 "toy.yaml"' in body
    assert "tbegen_u.partner_w(tbegen_e)" in body
    assert "const float acc" not in body  # per-row states are bound only where read


# ---- the harness and the operators (CPU) ------------------------------------------------------------


def test_the_harness_catches_a_wrong_table_stage(load_ops):
    """The comparison with `table_reference` can fail: a reference that averages 1% further, or at
    steps where the kernel does not, is caught, and so is a kernel run that changes anything at a
    step where the reference changes nothing."""
    spec, ops = load_ops("emainplace_rowwise_adagrad")
    case = harness.Case(hyper=(("step_ema", 1),), seed=5)
    assert not harness.run_case(spec, ops, case).failures
    further = dataclasses.replace(spec, table_reference=dataclasses.replace(
        spec.table_reference, code=spec.table_reference.code.replace("step_ema_coef *", "1.01 * step_ema_coef *")))
    assert any("table weights" in f for f in harness.run_case(further, ops, case).failures)
    never = dataclasses.replace(spec, table_reference=dataclasses.replace(
        spec.table_reference, code="pass\n"))
    assert any("table weights" in f for f in harness.run_case(never, ops, case).failures)
    spec, ops = load_ops("ensemble_rowwise_adagrad")
    case = harness.Case(hyper=(("step_ema", 1), ("step_swap", 2)), seed=6)
    assert not harness.run_case(spec, ops, case).failures
    no_zeroing = dataclasses.replace(spec, table_reference=dataclasses.replace(
        spec.table_reference, code=spec.table_reference.code.replace("step_mode == 0", "step_mode == 2")))
    assert any("table sparse_ema" in f for f in harness.run_case(no_zeroing, ops, case).failures)


def test_the_operator_refuses_odd_widths_when_its_stage_pairs_columns(load_ops):
    spec, ops = load_ops("emainplace_rowwise_adagrad")
    layout = harness.make_layout(((10, 4), (6, 3)), None)
    weights = torch.zeros(layout.weights_numel)
    momentum = torch.zeros(layout.total_hash_size)
    hyper = dict(harness.default_hyperparameters(spec, {}), step_ema=2)
    args = (weights, layout.features_tensor("cpu"), layout.total_hash_size, False, 0, momentum,
            *[hyper[h.name] for h in spec.hyperparameters])
    assert ops.table_update(*args, 1) is False  # step 1: the guard does not hold
    with pytest.raises(RuntimeError, match="odd width 3; the spec's whole-table stage pairs column j"):
        ops.table_update(*args, 2)


# ---- the module -----------------------------------------------------------------------------------------


def test_the_module_averages_every_row_before_the_forward_of_each_step_ema_th_step():
    tables = [(7, 4), (5, 6)]
    emb = TableBatchedEmbeddingBags(tables, optimizer="emainplace_rowwise_adagrad", learning_rate=0.1,
                                    step_ema=2, step_ema_coef=0.25)
    idx = torch.tensor([0, 1, 0, 2])  # rows 0-2 only: the others change through the average alone
    off = torch.tensor([0, 2, 4])  # two features (one per table), a batch of one
    emb(idx, off).sum().backward()  # step 1: no average
    before = [w.clone() for w in emb.split_embedding_weights()]
    out = emb(idx, off)  # step 2's forward: averaged first
    for w, b in zip(emb.split_embedding_weights(), before):
        h = w.shape[1] // 2
        expected = torch.cat([b[:, :h], b[:, h:] + 0.25 * (b[:, :h] - b[:, h:])], dim=1)
        torch.testing.assert_close(w, expected, rtol=1e-6, atol=1e-7)
        assert not torch.equal(w[4:], b[4:])  # untouched rows are averaged too
    # the forward read the averaged weights
    first = emb.split_embedding_weights()[0]
    torch.testing.assert_close(out[0, :4], first[0] + first[1])
    # a second forward of the same step (an evaluation pass, say) does not average again
    again = [w.clone() for w in emb.split_embedding_weights()]
    emb(idx, off)
    assert all(torch.equal(a, w) for a, w in zip(again, emb.split_embedding_weights()))
    out.sum().backward()  # step 2's update
    # in eval mode the forward never averages
    emb.eval()
    emb(idx, off)  # step 3 (no average due anyway)
    emb.train()
    assert emb.run_table_stages() is False  # step 3: not a multiple of 2


def test_the_module_keeps_the_table_step_in_its_state_dict_and_refuses_odd_widths():
    emb = TableBatchedEmbeddingBags([(6, 4)], optimizer="emainplace_rowwise_adagrad", step_ema=1)
    idx, off = torch.tensor([1, 2]), torch.tensor([0, 1, 2])
    emb(idx, off)  # averages for step 1
    state = emb.state_dict()
    assert state["_extra_state"]["table_step"] == 1 and state["_extra_state"]["step"] == 0
    fresh = TableBatchedEmbeddingBags([(6, 4)], optimizer="emainplace_rowwise_adagrad", step_ema=1)
    fresh.load_state_dict(state)
    weights = fresh.split_embedding_weights()[0].clone()
    fresh(idx, off)  # step 1 has been averaged already: not again
    assert torch.equal(fresh.split_embedding_weights()[0], weights)
    bad = dict(state)
    bad["_extra_state"] = dict(state["_extra_state"], table_step=5)
    with pytest.raises(RuntimeError, match="table_step must be an int from 0 to the step \\+ 1 \\(1\\), got 5"):
        fresh.load_state_dict(bad)
    with pytest.raises(ValueError, match="every table needs an even dim; table\\(s\\) \\[1\\] have dims \\[5\\]"):
        TableBatchedEmbeddingBags([(6, 4), (3, 5)], optimizer="emainplace_rowwise_adagrad")


def test_managed_caching_tables_refuse_whole_table_stages():
    """A whole-table stage rewrites every row; a cached copy of a row would not see it, so the
    combination is refused (by name) rather than trained wrong."""
    with pytest.raises(NotImplementedError, match="whole-table stages, which managed_caching tables do not support yet "
                                                  "\\(table\\(s\\) \\[1\\]\\)"):
        TableBatchedEmbeddingBags([(6, 4), (8, 4)], optimizer="emainplace_rowwise_adagrad",
                                  placements=["device", "managed_caching"])
    # without whole-table stages, the same placements are accepted
    TableBatchedEmbeddingBags([(6, 4), (8, 4)], optimizer="rowwise_adagrad", placements=["device", "managed_caching"])


def test_ensemble_swaps_the_average_into_the_weights():
    emb = TableBatchedEmbeddingBags([(5, 4)], optimizer="ensemble_rowwise_adagrad", learning_rate=0.1,
                                    step_ema=1, step_swap=2, step_start=0, step_ema_coef=0.5, step_mode=2)
    idx, off = torch.tensor([0, 3]), torch.tensor([0, 1, 2])
    w0 = emb.split_embedding_weights()[0].clone()
    emb(idx, off).sum().backward()  # step 1: average = 0.5 * 0 + 0.5 * w0
    avg = emb.split_optimizer_states()[0]["sparse_ema"]
    torch.testing.assert_close(avg, 0.5 * w0)
    w1 = emb.split_embedding_weights()[0].clone()
    emb(idx, off)  # step 2: average, then swap into the weights
    expected = 0.5 * (0.5 * w0) + 0.5 * w1
    torch.testing.assert_close(avg, expected)
    torch.testing.assert_close(emb.split_embedding_weights()[0], expected)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("name, hyper", [
    ("emainplace_rowwise_adagrad", dict(step_ema=1, step_ema_coef=0.3)),
    ("ensemble_rowwise_adagrad", dict(step_ema=1, step_swap=2, step_mode=0)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_table_stages_match_the_cpu_and_are_deterministic(name, hyper, dtype):
    """The module on CUDA and on the CPU, the same batches for 4 steps: the same weights and states
    (the backward differs only by the order of float32 sums), and two CUDA runs bitwise equal."""
    tables = [(300, 64), (50, 2), (20, 1030)]
    gen = torch.Generator().manual_seed(11)
    batches = []
    for _ in range(4):
        idx = torch.cat([torch.randint(0, E, (12,), generator=gen) for E, _ in tables])
        batches.append((idx, torch.arange(0, 12 * len(tables) + 1, 3), torch.randn(4, sum(D for _, D in tables),
                                                                                    generator=gen)))

    def train(device):
        emb = TableBatchedEmbeddingBags(tables, optimizer=name, device=device, weights_dtype=dtype,
                                        stochastic_rounding=False, learning_rate=0.05, **hyper)
        for idx, off, go in batches:
            emb(idx.to(device), off.to(device)).backward(go.to(device))
        return [w.cpu() for w in emb.split_embedding_weights()], emb.split_optimizer_states()

    w_cpu, st_cpu = train("cpu")
    w_gpu, st_gpu = train("cuda")
    w_again, _ = train("cuda")
    assert all(torch.equal(a, b) for a, b in zip(w_gpu, w_again))
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    for a, b in zip(w_gpu, w_cpu):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    for a, b in zip(st_gpu, st_cpu):
        for k in a:
            torch.testing.assert_close(a[k].cpu().float(), b[k].float(), rtol=1e-4, atol=1e-5)
