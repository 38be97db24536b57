"""tbegen/reference_check.py: `validate` runs each reference once on a tiny synthetic batch and
reports, at the reference's YAML line, an exception it raises and each state (and `w`) it leaves of
the wrong kind or shape. (The bad-spec corpus has one case of each kind: tests/test_bad_specs.py.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tbegen.cli import main
from tbegen.spec import SpecError, list_specs, load_spec, load_spec_text

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = list_specs()
OTHER_GOOD = sorted((ROOT / "tests" / "specs_good").glob("*.yaml")) + sorted((ROOT / "tests" / "specs_warn").glob("*.yaml"))

HEAD = """\
name: toy
summary: A spec whose reference is under test.
hyperparameters:
  lr: {type: float, default: 0.01}
  mode: {type: int, default: 0, choices: [0, 1]}
states:
  acc: {per: row, init: 0.0}
  count: {per: row, type: int, init: 0}
  v: {per: element, init: 0.0}
row: |
  acc += row_mean(g * g);
  count += mode + 1;
element: |
  v = 0.9f * v + g;
  w -= lr * v / (sqrtf(acc) + 1.0f) / (float)count;
reference: |
"""
REFERENCE_LINE = HEAD.count("\n") + 1  # the file line of the reference's first line


def toy(*reference_lines: str) -> str:
    return HEAD + "".join(f"  {line}\n" for line in reference_lines)


GOOD = ("acc = acc + (g * g).mean(dim=1)", "count = count + mode + 1", "v = 0.9 * v + g",
        "w = w - lr * v / (acc.sqrt() + 1.0)[:, None] / count[:, None]")


def problems(text: str):
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "toy.yaml", run_reference=True)
    return info.value.problems


@pytest.mark.parametrize("path", SHIPPED + OTHER_GOOD, ids=lambda p: p.stem)
def test_every_good_spec_passes(path):
    load_spec(path, run_reference=True)


def test_the_toy_passes_and_the_check_is_not_run_unless_asked():
    load_spec_text(toy(*GOOD), "toy.yaml", run_reference=True)
    broken = toy(*GOOD[:3], "w = w - lr * v / acc.sqrt()")  # [rows, D] / [rows]: raises when run
    load_spec_text(broken, "toy.yaml")  # the static checks alone accept it
    (p,) = problems(broken)
    assert (p.line, p.col, p.field) == (REFERENCE_LINE + 3, 3, "reference")
    assert p.message.startswith("`w = w - lr * v / acc.sqrt()` raised RuntimeError: The size of tensor a (4) "
                                "must match the size of tensor b (3)")
    assert "index the per-row one as `x[:, None]`" in p.message
    assert "Traceback" not in p.message


@pytest.mark.parametrize("line, index, shows", [
    ("count = count / 2", 1, "state 'count' (per: row, type: int) a float32 tensor: an int state holds integers"),
    ("count = count + 0.5", 1, "state 'count' (per: row, type: int) a float32 tensor"),
    ("count = count > 0", 1, "state 'count' (per: row, type: int) a bool tensor"),
    ("acc = acc > 0", 0, "state 'acc' (per: row) a bool tensor (a comparison)"),
    ("acc = torch.zeros_like(count)", 0, "state 'acc' (per: row) an int64 tensor: it holds floats"),
    ("acc = acc + (g * g)", None, None),  # [rows] + [rows, D]: raises (3 rows, D = 4)
    ("acc = acc[:, None] + g * g", 0, "state 'acc' (per: row) shaped [rows, D], not [rows]: reduce each row"),
    ("acc = (g * g).mean(dim=1, keepdim=True)", 0, "shaped [rows, 1], not [rows]: drop the column dimension"),
    ("acc = (g * g).mean()", 0, "shaped a single value (a 0-d tensor), not [rows]: reduce over each row only"),
    ("acc = 0.0", 0, "state 'acc' (per: row) a Python float (0.0), not a [rows] tensor: write `torch.full_like(acc, ...)`"),
    ("v = (0.9 * v + g).sum(dim=1)", 2, "state 'v' (per: element) shaped [rows], not [rows, D]: index a per-row value"),
])
def test_a_state_left_of_the_wrong_kind_or_shape(line, index, shows):
    """Each line replaces the statement of the good reference that writes the same state."""
    written = {"acc": 0, "count": 1, "v": 2}[line.split(" ")[0]]
    lines = list(GOOD)
    lines[written] = line
    p = problems(toy(*lines))[0]  # (a later statement may trip over it too)
    if shows is None:
        assert "raised RuntimeError" in p.message and p.line == REFERENCE_LINE + written
        return
    assert shows in p.message, p.message
    # at the statement that last assigned the state
    assert (p.line, p.col) == (REFERENCE_LINE + index, 3)
    assert "(run on 3 rows of D = 4 with the default hyperparameters, step = 2" in p.message


def test_the_last_assignment_that_ran_is_named():
    text = toy("acc = acc + (g * g).mean(dim=1)", "if mode == 0:", "    acc = acc > 0", "else:",
               "    acc = acc * 2", *GOOD[1:])
    (p,) = problems(text)
    assert (p.line, p.col) == (REFERENCE_LINE + 2, 7) and "a bool tensor" in p.message


def test_w_must_stay_rows_by_D_floating():
    (p,) = problems(toy(*GOOD[:3], "w = (w - lr * v).sum(dim=1)"))
    assert "the reference leaves `w` shaped [rows], not [rows, D]" in p.message
    (p,) = problems(toy(*GOOD[:3], "w = w > 0"))
    assert "`w` a bool tensor" in p.message


def test_a_mistake_in_a_branch_of_a_choice_is_found_and_named():
    text = toy(GOOD[0], "count = count + mode + 1 if mode == 0 else count * 1.5", *GOOD[2:])
    (p,) = problems(text)
    assert "state 'count' (per: row, type: int) a float32 tensor" in p.message
    assert p.message.endswith("(run on 3 rows of D = 4 with mode = 1, step = 2)")


def test_one_column_rows():
    """D = 1 is run too: a squeeze() that drops the column dimension there."""
    text = toy(*GOOD[:2], "v = (0.9 * v + g).squeeze()", GOOD[3])
    p, later = problems(text)  # v, then the w computed from it: [rows, rows]
    assert p.line == REFERENCE_LINE + 2 and "state 'v' (per: element) shaped [rows], not [rows, D]" in p.message
    assert p.message.endswith("(run on 2 rows of D = 1 with the default hyperparameters, step = 2)")
    assert later.line == REFERENCE_LINE + 3 and "`w` shaped [rows, rows], not [rows, D]" in later.message


def test_every_exception_is_a_problem_at_its_line():
    for bad, kind in (("x = acc.no_such_method()", "AttributeError"), ("x = 1 / 0", "ZeroDivisionError"),
                      ("x = torch.cat([g, acc])", "RuntimeError"), ("raise SystemExit(3)", "SystemExit")):
        (p,) = problems(toy(GOOD[0], bad, *GOOD[1:]))
        assert (p.line, p.col) == (REFERENCE_LINE + 1, 3) and f"raised {kind}" in p.message, p


TABLE_SPEC = """\
name: toy
summary: A per-table state refreshed by a reduce stage.
hyperparameters:
  lr: {type: float, default: 0.01}
