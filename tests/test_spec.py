"""Tests for tbegen.spec: YAML -> OptimizerSpec, and every kind of spec error.

Inline specs are loaded with `load_spec_text(text, "toy.yaml")`, so their `name`
must be `toy`; line numbers in the expected messages count from the first line
of the (dedented) text.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import List

import pytest

from tbegen import spec as spec_module
from tbegen.model import (
    Hyperparameter,
    Loc,
    OptimizerSpec,
    Reference,
    Stage,
    State,
    Temporary,
)
from tbegen.spec import (
    SpecError,
    SpecNotFoundError,
    SpecProblem,
    find_spec,
    list_specs,
    load_spec,
    load_spec_text,
)

BAD = Path(__file__).resolve().parent / "specs_bad"

VALID = """\
name: rowwise_adagrad            # identifier; must equal the file's stem
summary: Adagrad with one accumulator per row.
hyperparameters:
  learning_rate: {type: float, default: 0.01, doc: Step size.}
  eps: {type: float, default: 1e-8, doc: Added to the denominator.}
  weight_decay_mode: {type: int, default: 0, choices: [0, 1, 2], doc: "0 none, 1 L2, 2 decoupled."}
  scale: {type: float, default: 2}
  max_norm: {type: float}
  nesterov: {type: bool, default: false}
states:
  momentum: {per: row, init: 0.0, doc: Running sum of the mean squared gradient.}
  exp_avg: {per: element, init: 1, dtype: float32}
temporaries:
  r: {per: element}
update:                          # ordered stages
  - row: |
      momentum += row_mean(g * g);
      float multiplier = learning_rate / (sqrtf(momentum) + eps);
  - element: |
      r = multiplier * g;
  - element: w -= r;
reference: |
  momentum += (g * g).mean(dim=1)
  w -= (learning_rate / (momentum.sqrt() + eps))[:, None] * g
