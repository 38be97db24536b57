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


def _found_only_by_running_the_reference(path: str) -> bool:
    """Whether the spec passes the static checks (its mistake shows only when its reference runs:
    tbegen/reference_check.py, in `validate` and `test`)."""
    try:
        load_spec(path)
    except SpecError:
        return False
    return True


def test_no_bad_spec_reaches_the_compiler(monkeypatch, tmp_path, no_compiler):
    monkeypatch.chdir(ROOT)
    runner = CliRunner()
    for name in CORPUS:
        path = str(BAD / f"{name}.yaml")
        with pytest.raises(SpecError):
            load_spec(path, run_reference=True)
        commands = [["test", "--optimizer", path], ["test", "--optimizer", path, "--device", "cuda"]]
        if not _found_only_by_running_the_reference(path):
            # (render neither runs nor needs the reference: a reference mistake does not stop it)
            commands.append(["render", "--optimizer", path, "--out", str(tmp_path / name)])
        for args in commands:
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


# the corpus's cases that only running the reference finds, each with what it shows
REFERENCE_RUN_CASES = {
    "reference_int_state_divided": "state 'hits' (per: row, type: int) a float32 tensor",
    "reference_int_state_incremented_by_float": "`count += weight` raised RuntimeError",
    "reference_row_state_not_reduced": "state 'last_square' (per: row) shaped [rows, D], not [rows]",
    "reference_shape_mismatch": "`w -= multiplier * g` raised RuntimeError",
    "reference_float_state_bool": "state 'active' (per: row) a bool tensor",
}


def test_the_reference_run_cases_pass_the_static_checks_and_fail_validate(monkeypatch):
    """Each of these passes every static check (so the run is what finds it) and `validate` reports
    it at the reference's line, with no traceback; exactly these corpus cases need the run."""
    monkeypatch.chdir(ROOT)
    only_by_run = {name for name in CORPUS if _found_only_by_running_the_reference(str(BAD / f"{name}.yaml"))}
    assert only_by_run == set(REFERENCE_RUN_CASES)
    for name, shows in REFERENCE_RUN_CASES.items():
        with pytest.raises(SpecError) as info:
            load_spec(str(BAD / f"{name}.yaml"), run_reference=True)
        (problem,) = info.value.problems
        assert problem.field == "reference" and shows in problem.message, (name, problem)
        assert "(run on 3 rows of D = 4 with the default hyperparameters, step = 2)" in problem.message
