"""The authoring loop's rough edges of issue 26, each pinned: a spec rendered from outside
optimizers/ and `tbegen check`'s suggested fix; a reference-only edit rebuilds nothing."""

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from tbegen import build
from tbegen import render as rnd
from tbegen.cli import main
from tbegen.spec import list_specs, load_spec

ROOT = Path(__file__).resolve().parent.parent

OWN_SPEC = """\
name: my_own_opt
summary: A spec that lives outside optimizers/.
hyperparameters:
  learning_rate: {type: float, default: 0.01}
update:
  - element: |
      w -= learning_rate * g;
reference: |
  w -= learning_rate * g
"""


def test_check_after_rendering_a_spec_from_elsewhere_and_its_suggested_fix(tmp_path, monkeypatch):
    out = tmp_path / "generated"
    monkeypatch.setattr(rnd, "DEFAULT_OUT", out)  # the project's generated/, here a copy
    runner = CliRunner()
    assert runner.invoke(main, ["render", "--all"]).exit_code == 0
    spec = tmp_path / "elsewhere" / "my_own_opt.yaml"
    spec.parent.mkdir()
    spec.write_text(OWN_SPEC)
    result = runner.invoke(main, ["render", "--optimizer", str(spec)])
    assert result.exit_code == 0, result.output
    assert (out / "my_own_opt" / "ops.cpp").is_file()
    assert "my_own_opt's spec is not in optimizers/" in result.output
    assert "`tbegen render --all` removes it again" in result.output
    (out / "my_own_opt" / "__pycache__").mkdir()  # as if its module had been imported
    (out / "my_own_opt" / "__pycache__" / "module.cpython-311.pyc").write_bytes(b"\0")
    result = runner.invoke(main, ["check"])
    assert result.exit_code == 1
    assert result.output.rstrip().endswith("differ from a fresh render. Fix: tbegen render --all")
    # the suggested fix works: render --all removes what tbegen wrote for the other spec
    result = runner.invoke(main, ["render", "--all"])
    assert result.exit_code == 0, result.output
    assert f"removed {out / 'my_own_opt' / 'ops.cpp'}" in result.output
    assert not (out / "my_own_opt").exists()
    assert runner.invoke(main, ["check"]).exit_code == 0
    # a file tbegen did not write is never removed: check names it as the user's to delete
    (out / "sgd" / "notes.txt").write_text("mine\n")
    assert runner.invoke(main, ["render", "--all"]).exit_code == 0
    assert (out / "sgd" / "notes.txt").read_text() == "mine\n"
    result = runner.invoke(main, ["check"])
    assert result.exit_code == 1
    assert f"Fix: tbegen render --all, and delete {out / 'sgd' / 'notes.txt'} (not written by tbegen)" in result.output


def test_rendering_a_shipped_spec_or_into_another_folder_has_no_note(tmp_path, monkeypatch):
    monkeypatch.setattr(rnd, "DEFAULT_OUT", tmp_path / "generated")
    runner = CliRunner()
    result = runner.invoke(main, ["render", "--optimizer", "sgd"])
    assert result.exit_code == 0 and "note:" not in result.output
    spec = tmp_path / "my_own_opt.yaml"
    spec.write_text(OWN_SPEC)
    result = runner.invoke(main, ["render", "--optimizer", str(spec), "--out", str(tmp_path / "mine")])
    assert result.exit_code == 0 and "note:" not in result.output
    assert (tmp_path / "mine" / "my_own_opt" / "ops.cpp").is_file()
    # another folder compared by check: the fix it suggests names that folder, and works
    mine = tmp_path / "mine"
    result = runner.invoke(main, ["check", "--out", str(mine)])
    assert result.exit_code == 1
    assert result.output.rstrip().endswith(f"Fix: tbegen render --all --out {mine}")
    assert runner.invoke(main, ["render", "--all", "--out", str(mine)]).exit_code == 0
    assert runner.invoke(main, ["check", "--out", str(mine)]).exit_code == 0
    assert not (mine / "my_own_opt").exists()


