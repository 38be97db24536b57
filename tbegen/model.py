"""The typed model of an optimizer spec.

`tbegen.spec.load_spec` parses one YAML file into an `OptimizerSpec`; everything
downstream (rendering, building, the runtime module, the harness) reads only
these frozen dataclasses, never raw YAML. The spec language itself is described
in docs/spec-language.md.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple, Union

# Names the generator binds in every snippet, and the fixed arguments of the backward operator
# (hyperparameters and states become its other arguments); a spec may not declare them. The
# generator's own identifiers start with `tbegen`, which is reserved too (tbegen/spec.py).
RESERVED_NAMES = frozenset(
    {"g", "w", "step", "D", "row_sum", "row_mean", "row_max", "row_min", "col", "partner"}
    | {"grad_output", "weights", "features", "total_D", "max_D", "total_hash_size", "indices", "offsets",
       "per_sample_weights", "pooling", "max_segment_length_per_warp", "stochastic_rounding", "seed",
       "error_record", "skip_bad_indices", "check_finite", "feature_table"}
)

# Row reductions usable inside `row` stages, with their identity and combine op.
ROW_REDUCTIONS = ("row_sum", "row_mean", "row_max", "row_min")

# A state's storage dtype in a spec -> the torch dtype's name (torch.float32, ...) and the C++
# code the kernels dispatch on (common.h, StateDtype).
STATE_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

HyperValue = Union[float, int, bool]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Word(str, enum.Enum):
    """An enum whose members are the words a spec spells them with (they compare equal to those
    strings, and print as them)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class HyperType(_Word):
    """A hyperparameter's type: its word in a spec, its C++ type in the kernels, and the one
    conversion of a value to it (`convert`: used by the loader, the module and the harness)."""

    FLOAT = "float"
    INT = "int"
    BOOL = "bool"

    @property
    def cpp(self) -> str:
        """The C++ type of the kernels' Params field (float, int64_t, bool)."""
        return {"float": "float", "int": "int64_t", "bool": "bool"}[self.value]

    @property
    def article(self) -> str:
        return {"float": "a float", "int": "an int", "bool": "a bool"}[self.value]

    def convert(self, value: Any) -> HyperValue:
        """`value` as a value of this type: raises TypeError when it is not one (a bool is neither
        an int nor a float), ValueError when it is out of range (a float must be finite, an int
        must fit in int64)."""
        if self is HyperType.BOOL:
            if not isinstance(value, bool):
                raise TypeError(f"must be a bool, got {type(value).__name__} {value!r}")
            return value
        if isinstance(value, bool):
            raise TypeError(f"must be {self.article}, got bool {value!r}")
        if self is HyperType.INT:
            if not isinstance(value, numbers.Integral):
                raise TypeError(f"must be an int, got {type(value).__name__} {value!r}")
            converted = int(value)
            if not INT64_MIN <= converted <= INT64_MAX:
                raise ValueError(f"does not fit in int64: {value!r}")
            return converted
        if not isinstance(value, numbers.Real):
            raise TypeError(f"must be a float, got {type(value).__name__} {value!r}")
        converted = float(value)
        if not math.isfinite(converted):
            raise ValueError(f"must be finite, got {value!r}")
        return converted


class StatePer(_Word):
    """What a state holds one value for: each weight element (laid out like the weights), or each
    table row (one per linear key)."""

    ELEMENT = "element"
    ROW = "row"
    # one float per table: a per-table scalar, read-only in the update (a constant during the
    # step) and written by the `reduce` stages of `table:` (TableReduction)
    TABLE = "table"


class StateType(_Word):
    """A state's value type in snippets: float (stored as the state's dtype) or int (int64, per row
    only: counters, step numbers; exact)."""

    FLOAT = "float"
    INT = "int"


class StageKind(_Word):
    """How often a stage runs: once per unique row (scalar code; may use row reductions) or once
    per element of the row."""

    ROW = "row"
    ELEMENT = "element"


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
    # float (C++ float), int (C++ int64_t) or bool (C++ bool)
    type: HyperType
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

    def __post_init__(self) -> None:
        # the invariants the loader reports as spec problems, checked again for any other maker
        object.__setattr__(self, "type", HyperType(self.type))
        values = [self.default] if self.default is not None else []
        values += list(self.choices or ()) + list(self.test_values or ())
        values += [self.test_base] if self.test_base is not None else []
        for v in values:
            self.type.convert(v)
        if self.choices is not None:
            outside = [v for v in values if v not in self.choices]
            if outside:
                raise ValueError(f"hyperparameter {self.name}: {outside!r} not among its choices {list(self.choices)!r}")

    @property
    def required(self) -> bool:
        return self.default is None


