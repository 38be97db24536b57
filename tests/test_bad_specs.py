"""The bad-spec corpus (tests/specs_bad): each spec's exact `tbegen validate` output, and proof
that none of them reaches a compiler through any command.

Each `NAME.yaml` has its expected output beside it in `NAME.expected` (problems as
FILE:LINE[:COL]: FIELD: MESSAGE, warnings included). To add a case, write the spec, run
`python -m tbegen validate tests/specs_bad/NAME.yaml 2> tests/specs_bad/NAME.expected` from the
repository root, and check every line of it by hand.
"""

from pathlib import Path

import pytest
from click.testing import CliRunner

from tbegen import build
from tbegen.cli import main
from tbegen.spec import SpecError, load_spec

ROOT = Path(__file__).resolve().parent.parent
BAD = Path("tests") / "specs_bad"
CORPUS = sorted(p.stem for p in (ROOT / BAD).glob("*.yaml"))


def test_the_corpus_is_large_enough():
    assert len(CORPUS) >= 30


@pytest.mark.parametrize("name", CORPUS)
def test_validate_prints_exactly_the_expected_problems(monkeypatch, name):
    monkeypatch.chdir(ROOT)
    expected = (ROOT / BAD / f"{name}.expected").read_text()
    result = CliRunner().invoke(main, ["validate", str(BAD / f"{name}.yaml")])
    assert result.exit_code == 1
    assert result.output == expected


@pytest.fixture
def no_compiler(monkeypatch):
    """Counts (and refuses) every attempt to compile an extension."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args[0] if args else "?")
        raise AssertionError("a bad spec reached the compiler")

    monkeypatch.setattr(build, "_compile", refuse)
    monkeypatch.setattr(build, "_compile_in_worker", refuse)
    return calls


def test_no_bad_spec_reaches_the_compiler(monkeypatch, tmp_path, no_compiler):
    monkeypatch.chdir(ROOT)
    runner = CliRunner()
    for name in CORPUS:
        path = str(BAD / f"{name}.yaml")
        with pytest.raises(SpecError):
            load_spec(path)
        for args in (["test", "--optimizer", path], ["test", "--optimizer", path, "--device", "cuda"],
                     ["render", "--optimizer", path, "--out", str(tmp_path / name)]):
            result = runner.invoke(main, args)
            assert result.exit_code != 0, (name, args, result.output)
            assert "Traceback" not in result.output
            assert not (tmp_path / name / name).exists()
    assert no_compiler == []  # none of the corpus's specs reached a compiler


def test_the_issue_14_example_is_rejected_at_the_assignment(monkeypatch):
    """The spec of issue 14 (a row-wise Adagrad that accumulates its per-row state in an element
    stage) passed `tbegen validate` and the CPU tests and trained wrong on the GPU."""
    monkeypatch.chdir(ROOT)
    path = str(BAD / "row_acc_in_element.yaml")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    (problem,) = info.value.problems
    assert (problem.file, problem.line, problem.col, problem.field) == (path, 12, 7, "update[1].element")
    assert str(problem).startswith(f"{path}:12:7: update[1].element: 'acc' is a per-row state")
    assert "accumulate it with row_sum in a row stage" in problem.message