def _keys(path):
    spec = load_spec(str(path))
    return [build.cache_key(spec.name, build.spec_files(spec, with_cuda), with_cuda) for with_cuda in (False, True)]


@pytest.mark.parametrize("path", list_specs(), ids=lambda p: p.stem)
def test_editing_only_the_reference_rebuilds_nothing(tmp_path, path):
    """The reference is Python that `tbegen test` runs, never compiled: a change to it alone, even
    one that moves every later line of the file (the reference moved to the top), keeps the build's
    cache key. A change to a stage changes it (the test can fail)."""
    text = path.read_text()
    copy = tmp_path / path.name  # (the file's path is in the #line directives: edit in place)
    copy.write_text(text)
    before = _keys(copy)
    match = re.search(r"^reference: \|\n((?:  .*\n|\n)+)", text, re.M)
    assert match, "every shipped spec has a block reference"
    body = match.group(1)
    edited = "  # checked against torch by hand\n  unused = 2.0 * 3.0\n" + body
    moved = text.replace(match.group(0), "")
    first_key = re.search(r"^(hyperparameters|states|update|row|element):", moved, re.M)
    moved = moved[: first_key.start()] + "reference: |\n" + edited + moved[first_key.start():]
    copy.write_text(moved)
    assert load_spec(str(copy)).reference != load_spec(str(path)).reference
    assert _keys(copy) == before
    # the stages, on the other hand, are compiled
    stage = re.search(r"^(\s+)(w (?:-=|=|\+=) .*;)$", moved, re.M)  # (C++: the statement's `;`)
    assert stage or path.stem == "none", "a shipped optimizer that never writes w"
    if stage:
        copy.write_text(moved[: stage.start(2)] + "w = w * 1.0f;\n" + stage.group(1) + moved[stage.start(2):])
        assert _keys(copy) != before


def _sgd_copy(tmp_path, monkeypatch, first_reference_line=""):
    """optimizers/sgd.yaml copied to tmp_path (with a line put first in its reference), tested
    with the shipped sgd's library (the reference is never compiled: the library is the same)."""
    shipped = ROOT / "optimizers" / "sgd.yaml"
    ops = build.load_ops(load_spec(str(shipped)), with_cuda=False)
    monkeypatch.setattr(build, "load_ops", lambda spec, **kwargs: ops)
    text = shipped.read_text()
    if first_reference_line:
        text = text.replace("\nreference: |\n", f"\nreference: |\n  {first_reference_line}\n", 1)
    path = tmp_path / "sgd.yaml"
    path.write_text(text)
    line = text.splitlines().index("reference: |") + 2  # the reference's first line
    return path, line


def test_a_reference_that_raises_is_reported_at_its_yaml_line_without_a_traceback(tmp_path, monkeypatch):
    # (validate runs the reference on rows of D = 4 and 1, tbegen/reference_check.py: this one
    # raises only on the wider rows of `tbegen test`)
    statement = "bad = torch.ones(2) + torch.ones(3) if D > 4 else 0"
    path, line = _sgd_copy(tmp_path, monkeypatch, statement)
    assert CliRunner().invoke(main, ["validate", str(path)]).exit_code == 0  # (only running it tells)
    result = CliRunner().invoke(main, ["test", "--optimizer", str(path), "--quick"])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert f"{path}:{line}: reference: RuntimeError: The size of tensor a (2) must match" in result.output
    assert f"(in `{statement}`)" in result.output


def test_a_passing_test_gives_each_worst_error_with_its_tolerance(tmp_path, monkeypatch):
    path, _ = _sgd_copy(tmp_path, monkeypatch)
    result = CliRunner().invoke(main, ["test", "--optimizer", str(path), "--quick"])
    assert result.exit_code == 0, result.output
    assert re.search(r"worst error \(float32 weights\), nearest its tolerance: \S+ \S+, tolerance \S+ \(\d+% of it\)",
                     result.output), result.output
    assert re.search(r"lane split .* agree with the CPU kernel; nearest its tolerance: \S+ \S+, tolerance", result.output)