@dataclass(frozen=True)
class State:
    # identifier; also the key in split_optimizer_states() and state_dict()
    name: str
    # element: one value per weight element (laid out like the weights); row: one per table row
    per: StatePer
    # initial value of every entry
    init: float
    # storage dtype: "fp32", "bf16" or "fp16" (STATE_DTYPE_NAMES); the arithmetic is float32 and
    # a narrow state is rounded stochastically when stored. The module may override it per state.
    dtype: str
    doc: str
    loc: Loc
    # float (a float in snippets, stored as `dtype`) or int (per row only: an int64_t in
    # snippets and in storage, exact; counters, step numbers)
    type: StateType = StateType.FLOAT

    def __post_init__(self) -> None:
        object.__setattr__(self, "per", StatePer(self.per))
        object.__setattr__(self, "type", StateType(self.type))
        if self.dtype not in STATE_DTYPE_NAMES:
            raise ValueError(f"state {self.name}: dtype must be one of {list(STATE_DTYPE_NAMES)}, got {self.dtype!r}")
        if self.is_int and self.per is not StatePer.ROW:
            raise ValueError(f"state {self.name}: int states are per row only")
        if self.per is StatePer.TABLE and self.dtype != "fp32":
            raise ValueError(f"state {self.name}: per-table states are float32")

    @property
    def is_int(self) -> bool:
        return self.type is StateType.INT


@dataclass(frozen=True)
class Temporary:
    # per-element scratch value carried from one stage to the next, never saved
    name: str
    per: StatePer  # element only, for now
    loc: Loc

    def __post_init__(self) -> None:
        object.__setattr__(self, "per", StatePer(self.per))
        if self.per is not StatePer.ELEMENT:
            raise ValueError(f"temporary {self.name}: temporaries are per element only")


@dataclass(frozen=True)
class Stage:
    # row: runs once per unique row (scalar code; may call row_* reductions);
    # element: runs once per element of the row
    kind: StageKind
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StageKind(self.kind))


@dataclass(frozen=True)
class TableStage:
    """A whole-table stage (`table:` in a spec): element code run over every element of every row
    of every table of the module, once per step at which its guard holds, before that step's
    forward (and so before the step's fused row updates). See docs/spec-language.md."""

    # the C-like snippet, verbatim
    code: str
    # line in the spec file of the snippet's first line
    loc: Loc
    source_field: str = field(default="", compare=False)
    starts: Tuple[Tuple[int, int], ...] = field(default=(), compare=False)
    # a C condition over hyperparameters and `step` ("" = every step)
    when: str = ""
    # whether the code reads `partner(...)`: element j of a row is then updated together with
    # element j + D/2 (and j + D/2 with j), which needs even row widths
    pairs: bool = False


class ReduceOp(_Word):
    """How a `reduce` stage combines the rows' values: exact and independent of the order in
    which rows, threads or tables are visited (NaN values are skipped, as fmaxf/fminf do)."""

    MAX = "max"
    MIN = "min"


class ReduceOver(_Word):
    """What one value of a `reduce` stage covers: each table's own rows (the value goes to that
    table's entry), or the rows of all tables together (the value goes to every table's entry:
    FBGEMM's module-wide max_counter)."""

    TABLE = "table"
    ALL = "all"


@dataclass(frozen=True)
class TableReduction:
    """A `reduce` stage of `table:`: at the steps where its guard holds, before that step's
    forward (after the step's whole-table element stages), sets per-table state `into` to the
    max (or min) over the rows of each table (or of all tables) of the row expression `of`."""

    op: ReduceOp
    # the row expression (C): per-row states, per-table states, hyperparameters, step, D
    of: str
    # the per-table state written
    into: str
    over: ReduceOver
    loc: Loc
    source_field: str = field(default="", compare=False)
    starts: Tuple[Tuple[int, int], ...] = field(default=(), compare=False)
    when: str = ""

    @property
    def code(self) -> str:
        """The C code of the stage (its `of:`), as stages have it (compiler errors map through it)."""
        return self.of

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", ReduceOp(self.op))
        object.__setattr__(self, "over", ReduceOver(self.over))


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
    # whole-table stages, in order, and their float64 reference (Python run once per table and step)
    table_stages: Tuple["TableStage", ...] = ()
    table_reference: Optional[Reference] = None
    # the `reduce` stages of `table:` (after its element stages), and their float64 reference
    # (Python run once per step over all tables)
    table_reductions: Tuple["TableReduction", ...] = ()
    table_state_reference: Optional[Reference] = None
    # the per-table states (`per: table` in `states:`; kept apart from `states`, which are the
    # element and row states the fused update's operators take in declaration order)
    table_states: Tuple[State, ...] = ()

    @property
    def table_pairs(self) -> bool:
        """Whether a whole-table stage pairs element j with j +- D/2 (tables need even widths)."""
        return any(t.pairs for t in self.table_stages)

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