"""


def problems_of(text: str, path: str = "toy.yaml") -> List[str]:
    """Every problem reported for `text`, as `FILE:LINE: FIELD: MESSAGE` strings."""
    with pytest.raises(SpecError) as info:
        load_spec_text(textwrap.dedent(text), path)
    return [str(p) for p in info.value.problems]


def only_problem(text: str, path: str = "toy.yaml") -> str:
    """The single problem reported for `text`."""
    found = problems_of(text, path)
    assert len(found) == 1, found
    return found[0]


def minimal(**lines: str) -> str:
    """A valid minimal spec named toy; keyword arguments add or replace top-level lines."""
    parts = {
        "name": "name: toy",
        "summary": "summary: A toy.",
        "element": "element: w -= g;",
        "reference": "reference: w -= g",
    }
    parts.update(lines)
    return "\n".join(v for v in parts.values() if v) + "\n"


# ---------------------------------------------------------------------------
# Valid specs
# ---------------------------------------------------------------------------


def test_valid_spec_parses_into_the_model(tmp_path):
    path = tmp_path / "rowwise_adagrad.yaml"
    path.write_text(VALID)
    spec = load_spec(path)
    file = str(path)

    expected = OptimizerSpec(
        name="rowwise_adagrad",
        summary="Adagrad with one accumulator per row.",
        path=file,
        hyperparameters=(
            Hyperparameter("learning_rate", "float", 0.01, "Step size.", None, Loc(file, 4)),
            Hyperparameter("eps", "float", 1e-8, "Added to the denominator.", None, Loc(file, 5)),
            Hyperparameter("weight_decay_mode", "int", 0, "0 none, 1 L2, 2 decoupled.", (0, 1, 2), Loc(file, 6)),
            Hyperparameter("scale", "float", 2.0, "", None, Loc(file, 7)),
            Hyperparameter("max_norm", "float", None, "", None, Loc(file, 8)),
            Hyperparameter("nesterov", "bool", False, "", None, Loc(file, 9)),
        ),
        states=(
            State("momentum", "row", 0.0, "fp32", "Running sum of the mean squared gradient.", Loc(file, 11)),
            State("exp_avg", "element", 1.0, "fp32", "", Loc(file, 12)),
        ),
        temporaries=(Temporary("r", "element", Loc(file, 14)),),
        stages=(
            Stage(
                "row",
                "momentum += row_mean(g * g);\nfloat multiplier = learning_rate / (sqrtf(momentum) + eps);\n",
                Loc(file, 17),
            ),
            Stage("element", "r = multiplier * g;\n", Loc(file, 20)),
            Stage("element", "w -= r;", Loc(file, 21)),
        ),
        reference=Reference(
            "momentum += (g * g).mean(dim=1)\nw -= (learning_rate / (momentum.sqrt() + eps))[:, None] * g\n",
            Loc(file, 23),
        ),
        loc=Loc(file, 1),
    )
    assert spec == expected
    assert spec.loc == Loc(file, 1)
    # Loc lines point at the first line of code, in the file itself.
    lines = VALID.splitlines()
    assert lines[spec.stages[0].loc.line - 1].strip() == "momentum += row_mean(g * g);"
    assert lines[spec.reference.loc.line - 1].strip() == "momentum += (g * g).mean(dim=1)"


def test_value_types_and_derived_properties():
    spec = load_spec_text(VALID, "rowwise_adagrad.yaml")
    scale = spec.hyperparameter("scale")
    assert type(scale.default) is float  # int accepted for float, converted
    assert type(spec.hyperparameter("weight_decay_mode").default) is int
    assert spec.hyperparameter("max_norm").required
    assert [s.name for s in spec.row_states] == ["momentum"]
    assert [s.name for s in spec.element_states] == ["exp_avg"]
    assert type(spec.states[1].init) is float
    assert spec.path == "rowwise_adagrad.yaml"


def test_shorthand_stages_run_row_first():
    text = """\
        name: toy
        summary: A toy.
        element: |
          w -= m * g;
        row: |
          float m = row_max(fabsf(g));
        reference: w -= g.abs().amax(dim=1, keepdim=True) * g
        """
    spec = load_spec_text(textwrap.dedent(text), "toy.yaml")
    assert [(s.kind, s.loc.line) for s in spec.stages] == [("row", 6), ("element", 4)]
    assert spec.reference.loc == Loc("toy.yaml", 7)


def test_shorthand_single_stage_and_no_optional_sections():
    spec = load_spec_text(minimal(), "toy.yaml")
    assert spec.stages == (Stage("element", "w -= g;", Loc("toy.yaml", 3)),)
    assert spec.hyperparameters == spec.states == spec.temporaries == ()


def test_empty_sections_are_allowed():
    spec = load_spec_text(minimal(extra="hyperparameters:\nstates: {}\ntemporaries:"), "toy.yaml")
    assert spec.hyperparameters == spec.states == spec.temporaries == ()


def test_stem_is_not_checked_for_in_memory_text():
    spec = load_spec_text(minimal())
    assert spec.name == "toy" and spec.path == "<string>"


def test_reduction_in_a_comment_is_ignored():
    spec = load_spec_text(minimal(element="element: w -= g;  // not row_sum(g) here"), "toy.yaml")
    assert spec.stages[0].kind == "element"


def test_leading_blank_line_in_block_keeps_lines_aligned():
    text = "name: toy\nsummary: A toy.\nelement: w -= g;\nreference: |\n\n  w -= g +\n"
    found = problems_of(text)
    assert found == ["toy.yaml:6: reference: not valid Python: invalid syntax"]


# ---------------------------------------------------------------------------
# Problem and error objects
# ---------------------------------------------------------------------------


def test_problem_and_error_formatting():
    a = SpecProblem("f.yaml", 3, "states.m.per", "must be element or row")
    b = SpecProblem("f.yaml", 7, "name", "missing required key")
    assert str(a) == "f.yaml:3: states.m.per: must be element or row"
    error = SpecError([a, b])
    assert error.problems == (a, b)
    assert str(error) == "f.yaml:3: states.m.per: must be element or row\nf.yaml:7: name: missing required key"


# ---------------------------------------------------------------------------
# YAML-level errors
# ---------------------------------------------------------------------------


def test_yaml_syntax_error_names_the_line():
    path = BAD / "bad_yaml.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(path)
    [problem] = info.value.problems
    assert str(problem).startswith(f"{path}:4: yaml: ")
    assert "flow sequence" in problem.message


def test_duplicate_keys_at_every_level():
    path = BAD / "duplicate_keys.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(str(path))
    assert [str(p) for p in info.value.problems] == [
        f"{path}:4: hyperparameters.learning_rate.type: duplicate key (first given at line 4)",
        f"{path}:7: summary: duplicate key (first given at line 2)",
    ]


def test_empty_file():
    assert only_problem("") == (
        "toy.yaml:1: spec: empty spec; expected a mapping with name, summary, update and reference"
    )


def test_top_level_must_be_a_mapping():
    assert only_problem("- name: toy\n") == "toy.yaml:1: spec: must be a mapping, got a list"


# ---------------------------------------------------------------------------
# Top level: required and unknown keys, name, summary
# ---------------------------------------------------------------------------


def test_missing_required_keys_are_all_reported():
    assert problems_of("# only a comment\nhyperparameters: {}\n") == [
        "toy.yaml:2: name: missing required key",
        "toy.yaml:2: summary: missing required key",
        "toy.yaml:2: update: missing required key (or the `row`/`element` shorthand)",
        "toy.yaml:2: reference: missing required key",
    ]


def test_unknown_top_level_key_suggests_the_right_one():
    problem = only_problem(minimal(extra="hyperparameter: {}"))
    assert problem.startswith("toy.yaml:5: hyperparameter: unknown key; expected one of: name, summary,")
    assert "(did you mean 'hyperparameters'?)" in problem


def test_name_must_equal_the_file_stem():
    path = BAD / "not_the_stem.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert [str(p) for p in info.value.problems] == [
        f"{path}:1: name: 'something_else' must equal the file's stem 'not_the_stem'; "
        "rename the file or the optimizer"
    ]


@pytest.mark.parametrize(
    "value, message",
    [
        ("Toy", "'Toy' must match [a-z][a-z0-9_]*"),
        ("toy-2", "'toy-2' must match [a-z][a-z0-9_]*"),
        ("12", "must be a string, got integer 12"),
        ("class", "'class' is a C++ keyword"),
        ("lambda", "'lambda' is a Python keyword"),
        ("tbegen_sgd", "names starting with 'tbegen' are reserved for the generator"),
    ],
)
def test_bad_optimizer_names(value, message):
    assert only_problem(minimal(name=f"name: {value}"), path="<string>") == f"<string>:1: name: {message}"


@pytest.mark.parametrize(
    "summary, message",
    [
        ("summary: |\n  Two\n  lines.", "must be one line"),
        ("summary: 3", "must be a string, got integer 3"),
        ("summary: ''", "must not be empty"),
    ],
)
def test_bad_summary(summary, message):
    assert only_problem(minimal(summary=summary)) == f"toy.yaml:2: summary: {message}"


# ---------------------------------------------------------------------------
# Hyperparameters
# ---------------------------------------------------------------------------


def hyper(entry: str) -> str:
    """A minimal spec with one hyperparameter `lr: ENTRY` on line 6."""
    return minimal(extra=f"hyperparameters:\n  lr: {entry}")


@pytest.mark.parametrize(
    "entry, field, message",
    [
        ("{type: double}", "type", "must be float or int or bool, got string 'double'"),
        ("{default: 0.1}", "type", "missing required key"),
        ("{type: float, default: fast}", "default", "must be a float, got string 'fast'"),
        ("{type: float, default: true}", "default", "must be a float, got boolean true"),
        ("{type: int, default: 0.5}", "default", "must be an int, got float 0.5"),
        ("{type: int, default: false}", "default", "must be an int, got boolean false"),
        ("{type: bool, default: 1}", "default", "must be a bool, got integer 1"),
        ("{type: int, default: 99999999999999999999}", "default", "does not fit in int64: 99999999999999999999"),
        ("{type: float, default: null}", "default", "must be a float, got null (leave `default` out"),
        ("{type: int, choices: 3}", "choices", "must be a non-empty list, got integer 3"),
        ("{type: int, choices: []}", "choices", "must be a non-empty list, got a list"),
        ("{type: int, choices: [0, 1.5]}", "choices[1]", "must be an int, got float 1.5"),
        ("{type: int, default: 3, choices: [0, 1, 2]}", "default", "3 is not one of the choices [0, 1, 2]"),
        ("{type: float, doc: [a]}", "doc", "must be a string, got a list"),
        ("{type: float, defualt: 1.0}", "defualt", "unknown key; expected one of: type, default, doc, choices"),
    ],
)
def test_bad_hyperparameter(entry, field, message):
    problem = only_problem(hyper(entry))
    assert problem.startswith(f"toy.yaml:6: hyperparameters.lr.{field}: {message}")


def test_unknown_hyperparameter_key_suggestion():
    assert only_problem(hyper("{type: float, defualt: 1.0}")).endswith("(did you mean 'default'?)")


def test_float_choices_are_converted_and_checked():
    spec = load_spec_text(hyper("{type: float, default: 1, choices: [0, 1, 2.5]}"), "toy.yaml")
    assert spec.hyperparameter("lr").choices == (0.0, 1.0, 2.5)
    assert spec.hyperparameter("lr").default == 1.0


def test_choice_problem_names_the_item_line():
    text = minimal(extra="hyperparameters:\n  lr:\n    type: int\n    choices:\n      - 0\n      - x")
    assert only_problem(text) == "toy.yaml:10: hyperparameters.lr.choices[1]: must be an int, got string 'x'"


def test_comma_in_flow_mapping_doc_is_explained():
    problem = only_problem(hyper("{type: int, doc: 0 none, 1 L2}"))
    assert problem.startswith("toy.yaml:6: hyperparameters.lr.1 L2: unknown key")
    assert "quote text that contains commas" in problem


def test_section_must_be_a_mapping():
    assert only_problem(minimal(extra="hyperparameters: [lr]")) == (
        "toy.yaml:5: hyperparameters: must be a mapping of name -> {type, default, doc, choices, test, test_base}, got a list"
    )


def test_entry_must_be_a_mapping():
    assert only_problem(hyper("0.1")) == (
        "toy.yaml:6: hyperparameters.lr: must be a mapping {type, default, doc, choices, test, test_base}, got float 0.1"
    )


# ---------------------------------------------------------------------------
# Names: identifiers, reserved names, duplicates across sections
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, message",
    [
        ("bad-name", "'bad-name' is not a valid identifier ([A-Za-z][A-Za-z0-9_]*)"),
        ("2x", "'2x' is not a valid identifier ([A-Za-z][A-Za-z0-9_]*)"),
        ("_hidden", "names starting with '_' are reserved"),
        ("tbegen_tmp", "names starting with 'tbegen' are reserved for the generator"),
        ("g", "'g' is reserved: the generator binds it in every snippet"),
        ("step", "'step' is reserved: the generator binds it in every snippet"),
        ("D", "'D' is reserved: the generator binds it in every snippet"),
        ("row_mean", "'row_mean' is reserved: the generator binds it in every snippet"),
        ("torch", "'torch' is reserved: the reference binds it"),
        ("float", "'float' is a C++ keyword"),
        ("volatile", "'volatile' is a C++ keyword"),
        ("threadIdx", "'threadIdx' is a CUDA built-in"),
        ("lambda", "'lambda' is a Python keyword"),
        ("None", "'None' is a Python keyword"),
        ("on", "name must be a string, got boolean true (YAML reads yes/no/on/off/true/false as booleans"),
    ],
)
def test_bad_declared_names(name, message):
    text = minimal(extra=f"states:\n  {name}: {{per: row}}")
    problem = only_problem(text)
    expected_field = "True" if name == "on" else name
    assert problem.startswith(f"toy.yaml:6: states.{expected_field}: {message}")


def test_duplicate_names_across_sections():
    text = minimal(
        extra="hyperparameters:\n  m: {type: float}\nstates:\n  m: {per: row}\ntemporaries:\n  m: {per: element}"
    )
    assert problems_of(text) == [
        "toy.yaml:8: states.m: name 'm' is already declared in hyperparameters at line 6",
        "toy.yaml:10: temporaries.m: name 'm' is already declared in hyperparameters at line 6",
    ]


# ---------------------------------------------------------------------------
# States and temporaries
# ---------------------------------------------------------------------------


def state(entry: str) -> str:
    """A minimal spec with one state `m: ENTRY` on line 6."""
    return minimal(extra=f"states:\n  m: {entry}")


@pytest.mark.parametrize(
    "entry, field, message",
    [
        ("{per: column}", "per", "must be element or row or table, got string 'column'"),
        ("{init: 0.0}", "per", "missing required key"),
        ("{per: row, init: zero}", "init", "must be a number, got string 'zero'"),
        ("{per: row, init: true}", "init", "must be a number, got boolean true"),
        ("{per: row, dtype: float16}", "dtype", "must be fp32 or bf16 or fp16 (the storage type; arithmetic is float32), got string 'float16' (did you mean 'fp16'?)"),
        ("{per: row, dtype: int8}", "dtype", "must be fp32 or bf16 or fp16"),
        ("{per: row, shape: [1]}", "shape", "unknown key; expected one of: per, type, init, dtype, doc"),
        ("{per: element, type: int}", "type", "int states are per row only"),
        ("{per: row, type: int, init: 1.5}", "init", "must be an integer for an int state, got 1.5"),
        ("{per: row, type: int, dtype: fp16}", "dtype", "an int state is stored as int64"),
    ],
)
def test_bad_state(entry, field, message):
    assert only_problem(state(entry)).startswith(f"toy.yaml:6: states.m.{field}: {message}")


@pytest.mark.parametrize(
    "entry, field, message",
    [
        (
            "{per: row}",
            "per",
            "must be element, got string 'row' (only per-element temporaries are supported for now)",
        ),
        ("{}", "per", "missing required key"),
        ("{per: element, init: 0}", "init", "unknown key; expected one of: per"),
    ],
)
def test_bad_temporary(entry, field, message):
    text = minimal(extra=f"temporaries:\n  t: {entry}")
    assert only_problem(text) == f"toy.yaml:6: temporaries.t.{field}: {message}"


# ---------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------


def with_update(body: str) -> str:
    """A spec whose `update:` key is on line 3, followed by `body`."""
    return f"name: toy\nsummary: A toy.\nupdate:{body}\nreference: w -= g\n"


@pytest.mark.parametrize(
    "body, problem",
    [
        ("", "toy.yaml:3: update: must be a non-empty list of {row: CODE} / {element: CODE}, got null"),
        (" []", "toy.yaml:3: update: must be a non-empty list of {row: CODE} / {element: CODE}, got a list"),
        (" {row: x;}", "toy.yaml:3: update: must be a non-empty list of {row: CODE} / {element: CODE}, got a mapping"),
        ("\n  - w -= g;", "toy.yaml:4: update[0]: must be a mapping {row: CODE} or {element: CODE}, got string 'w -= g;'"),
        ("\n  - {}", "toy.yaml:4: update[0]: a stage needs one key, row or element"),
        ("\n  - element: ''", "toy.yaml:4: update[0].element: must be a non-empty string of code, got string ''"),
        ("\n  - element: 5", "toy.yaml:4: update[0].element: must be a non-empty string of code, got integer 5"),
        (
            "\n  - element: w -= g;\n    row: float x = 1;",
            "toy.yaml:4: update[0]: a stage has exactly one key, row or element; split it into two stages",
        ),
        (
            "\n  - element: w -= g;\n    unless: always",
            "toy.yaml:5: update[0].unless: unknown key; expected one of: row, element, when",
        ),
    ],
)
def test_bad_update(body, problem):
    assert only_problem(with_update(body)) == problem


def test_update_together_with_shorthand():
    text = with_update("\n  - element: w -= g;") + "row: float x = 1;\nelement: w -= g;\n"
    assert problems_of(text) == [
        "toy.yaml:6: row: cannot be combined with `update`; move it into the `update` list",
        "toy.yaml:7: element: cannot be combined with `update`; move it into the `update` list",
    ]


def test_no_stage_at_all():
    assert only_problem(minimal(element="")) == (
        "toy.yaml:1: update: missing required key (or the `row`/`element` shorthand)"
    )


def test_row_reduction_in_an_element_stage_names_its_line():
    body = "\n  - element: |\n      float a = g;\n      w -= row_sum (a) * g;"
    assert only_problem(with_update(body)) == (
        "toy.yaml:6:12: update[0].element: row_sum(...) is a row reduction; use it in a row stage only"
    )


def test_row_reduction_in_shorthand_element_stage():
    assert only_problem(minimal(element="element: w -= row_max(g);")) == (
        "toy.yaml:3:15: element: row_max(...) is a row reduction; use it in a row stage only"
    )


def test_unbalanced_row_reduction():
    body = "\n  - row: |\n      float s = 0;\n      s = row_min(fabsf(g);"
    assert only_problem(with_update(body)) == (
        "toy.yaml:6:18: update[0].row: unbalanced brackets: '(' is never closed (missing ')')"
    )


def test_nested_row_reductions():
    assert only_problem(minimal(element="row: float s = row_sum(g * row_mean(g));")) == (
        "toy.yaml:3:28: row: row_mean(...) is nested in another row reduction"
    )


def test_balanced_row_reductions_are_fine():
    spec = load_spec_text(minimal(element="row: float s = row_sum((g + 1) * (w - 2)) + row_max(g);"), "toy.yaml")
    assert spec.stages[0].kind == "row"


# ---------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------


def test_reference_syntax_error_names_the_yaml_line():
    text = minimal(reference="reference: |\n  a = 1\n  w -= (g\n  b = 2\n")
    problem = only_problem(text)
    assert problem.startswith("toy.yaml:6: reference: not valid Python: ")
    assert "never closed" in problem


def test_reference_plain_scalar_error_is_on_its_line():
    assert only_problem(minimal(reference="reference: w -= = g")) == (
        "toy.yaml:4: reference: not valid Python: invalid syntax"
    )


@pytest.mark.parametrize(
    "reference, problem",
    [
        ("reference: |\n\n", "toy.yaml:4: reference: must be a non-empty string of Python code, got string ''"),
        ("reference: 3", "toy.yaml:4: reference: must be a non-empty string of Python code, got integer 3"),
        ("", "toy.yaml:1: reference: missing required key"),
    ],
)
def test_bad_reference(reference, problem):
    assert only_problem(minimal(reference=reference)) == problem


# ---------------------------------------------------------------------------
# Several problems in one file
# ---------------------------------------------------------------------------


def test_all_problems_in_a_file_are_reported():
    path = BAD / "many_problems.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(path)
    prefixes = [f"{p.line}: {p.field}" for p in info.value.problems]
    assert prefixes == [
        "4: hyperparameters.learning_rate.default",
        "5: hyperparameters.eps.type",
        "6: hyperparameters.g",
        "8: states.momentum.per",
        "8: states.momentum.dtype",
        "9: states.learning_rate",
        "11: temporaries.r.per",
        "14: update[0].row",
        "16: update[1].element",
        "17: update[2].elemnt",
        "20: reference",
        "21: colour",
    ]
    text = str(info.value)
    assert len(text.splitlines()) == 12
    assert all(line.startswith(f"{path}:") for line in text.splitlines())
    assert "states.momentum.dtype: must be fp32 or bf16 or fp16" in text


# ---------------------------------------------------------------------------
# find_spec / list_specs
# ---------------------------------------------------------------------------


def make_specs(directory: Path, *names: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_text(minimal(name=f"name: {Path(name).stem}"))


def test_list_specs_is_sorted(tmp_path):
    make_specs(tmp_path, "sgd.yaml", "adam.yaml", "lamb.yml")
    (tmp_path / "notes.txt").write_text("not a spec")
    assert list_specs(tmp_path) == [tmp_path / "adam.yaml", tmp_path / "lamb.yml", tmp_path / "sgd.yaml"]
    assert list_specs(tmp_path / "missing") == []


def test_find_spec_by_name_and_by_path(tmp_path):
    make_specs(tmp_path, "sgd.yaml", "lamb.yml")
    assert find_spec("sgd", search_dir=tmp_path) == tmp_path / "sgd.yaml"
    assert find_spec("lamb", search_dir=tmp_path) == tmp_path / "lamb.yml"
    assert find_spec(tmp_path / "sgd.yaml") == tmp_path / "sgd.yaml"
    assert find_spec(str(tmp_path / "sgd.yaml")) == tmp_path / "sgd.yaml"
    assert load_spec(find_spec("sgd", search_dir=tmp_path)).name == "sgd"


def test_find_spec_unknown_name_lists_the_available_ones(tmp_path):
    make_specs(tmp_path, "sgd.yaml", "adam.yaml")
    with pytest.raises(SpecNotFoundError) as info:
        find_spec("adamw", search_dir=tmp_path)
    assert isinstance(info.value, ValueError)
    assert "unknown optimizer 'adamw'" in str(info.value)
    assert "available: adam, sgd" in str(info.value)


def test_find_spec_missing_file(tmp_path):
    with pytest.raises(SpecNotFoundError, match="no such spec file"):
        find_spec(tmp_path / "nope.yaml")


def test_default_search_dir_is_the_repository_optimizers_directory():
    repo = Path(spec_module.__file__).resolve().parent.parent
    assert spec_module.DEFAULT_SPEC_DIR == repo / "optimizers"
    with pytest.raises(SpecNotFoundError) as info:
        find_spec("no_such_optimizer_xyz")
    assert str(repo / "optimizers") in str(info.value)


def test_reduction_of_a_name_set_earlier_in_the_same_stage_is_rejected(tmp_path):
    path = tmp_path / "redorder.yaml"
    path.write_text(
        "name: redorder\nsummary: x\nstates:\n  c: {per: row}\nupdate:\n  - row: |\n      c = 2.0f;\n"
        "      float s = row_sum(c * g);\n  - element: |\n      w -= s * g;\nreference: |\n  w -= g\n"
    )
    with pytest.raises(SpecError) as err:
        load_spec(str(path))
    assert f"{path}:8:17: update[0].row: row_sum(...) uses 'c', which this stage sets before it" in str(err.value)


@pytest.mark.parametrize("name", ["seed", "pooling", "weights", "offsets"])
def test_operator_argument_names_are_reserved(tmp_path, name):
    path = tmp_path / "opnames.yaml"
    path.write_text(
        f"name: opnames\nsummary: x\nhyperparameters:\n  {name}: {{type: float, default: 1.0}}\n"
        "element: |\n  w -= g;\nreference: |\n  w -= g\n"
    )
    with pytest.raises(SpecError) as err:
        load_spec(str(path))
    assert f"hyperparameters.{name}" in str(err.value)


def test_hyperparameter_test_values(tmp_path):
    path = tmp_path / "tv.yaml"
    path.write_text(
        "name: tv\nsummary: x\nhyperparameters:\n  l1: {type: float, default: 0.0, test: [0.001, 1]}\n"
        "  mode: {type: int, default: 0, choices: [0, 1], test: [2]}\n"
        "element: |\n  w -= g;\nreference: |\n  w -= g\n"
    )
    with pytest.raises(SpecError) as err:
        load_spec(str(path))
    assert f"{path}:5: hyperparameters.mode.test: [2] not among the choices [0, 1]" in str(err.value)
    path.write_text(path.read_text().replace("test: [2]", "test: [1]"))
    spec = load_spec(str(path))
    assert spec.hyperparameter("l1").test_values == (0.001, 1.0)
    assert spec.hyperparameter("mode").test_values == (1,)


def test_hyperparameter_test_base(tmp_path):
    """`test_base`: the value a hyperparameter takes in every other test case; checked like a default."""
    path = tmp_path / "tb.yaml"
    path.write_text(
        "name: tb\nsummary: x\nhyperparameters:\n  decay: {type: float, default: 0.0, test_base: yes}\n"
        "  mode: {type: int, default: 0, choices: [0, 1], test_base: 2}\n"
        "element: |\n  w -= g * (1.0f - decay) + mode;\nreference: |\n  w -= g * (1.0 - decay) + mode\n"
    )
    with pytest.raises(SpecError) as err:
        load_spec(str(path))
    assert f"{path}:4: hyperparameters.decay.test_base: must be a float, got boolean true" in str(err.value)
    assert f"{path}:5: hyperparameters.mode.test_base: 2 is not one of the choices [0, 1]" in str(err.value)
    path.write_text(path.read_text().replace("test_base: yes", "test_base: 0.05").replace("test_base: 2", "test: [1]"))
    spec = load_spec(str(path))
    assert spec.hyperparameter("decay").test_base == 0.05
    assert spec.hyperparameter("mode").test_base is None


def test_harness_cases_come_from_the_spec(tmp_path):
    """The harness's hyperparameter cases are read from the spec (`choices`, `test`, `test_base`),
    never from hyperparameter names it knows: a spec naming its decay differently gets the same."""
    from tbegen.harness import test_hyperparameters

    text = (
        "name: {name}\nsummary: x\nhyperparameters:\n"
        "  {decay}: {{type: float, default: 0.0, test_base: 0.05}}\n"
        "  mode: {{type: int, default: 0, choices: [0, 1]}}\n"
        "  clip: {{type: float, default: 0.0, test: [0.3]}}\n"
        "element: |\n  w -= g * (1.0f - {decay}) + mode + clip;\nreference: |\n  w -= g * (1.0 - {decay}) + mode + clip\n"
    )
    cases = {}
    for decay in ("weight_decay", "l2_penalty"):
        path = tmp_path / f"h_{decay}.yaml"
        path.write_text(text.format(name=f"h_{decay}", decay=decay))
        cases[decay] = test_hyperparameters(load_spec(str(path)))
    assert cases["weight_decay"] == [
        (("weight_decay", 0.05), ("mode", 0)), (("weight_decay", 0.05), ("mode", 1)),
        (("weight_decay", 0.05), ("clip", 0.3)),
    ]
    rename = {"weight_decay": "l2_penalty"}
    assert cases["l2_penalty"] == [tuple((rename.get(k, k), v) for k, v in c) for c in cases["weight_decay"]]
    # nothing but a base: the base alone
    path = tmp_path / "h_base.yaml"
    path.write_text("name: h_base\nsummary: x\nhyperparameters:\n  decay: {type: float, default: 0.0, test_base: 0.1}\n"
                    "element: |\n  w -= g + decay;\nreference: |\n  w -= g + decay\n")
    assert test_hyperparameters(load_spec(str(path))) == [(("decay", 0.1),)]
