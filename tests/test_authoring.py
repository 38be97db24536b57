"""Authoring tools (issue 10): the spec's dense-gradient property, `tbegen schema`, `tbegen new`,
and compiler errors mapped back to the YAML."""

from __future__ import annotations

import textwrap

import pytest

from tbegen.spec import SpecError, list_specs, load_spec, load_spec_text

TOY = """\
name: toy
summary: A toy.
{extra}
element: |
  w = g;
reference: |
  w = g.clone()
"""


# ---- dense_gradient ----------------------------------------------------------------------------


def test_dense_gradient_is_declared_by_the_spec_not_by_its_name():
    assert load_spec_text(TOY.format(extra="dense_gradient: true"), "toy.yaml").dense_gradient
    assert not load_spec_text(TOY.format(extra=""), "toy.yaml").dense_gradient
    shipped = {p.stem: load_spec(p).dense_gradient for p in list_specs()}
    assert [name for name, dense in shipped.items() if dense] == ["none"]


def test_dense_gradient_must_be_a_bool():
    with pytest.raises(SpecError) as e:
        load_spec_text(TOY.format(extra="dense_gradient: yes please"), "toy.yaml")
    assert str(e.value) == "toy.yaml:3: dense_gradient: must be true or false, got string 'yes please'"


def test_dense_gradient_spec_cannot_have_states():
    text = TOY.format(extra="dense_gradient: true\nstates:\n  acc: {per: row, init: 0}")
    text = text.replace("w = g;", "acc = 1.0f;\n  w = g;")
    with pytest.raises(SpecError) as e:
        load_spec_text(text, "toy.yaml")
    assert "toy.yaml:3: dense_gradient: a dense-gradient spec cannot declare states (acc)" in str(e.value)


