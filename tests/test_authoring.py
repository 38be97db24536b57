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
