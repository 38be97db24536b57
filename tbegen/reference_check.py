"""Runs a spec's Python references once on a tiny synthetic batch and checks what they leave.

The harness (tbegen/harness.py) runs a spec's `reference` on whole batches of touched rows: `g`
and `w` are [rows, D] float64 tensors, a per-element state [rows, D], a per-row state [rows].
What the reference leaves there is stored back into the states, so a per-row state left
[rows, D] (a `.mean(dim=1)` forgotten), an int state left a float tensor (`counter / 2`) or a
float state left bool (`momentum > 0`) surfaces only after a build, as a shape error or a silently
rounded value. `check_references` finds them before any compiler: it runs each reference of a
spec that is otherwise valid on 3 rows of D = 4 columns (the hyperparameters at their defaults,
then each `choices` and `test` value in turn) and on 2 rows of D = 1 (3 rows of D = 2 where a
whole-table stage pairs columns), and reports, at the YAML
line of the reference, an exception it raises and every state (and `w`) whose kind or shape is not
the declared one. Int states are bound as int64 tensors, as the kernels hold them; everything
else as float64. The batch is deterministic (a fixed seed). torch is imported here, lazily: only
`tbegen validate` and `tbegen test` run this (spec.load_spec_text(..., run_reference=True)).
"""

from __future__ import annotations

import ast
import math
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

from .model import HyperType, OptimizerSpec, State
from .snippets import Finding, Source

# (rows, D) of the synthetic batches: rows != D, so that a [rows] value meeting a [rows, D] one
# fails as it would on real batches; D = 1 catches a squeeze() that drops the column dimension
SHAPES = ((3, 4), (2, 1))
# the same for a spec whose whole-table stage pairs columns (partner): its tables have even widths
PAIRED_SHAPES = ((3, 4), (3, 2))
# the tables of the synthetic `table_state_reference` run: rows of each table
TABLE_ROWS = (3, 2)
STEP = 2
SEED = 0
# the name under which the instrumented reference records the line of each assignment it runs
# (the prefix `tbegen` is reserved: no spec name collides with it)
_WHERE = "tbegen_assigned"


def _hyper_value(h) -> object:
    """The value a hyperparameter takes at its default (a required one: its test_base, first test
    value or first choice, else a plain value of its type)."""
    for v in (h.default, h.test_base, *(h.test_values or ()), *(h.choices or ())):
        if v is not None:
            return v
    return {HyperType.FLOAT: 0.5, HyperType.INT: 1, HyperType.BOOL: False}[h.type]


def hyperparameter_sets(spec: OptimizerSpec) -> List[Tuple[Dict[str, object], str]]:
    """The defaults, then each choice and test value of each hyperparameter with the others at
    their defaults: (values, how to name the set in a message)."""
    base = {h.name: _hyper_value(h) for h in spec.hyperparameters}
    sets = [(base, "the default hyperparameters")]
    seen = {tuple(sorted(base.items()))}
    for h in spec.hyperparameters:
        for v in (*(h.choices or ()), *(h.test_values or ()), *(() if h.test_base is None else (h.test_base,))):
            values = dict(base, **{h.name: v})
            key = tuple(sorted(values.items()))
            if key not in seen:
                seen.add(key)
                sets.append((values, f"{h.name} = {v!r}"))
    return sets


