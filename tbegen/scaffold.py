"""`tbegen new NAME [--from SPEC]`: a new spec file to start from.

Without --from, the new spec is a small row-wise adaptive optimizer that shows each part of the
language once (a hyperparameter, a row state, a row stage with a reduction, an element stage,
and the float64 reference that the tests compare against). With --from, it is a copy of an
existing spec (comments and all) under the new name. Either way the text is loaded and checked
before anything is written, so what `tbegen new` writes always validates.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from .spec import SpecError, find_spec, load_spec_text

STARTER = """\
# {name}: an optimizer for tbegen; docs/spec-language.md describes every key.
# Check it:            tbegen validate {name}.yaml
# Build and test it:   tbegen test --optimizer {name}.yaml --quick
# It starts as a row-wise Adagrad; change the update and the reference together.
name: {name}
summary: Row-wise Adagrad, scaffolded by tbegen new (edit this line to say what {name} does).
hyperparameters:
  learning_rate: {{type: float, default: 0.01, doc: Step size.}}
  eps: {{type: float, default: 1.0e-8, doc: Added to the square root of the accumulator.}}
states:
  sum_sq: {{per: row, init: 0.0, doc: Sum over steps of the row's mean squared gradient.}}
update:
  - row: |
      // once per touched row; row_mean(...) averages an expression over the row's elements
      sum_sq += row_mean(g * g);
      float step_size = learning_rate / (sqrtf(sum_sq) + eps);
  - element: |
      // once per element of the row; w is writable, g is the row's summed gradient
      w -= step_size * g;
reference: |
  # float64 torch code over the touched rows: g and w are [rows, D], row states [rows]
  sum_sq += (g * g).mean(dim=1)
  w -= (learning_rate / (sum_sq.sqrt() + eps))[:, None] * g
"""

# the top-level `name:` line of a spec (its value, quoted or not, and any comment after it)
_NAME_LINE_RE = re.compile(r"^name:[ \t]*(?:\"[^\"\n]*\"|'[^'\n]*'|[^\s#]+)", re.MULTILINE)


def scaffold_text(name: str, from_spec: Optional[str] = None) -> str:
    """The text of a new spec called `name`: the starter, or a copy of `from_spec` (a name in
    optimizers/ or a path). Raises SpecError if the result would not validate (e.g. a bad name)."""
    if from_spec is None:
        text = STARTER.format(name=name)
    else:
        source = find_spec(from_spec)  # SpecNotFoundError (a ValueError) names the available ones
        original = source.read_text(encoding="utf-8")
        text, count = _NAME_LINE_RE.subn(f"name: {name}", original, count=1)
        if count != 1:
            raise ValueError(f"{source}: no top-level `name:` line to replace")
    load_spec_text(text, f"{name}.yaml")  # what is written must validate
    return text


def write_scaffold(name: str, out_dir: Path, from_spec: Optional[str] = None) -> Path:
    """Writes OUT_DIR/NAME.yaml (never over an existing file) and returns its path."""
    path = Path(out_dir) / f"{name}.yaml"
    if path.exists():
        raise FileExistsError(f"{path} already exists; choose another name or --out folder")
    text = scaffold_text(name, from_spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


__all__ = ["STARTER", "SpecError", "scaffold_text", "write_scaffold"]
