"""The typed model of an optimizer spec.

`tbegen.spec.load_spec` parses one YAML file into an `OptimizerSpec`; everything
downstream (rendering, building, the runtime module, the harness) reads only
these frozen dataclasses, never raw YAML. The spec language itself is described
in docs/spec-language.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

# Names the generator binds in every snippet, and the fixed arguments of the backward operator
# (hyperparameters and states become its other arguments); a spec may not declare them. The
# generator's own identifiers start with `tbegen`, which is reserved too (tbegen/spec.py).
RESERVED_NAMES = frozenset(
    {"g", "w", "step", "D", "row_sum", "row_mean", "row_max", "row_min"}
    | {"grad_output", "weights", "features", "total_D", "max_D", "total_hash_size", "indices", "offsets",
       "per_sample_weights", "pooling", "max_segment_length_per_warp", "stochastic_rounding", "seed",
       "error_record", "skip_bad_indices", "check_finite"}
)

# Row reductions usable inside `row` stages, with their identity and combine op.
ROW_REDUCTIONS = ("row_sum", "row_mean", "row_max", "row_min")

# A state's storage dtype in a spec -> the torch dtype's name (torch.float32, ...) and the C++
# code the kernels dispatch on (common.h, StateDtype).
STATE_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

HyperValue = Union[float, int, bool]


@dataclass(frozen=True)
class Loc:
    """A place in a spec file (1-based line)."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Hyperparameter:
    # identifier, used verbatim in snippets, the op schema and the Python API
    name: str
    # "float" (C++ float), "int" (C++ int64_t) or "bool" (C++ bool)
    type: str
    # None means the hyperparameter is required (no default)
    default: Optional[HyperValue]
    # one-line description shown by the CLI and in docstrings
    doc: str
    # optional whitelist of allowed values (e.g. weight_decay_mode: [0, 1, 2])
    choices: Optional[Tuple[HyperValue, ...]]
    loc: Loc
    # optional values worth a numerical test case each (`tbegen test`, the test suite)
    test_values: Optional[Tuple[HyperValue, ...]] = None
    # optional value this hyperparameter takes in every other test case (a decay switched on
    # while the cases for choices and test values run); None: its default there
    test_base: Optional[HyperValue] = None

    @property
    def required(self) -> bool:
        return self.default is None


@dataclass(frozen=True)
class State:
    # identifier; also the key in split_optimizer_states() and state_dict()
    name: str
    # "element": one value per weight element (laid out like the weights);
    # "row": one value per table row
    per: str
    # initial value of every entry
    init: float
    # storage dtype: "fp32", "bf16" or "fp16" (STATE_DTYPE_NAMES); the arithmetic is float32 and
    # a narrow state is rounded stochastically when stored. The module may override it per state.
    dtype: str
    doc: str
    loc: Loc
    # "float" (a float in snippets, stored as `dtype`) or "int" (per row only: an int64_t in
    # snippets and in storage, exact; counters, step numbers)
    type: str = "float"

    @property
    def is_int(self) -> bool:
        return self.type == "int"


@dataclass(frozen=True)
class Temporary:
    # per-element scratch value carried from one stage to the next, never saved
    name: str
    per: str  # "element" only, for now
    loc: Loc


@dataclass(frozen=True)
class Stage:
    # "row": runs once per unique row (scalar code; may call row_* reductions);
    # "element": runs once per element of the row
    kind: str
    # the C-like snippet, verbatim
    code: str
    # line in the spec file of the snippet's first line (for #line directives)
    loc: Loc
    # dotted path of the snippet in the spec (e.g. "element", "update[1].row"), for messages
    source_field: str = field(default="", compare=False)
    # per line of `code`: (1-based file line, 0-based file column of its first character), as
    # the loader found them; maps a compiler's column in the generated code back to the YAML
    starts: Tuple[Tuple[int, int], ...] = field(default=(), compare=False)
    # the stage's guard: a C condition over hyperparameters only ("" = always runs). Consecutive
    # stages with the same guard run together inside one `if`, so their locals are shared by
    # them and by no later stage.
    when: str = ""


@dataclass(frozen=True)
class Reference:
    # float64 torch code updating g/w/states over the touched rows (see docs)
    code: str
    # line of the first code line
    loc: Loc


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    summary: str
    # path of the YAML file the spec came from, as given to load_spec
    path: str
    hyperparameters: Tuple[Hyperparameter, ...]
    states: Tuple[State, ...]
    temporaries: Tuple[Temporary, ...]
    stages: Tuple[Stage, ...]
    reference: Reference
    loc: Loc = field(compare=False)
    # `dense_gradient: true`: no optimizer step. The module makes `weights` an nn.Parameter and
    # runs the update on a zeroed buffer, which the update turns into the weights' gradient
    # (optimizers/none.yaml: `w = g`); autograd then hands it to any torch.optim optimizer.
    dense_gradient: bool = False

    @property
    def element_states(self) -> Tuple[State, ...]:
        return tuple(s for s in self.states if s.per == "element")

    @property
    def row_states(self) -> Tuple[State, ...]:
        """The float per-row states (int ones: `int_row_states`)."""
        return tuple(s for s in self.states if s.per == "row" and not s.is_int)

    @property
    def int_row_states(self) -> Tuple[State, ...]:
        return tuple(s for s in self.states if s.is_int)

    def hyperparameter(self, name: str) -> Hyperparameter:
        for h in self.hyperparameters:
            if h.name == name:
                return h
        raise KeyError(name)