class _Recorder(ast.NodeTransformer):
    """After every statement that assigns one of `names`, calls the namespace's `tbegen_assigned`
    (a _Tracker) with the name, line and column; every original node keeps its line numbers."""

    def __init__(self, names):
        self.names = set(names)

    def _targets(self, stmt) -> List[ast.Name]:
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        elif isinstance(stmt, (ast.AugAssign, ast.AnnAssign)):
            targets = [stmt.target]
        else:
            return []
        return [n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and n.id in self.names]

    def _body(self, stmts):
        out = []
        for stmt in stmts:
            out.append(self.visit(stmt))
            for name in self._targets(stmt):
                note = ast.parse(f"{_WHERE}({name.id!r}, {name.lineno}, {name.col_offset})").body[0]
                for node in ast.walk(note):
                    ast.copy_location(node, stmt)
                out.append(note)
        return out

    def generic_visit(self, node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return node  # (names assigned there are its own locals)
        for field in ("body", "orelse", "finalbody"):
            value = getattr(node, field, None)
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                setattr(node, field, self._body(value))
        for handler in getattr(node, "handlers", ()):
            handler.body = self._body(handler.body)
        return node


def _instrumented(code: str, names, label: str):
    tree = _Recorder(names).visit(ast.parse(code))
    return compile(ast.fix_missing_locations(tree), label, "exec")


def _hint(error: BaseException, statement: str, int_states: Sequence[str]) -> str:
    """What to write instead, for the exceptions a reference typically raises on its first run."""
    text = str(error)
    if "must match the size of tensor" in text:
        return (". A per-row value, shaped [rows], meets a per-element one, shaped [rows, D]: index the "
                "per-row one as `x[:, None]`")
    if "can't be cast to the desired output type Long" in text:
        names = [n for n in int_states if n in statement]
        name = names[0] if names else "x"
        what = f"{name!r} is an int state (an int64 tensor here)" if names else "an int state is an int64 tensor here"
        return (f". {what}: an in-place update cannot store a float in it; compute it with integers, or "
                f"round explicitly, e.g. `{name} = torch.floor(...).long()`")
    return ""


def raised_at(e: BaseException, label: str) -> Optional[int]:
    """The line (from 1) of the code compiled under `label` at which `e` was raised: its
    innermost frame of that code (a SyntaxError's own line), None if it was not raised there.
    (Also the harness's, for `tbegen test`: tbegen/harness.py, run_reference.)"""
    lineno = getattr(e, "lineno", None) if isinstance(e, SyntaxError) else None
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == label:
            lineno = tb.tb_lineno
        tb = tb.tb_next
    return lineno


def _raised(source: Source, compiled, e: BaseException, int_states: Sequence[str]) -> Tuple[int, int, str]:
    """(file line, column, what) of an exception the reference raised: at the statement of the
    reference where it was raised."""
    lineno = raised_at(e, compiled.co_filename)
    lines = source.code.splitlines()
    index = (lineno or 1) - 1
    statement = lines[index].strip() if 0 <= index < len(lines) else ""
    indent = len(lines[index]) - len(lines[index].lstrip()) if 0 <= index < len(lines) else 0
    line, col = source.at(index, indent)
    what = f"`{statement}`" if statement else "the reference"
    return line, col, f"{what} raised {type(e).__name__}: {e}{_hint(e, statement, int_states)}"


class _Tracker:
    """Called by the instrumented reference after each assignment of a checked name: remembers
    where each was last assigned, and the first problem each had right after an assignment (what
    a later statement may then trip over)."""

    def __init__(self, torch, ns: dict, checked: Sequence[Tuple[str, str, bool]], rows: int, D: Optional[int]):
        self.torch, self.ns, self.rows, self.D = torch, ns, rows, D
        self.checked = {name: (per, is_int) for name, per, is_int in checked}
        self.where: Dict[str, Tuple[int, int]] = {}
        self.early: Dict[str, str] = {}

    def problem(self, name: str) -> Optional[str]:
        per, is_int = self.checked[name]
        return _state_problem(self.torch, name, self.ns.get(name), per, is_int, self.rows, self.D)

    def __call__(self, name: str, lineno: int, col: int) -> None:
        self.where[name] = (lineno, col)
        if name not in self.early:
            problem = self.problem(name)
            if problem is not None:
                self.early[name] = problem


def _run(torch, source: Source, compiled, ns: dict, checked: Sequence[Tuple[str, str, bool]], rows: int,
         D: Optional[int], context: str, int_states: Sequence[str]) -> List[Finding]:
    """Runs the instrumented reference in `ns`; what it raises or leaves wrong, as findings."""
    tracker = _Tracker(torch, ns, checked, rows, D)
    ns[_WHERE] = tracker
    try:
        with warnings.catch_warnings():  # (validate's output is the spec's problems only)
            warnings.simplefilter("ignore")
            exec(compiled, ns)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - all of it is the spec's code
        line, col, raised = _raised(source, compiled, e, int_states)
        if not tracker.early:
            return [Finding(line, col, source.field, f"{raised} (run on {context})")]
        # a state assigned a value of the wrong kind or shape, which a later statement tripped over
        then = raised.split(": ", 1)[0]
        return [_at(source, tracker.where[name], f"{problem} (run on {context}; then {then})")
                for name, problem in tracker.early.items()]
    return [_at(source, tracker.where.get(name), f"{problem} (run on {context})")
            for name, problem in ((n, tracker.problem(n)) for n in tracker.checked) if problem is not None]


def _at(source: Source, where: Optional[Tuple[int, int]], message: str) -> Finding:
    """A finding at (reference line, 0-based byte column), or at the reference's first line."""
    if where is None:
        return Finding(*_first_line(source), source.field, message)
    lineno, col = where
    text = source.code.splitlines()[lineno - 1]
    col = len(text.encode("utf-8")[:col].decode("utf-8", "replace"))
    return Finding(*source.at(lineno - 1, col), source.field, message)


def _shape_words(shape: Tuple[int, ...], rows: int, D: Optional[int], row_word: str = "rows") -> str:
    if not shape:
        return "a single value (a 0-d tensor)"
    words = [row_word if n == rows else "D" if D is not None and n == D else str(n) for n in shape]
    return "[" + ", ".join(words) + "]"


def _kind_words(torch, value) -> str:
    if isinstance(value, bool):
        return "a Python bool"
    if isinstance(value, (int, float)):
        return f"a Python {type(value).__name__} ({value!r})"
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}"
    dtype = str(value.dtype).replace("torch.", "")
    return f"{'an' if dtype.startswith('int') else 'a'} {dtype} tensor"


