"""Turns a spec's update stages into the body of its C++ `update_row` function.

The generator's own names in that body (`tbegen_row`, `tbegen_p`, `tbegen_step`, `tbegen_i`,
`tbegen_red_N`) start with `tbegen`, which specs may not use, so no spec name can shadow them.

The same body serves the CPU and the CUDA kernels: it is a template over a *row view*
(`tbegen::cpu::CpuRow` or `tbegen::cuda::WarpRow`) that supplies the values of the row this
thread owns, and the reductions across the threads that share the row. Element stages become
`TBEGEN_FOR_ELEMENTS` loops (a plain loop over D on the CPU; on the GPU an unrolled loop over the
lane's 4-wide register slices); row reductions become a loop that accumulates a partial value
(`TBEGEN_FOR_ELEMENTS_SUM` where they are all sums, which the CPU may vectorise) followed by `row.all_sum` / `all_max` / `all_min` (the identity on the CPU, warp shuffles on the
GPU).

Every snippet line is preceded by a `#line` directive naming the YAML file, so that a compiler
error in a snippet is reported at the spec's line. `LINE_RESTORE` marks where the generated file's
own numbering resumes; `tbegen.render` replaces it once the output's line numbers are known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import re

from .model import OptimizerSpec, Stage, TableStage
from .spec import PARTNER_CALL_RE, REDUCTION_CALL_RE, WORD_RE, blank_comments, matching_paren
from .step_values import StepValue, find_step_values, rewrite_stage, statement_lines, values_by_stage

LINE_RESTORE = "#line TBEGEN_RESTORE"


# identity value and the row view's combine method for each reduction
_REDUCTIONS = {
    "sum": ("0.0f", "{acc} += ({expr});", "all_sum"),
    "mean": ("0.0f", "{acc} += ({expr});", "all_sum"),
    "max": ("-INFINITY", "{acc} = fmaxf({acc}, ({expr}));", "all_max"),
    "min": ("INFINITY", "{acc} = fminf({acc}, ({expr}));", "all_min"),
}


@dataclass(frozen=True)
class Reduction:
    kind: str  # sum | mean | max | min
    expr: str
    line: int  # spec line of the reduction's call
    var: str  # C++ accumulator name


def used_names(code: str) -> set:
    """Identifiers that occur in `code` (comments excluded)."""
    return set(WORD_RE.findall(blank_comments(code)))


def extract_reductions(code: str, first_line: int, counter: List[int]) -> Tuple[str, List[Reduction]]:
    """Replaces each `row_X(expr)` in a row stage by an accumulator variable.

    Returns the rewritten code and the reductions, in order. `counter` numbers accumulators
    across the whole update so that their names are unique. Reductions are looked for outside
    comments only (the spec loader has already checked that they are balanced and not nested).
    """
    text = blank_comments(code)  # same length as `code`: positions carry over
    out: List[str] = []
    reductions: List[Reduction] = []
    pos = 0
    for m in REDUCTION_CALL_RE.finditer(text):
        if m.start() < pos:
            raise ValueError("row reductions cannot be nested")
        close = matching_paren(text, m.end() - 1)
        if close is None:
            raise ValueError(f"unbalanced parentheses in {m.group(0)}...)")
        expr = code[m.end() : close].strip()
        var = f"tbegen_red_{counter[0]}"
        counter[0] += 1
        line = first_line + code.count("\n", 0, m.start())
        reductions.append(Reduction(m.group(1)[len("row_"):], expr, line, var))
        out.append(code[pos : m.start()])
        out.append(var)
        pos = close + 1
    out.append(code[pos:])
    return "".join(out), reductions


class UpdateEmitter:
    """Emits the C++ body of `update_row` for one spec (see the module docstring)."""

    def __init__(self, spec: OptimizerSpec, spec_path: str):
        self.spec = spec
        self.path = spec_path
        self.element_slots = [s.name for s in spec.element_states] + [t.name for t in spec.temporaries]
        self.lines: List[str] = []
        # declarations computed once per step by `step_values` (tbegen/step_values.py)
        self.step_values = find_step_values(spec)

    # -- helpers -------------------------------------------------------------------------------
    def _emit(self, text: str, indent: int) -> None:
        for line in text.splitlines():
            self.lines.append((" " * indent + line) if line.strip() else "")

    def _snippet(self, code: str, line: int, indent: int) -> None:
        self.lines.append(f'#line {line} "{self.path}"')
        self._emit(code.rstrip("\n"), indent)
        self.lines.append(LINE_RESTORE)

    def _element_bindings(self, names: set, writable: bool, indent: int) -> None:
        """Binds g, w, element states and temporaries used by an element expression or stage."""
        ref = "float&" if writable else "const float"
        pad = " " * indent
        if "g" in names:
            self.lines.append(f"{pad}const float g = tbegen_row.g(tbegen_i);")
        if "w" in names:
            self.lines.append(f"{pad}{ref} w = tbegen_row.w(tbegen_i);")
        for k, name in enumerate(self.element_slots):
            if name in names:
                self.lines.append(f"{pad}{ref} {name} = tbegen_row.element({k}, tbegen_i);")

    # -- stages --------------------------------------------------------------------------------
    def _row_stage(self, stage: Stage, number: int, counter: List[int], lifted: Sequence[StepValue]) -> None:
        code = rewrite_stage(stage.code, lifted, "tbegen_s") if lifted else stage.code
        code, reductions = extract_reductions(code, stage.loc.line, counter)
        self.lines.append(f"  // stage {number}: row ({self.path}:{stage.loc.line})")
        for red in reductions:
            identity, _, _ = _REDUCTIONS[red.kind]
            self.lines.append(f"  float {red.var} = {identity};  // row_{red.kind}({red.expr})")
        if reductions:
            if all(r.kind in ("sum", "mean") for r in reductions):
                # sums only: the CPU may split them into SIMD lanes (common.h)
                accumulators = ", ".join(r.var for r in reductions)
                self.lines.append(f"  TBEGEN_FOR_ELEMENTS_SUM(tbegen_row, tbegen_i, {accumulators}) {{")
            else:
                self.lines.append("  TBEGEN_FOR_ELEMENTS(tbegen_row, tbegen_i) {")
            names = set().union(*(used_names(r.expr) for r in reductions))
            self._element_bindings(names, writable=False, indent=4)
            for red in reductions:
                _, update, _ = _REDUCTIONS[red.kind]
                self.lines.append(f'#line {red.line} "{self.path}"')
                self.lines.append("    " + update.format(acc=red.var, expr=red.expr))
                self.lines.append(LINE_RESTORE)
            self.lines.append("  }")
            for red in reductions:
                _, _, combine = _REDUCTIONS[red.kind]
                scale = " / static_cast<float>(D)" if red.kind == "mean" else ""
                self.lines.append(f"  {red.var} = tbegen_row.{combine}({red.var}){scale};")
        self._snippet(code, stage.loc.line, indent=2)

    def _element_stage(self, stage: Stage, number: int) -> None:
        self.lines.append(f"  // stage {number}: element ({self.path}:{stage.loc.line})")
        self.lines.append("  TBEGEN_FOR_ELEMENTS(tbegen_row, tbegen_i) {")
        self._element_bindings(used_names(stage.code), writable=True, indent=4)
        self.lines.append("    {")
        self._snippet(stage.code, stage.loc.line, indent=6)
        self.lines.append("    }")
        self.lines.append("  }")

    def _close_guard(self, start: int) -> None:
        """Indents the guarded stages' lines (from `start`) one level and closes their `if`."""
        self.lines[start:] = [l if not l or l.startswith("#") else "  " + l for l in self.lines[start:]]
        self.lines.append("  }")

    def emit(self) -> str:
        spec = self.spec
        all_code = "\n".join([s.code for s in spec.stages] + [s.when for s in spec.stages])
        names = used_names(all_code)
        for h in spec.hyperparameters:
            if h.name in names:
                self.lines.append(f"  const {h.type.cpp} {h.name} = tbegen_p.{h.name};")
        if "step" in names:
            self.lines.append("  const int64_t step = tbegen_s.step;")
        if "D" in names or "row_mean" in names:
            self.lines.append("  const int D = tbegen_row.dim();")
        for k, s in enumerate(spec.row_states):
            self.lines.append(f"  float& {s.name} = tbegen_row.row_state({k});")
        for k, s in enumerate(spec.int_row_states):
            self.lines.append(f"  int64_t& {s.name} = tbegen_row.int_row_state({k});")
        for k, s in enumerate(spec.table_states):
            if s.name in names:
                self.lines.append(f"  const float {s.name} = tbegen_row.table_state({k});  // per-table state: a constant "
                                  f"during the step")
        counter = [0]
        guard, guard_start = "", 0
        lifted = values_by_stage(self.step_values)
        for number, stage in enumerate(spec.stages, start=1):
            if stage.when != guard:
                if guard:
                    self._close_guard(guard_start)
                guard = stage.when
                if guard:
                    # a run of stages with one guard: skipped together (hyperparameters only, so
                    # every lane of a warp takes the same branch)
                    self.lines.append(f"  if ({guard}) {{  // the `when:` of the stages below ({self.path})")
                    guard_start = len(self.lines)
            if stage.kind == "row":
                self._row_stage(stage, number, counter, lifted.get(number - 1, []))
            else:
                self._element_stage(stage, number)
        if guard:
            self._close_guard(guard_start)
        if "step" not in names and not self.step_values:
            self.lines.append("  (void)tbegen_s;")
        # the body sits inside a member function: indent everything but preprocessor lines
        return "\n".join("  " + l if l and not l.startswith("#") else l for l in self.lines)

    def emit_step_values(self) -> Tuple[str, str]:
        """The members of `StepValues` after `step`, and the body of `step_values`."""
        spec = self.spec
        members = [f"    {v.ctype} {v.name};  // {self.path}:{spec.stages[v.stage].loc.line + v.first_line}"
                   for v in self.step_values]
        lines: List[str] = []
        stages_code = "\n".join(spec.stages[v.stage].code[v.init_start:v.init_end] for v in self.step_values)
        _bind_hyperparameters(spec, used_names(stages_code), lines)
        next_line = None  # the spec line that follows the last statement emitted
        for v in self.step_values:
            stage = spec.stages[v.stage]
            first, text = statement_lines(stage.code, v)
            if stage.loc.line + first != next_line:
                if next_line is not None:
                    lines.append(LINE_RESTORE)
                lines.append(f'#line {stage.loc.line + first} "{self.path}"')
            lines.extend(("  " + l) if l.strip() else "" for l in text.splitlines())
            next_line = stage.loc.line + first + len(text.splitlines())
        if next_line is not None:
            lines.append(LINE_RESTORE)
        fields = ", ".join(["tbegen_step"] + [v.name for v in self.step_values])
        if not self.step_values:
            lines.append("  (void)tbegen_p;")
        lines.append(f"  return StepValues{{{fields}}};")
        body = "\n".join("  " + l if l and not l.startswith("#") else l for l in lines)
        return "\n".join(members), body


