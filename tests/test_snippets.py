"""The snippet checker (tbegen/snippets.py) beyond the bad-spec corpus: legal constructs pass,
columns are exact for every way YAML can hold a snippet, warnings do not fail validation."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from tbegen.cli import main
from tbegen.spec import SpecError, load_spec, load_spec_text

GOOD = Path(__file__).resolve().parent / "specs_good"

HEAD = "name: toy\nsummary: x\nhyperparameters:\n  learning_rate: {type: float, default: 0.1}\n"


def problems(text):
    with pytest.raises(SpecError) as info:
        load_spec_text(text, "toy.yaml")
    return [str(p) for p in info.value.problems]


def test_legal_edge_constructs_pass_without_warnings():
    warnings = []
    load_spec(GOOD / "edge.yaml", warnings)
    assert warnings == []


@pytest.mark.parametrize("element,col", [
    ("w -= learnin_rate * g;", 15),  # plain scalar on the key's line
    ('"w -= learnin_rate * g;"', 16),  # quoted
    ("'w -= learnin_rate * g;'", 16),
    ("|\n  w -= learnin_rate * g;", 8),  # literal block
    ("|\n      w -= learnin_rate * g;", 12),  # deeper indentation
    ("|2\n    w -= learnin_rate * g;", 10),  # explicit indentation: the extra spaces are code
])
def test_columns_are_exact(element, col):
    text = HEAD + f"element: {element}\nreference: |\n  w -= learning_rate * g\n"
    line = 5 if element.startswith(("w", "'", '"')) else 6
    assert problems(text) == [
        f"toy.yaml:{line}:{col}: element: unknown name 'learnin_rate' (did you mean 'learning_rate'?)"
    ]


def test_every_problem_at_once_in_file_order():
    text = HEAD + (
        "states:\n  acc: {per: row}\n"
        "update:\n"
        "  - row: |\n      float s = sqrtf(acc) + g;\n"
        "  - element: |\n      acc += g;\n      w -= learning_rate * s\n"
        "reference: |\n  w -= learning_rat * g\n"
    )
    assert problems(text) == [
        "toy.yaml:9:30: update[0].row: 'g' has one value per element; in a row stage use it only inside a row "
        "reduction (row_sum, row_mean, row_max, row_min)",
        "toy.yaml:11:7: update[1].element: 'acc' is a per-row state: an element stage may not assign it (on the GPU "
        "each lane would update its own copy from its slice of the row); accumulate it with row_sum in a row "
        "stage: `acc += row_sum(...);`",
        "toy.yaml:12:29: update[1].element: missing ';' at the end of this statement",
        "toy.yaml:14:8: reference: unknown name 'learning_rat' (did you mean 'learning_rate'?)",
    ]


def test_warnings_do_not_fail_validation(tmp_path):
    path = tmp_path / "toy.yaml"
    path.write_text(HEAD + "  unused: {type: int, default: 1}\nelement: w -= learning_rate * g;\n"
                    "reference: |\n  w -= learning_rate * g\n")
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 0
    assert result.output == (f"{path}:5:3: hyperparameters.unused: warning: 'unused' is never used in the update "
                             f"stages\n{path}: ok (1 warning(s))\n")


def test_the_checker_can_be_bypassed_only_on_request():
    text = HEAD + "states:\n  acc: {per: row}\nelement: |\n  acc += g;\n  w -= learning_rate * g;\n" \
                  "reference: |\n  w -= learning_rate * g\n"
    assert len(problems(text)) == 1
    spec = load_spec_text(text, "toy.yaml", check_snippets=False)
    assert spec.stages[0].kind == "element"