states:
  hits: {per: row, init: 0.0}
  top: {per: table, init: 1.0}
row: |
  hits += 1.0f;
element: |
  w -= lr / top * g;
table:
  - reduce: max
    of: hits
    into: top
    over: all
table_state_reference: |
  %s
reference: |
  hits = hits + 1
  w -= lr / top[:, None] * g
"""


def test_the_table_state_reference_leaves_each_table_state_one_float_per_table():
    load_spec_text(TABLE_SPEC % "top[:] = max(float(h.max()) for h in hits)", "toy.yaml", run_reference=True)
    (p,) = problems(TABLE_SPEC % "top = max(float(h.max()) for h in hits)")
    assert (p.line, p.field) == (18, "table_state_reference")
    assert "state 'top' (per: table) a Python float" in p.message and "2 tables" in p.message
    (p,) = problems(TABLE_SPEC % "top = torch.cat(hits)")
    assert p.line == 18 and "state 'top' (per: table) shaped [5], not [tables]" in p.message


def test_a_state_problem_is_reported_before_what_it_makes_fail():
    """A per-row state left [rows, D] makes the next statement raise: the state is the mistake."""
    (p,) = problems(toy("acc = g * g", *GOOD[1:3], "w = w - lr * v / (acc + count).sqrt()[:, None]"))
    assert (p.line, p.col) == (REFERENCE_LINE, 3)
    assert p.message.startswith("the reference leaves state 'acc' (per: row) shaped [rows, D], not [rows]")
    assert p.message.endswith("step = 2; then `w = w - lr * v / (acc + count).sqrt()[:, None]` raised RuntimeError)")


def test_validate_reports_it_and_test_stops_before_building(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "toy.yaml").write_text(toy(GOOD[0], "count = count / 2", *GOOD[2:]))
    runner = CliRunner()
    result = runner.invoke(main, ["validate", "toy.yaml"])
    assert result.exit_code == 1
    assert result.output.startswith(f"toy.yaml:{REFERENCE_LINE + 1}:3: reference: the reference leaves state 'count'")
    from tbegen import build

    def refuse(*args, **kwargs):
        raise AssertionError("built")

    monkeypatch.setattr(build, "load_ops", refuse)
    result = runner.invoke(main, ["test", "--optimizer", "toy.yaml"])
    assert result.exit_code != 0 and "reference: the reference leaves state 'count'" in result.output
    assert "Traceback" not in result.output


def test_deterministic_and_fast():
    text = toy(GOOD[0], "count = count + torch.rand(count.shape)", *GOOD[2:])
    first = problems(text)
    assert problems(text) == first
    load_spec(SHIPPED[0], run_reference=True)  # (torch imported, first calls made)
    t0 = time.perf_counter()
    for path in SHIPPED:
        load_spec(path, run_reference=True)
    with_run = time.perf_counter() - t0
    t0 = time.perf_counter()
    for path in SHIPPED:
        load_spec(path)
    static = time.perf_counter() - t0
    # measured 2026-12-04 on 2 busy cores: about 40 ms for the 17 shipped specs' runs
    assert with_run - static < 0.5 * len(SHIPPED) / 17 + 0.5, (with_run, static)


def _emainplace(table_reference: str) -> str:
    """optimizers/emainplace_rowwise_adagrad.yaml (a whole-table stage pairing columns) with its
    table_reference replaced."""
    text = (ROOT / "optimizers" / "emainplace_rowwise_adagrad.yaml").read_text()
    head, _, _ = text.partition("table_reference: |\n")
    return head + "table_reference: |\n" + "".join(f"  {line}\n" for line in table_reference.splitlines())


def test_the_table_reference_is_run_on_even_widths_where_columns_pair():
    # (the shipped one passes: test_every_good_spec_passes) every row of a table, no g
    halves = "fast, slow = w.reshape(w.shape[0], 2, D // 2).unbind(1)\nw = torch.cat([fast, (fast + slow) / 2], dim=1)"
    load_spec_text(_emainplace(halves), "emainplace_rowwise_adagrad.yaml", run_reference=True)
    with pytest.raises(SpecError) as info:
        load_spec_text(_emainplace(halves + "\nmomentum = momentum[:, None] * w"), "emainplace_rowwise_adagrad.yaml",
                       run_reference=True)
    (p,) = info.value.problems
    assert p.field == "table_reference"
    assert "state 'momentum' (per: row) shaped [rows, D], not [rows]" in p.message
    with pytest.raises(SpecError) as info:
        load_spec_text(_emainplace("w = w[:, : D // 2] + w[:, D // 2 + 1 :]"), "emainplace_rowwise_adagrad.yaml",
                       run_reference=True)
    (p,) = info.value.problems
    assert (p.field, p.col) == ("table_reference", 3)
    assert p.message.startswith("the reference leaves `w` shaped [rows, 2], not [rows, D]")


def test_names_assigned_in_a_function_of_the_reference_are_its_own():
    load_spec_text(toy("def scaled(x):", "    acc = x > 0", "    return x * 2", *GOOD), "toy.yaml", run_reference=True)


def test_warnings_of_the_reference_are_not_printed(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "toy.yaml").write_text(toy("import warnings", "warnings.warn('from the reference')", *GOOD))
    result = CliRunner().invoke(main, ["validate", "toy.yaml"])
    assert result.exit_code == 0 and result.output == "toy.yaml: ok\n"
    assert "from the reference" not in capfd.readouterr().err
