"""Per-table states (`per: table`) and the reduce stages of `table:` that set them
(docs/spec-language.md, "Per-table states"): the loader, the generated code, the operators, the
harness's check against `table_state_reference`, the module (state_dict, the order of updates),
and FBGEMM's max_counter in optimizers/rowwise_adagrad_with_counter.yaml.

The counter spec's numerical grid runs in tests/test_numerics.py (CPU) and tests/test_cuda.py
(GPU); against FBGEMM in tests/test_fbgemm_compat.py; the checker's messages in
tests/specs_bad (table_state_*, reduce_*, element_stage_after_reduce).
"""

import dataclasses

import pytest
import torch

from tbegen import build, codegen, harness
from tbegen.module import TableBatchedEmbeddingBags
from tbegen.spec import SpecError, load_spec, load_spec_text

from conftest import HAS_CUDA

# A toy: SGD whose rate is divided by a per-table state `top` (each table's largest count plus
# one, refreshed every `every` steps, over that table's rows) and a module-wide `low` (the
# smallest count minus the previous low, over all tables: `of:` reads a per-table state).
TOY = """\
name: tablestate_toy
summary: SGD scaled by per-table states.
hyperparameters:
  learning_rate: {type: float, default: 0.1, doc: Step size.}
  every: {type: int, default: 2, test: [1, 3], doc: Period of the refresh.}
states:
  hits: {per: row, init: 0.0, doc: Occurrences of the row.}
  seen: {per: row, type: int, init: 0, doc: Steps at which the row was updated.}
  top: {per: table, init: 1.0, doc: The table's largest count plus one.}
  low: {per: table, init: 0.0, doc: Smallest count over all tables less the previous low.}
update:
  - row: |
      hits += 1.0f;
      seen += 1;
      float rate = learning_rate / (top + fabsf(low));
  - element: |
      w -= rate * g;
reference: |
  hits = hits + 1
  seen = seen + 1
  w = w - (learning_rate / (top + low.abs()))[:, None] * g
table:
  - when: every > 0 && step % every == 0
    reduce: max
    of: hits + 1.0f
    into: top
  - when: every > 0 && step % every == 0
    reduce: min
    of: static_cast<float>(seen) - low
    into: low
    over: all
table_state_reference: |
  if every > 0 and step % every == 0:
      top = torch.stack([h.max() + 1 for h in hits])
      low = torch.full_like(low, min(float(s.min()) - float(l) for s, l in zip(seen, low)))
"""


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """(spec, ops) of the toy, built for this machine."""
    path = tmp_path_factory.mktemp("toy") / "tablestate_toy.yaml"
    path.write_text(TOY)
    spec = load_spec(str(path))
    return spec, build.load_ops(spec, with_cuda=HAS_CUDA)


# ---- the loader ----------------------------------------------------------------------------------


def test_per_table_states_and_reduce_stages_load():
    spec = load_spec_text(TOY, "tablestate_toy.yaml")
    assert [s.name for s in spec.states] == ["hits", "seen"]  # (the operators' element/row states)
    assert [(s.name, s.init) for s in spec.table_states] == [("top", 1.0), ("low", 0.0)]
    assert [(r.op, r.of, r.into, r.over, r.when) for r in spec.table_reductions] == [
        ("max", "hits + 1.0f", "top", "table", "every > 0 && step % every == 0"),
        ("min", "static_cast<float>(seen) - low", "low", "all", "every > 0 && step % every == 0"),
    ]
    assert spec.table_stages == () and spec.table_reference is None
    assert "table_state_reference" not in TOY.split("table:")[0]


@pytest.mark.parametrize("edit, message", [
    (("top: {per: table, init: 1.0", "top: {per: table, init: 1.0, dtype: bf16"),
     "states.top.dtype: a per-table state is one float32 per table"),
    (("top: {per: table, init: 1.0", "top: {per: table, type: int, init: 1"), "int states are per row only"),
    (("    over: all\n", "    over: everything\n"), "table[1].over: must be table or all"),
    (("table_state_reference: |", "table_reference: |"), "table_state_reference: missing: a spec with `reduce` stages"),
    (("    into: top\n", ""), "table[0].into: missing required key"),
    (("hits += 1.0f;", "hits += 1.0f;\n      low = 0.0f;"), "'low' is a per-table state: read-only here"),
    (("h.max() + 1 for h in hits", "h.max() + w.sum() for h in hits"), "table_state_reference: unknown name 'w'"),
])
def test_the_loader_rejects_misuse(edit, message):
    with pytest.raises(SpecError) as info:
        load_spec_text(TOY.replace(*edit), "tablestate_toy.yaml")
    assert any(message in str(p) for p in info.value.problems), [str(p) for p in info.value.problems]