def emit_update_body(spec: OptimizerSpec, spec_path: str) -> str:
    return UpdateEmitter(spec, spec_path).emit()


def emit_step_values(spec: OptimizerSpec, spec_path: str) -> Tuple[str, str]:
    """(the extra members of StepValues, the body of step_values) for one spec."""
    return UpdateEmitter(spec, spec_path).emit_step_values()


# ---------------------------------------------------------------------------------------------
# Whole-table stages (`table:`): the bodies of the Optimizer's `table_runs` (the guard, on the
# host) and `table_unit` (one element, or a pair of columns j, j + D/2, through the unit view
# tbegen::TableUnit of templates/include/tbegen/table_stage.h).

_PARTNER_ARG_RE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)")


def rewrite_partner(code: str, element_states: Sequence[str]) -> str:
    """`partner(w)` -> the unit's partner weight, `partner(STATE)` -> its partner state (the
    checker has made sure that the argument is w or a per-element state)."""
    text = blank_comments(code)
    out: List[str] = []
    pos = 0
    for m in PARTNER_CALL_RE.finditer(text):
        arg = _PARTNER_ARG_RE.match(text, m.end())
        if arg is None:
            raise ValueError("partner(...) takes one name")
        name = arg.group(1)
        if name == "w":
            call = "tbegen_u.partner_w(tbegen_e)"
        else:
            call = f"tbegen_u.partner_element({list(element_states).index(name)}, tbegen_e)"
        out.append(code[pos : m.start()])
        out.append(call)
        pos = arg.end()
    out.append(code[pos:])
    return "".join(out)