def _state_problem(torch, name: str, value, per: str, is_int: bool, rows: int, D: Optional[int]) -> Optional[str]:
    """What is wrong with what the reference left in state (or `w`) `name`, in the spec's terms;
    None when it is a tensor of the declared kind and shape."""
    if name == "w":
        what, shape, word = "`w`", (rows, D), "[rows, D]"
    else:
        declared = f"per: {per}" + (", type: int" if is_int else "")
        what = f"state {name!r} ({declared})"
        shape = (rows, D) if per == "element" else (rows,)
        word = "[rows, D]" if per == "element" else "[rows]" if per == "row" else "[tables]"
    if not isinstance(value, torch.Tensor):
        fix = f"`torch.full_like({name}, ...)`" if name != "w" else "a [rows, D] tensor"
        return (f"the reference leaves {what} {_kind_words(torch, value)}, not a {word} tensor: "
                f"write {fix}")
    if value.dtype == torch.bool:
        fix = ("`(...).long()`" if is_int else
               "`(...).to(w.dtype)` for 1.0/0.0, or `torch.where(condition, a, b)` to choose a value")
        return (f"the reference leaves {what} a bool tensor (a comparison): it holds "
                f"{'integers' if is_int else 'floats'}; write {fix}")
    if is_int and (value.dtype.is_floating_point or value.dtype.is_complex):
        return (f"the reference leaves {what} {_kind_words(torch, value)}: an int state holds integers "
                f"(int64 in the kernels; a float is truncated there). Compute it with integers (`+ 1`, "
                f"`//`, `step`), or round explicitly: `torch.floor(...).long()`")
    if not is_int and not value.dtype.is_floating_point:
        return (f"the reference leaves {what} {_kind_words(torch, value)}: it holds floats; write "
                f"`(...).to(w.dtype)`")
    if tuple(value.shape) != shape:
        found = _shape_words(tuple(value.shape), rows, D, "tables" if per == "table" else "rows")
        if per == "row" and tuple(value.shape) == (rows, D):
            fix = "reduce each row to one value, e.g. `(...).mean(dim=1)` or `.sum(dim=1)`"
        elif per == "row" and tuple(value.shape) == (rows, 1):
            fix = "drop the column dimension: reduce with `dim=1` and no `keepdim`, or `.squeeze(1)`"
        elif not value.shape:
            fix = "reduce over each row only (`dim=1`), not over the whole batch"
        elif per == "element" and tuple(value.shape) == (rows,):
            fix = "index a per-row value as `x[:, None]` to combine it with `g` and `w`"
        else:
            fix = f"keep it {word}"
        return f"the reference leaves {what} shaped {found}, not {word}: {fix}"
    return None