def test_per_table_state_reads_compile_only_where_declared():
    """The update reads a per-table state through the row view's table_state(k) (a constant);
    a spec without one gets kTableStates = 0 and no such read (the kernels compile nothing for it)."""
    spec = load_spec_text(TOY, "tablestate_toy.yaml")
    body = codegen.emit_update_body(spec, "toy.yaml")
    assert "const float top = tbegen_row.table_state(0);" in body
    assert "const float low = tbegen_row.table_state(1);" in body
    plain = load_spec_text(TOY.split("table:")[0].replace("  top: {per: table, init: 1.0, doc: The table's largest "
                                                          "count plus one.}\n", "").replace(
        "  low: {per: table, init: 0.0, doc: Smallest count over all tables less the previous low.}\n", "").replace(
        "(top + fabsf(low))", "2.0f").replace("(top + low.abs())", "2.0"), "tablestate_toy.yaml")
    assert plain.table_states == () and "table_state" not in codegen.emit_update_body(plain, "toy.yaml")


# ---- the harness and the operators (CPU, or the GPU where there is one) ---------------------------


def test_the_toy_matches_its_reference_and_the_harness_catches_a_wrong_one(toy):
    spec, ops = toy
    for case in (harness.Case(seed=3, steps=4), harness.Case(hyper=(("every", 1),), seed=4, steps=3),
                 harness.Case(tables=harness.MIXED_TABLES, feature_table_map=(0, 1, 1, 2, 0, 3), pooling="mean",
                              weighted=True, seed=5, steps=4)):
        result = harness.run_case(spec, ops, case, device="cuda" if HAS_CUDA else "cpu")
        assert not result.failures, result.failures
        assert not harness.run_lane_split_case(spec, ops, case).failures
    # a reference that keeps the largest count (not plus one), or reduces over all tables, fails
    case = harness.Case(seed=3, steps=4)
    for wrong in ("h.max() + 1 for", "h.max() + 0 for"), ("torch.stack([h.max() + 1 for h in hits])",
                                                         "torch.full_like(top, max(float(h.max()) for h in hits) + 1)"):
        bad = dataclasses.replace(spec, table_state_reference=dataclasses.replace(
            spec.table_state_reference, code=spec.table_state_reference.code.replace(*wrong)))
        assert any("table top" in f for f in harness.run_case(bad, ops, case).failures), wrong


def test_the_operator_checks_the_feature_table(toy):
    spec, ops = toy
    layout = harness.make_layout(((10, 4), (6, 4)), None)
    weights = torch.zeros(layout.weights_numel)
    hyper = harness.default_hyperparameters(spec, {})
    states = [torch.zeros(16), torch.zeros(16, dtype=torch.int64), torch.ones(2), torch.zeros(2)]

    def call(feature_table, step=2, top=None):
        return ops.table_update(weights, layout.features_tensor(), 16, False, 0, states[0], states[1],
                                states[2] if top is None else top, states[3], feature_table, *hyper.values(), step)

    assert call(torch.tensor([0, 1]))
    assert not call(torch.tensor([0, 1]), step=3)  # (the guard: nothing runs, nothing is read)
    with pytest.raises(RuntimeError, match="feature_table\\[1\\] = 2 is not a table"):
        call(torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="feature_table must have one entry per feature"):
        call(torch.tensor([0, 1, 1]))
    with pytest.raises(RuntimeError, match="per-table state 'low' has 2 entries, the one before it 3"):
        call(torch.tensor([0, 1]), top=torch.ones(3))


# ---- the module ---------------------------------------------------------------------------------


def _batches(tables, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.cat([torch.randint(0, E, (6,), generator=gen) for E, _ in tables])
        out.append((idx, torch.arange(0, 6 * len(tables) + 1, 2), torch.randn(3, sum(D for _, D in tables), generator=gen)))
    return out


def test_the_module_refreshes_per_table_states_before_the_forward_and_saves_them(toy):
    """The order of updates at step s: the reduce stages (if their guard holds at s) over the states
    the updates of steps 1 .. s-1 left, then the forward, then the fused update of s, which reads
    the new values. Saved in state_dict, restored by load_state_dict."""
    spec, _ = toy
    tables = [(9, 4), (7, 8), (5, 4)]
    emb = TableBatchedEmbeddingBags(tables, optimizer=spec, learning_rate=0.1, every=2)
    top, low = emb.optimizer_state("top"), emb.optimizer_state("low")
    assert torch.equal(top, torch.ones(3)) and torch.equal(low, torch.zeros(3))
    for idx, off, go in _batches(tables, 5, seed=1):
        step = emb.step + 1
        hits = [emb.split_optimizer_states()[t]["hits"].clone() for t in range(3)]
        seen = torch.cat([emb.split_optimizer_states()[t]["seen"] for t in range(3)])
        want_top = torch.stack([h.max() + 1 for h in hits]) if step % 2 == 0 else top.clone()
        want_low = torch.full((3,), float(seen.min()) - float(low[0])) if step % 2 == 0 else low.clone()
        w = [x.clone() for x in emb.split_embedding_weights()]
        emb(idx, off).backward(go)
        assert torch.equal(top, want_top) and torch.equal(low, want_low), step
        # the update of this step read the new values: rows moved by rate = lr / (top + |low|)
        for t, (E, D) in enumerate(tables):
            moved = (emb.split_embedding_weights()[t] - w[t]).abs().amax(1) > 0
            assert moved.any()
    saved = emb.state_dict()
    assert torch.equal(saved["table_states.top"], top) and torch.equal(saved["table_states.low"], low)
    fresh = TableBatchedEmbeddingBags(tables, optimizer=spec, learning_rate=0.1, every=2)
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.optimizer_state("top"), top) and torch.equal(fresh.optimizer_state("low"), low)
    # (an eval() forward does not run the stages)
    emb.eval()
    before = top.clone()
    emb.set_hyperparameters(every=1)
    emb(*_batches(tables, 1, seed=2)[0][:2])
    assert torch.equal(top, before)