def test_no_code_branches_on_an_optimizer_name():
    """Behaviour belongs in specs: no `.name == "..."` comparison of a spec in tbegen/ or templates/."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    pattern = re.compile(r"""\.name\s*(==|!=|in)\s*[("'\[]""")
    offenders = [
        f"{p.relative_to(root)}:{n}"
        for folder in ("tbegen", "templates")
        for p in sorted((root / folder).rglob("*"))
        if p.is_file() and p.suffix in (".py", ".h", ".cpp", ".cu", ".j2", ".jinja")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "spec" in line and pattern.search(line)
    ]
    assert offenders == []


# ---- compiler errors mapped to the YAML ------------------------------------------------------

# Passes the snippet checker (the names and the structure are right) but not the compiler:
# `^` of floats is a C++ type error (the type checker leaves bitwise operators to the compiler).
# Indented differently from the generated code on purpose.
UNCOMPILABLE = """\
name: toy
summary: A toy that passes the checker but not the compiler.
hyperparameters:
  lr: {type: float, default: 0.1}
update:
  - row: |
        float scale = row_mean(g ^ 2.0f) + (lr ^ 3.0f);
  - element: |
      float x = lr * scale;
      w = x + w ^ 2.0f;
reference: |
  w = w - lr * g
table:
  - when: step % 2 == 0
    element: |
          w = partner(w) ^ lr;
table_reference: |
  w = w
"""


def test_compiler_errors_are_reported_at_the_yaml_column(tmp_path):
    """One CPU build (~20 s): the compiler's lines, mapped to the spec's line and exact column,
    no traceback, the full log kept."""
    from click.testing import CliRunner

    from tbegen.cli import main

    path = tmp_path / "toy.yaml"
    path.write_text(UNCOMPILABLE)
    result = CliRunner().invoke(main, ["test", "-o", str(path), "--quick"])
    assert result.exit_code == 1
    out = result.output
    assert "Traceback" not in out
    # (`^` on floats: the type checker reports `%` on floats itself, before any compiler; it leaves
    # bitwise operators to the compiler)
    bad = "error: invalid operands of types ‘{}’ and ‘float’ to binary ‘operator^’"
    if "‘" not in out:  # a compiler speaking plain ASCII quotes
        bad = bad.replace("‘", "'").replace("’", "'")
    assert f"{path}:7:34: update[0].row: " + bad.format("const float") in out  # inside row_mean(...)
    assert f"{path}:7:48: update[0].row: " + bad.format("const float") in out  # after the rewritten reduction
    assert f"{path}:10:17: update[1].element: " + bad.format("float") in out
    # a whole-table stage's line, its partner(...) rewritten (the type differs between compilers'
    # wording, so only the place and the operator are required)
    assert any(line.startswith(f"{path}:16:26: table[0].element: error: invalid operands")
               for line in out.splitlines()), out
    log_line = [line for line in out.splitlines() if line.startswith("full compiler log: ")]
    assert len(log_line) == 1
    log = open(log_line[0][len("full compiler log: "):]).read()
    assert f"{path}:10:19: error:" in log  # the compiler's own column counts the generated indentation
    assert len(out.splitlines()) <= 9


def test_nvcc_diagnostics_take_their_column_from_the_caret():
    from tbegen.compile_errors import parse_diagnostics

    log = ('optimizers/toy.yaml(10): error: expression must have integral or unscoped enum type\n'
           '              w = x + w % 2.0f;\n'
           '                      ^\n'
           '\n'
           'gen.cu(5): error: something else\n')
    diags = parse_diagnostics(log)
    assert [(d.file, d.line, d.col) for d in diags] == [("optimizers/toy.yaml", 10, 23), ("gen.cu", 5, None)]


def test_column_mapping_through_generated_indentation_and_line_directives():
    from tbegen.compile_errors import generated_lines, yaml_column

    files = {"a/ops.cpp": 'int f() {\n#line 9 "s.yaml"\n          w = x + w % 2.0f;\n#line 4 "a/ops.cpp"\n}\n'}
    lines = generated_lines(files)
    assert lines[("s.yaml", 9)] == ["          w = x + w % 2.0f;"]
    # the compiler's column 21 is the `%`; in the snippet line it is column index 10
    assert yaml_column(lines[("s.yaml", 9)], "w = x + w % 2.0f;", 21) == 10
    # just past the last character (where "expected ';'" points)
    assert yaml_column(lines[("s.yaml", 9)], "w = x + w % 2.0f;", 28) == 17


# ---- tbegen schema -----------------------------------------------------------------------------


def _schema():
    import json

    from click.testing import CliRunner

    from tbegen.cli import main

    result = CliRunner().invoke(main, ["schema"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _validator():
    jsonschema = pytest.importorskip("jsonschema")
    schema = _schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_schema_covers_every_key_the_loader_knows():
    from tbegen import spec as sp

    schema = _schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert set(schema["properties"]) == set(sp.TOP_KEYS)
    assert set(schema["properties"]["hyperparameters"]["additionalProperties"]["properties"]) == set(sp.HYPERPARAMETER_KEYS)
    assert set(schema["properties"]["states"]["additionalProperties"]["properties"]) == set(sp.STATE_KEYS)


@pytest.mark.parametrize("path", list_specs(), ids=lambda p: p.stem)
def test_every_shipped_spec_satisfies_the_schema(path):
    import yaml

    errors = [e.message for e in _validator().iter_errors(yaml.safe_load(path.read_text()))]
    assert errors == []


@pytest.mark.parametrize("change, expected", [
    (lambda d: d.pop("summary"), "'summary' is a required property"),
    (lambda d: d.update(colour="red"), "Additional properties are not allowed ('colour' was unexpected)"),
    (lambda d: d["hyperparameters"]["eps"].update(default="fast"), "'fast' is not of type 'number'"),
    (lambda d: d["states"]["momentum"].update(per="column"), "'column' is not one of ['element', 'row', 'table']"),
    (lambda d: d.update(row="x = 1.0f;"), "should not be valid"),
    (lambda d: d["update"].append({"row": "a;", "element": "b;"}), "is valid under each of"),
    (lambda d: d["update"].append({"when": "max_norm > 0.0f"}), "is not valid under any of the given schemas"),
    (lambda d: d.update(name="Adam"), "does not match"),
])
def test_schema_rejects_what_the_loader_rejects(change, expected):
    import copy

    import yaml

    from tbegen.spec import find_spec

    doc = yaml.safe_load(find_spec("rowwise_adagrad").read_text())
    assert list(_validator().iter_errors(doc)) == []
    change(doc)
    messages = [e.message for e in _validator().iter_errors(doc)]
    assert any(expected in m for m in messages), messages



# ---- tbegen new --------------------------------------------------------------------------------


def _new(*args):
    from click.testing import CliRunner

    from tbegen.cli import main

    return CliRunner().invoke(main, ["new", *args])


def test_new_scaffolds_a_spec_that_validates_and_passes_the_numerical_test(tmp_path):
    """One CPU build (float32 weights only, ~10 s) and one harness case."""
    import torch

    from tbegen import build, harness

    result = _new("my_opt", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    path = tmp_path / "my_opt.yaml"
    assert f"wrote {path}" in result.output
    warnings = []
    spec = load_spec(path, warnings)
    assert (spec.name, warnings) == ("my_opt", [])
    assert [s.kind for s in spec.stages] == ["row", "element"] and spec.states and spec.hyperparameters
    ops = build.load_ops(spec, with_cuda=False, fp32_weights_only=True)  # (`tbegen test --quick`'s library)
    case = harness.standard_cases(spec, dtypes=(torch.float32,))[0]
    r = harness.run_case(spec, ops, case, device="cpu")
    assert r.failures == []
    assert {"weights", "sum_sq"} <= set(r.errors) and r.worst < 1e-4


def test_new_from_an_existing_spec_keeps_its_text_under_the_new_name(tmp_path):
    result = _new("adam2", "--from", "adam", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    from tbegen.spec import find_spec

    original = find_spec("adam").read_text()
    copied = (tmp_path / "adam2.yaml").read_text()
    assert copied == original.replace("name: adam\n", "name: adam2\n", 1)
    assert [s.code for s in load_spec(tmp_path / "adam2.yaml").stages] == [s.code for s in load_spec(find_spec("adam")).stages]


@pytest.mark.parametrize("args, message", [
    (["float"], "float.yaml:5: name: 'float' is a C++ keyword"),
    (["Bad-Name"], "name: 'Bad-Name' must match [a-z][a-z0-9_]*"),
    (["x", "--from", "nosuch"], "unknown optimizer 'nosuch'"),
])
def test_new_refuses_what_would_not_validate(tmp_path, args, message):
    result = _new(*args, "--out", str(tmp_path))
    assert result.exit_code == 1
    assert message in result.output
    assert list(tmp_path.iterdir()) == []


def test_new_never_overwrites(tmp_path):
    (tmp_path / "mine.yaml").write_text("precious")
    result = _new("mine", "--out", str(tmp_path))
    assert result.exit_code == 1 and "already exists" in result.output
    assert (tmp_path / "mine.yaml").read_text() == "precious"