def _bind_hyperparameters(spec: OptimizerSpec, names: set, lines: List[str], indent: str = "  ") -> None:
    for h in spec.hyperparameters:
        if h.name in names:
            lines.append(f"{indent}const {h.type.cpp} {h.name} = tbegen_p.{h.name};")
    if "step" in names:
        lines.append(f"{indent}const int64_t step = tbegen_step;")


def _bind_row_values(spec: OptimizerSpec, names: set, lines: List[str], view: str, comment: str) -> None:
    """Read-only locals for the row width and the per-row states (float and int) that `names`
    uses, from the row view `view` of a whole-table stage."""
    if "D" in names:
        lines.append(f"  const int D = {view}.dim();")
    for k, s in enumerate(spec.row_states):
        if s.name in names:
            lines.append(f"  const float {s.name} = {view}.row_state({k});{comment}")
    for k, s in enumerate(spec.int_row_states):
        if s.name in names:
            lines.append(f"  const int64_t {s.name} = {view}.int_row_state({k});{comment}")


def emit_table_guard(spec: OptimizerSpec) -> str:
    """The body of `table_runs`: whether any whole-table element stage runs at this step."""
    guards = [t.when for t in spec.table_stages]
    lines: List[str] = []
    if not guards:
        lines.append("  (void)tbegen_p;")
        lines.append("  (void)tbegen_step;")
        lines.append("  return false;  // no whole-table element stages (only reduce stages)")
    elif any(not g for g in guards):
        lines.append("  (void)tbegen_p;")
        lines.append("  (void)tbegen_step;")
        lines.append("  return true;  // a stage without a guard runs every step")
    else:
        names = used_names("\n".join(guards))
        _bind_hyperparameters(spec, names, lines)
        if "step" not in names:
            lines.append("  (void)tbegen_step;")
        lines.append("  return " + " ||\n         ".join(f"({g})" for g in guards) + ";")
    return "\n".join("  " + l if l else l for l in lines)