def test_counter_spec_refreshes_max_counter_as_fbgemm_orders_it():
    """rowwise_adagrad_with_counter keeps FBGEMM's max_counter as a per-table state: 1 at first,
    and before the forward of every step that max_counter_update_freq divides, max(row_counter) + 1
    over all tables (the counters after the previous step), the same value in every entry."""
    tables = [(40, 8), (25, 12)]
    emb = TableBatchedEmbeddingBags(tables, optimizer="rowwise_adagrad_with_counter", max_counter_update_freq=2,
                                    learning_rate_mode=0, weight_decay_mode=1, weight_decay=0.01)
    max_counter = emb.optimizer_state("max_counter")
    assert max_counter.shape == (2,) and torch.equal(max_counter, torch.ones(2))
    for idx, off, go in _batches(tables, 5, seed=3):
        step = emb.step + 1
        counters = emb.optimizer_state("row_counter").clone()
        want = torch.full((2,), float(counters.max()) + 1) if step % 2 == 0 else max_counter.clone()
        emb(idx, off).backward(go)
        assert torch.equal(max_counter, want), step
    assert float(max_counter[0]) > 1  # (the refresh happened)
    assert "table_states.max_counter" in emb.state_dict()
    with pytest.raises(TypeError, match="max_counter"):  # (no longer a hyperparameter)
        TableBatchedEmbeddingBags(tables, optimizer="rowwise_adagrad_with_counter", max_counter=3.0)


def test_managed_caching_tables_refresh_max_counter_from_their_cached_rows():
    """With managed_caching tables the reduce stage sees the counters of the rows the caches hold
    (written back before it runs): the same max_counter and tables as device placement."""
    tables = [(40, 8), (25, 12)]
    kw = dict(optimizer="rowwise_adagrad_with_counter", max_counter_update_freq=2, learning_rate_mode=0)
    device = TableBatchedEmbeddingBags(tables, **kw)
    cached = TableBatchedEmbeddingBags(tables, placements="managed_caching", cache_rows=[8, 6], **kw)
    for idx, off, go in _batches(tables, 5, seed=4):
        for emb in (device, cached):
            emb(idx, off).backward(go)
        assert torch.equal(cached.optimizer_state("max_counter"), device.optimizer_state("max_counter"))
    assert float(device.optimizer_state("max_counter")[0]) > 1
    for a, b in zip(cached.split_embedding_weights(), device.split_embedding_weights()):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("placement", ["device", "managed"])
def test_cuda_per_table_states_match_the_cpu(placement):
    """The counter spec on the GPU (both placements) and on the CPU, the same batches for 6 steps
    with max_counter refreshed every 2 and read by learning-rate mode 0: max_counter bitwise equal
    (max is exact in any order), the weights and states within float32 rounding."""
    tables = [(300, 64), (50, 4), (20, 36)]
    batches = _batches(tables, 6, seed=7)

    def train(device):
        emb = TableBatchedEmbeddingBags(tables, optimizer="rowwise_adagrad_with_counter", device=device,
                                        placements=[placement if device == "cuda" else "device"] * 3,
                                        max_counter_update_freq=2, learning_rate_mode=0, counter_halflife=3)
        for idx, off, go in batches:
            emb(idx.to(device), off.to(device)).backward(go.to(device))
        return emb

    cpu, gpu = train("cpu"), train("cuda")
    assert gpu.optimizer_state("max_counter").is_cuda
    assert torch.equal(gpu.optimizer_state("max_counter").cpu(), cpu.optimizer_state("max_counter"))
    for a, b in zip(gpu.split_embedding_weights(), cpu.split_embedding_weights()):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)
    moved = train("cpu").to("cuda")  # (moved with the module)
    assert moved.optimizer_state("max_counter").is_cuda
