"""Row-stage declarations computed once per step (tbegen/step_values.py): which ones are lifted
out of `update_row`, and what the generated code then looks like."""
from pathlib import Path

from tbegen.codegen import emit_step_values, emit_update_body
from tbegen.spec import load_spec, load_spec_text
from tbegen.step_values import find_step_values, rewrite_stage

ROOT = Path(__file__).resolve().parents[1]

HEADER = """name: lifted
summary: test spec
hyperparameters:
  learning_rate: {type: float, default: 0.1}
  beta: {type: float, default: 0.9}
  mode: {type: int, default: 0}
states:
  acc: {per: row, init: 0.0}
  m: {per: element, init: 0.0}
"""


def spec_with(row_code, element="w -= learning_rate * g;", extra_stages=""):
    body = "\n".join("      " + line for line in row_code.strip().splitlines())
    text = HEADER + f"update:\n  - row: |\n{body}\n  - element: |\n      {element}\n{extra_stages}"
    text += "reference: |\n  w = w - learning_rate * g\n"
    return load_spec_text(text)


def names(spec):
    return [v.name for v in find_step_values(spec)]


def test_adams_bias_corrections_are_lifted():
    spec = load_spec(ROOT / "optimizers" / "adam.yaml")
    assert names(spec) == ["bias1", "bias2"]
    members, body = emit_step_values(spec, "optimizers/adam.yaml")
    assert "float bias1;" in members and "float bias2;" in members
    assert "pow(static_cast<double>(beta1)" in body and body.rstrip().endswith("return StepValues{tbegen_step, bias1, bias2};")
    update = emit_update_body(spec, "optimizers/adam.yaml")
    assert "pow(" not in update  # no longer computed per row
    assert "float bias1 = tbegen_s.bias1;" in update


def test_only_declarations_of_the_step_and_hyperparameters_that_call_a_function():
    spec = spec_with("""
float decay = powf(beta, static_cast<float>(step));
float cheap = mode == 1 ? beta : 0.0f;
float from_state = sqrtf(acc);
float from_lifted = expf(decay) + 1.0f;
float from_grad = sqrtf(row_sum(g * g));
acc += from_grad * decay * cheap * from_state * from_lifted;
""")
    # `cheap` calls no function; `from_state` reads a per-row state; `from_grad` reduces g
    assert names(spec) == ["decay", "from_lifted"]


def test_assigned_locals_guarded_stages_and_nested_blocks_stay_per_row():
    spec = spec_with("""
float changed = powf(beta, 2.0f);
if (mode == 1) changed = 1.0f;
float kept = powf(beta, 3.0f);
if (mode == 2) {
  float nested = powf(beta, 4.0f);
  acc += nested;
}
acc += changed + kept;
""", extra_stages="""  - when: mode > 3
    row: |
      float guarded = powf(beta, 5.0f);
      acc += guarded;
""")
    assert names(spec) == ["kept"]


def test_rewriting_keeps_the_lines():
    code = "float a = powf(beta,\n    2.0f);\nacc += a;\n"
    spec = spec_with(code)
    (value,) = find_step_values(spec)
    rewritten = rewrite_stage(spec.stages[0].code, [value], "tbegen_s")
    assert rewritten.count("\n") == spec.stages[0].code.count("\n")
    assert rewritten.splitlines()[0].startswith("float a = tbegen_s.a;")
    assert "acc += a;" in rewritten


def test_specs_without_lifted_values_compute_only_the_step():
    spec = load_spec(ROOT / "optimizers" / "sgd.yaml")
    members, body = emit_step_values(spec, "optimizers/sgd.yaml")
    assert members == ""
    assert body.strip().splitlines()[-1].strip() == "return StepValues{tbegen_step};"