def emit_table_reductions(spec: OptimizerSpec, spec_path: str) -> Tuple[str, str, str]:
    """The bodies of `table_reduction` (what each reduce stage is), `table_reduction_runs` (its
    guard, on the host) and `table_reduction_value` (its `of:` for one row, through the view
    tbegen::TableRowValues of templates/include/tbegen/table_stage.h)."""
    reductions = spec.table_reductions
    table_index = {s.name: k for k, s in enumerate(spec.table_states)}
    info = ["  switch (tbegen_r) {"]
    runs = ["  switch (tbegen_r) {"]
    value: List[str] = []
    if len(reductions) > 32:
        raise ValueError(f"{spec.name}: at most 32 reduce stages (the CUDA launch marks them in a 32-bit mask)")
    names = used_names("\n".join(r.of for r in reductions))
    _bind_hyperparameters(spec, names, value)
    if not any(h.name in names for h in spec.hyperparameters):
        value.append("  (void)tbegen_p;")
    if "step" not in names:
        value.append("  (void)tbegen_step;")
    _bind_row_values(spec, names, value, "tbegen_v", "")
    for k, s in enumerate(spec.table_states):
        if s.name in names:
            value.append(f"  const float {s.name} = tbegen_v.table_state({k});  // its value before the stage")
    value.append("  switch (tbegen_r) {")
    guard_names = used_names("\n".join(r.when for r in reductions))
    guard_lines: List[str] = []
    _bind_hyperparameters(spec, guard_names, guard_lines)
    for r, red in enumerate(reductions):
        over_all = "true" if red.over == "all" else "false"
        info.append(f"    case {r}:  // {spec_path}:{red.loc.line}: {red.op} of `{red.of}` into {red.into}, over {red.over}")
        info.append(f"      return TableReductionInfo{{{'true' if red.op == 'max' else 'false'}, {over_all}, "
                    f"{table_index[red.into]}}};")
        runs.append(f"    case {r}:")
        runs.append(f"      return {red.when or 'true'};")
        value.append(f"    case {r}:")
        value.append(f"      return static_cast<float>(")
        value.append(f'#line {red.starts[0][0] if red.starts else red.loc.line} "{spec_path}"')
        value.append(f"          {red.of}")
        value.append(LINE_RESTORE)
        value.append("      );")
    for block in (info, runs, value):
        block.append("  }")
    info.append("  return TableReductionInfo{true, false, 0};")
    runs.append("  return false;")
    value.append("  return 0.0f;")
    runs = guard_lines + (["  (void)tbegen_step;"] if "step" not in guard_names else []) + \
        (["  (void)tbegen_p;"] if not guard_lines else []) + runs
    indent = lambda lines: "\n".join("  " + l if l and not l.startswith("#") else l for l in lines)
    return indent(info), indent(runs), indent(value)