def _first_line(source: Source) -> Tuple[int, int]:
    lines = source.code.splitlines() or [""]
    return source.at(0, len(lines[0]) - len(lines[0].lstrip()))


def check_references(spec: OptimizerSpec, sources: Dict[str, Source]) -> List[Finding]:
    """Runs the spec's references (`reference`, `table_reference`, `table_state_reference`, each
    where the spec has it and `sources` gives its place in the YAML file) on synthetic batches;
    every problem found, for each reference only those of the first run that shows one."""
    import torch

    findings: List[Finding] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only cost here (see harness._one_thread)
    try:
        for field, ref, run in (("reference", spec.reference, _row_runs),
                                ("table_reference", spec.table_reference, _row_runs),
                                ("table_state_reference", spec.table_state_reference, _table_state_runs)):
            if ref is None or field not in sources:
                continue
            source = sources[field]
            for found in run(torch, spec, source, field):
                if found:
                    findings.extend(found)
                    break
    finally:
        torch.set_num_threads(threads)
    return findings


def _context(rows: int, D: Optional[int], hyper_words: str) -> str:
    shape = f"{rows} rows of D = {D}" if D is not None else f"{len(TABLE_ROWS)} tables"
    return f"{shape} with {hyper_words}, step = {STEP}"


def _row_runs(torch, spec: OptimizerSpec, source: Source, field: str):
    """`reference` (g, w and the states of the touched rows) or `table_reference` (no g; w and the
    states of every row of a table): one run per synthetic batch, each yielding its findings."""
    table = field == "table_reference"
    int_states = [s.name for s in spec.states if s.is_int]
    checked = [("w", "element", False)] + [(s.name, str(s.per), s.is_int) for s in spec.states]
    compiled = _instrumented(source.code, [name for name, _, _ in checked], f"{spec.path}:{field}")
    sets = hyperparameter_sets(spec)
    shapes = PAIRED_SHAPES if spec.table_pairs else SHAPES
    runs = [(rows, D, hyper) for rows, D in shapes[:1] for hyper in sets] + \
           [(rows, D, sets[0]) for rows, D in shapes[1:]]
    for rows, D, (values, words) in runs:
        gen = torch.Generator().manual_seed(SEED)
        ns = dict(values)
        ns.update(torch=torch, math=math, step=STEP, D=D)
        ns["w"] = torch.rand(rows, D, generator=gen, dtype=torch.float64) - 0.5
        if not table:
            ns["g"] = torch.rand(rows, D, generator=gen, dtype=torch.float64) - 0.5
        for s in spec.states:
            ns[s.name] = _initial(torch, s, rows, D)
        for s in spec.table_states:  # read-only: the value of each row's table
            ns[s.name] = torch.full((rows,), float(s.init), dtype=torch.float64)
        yield _run(torch, source, compiled, ns, checked, rows, D, _context(rows, D, words), int_states)


def _table_state_runs(torch, spec: OptimizerSpec, source: Source, field: str):
    """`table_state_reference`: each per-row state as a list of one [E] tensor per table, each
    per-table state a [tables] tensor, which the reference must leave a [tables] float tensor."""
    T = len(TABLE_ROWS)
    checked = [(s.name, "table", False) for s in spec.table_states]
    compiled = _instrumented(source.code, [name for name, _, _ in checked], f"{spec.path}:{field}")
    for values, words in hyperparameter_sets(spec):
        ns = dict(values)
        ns.update(torch=torch, math=math, step=STEP)
        for s in spec.states:
            if s.per == "row":
                ns[s.name] = [_initial(torch, s, E, None) for E in TABLE_ROWS]
        for s in spec.table_states:
            ns[s.name] = torch.full((T,), float(s.init), dtype=torch.float64)
        yield _run(torch, source, compiled, ns, checked, T, None, _context(T, None, words), [])


def _initial(torch, s: State, rows: int, D: Optional[int]):
    """State `s` at its declared init: int64 for an int state, float64 otherwise."""
    shape = (rows, D) if s.per == "element" else (rows,)
    if s.is_int:
        return torch.full(shape, int(s.init), dtype=torch.int64)
    return torch.full(shape, float(s.init), dtype=torch.float64)
