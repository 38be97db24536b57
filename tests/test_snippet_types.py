"""Types in the snippet language (tbegen/snippet_types.py): the mistakes of type that C++ accepts
(warnings, errors under `validate --strict`) or refuses late (errors), at the YAML line and column."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from tbegen.cli import main
from tbegen.spec import SpecError, list_specs, load_spec_text

ROOT = Path(__file__).resolve().parent.parent
WARN = Path("tests") / "specs_warn"
WARN_CORPUS = sorted(p.stem for p in (ROOT / WARN).glob("*.yaml"))

HEAD = """\
name: typed
summary: A spec to check the types of.
hyperparameters:
  lr: {type: float, default: 0.01}
  n: {type: int, default: 10}
  period: {type: float, default: 4.0}
  flag: {type: bool, default: false}
states:
  count: {per: row, type: int, init: 0}
  acc: {per: row, init: 0.0}
update:
"""
ROW_LINE = HEAD.count("\n") + 2  # the file line of the row stage's first line in `findings`


def spec_text(row: str, when: str = "") -> str:
    """A spec whose first row stage is `row` (guarded by `when`); every declaration used once after
    it, so that no unused-declaration warning mixes in."""
    text = HEAD + (f"  - when: {when}\n    row: |\n" if when else "  - row: |\n")
    text += "".join(f"      {line}\n" for line in row.splitlines())
    text += ("  - row: |\n"
             "      float scale = (flag ? period : (float)n) + acc + (float)count + lr;\n"
             "  - element: |\n"
             "      w -= scale * g;\n"
             "reference: |\n"
             "  w -= lr * g\n")
    return text


def findings(row: str, when: str = ""):
    """(errors, warnings) of spec_text(row, when), as 'line:col: message'."""
    warnings = []
    try:
        load_spec_text(spec_text(row, when), "typed.yaml", warnings)
        errors = []
    except SpecError as e:
        errors = [f"{p.line}:{p.col}: {p.message}" for p in e.problems if not p.warning]
        warnings = list(warnings) + [p for p in e.problems if p.warning]
    return errors, [f"{p.line}:{p.col}: {p.message}" for p in warnings]


@pytest.mark.parametrize("row", [
    "int64_t q = step / n;",                 # integer division kept as an integer: meant
    "float ok = (float)step / n;",           # the fix
    "float ok = static_cast<float>(step) / n;",
    "float ok = step / (float)n;",
    "bool zero = lr == 0.0f;",               # an exact zero test is fine
    "count = count + 1;",
    "count += n;",
    "int64_t since = step - count;",
    "acc += row_mean(g * g) / D;",           # float / int: float
    "float h = n > 0 ? 1.0f / n : 1.0f;",
])
def test_sound_code_has_no_finding(row):
    assert findings(row) == ([], [])


def column(row: str, marker: str, indent: int = 6) -> int:
    """The 1-based file column of `marker` in the row stage's line (indented by `indent`)."""
    return indent + row.index(marker) + 1


@pytest.mark.parametrize("row,marker,words", [
    ("float ramp = step / n;", "/", "integer division: `step / n`"),
    ("float ramp = lr * (step / n);", "/", "write `(float)step / n`"),
    ("float ramp = fminf(1.0f, step / n);", "/", "integer division"),
    ("acc += step / n;", "/", "integer division"),
    ("float ramp = (step + 1) / n * lr;", "/", "write `(float)(step + 1) / n`"),
    ("count = acc * 2.0f;", "count", "'count' is an int state but is assigned a float expression"),
    ("count += lr;", "count", "truncates it toward zero"),
    ("int64_t k = lr * 10.0f;", "k =", "'k' is an int variable"),
    ("int k = step;", "k =", "'k' is a 32-bit int but `step` is int64"),
    ("bool same = lr == period;", "==", "compares floats for exact equality"),
])
def test_mistakes_of_type_are_warnings_at_their_column(row, marker, words):
    errors, warnings = findings(row)
    assert errors == []
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"{ROW_LINE}:{column(row, marker)}: ") and words in warnings[0], warnings


@pytest.mark.parametrize("row,when,marker,words", [
    ("float on = step % period == 0 ? 1.0f : 0.0f;", "", "%", "`%` needs integer operands"),
    ("acc %= 2.0f;", "", "acc", "`%=` needs integer operands"),
    ("acc += 1.0f;", "step % period == 0", "%", "write `fmodf(step, period)`"),
])
def test_modulo_of_a_float_is_an_error(row, when, marker, words):
    errors, _ = findings(row, when)
    assert len(errors) == 1, errors
    where = f"{ROW_LINE - 1}:{column(when, marker, 10)}" if when else f"{ROW_LINE}:{column(row, marker)}"
    assert errors[0].startswith(where + ": ") and words in errors[0], errors


def test_the_shipped_specs_are_clean_under_strict(monkeypatch):
    monkeypatch.chdir(ROOT)
    paths = [str(p.relative_to(ROOT)) for p in list_specs()]
    result = CliRunner().invoke(main, ["validate", "--strict", *paths])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("name", WARN_CORPUS)
def test_the_warning_corpus_fails_only_under_strict(monkeypatch, name):
    monkeypatch.chdir(ROOT)
    path = str(WARN / f"{name}.yaml")
    strict = CliRunner().invoke(main, ["validate", "--strict", path])
    assert strict.exit_code == 1
    assert strict.output == (ROOT / WARN / f"{name}.expected").read_text()
    plain = CliRunner().invoke(main, ["validate", path])
    assert plain.exit_code == 0 and plain.output.endswith(f"{path}: ok ({plain.output.count('warning:')} warning(s))\n")


def test_the_warning_corpus_has_the_reported_mistakes():
    assert {"warmup_integer_division", "int_state_float_value", "int64_into_int", "float_equality"} <= set(WARN_CORPUS)