def emit_table_body(spec: OptimizerSpec, spec_path: str) -> str:
    """The body of `table_unit`: every whole-table stage, in order, each under its guard."""
    stages = spec.table_stages
    element_states = [s.name for s in spec.element_states]
    names = used_names("\n".join([t.code for t in stages] + [t.when for t in stages]))
    lines: List[str] = []
    _bind_hyperparameters(spec, names, lines)
    if "step" not in names:
        lines.append("  (void)tbegen_step;")
    _bind_row_values(spec, names, lines, "tbegen_u", "  // per-row state, read-only here")
    for number, stage in enumerate(stages, start=1):
        lines.append(f"  // whole-table stage {number} ({spec_path}:{stage.loc.line})")
        indent = "  "
        if stage.when:
            lines.append(f"  if ({stage.when}) {{  // its `when:`")
            indent = "    "
        if stage.pairs:
            lines.append(f"{indent}tbegen_u.snapshot();  // partner(...) reads the values from here")
        lines.append(f"{indent}for (int tbegen_e = 0; tbegen_e < tbegen_u.count(); ++tbegen_e) {{")
        stage_names = used_names(stage.code)
        inner = indent + "  "
        if "w" in stage_names:
            lines.append(f"{inner}float& w = tbegen_u.w(tbegen_e);")
        for k, name in enumerate(element_states):
            if name in stage_names:
                lines.append(f"{inner}float& {name} = tbegen_u.element({k}, tbegen_e);")
        if "col" in stage_names:
            lines.append(f"{inner}const int col = tbegen_u.col(tbegen_e);")
        lines.append(f"{inner}{{")
        lines.append(f'#line {stage.loc.line} "{spec_path}"')
        code = rewrite_partner(stage.code, element_states).rstrip("\n")
        for line in code.splitlines():
            lines.append((inner + "  " + line) if line.strip() else "")
        lines.append(LINE_RESTORE)
        lines.append(f"{inner}}}")
        lines.append(f"{indent}}}")
        if stage.when:
            lines.append("  }")
    return "\n".join("  " + l if l and not l.startswith("#") else l for l in lines)


# ---------------------------------------------------------------------------------------------
# Operator signatures: one description, rendered as the TORCH_LIBRARY schema, the C++ parameter
# list and the Python call.


