"""Values of an update that depend on the step and the hyperparameters only.

A row stage often starts with such values: Adam's bias corrections `1 - beta^step` (two `pow`
calls in double precision), a decay factor from the learning rate. Written in a row stage they
are computed once per unique row, millions of times a step, with the same result each time; the
CUDA compiler does not hoist them out of a kernel's loop over rows (they are calls into the math
library). So the generator lifts them out itself: each one is computed once per kernel thread by
the Optimizer's `step_values` and read in `update_row` from the `StepValues` it returns. The code
that computes a value is the spec's own statement, unchanged (the same device, the same bits).

A statement is lifted when it is the declaration of one local, `[const] TYPE NAME = EXPR;`, at the
top level of a row stage without a `when:`, where
- TYPE is a plain arithmetic type (not `auto`),
- EXPR reads hyperparameters, `step`, literals, math functions and locals lifted before it only,
  and calls a math function (arithmetic alone costs less per row than the register that would
  carry its value through a kernel's loop),
- and NAME is never assigned anywhere in the update (so its value is the declaration's).
In `update_row` the declaration stays where it was, initialised from the lifted value, so that the
local's scope and meaning do not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Set, Tuple

from .model import OptimizerSpec, StageKind
from .snippets import (ASSIGN_OPS, CONSTANTS, INCREMENT_OPS, MATH_FUNCTIONS, OTHER_WORDS, TYPE_WORDS,
                       tokenize)

# the types a lifted value may have (a struct member must be nameable; `auto` is not)
_VALUE_TYPES = TYPE_WORDS - {"auto", "const"}


@dataclass(frozen=True)
class StepValue:
    ctype: str  # the declared type without `const`, e.g. "float"
    name: str
    stage: int  # index of its stage in spec.stages
    start: int  # character span of the whole declaration in the stage's code
    end: int
    init_start: int  # character span of EXPR
    init_end: int
    first_line: int  # 0-based line of the declaration within the stage's code


def _offsets(code: str) -> List[int]:
    starts = [0]
    for i, ch in enumerate(code):
        if ch == "\n":
            starts.append(i + 1)
    return starts


def _assigned_names(spec: OptimizerSpec) -> Set[str]:
    """Names that some stage assigns or increments (a declaration's `=` is not an assignment)."""
    names: Set[str] = set()
    for stage in spec.stages:
        tokens, _ = tokenize(stage.code)
        for i, t in enumerate(tokens):
            if t.kind != "name":
                continue
            nxt = tokens[i + 1].text if i + 1 < len(tokens) else ""
            prev = tokens[i - 1].text if i > 0 else ""
            declared_here = prev in TYPE_WORDS
            if (nxt in ASSIGN_OPS and not (nxt == "=" and declared_here)) or nxt in INCREMENT_OPS or \
                    prev in INCREMENT_OPS:
                names.add(t.text)
    return names


def find_step_values(spec: OptimizerSpec) -> List[StepValue]:
    """The declarations that `step_values` computes, in the order of the update."""
    invariant: Set[str] = {h.name for h in spec.hyperparameters} | {"step"}
    allowed = invariant | MATH_FUNCTIONS | CONSTANTS | TYPE_WORDS | OTHER_WORDS
    assigned = _assigned_names(spec)
    found: List[StepValue] = []
    for index, stage in enumerate(spec.stages):
        if stage.kind != StageKind.ROW or stage.when:
            continue
        code = stage.code
        line_starts = _offsets(code)
        tokens, problems = tokenize(code)
        if problems:
            continue
        pos = lambda t: line_starts[t.line] + t.col  # noqa: E731
        end = lambda t: line_starts[t.end_line] + t.end_col  # noqa: E731
        depth = 0
        statement_start = True
        i = 0
        while i < len(tokens):
            t = tokens[i]
            if depth == 0 and statement_start and t.kind == "name" and t.text in TYPE_WORDS:
                # [const] TYPE... NAME = EXPR ;  (one declarator)
                k = i
                type_words = []
                while k < len(tokens) and tokens[k].kind == "name" and tokens[k].text in TYPE_WORDS:
                    type_words.append(tokens[k].text)
                    k += 1
                if k + 1 < len(tokens) and tokens[k].kind == "name" and tokens[k + 1].text == "=":
                    name = tokens[k].text
                    j = k + 2
                    inner = 0
                    while j < len(tokens) and not (inner == 0 and tokens[j].text in (";", ",")):
                        if tokens[j].text in "([{":
                            inner += 1
                        elif tokens[j].text in ")]}":
                            inner -= 1
                        j += 1
                    expr = tokens[k + 2:j]
                    ctype = " ".join(w for w in type_words if w != "const")
                    if (j < len(tokens) and tokens[j].text == ";" and expr
                            and all(w in _VALUE_TYPES for w in ctype.split()) and ctype
                            and name not in assigned
                            and all(x.kind != "name" or x.text in allowed for x in expr)
                            and all(x.kind in ("name", "number", "op") for x in expr)
                            and any(x.kind == "name" and x.text in MATH_FUNCTIONS for x in expr)):
                        found.append(StepValue(ctype, name, index, pos(t), end(tokens[j]), pos(expr[0]),
                                               end(expr[-1]), t.line))
                        allowed.add(name)
                    i = j + 1 if j < len(tokens) and tokens[j].text == ";" else j
                    statement_start = True
                    continue
            statement_start = False
            if t.text in ("{", "("):
                depth += 1
            elif t.text in ("}", ")"):
                depth -= 1
            if t.text in (";", "{", "}"):
                statement_start = True
            i += 1
    return found


def rewrite_stage(code: str, values: Sequence[StepValue], holder: str) -> str:
    """The stage's code with each lifted declaration initialised from `holder.NAME` instead of its
    expression (the line count kept: `#line` directives and error positions depend on it)."""
    out: List[str] = []
    pos = 0
    for v in sorted(values, key=lambda v: v.init_start):
        expr = code[v.init_start:v.init_end]
        out.append(code[pos:v.init_start])
        out.append(f"{holder}.{v.name}")
        out.append(code[v.init_end:v.end])  # the `;`
        line_end = code.find("\n", v.end)
        rest = code[v.end:line_end if line_end >= 0 else len(code)]
        if not rest.strip():
            out.append("  // computed once per step (step_values)")
        out.append("\n" * expr.count("\n"))
        pos = v.end
    out.append(code[pos:])
    return "".join(out)


def statement_lines(code: str, value: StepValue) -> Tuple[int, str]:
    """(0-based first line, text) of the lifted declaration: whole lines of the stage's code, so
    that the statement keeps its columns in the generated file."""
    line_starts = _offsets(code)
    first = value.first_line
    last_end = code.find("\n", value.end)
    text = code[line_starts[first]:last_end if last_end >= 0 else len(code)]
    # only the declaration itself: blank whatever else shares its lines
    lead = value.start - line_starts[first]
    tail = (last_end if last_end >= 0 else len(code)) - value.end
    body = text[lead:len(text) - tail] if tail else text[lead:]
    return first, " " * lead + body


def values_by_stage(values: Sequence[StepValue]) -> Dict[int, List[StepValue]]:
    by: Dict[int, List[StepValue]] = {}
    for v in values:
        by.setdefault(v.stage, []).append(v)
    return by