@dataclass(frozen=True)
class Arg:
    name: str
    # schema type: Tensor, Tensor?, int, float, bool; `mutable` adds an alias annotation
    type: str
    doc: str
    mutable: bool = False
    # schema default (e.g. "None", "False"); arguments with one come last and may be left out
    default: Optional[str] = None

    def schema(self, alias: str) -> str:
        t = f"Tensor({alias}!)" if self.mutable else self.type
        return f"{t} {self.name}" + (f"={self.default}" if self.default is not None else "")

    @property
    def cpp(self) -> str:
        cpp = {
            "Tensor": "const at::Tensor&",
            "Tensor?": "const c10::optional<at::Tensor>&",
            "int": "int64_t",
            "float": "double",
            "bool": "bool",
        }[self.type]
        return f"{cpp} {self.name}"


@dataclass(frozen=True)
class OpSignature:
    name: str
    args: Tuple[Arg, ...]
    returns: str  # schema return type: "Tensor" or "()"

    @property
    def schema(self) -> str:
        aliases = iter("abcdefghijklmnopqrstuvwxyz")
        args = ", ".join(a.schema(next(aliases) if a.mutable else "") for a in self.args)
        return f"{self.name}({args}) -> {self.returns}"

    @property
    def cpp_params(self) -> str:
        return ", ".join(a.cpp for a in self.args)

    @property
    def arg_names(self) -> Sequence[str]:
        return [a.name for a in self.args]


LAYOUT_ARGS = (
    Arg("features", "Tensor", "int64 [F, 5]: weights offset, rows, D, output offset, key base per feature"),
    Arg("total_D", "int", "width of the pooled output"),
    Arg("max_D", "int", "widest row (the output width for pooling none)"),
)
BATCH_ARGS = (
    Arg("indices", "Tensor", "int32 or int64 row indices, all features concatenated"),
    Arg("offsets", "Tensor", "F * B + 1 bag boundaries, feature-major, same dtype as indices"),
)
# How an operator reports bad input (host.h). Without a record it raises before returning (on
# CUDA that waits for the kernels); with one, CUDA kernels record the first bad index and the
# first fatal error there and the caller reads it when it likes (the module: without stopping
# the GPU). Bad indices are skipped instead of raised when asked.
ERROR_ARGS = (
    Arg("error_record", "Tensor?", "int64 [6] error record on the weights' device, or None", default="None"),
    Arg("skip_bad_indices", "bool", "skip out-of-range indices instead of raising", default="False"),
)
# Variable batch size per feature (VBE, tbegen/module.py): the kernels write (forward) and read
# (backward) FBGEMM's 1-D rank-major output directly, bag b's D_f values at element
# bag_output_offsets[b] (-1: a padding bag, which has no lookups); None: the [B, total_D] output.
VBE_ARG = Arg("bag_output_offsets", "Tensor?", "int64 [F * B]: each bag's element offset in the 1-D VBE output "
              "(-1 for an empty padding bag), or None for the [B, total_D] output", default="None")
# ... and the VBE batch's own offsets read through its plan's padding index (vbe.h's `pad`): padded
# bag b's bounds are offsets[bag_pad[b]] and offsets[bag_pad[b + 1]], no padded copy of the offsets
# made first; None: `offsets` are the padded batch's.
PAD_ARG = Arg("bag_pad", "Tensor?", "int64 [F * B + 1]: a VBE batch's padding index; offsets are then the VBE "
              "batch's own, bag b's bounds offsets[bag_pad[b]] and offsets[bag_pad[b + 1]]; or None", default="None")


def forward_signature() -> OpSignature:
    return OpSignature(
        "forward",
        (Arg("weights", "Tensor", "flat weights buffer"),)
        + LAYOUT_ARGS
        + BATCH_ARGS
        + (
            Arg("per_sample_weights", "Tensor?", "float32, one per index, or None"),
            Arg("pooling", "int", "0 sum, 1 mean, 2 none"),
        )
        + ERROR_ARGS
        + (VBE_ARG, Arg("output_size", "int", "numel of the 1-D VBE output (with bag_output_offsets)", default="-1"),
           PAD_ARG),
        "Tensor",
    )


def grad_psw_signature() -> OpSignature:
    return OpSignature(
        "grad_per_sample_weights",
        (
            Arg("grad_output", "Tensor", "gradient of the forward's output, float32"),
            Arg("weights", "Tensor", "flat weights buffer (before the update)"),
        )
        + LAYOUT_ARGS
        + BATCH_ARGS
        + (Arg("pooling", "int", "0 sum, 1 mean, 2 none"),)
        + ERROR_ARGS
        + (VBE_ARG, PAD_ARG),
        "Tensor",
    )


def backward_signature(spec: OptimizerSpec) -> OpSignature:
    args = (
        (
            Arg("grad_output", "Tensor", "gradient of the forward's output, float32"),
            Arg("weights", "Tensor", "flat weights buffer, updated in place", mutable=True),
        )
        + LAYOUT_ARGS
        + (Arg("total_hash_size", "int", "number of linear keys (rows of all tables)"),)
        + BATCH_ARGS
        + (
            Arg("per_sample_weights", "Tensor?", "float32, one per index, or None"),
            Arg("pooling", "int", "0 sum, 1 mean, 2 none"),
            Arg("max_segment_length_per_warp", "int", "rows with at least this many occurrences "
                "are summed in segments by several warps (CUDA)"),
            Arg("stochastic_rounding", "bool", "round fp16/bf16 weights stochastically"),
            Arg("seed", "int", "seed of the stochastic rounding"),
        )
    )
    args += _state_and_hyperparameter_args(spec)
    args += (Arg("step", "int", "1-based step counter"),)
    args += ERROR_ARGS + (
        Arg("check_finite", "bool", "raise on NaN/Inf in per_sample_weights or grad_output", default="True"),
        VBE_ARG,
        PAD_ARG,
    )
    return OpSignature("backward", args, "()")


def _state_and_hyperparameter_args(spec: OptimizerSpec) -> Tuple[Arg, ...]:
    """The spec's states (updated in place) and hyperparameters, in declaration order: the
    arguments every operator that updates weights takes after its own."""
    args: Tuple[Arg, ...] = ()
    for s in spec.states:
        layout = "like the weights" if s.per == "element" else "one per linear key"
        kind = "int64" if s.is_int else "float32, float16 or bfloat16"
        args += (Arg(s.name, "Tensor", f"state, {kind}, {layout}", mutable=True),)
    for s in spec.table_states:
        args += (Arg(s.name, "Tensor", "per-table state, float32, one per table", mutable=True),)
    if spec.table_states:
        args += (Arg("feature_table", "Tensor", "int64 [F]: the table each feature reads (indexes the per-table states)"),)
    for h in spec.hyperparameters:
        args += (Arg(h.name, h.type, h.doc),)
    return args


def table_signature(spec: OptimizerSpec) -> OpSignature:
    """`table_update`: the whole-table stages of one step (specs with `table:` only); returns
    whether any stage ran."""
    args = (
        Arg("weights", "Tensor", "flat weights buffer, updated in place", mutable=True),
        Arg("features", "Tensor", "int64 [F, 5]: the layout (each table is updated once)"),
        Arg("total_hash_size", "int", "number of linear keys (rows of all tables)"),
        Arg("stochastic_rounding", "bool", "round fp16/bf16 weights stochastically"),
        Arg("seed", "int", "seed of the stochastic rounding"),
    )
    args += _state_and_hyperparameter_args(spec)
    args += (Arg("step", "int", "the step whose forward follows (1-based)"),)
    return OpSignature("table_update", args, "bool")


def lane_split_signature(spec: OptimizerSpec) -> OpSignature:
    """`backward` run the way the CUDA kernel splits a row over lanes (CPU only; see the harness)."""
    return OpSignature("backward_lane_split", backward_signature(spec).args, "()")
