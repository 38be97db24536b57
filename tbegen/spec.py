"""Load optimizer specs (YAML) into the typed model of `tbegen.model`.

The spec language is described in docs/spec-language.md. Typical use:

    path = find_spec("rowwise_adagrad")   # a bare name or a path -> Path
    spec = load_spec(path)                # -> model.OptimizerSpec

Loading never stops at the first mistake: every problem found in a file is
collected as a `SpecProblem` (file, line, field, message) and all of them are
raised together as one `SpecError`, one `FILE:LINE: FIELD: MESSAGE` per line
(`FILE:LINE:COL: ...` for problems in code). The update stages and the reference are checked by
`tbegen.snippets` (names, syntax, and the constructs whose result would depend on how the GPU
splits a row over lanes) before anything downstream sees them.

The approach follows torchgen: a YAML loader stamps every mapping with the lines
of its keys and values and records duplicate keys; each section parser pops the
keys it knows (`_Fields`) and reports whatever is left over as unknown.
Nothing downstream of this module reads raw YAML.
"""

from __future__ import annotations

import difflib
import keyword
import os
import re
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

import yaml

from tbegen import reference_check, resources, snippet_types, snippets
from tbegen.vocabulary import CPP_KEYWORDS, CUDA_BUILTINS
from tbegen.model import (
    INT64_MAX,
    INT64_MIN,
    RESERVED_NAMES,
    ROW_REDUCTIONS,
    Hyperparameter,
    HyperType,
    HyperValue,
    Loc,
    OptimizerSpec,
    Reference,
    Stage,
    StageKind,
    State,
    ReduceOp,
    ReduceOver,
    StatePer,
    StateType,
    TableReduction,
    TableStage,
    Temporary,
)

__all__ = [
    "SpecProblem",
    "SpecError",
    "SpecNotFoundError",
    "load_spec",
    "load_spec_text",
    "find_spec",
    "list_specs",
    "DEFAULT_SPEC_DIR",
]

StrPath = Union[str, "os.PathLike[str]"]

# optimizers/ of the checkout, or its copy shipped in the package (tbegen/resources.py).
DEFAULT_SPEC_DIR = resources.SPEC_DIR

# File suffixes accepted for spec files.
SPEC_SUFFIXES = (".yaml", ".yml")

HYPERPARAMETER_TYPES = tuple(t.value for t in HyperType)
STATE_PERS = tuple(p.value for p in StatePer)
STATE_DTYPES = ("fp32", "bf16", "fp16")  # storage; the arithmetic is float32
TEMPORARY_PERS = ("element",)
STAGE_KINDS = tuple(k.value for k in StageKind)

TOP_KEYS = (
    "name",
    "summary",
    "hyperparameters",
    "states",
    "temporaries",
    "update",
    "row",
    "element",
    "reference",
    "dense_gradient",
    "table",
    "table_reference",
    "table_state_reference",
)
TABLE_STAGE_KINDS = ("element",)
# the keys of a `reduce` stage of `table:` (sets a per-table state from the table's rows)
TABLE_REDUCE_KEYS = ("reduce", "of", "into", "over", "when")
REDUCE_OPS = tuple(o.value for o in ReduceOp)
REDUCE_OVERS = tuple(o.value for o in ReduceOver)  # a whole-table stage runs once per element of every row
HYPERPARAMETER_KEYS = ("type", "default", "doc", "choices", "test", "test_base")
STATE_KEYS = ("per", "type", "init", "dtype", "doc")
STATE_TYPES = tuple(t.value for t in StateType)  # int: an exact int64 per-row value (counters, step numbers)
# how entries are described in problems, e.g. HYPERPARAMETER_SHAPE
HYPERPARAMETER_SHAPE = "{" + ", ".join(HYPERPARAMETER_KEYS) + "}"
STATE_SHAPE = "{" + ", ".join(STATE_KEYS) + "}"
TEMPORARY_KEYS = ("per",)

IDENTIFIER_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
OPTIMIZER_NAME_RE = re.compile(r"[a-z][a-z0-9_]*")

# Marks a key or document that is absent (None is a legitimate YAML value).
_MISSING: Any = object()

# C++ keywords and alternative operator spellings (C++20), plus a few names every
# C++/CUDA translation unit has in scope; a snippet name may not shadow them.
# Bound in the reference besides the snippet names (see docs, "The reference").
REFERENCE_NAMES = frozenset({"torch"})


# --------------------------------------------------------------------------
# Problems
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecProblem:
    """One mistake in a spec file."""

    file: str
    line: int
    # dotted path of the offending key, e.g. "hyperparameters.eps.default"
    field: str
    message: str
    # 1-based column, where known (every problem the snippet checker finds has one)
    col: Optional[int] = None
    # a warning does not make the spec invalid
    warning: bool = False

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.col}" if self.col is not None else f"{self.file}:{self.line}"
        return f"{where}: {self.field}: {'warning: ' if self.warning else ''}{self.message}"


class SpecError(Exception):
    """Every problem found in a spec, reported together."""

    def __init__(self, problems: Iterable[SpecProblem]):
        self.problems: Tuple[SpecProblem, ...] = tuple(problems)
        super().__init__(self.problems)

    def __str__(self) -> str:
        return "\n".join(str(p) for p in self.problems)


class SpecNotFoundError(ValueError):
    """`find_spec` could not resolve a name or path to a spec file."""


class _Problems:
    """Collects the problems of one spec file, in the order they are found."""

    def __init__(self, path: str, text: str = ""):
        self.path = path
        self.text_lines = text.splitlines()
        self.items: List[SpecProblem] = []
        self.warnings: List[SpecProblem] = []
        # code found while parsing, for the snippet checker (tbegen/snippets.py)
        self.stage_sources: List[snippets.StageSource] = []
        self.reference_source: Optional[snippets.Source] = None
        self.table_reference_source: Optional[snippets.Source] = None
        self.table_state_reference_source: Optional[snippets.Source] = None
        # the `into:` of each reduce stage: (name, line, col, field), checked against the states
        self.reduce_targets: List[Tuple[Any, int, Optional[int], str]] = []

    def add(self, line: int, field: str, message: str, col: Optional[int] = None) -> None:
        self.items.append(SpecProblem(self.path, line, field, message, col))

    def add_finding(self, f: "snippets.Finding") -> None:
        problem = SpecProblem(self.path, f.line, f.field, f.message, f.col, f.warning)
        (self.warnings if f.warning else self.items).append(problem)

    def __len__(self) -> int:
        return len(self.items)

    def loc(self, line: int) -> Loc:
        return Loc(self.path, line)

    def raise_if_any(self) -> None:
        if self.items:
            # Stable sort: problems on one line keep the order they were found in.
            raise SpecError(sorted(self.items, key=lambda p: (p.line, p.col or 0)))


# --------------------------------------------------------------------------
# YAML loading with line numbers
# --------------------------------------------------------------------------


class _Mapping(dict):
    """A YAML mapping that remembers where each of its keys and values is.

    Lines are 1-based. `code_lines[key]` is the line of the first line of the
    value's text: the line after `key: |` for a block scalar, else the value's
    own line.
    """

    def __init__(self, line: int):
        super().__init__()
        self.line = line
        self.key_lines: dict = {}
        self.value_lines: dict = {}
        self.code_lines: dict = {}
        # key -> (scalar style, 1-based line, 0-based column) of the value node
        self.value_marks: dict = {}
        self.value_end_lines: dict = {}  # key -> 1-based line where the value node ends
        self.key_cols: dict = {}  # key -> 0-based column of the key
        # (key, line of the repeat, line of the first occurrence)
        self.duplicates: List[Tuple[Any, int, int]] = []


class _Sequence(list):
    """A YAML sequence that remembers its line and the line of each item."""

    def __init__(self, line: int):
        super().__init__()
        self.line = line
        self.item_lines: List[int] = []


def _start_line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _code_line(node: yaml.Node) -> int:
    """Line of the first line of text of a scalar node (see `_Mapping`)."""
    if isinstance(node, yaml.ScalarNode) and node.style in ("|", ">"):
        return _start_line(node) + 1
    return _start_line(node)


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader that builds `_Mapping`/`_Sequence` and records duplicate keys.

    Also reads `1e-8` as a float (PyYAML's YAML 1.1 resolver wants `1.0e-8`).
    """

    def construct_spec_mapping(self, node: yaml.MappingNode):
        data = _Mapping(_start_line(node))
        yield data
        # Keys written in this mapping, as opposed to ones merged in with `<<`
        # (which they may override); a repeated own key is a duplicate.
        own_key_nodes = {id(k) for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"}
        own_keys: set = set()
        self.flatten_mapping(node)  # expands `<<` merge keys, merged pairs first
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=False)
            if not isinstance(key, Hashable):
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    "found unhashable key",
                    key_node.start_mark,
                )
            if id(key_node) in own_key_nodes:
                if key in own_keys:  # the first occurrence wins
                    data.duplicates.append((key, _start_line(key_node), data.key_lines[key]))
                    continue
                own_keys.add(key)
            data[key] = self.construct_object(value_node, deep=False)
            data.key_lines[key] = _start_line(key_node)
            data.key_cols[key] = key_node.start_mark.column
            data.value_lines[key] = _start_line(value_node)
            data.code_lines[key] = _code_line(value_node)
            data.value_marks[key] = (getattr(value_node, "style", None), _start_line(value_node),
                                     value_node.start_mark.column)
            data.value_end_lines[key] = value_node.end_mark.line + 1

    def construct_spec_sequence(self, node: yaml.SequenceNode):
        data = _Sequence(_start_line(node))
        yield data
        data.extend(self.construct_object(child, deep=False) for child in node.value)
        data.item_lines = [_start_line(child) for child in node.value]


_SpecLoader.add_constructor("tag:yaml.org,2002:map", _SpecLoader.construct_spec_mapping)
_SpecLoader.add_constructor("tag:yaml.org,2002:seq", _SpecLoader.construct_spec_sequence)
_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _load_yaml(text: str, problems: _Problems) -> Any:
    """Parse YAML text; on a syntax error, record it and return _MISSING."""
    loader = _SpecLoader(text)
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        message = e.problem or "invalid YAML"
        if e.context:
            message = f"{message} ({e.context})"
        # An error at the end of the stream is reported on the last line.
        last_line = max(1, len(text.splitlines()))
        problems.add(min(mark.line + 1, last_line) if mark else 1, "yaml", message)
    except yaml.YAMLError as e:
        problems.add(1, "yaml", str(e))
    finally:
        loader.dispose()
    return _MISSING


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _report_duplicate_keys(problems: _Problems, value: Any, field: str = "") -> None:
    """Report every duplicate key anywhere in the document."""
    seen: set = set()

    def walk(value: Any, field: str) -> None:
        if id(value) in seen:  # aliases may share (or cycle through) a node
            return
        seen.add(id(value))
        if isinstance(value, _Mapping):
            for key, line, first in value.duplicates:
                problems.add(line, _join(field, key), f"duplicate key (first given at line {first})")
            for key, item in value.items():
                walk(item, _join(field, key))
        elif isinstance(value, _Sequence):
            for i, item in enumerate(value):
                walk(item, f"{field}[{i}]")

    walk(value, field)


# --------------------------------------------------------------------------
# Helpers shared by the section parsers
# --------------------------------------------------------------------------

def _describe(value: Any) -> str:
    """A value as the YAML author wrote it, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"float {value!r}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


class _Fields:
    """The keys of one YAML mapping, popped one by one as they are parsed.

    `finish()` reports every key that nobody popped as unknown, so a misspelt
    key never passes silently.
    """

    def __init__(
        self,
        problems: _Problems,
        mapping: _Mapping,
        field: str,
        line: int,
        known: Sequence[str],
    ):
        self.problems = problems
        self.mapping = mapping
        self.field = field  # dotted path of the mapping ("" at the top level)
        self.line = line  # where to report a missing key
        self.known = tuple(known)
        self._remaining = dict(mapping)

    def path(self, key: str) -> str:
        return _join(self.field, key)

    def has(self, key: str) -> bool:
        return key in self.mapping

    def key_line(self, key: Any) -> int:
        return self.mapping.key_lines.get(key, self.line)

    def value_line(self, key: str) -> int:
        return self.mapping.value_lines.get(key, self.line)

    def code_line(self, key: str) -> int:
        return self.mapping.code_lines.get(key, self.line)

    def source(self, key: str, code: str) -> snippets.Source:
        """`code`, the string value of `key`, with where each of its lines starts in the file."""
        style, line, col = self.mapping.value_marks.get(key, (None, self.line, 0))
        end = self.mapping.value_end_lines.get(key, line)
        if key not in ("when", "of") and (style == ">" or (style != "|" and end > line and "\n" not in code.strip())):
            # YAML joined the snippet's lines into one: a `//` comment then swallows the rest of it,
            # and every later line number is wrong
            how = "a folded block (`>`)" if style == ">" else "a plain or quoted scalar over several lines"
            self.problems.add(line, self.path(key), f"{key!r} is written as {how}: YAML joins its lines into one line, "
                                                    f"so a `//` comment swallows everything after it; write it as a "
                                                    f"literal block, `{key}: |`, with the code on the lines below", col + 1)
        lines = code.splitlines() or [""]
        starts = []
        if style == "|":  # a literal block: line i is file line first + i, after the indentation
            first = self.code_line(key)
            text = self.problems.text_lines
            for i, code_line in enumerate(lines):
                raw = text[first - 1 + i] if first - 1 + i < len(text) else ""
                offset = len(raw) - len(code_line) if code_line and raw.endswith(code_line) else \
                    len(raw) - len(raw.lstrip(" "))
                starts.append((first + i, offset))
        else:  # plain or quoted on the key's line (exact for one line without escapes)
            offset = col + (1 if style in ("'", '"') else 0)
            starts = [(line, offset)] + [(line + i, offset) for i in range(1, len(lines))]
        return snippets.Source(code, self.path(key), tuple(starts))

    def pop(self, key: str, default: Any = _MISSING) -> Any:
        """The value of `key`; a missing required key is reported and gives _MISSING."""
        if key in self._remaining:
            return self._remaining.pop(key)
        if default is _MISSING:
            self.problems.add(self.line, self.path(key), "missing required key")
        return default

    def finish(self) -> None:
        """Report every key that was not popped."""
        for key in self._remaining:
            message = f"unknown key; expected one of: {', '.join(self.known)}"
            close = difflib.get_close_matches(str(key), self.known, n=1)
            if close:
                message += f" (did you mean {close[0]!r}?)"
            elif self.mapping[key] is None and " " in str(key):
                message += " (a comma inside {...} starts a new key; quote text that contains commas)"
            self.problems.add(self.key_line(key), self.path(key), message)


def _as_mapping(
    problems: _Problems, value: Any, field: str, line: int, shape: str, *, allow_null: bool = False
) -> Optional[_Mapping]:
    """`value` if it is a mapping (null -> empty when allowed), else report it."""
    if value is None and allow_null:
        return _Mapping(line)
    if isinstance(value, _Mapping):
        return value
    problems.add(line, field, f"must be a mapping {shape}, got {_describe(value)}")
    return None


def _pop_string(fields: _Fields, key: str, default: Any = _MISSING) -> Optional[str]:
    """A string value, stripped; reports a missing or non-string value (-> None)."""
    value = fields.pop(key, default)
    if value is _MISSING:
        return None
    if not isinstance(value, str):
        fields.problems.add(fields.value_line(key), fields.path(key), f"must be a string, got {_describe(value)}")
        return None
    return value.strip()


def _pop_choice(fields: _Fields, key: str, allowed: Sequence[str], hint: str = "") -> Optional[str]:
    """A required string value that must be one of `allowed`."""
    value = fields.pop(key)
    if value is _MISSING:
        return None
    if not isinstance(value, str) or value not in allowed:
        message = f"must be {' or '.join(allowed)}, got {_describe(value)}"
        fields.problems.add(fields.value_line(key), fields.path(key), message + (f" ({hint})" if hint else ""))
        return None
    return value


# --------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------


def _keyword_reason(name: str) -> Optional[str]:
    """Why `name` cannot be used in generated C++/CUDA/Python, or None."""
    if name.startswith("tbegen"):
        return "names starting with 'tbegen' are reserved for the generator"
    if name in CPP_KEYWORDS:
        return f"{name!r} is a C++ keyword"
    if name in CUDA_BUILTINS:
        return f"{name!r} is a CUDA built-in"
    if keyword.iskeyword(name):
        return f"{name!r} is a Python keyword"
    return None


def _reserved_reason(name: str) -> Optional[str]:
    """Why `name` cannot name a hyperparameter, state or temporary, or None."""
    if name.startswith("_"):
        return "names starting with '_' are reserved"
    if name in RESERVED_NAMES:
        return f"{name!r} is reserved: the generator binds it in every snippet"
    if name in REFERENCE_NAMES:
        return f"{name!r} is reserved: the reference binds it"
    return _keyword_reason(name)


def _check_identifier(problems: _Problems, name: Any, field: str, line: int) -> bool:
    """Report a bad hyperparameter/state/temporary name; True when it is fine."""
    if not isinstance(name, str):
        message = f"name must be a string, got {_describe(name)}"
        if isinstance(name, bool):
            message += " (YAML reads yes/no/on/off/true/false as booleans; quote the name)"
        problems.add(line, field, message)
        return False
    reason = _reserved_reason(name)
    if reason is None and not IDENTIFIER_RE.fullmatch(name):
        reason = f"{name!r} is not a valid identifier ([A-Za-z][A-Za-z0-9_]*)"
    if reason is not None:
        problems.add(line, field, reason)
        return False
    return True


def _check_unique_names(problems: _Problems, doc: _Mapping) -> None:
    """One name may be declared once across hyperparameters, states and temporaries."""
    first: dict = {}
    for section in ("hyperparameters", "states", "temporaries"):
        entries = doc.get(section)
        if not isinstance(entries, _Mapping):
            continue
        for name in entries:
            line = entries.key_lines[name]
            if name in first:
                other_section, other_line = first[name]
                problems.add(
                    line,
                    _join(section, name),
                    f"name {name!r} is already declared in {other_section} at line {other_line}",
                )
            else:
                first[name] = (section, line)


# --------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------


def _parse_name(fields: _Fields, stem: Optional[str]) -> Optional[str]:
    """`name`: a lower-case identifier equal to the file's stem."""
    name = _pop_string(fields, "name")
    if name is None:
        return None
    line, field = fields.value_line("name"), fields.path("name")
    if not OPTIMIZER_NAME_RE.fullmatch(name):
        fields.problems.add(line, field, f"{name!r} must match [a-z][a-z0-9_]*")
        return None
    reason = _keyword_reason(name)
    if reason is not None:
        fields.problems.add(line, field, reason)
        return None
    if stem is not None and name != stem:
        fields.problems.add(
            line, field, f"{name!r} must equal the file's stem {stem!r}; rename the file or the optimizer"
        )
        return None
    return name


def _parse_summary(fields: _Fields) -> Optional[str]:
    """`summary`: one non-empty line of text."""
    summary = _pop_string(fields, "summary")
    if summary is None:
        return None
    if not summary:
        fields.problems.add(fields.value_line("summary"), fields.path("summary"), "must not be empty")
        return None
    if "\n" in summary:
        fields.problems.add(fields.value_line("summary"), fields.path("summary"), "must be one line")
        return None
    return summary


def _hyper_value(type_: str, value: Any) -> Tuple[Any, str]:
    """(`value` as a hyperparameter of `type_`, "") by HyperType.convert (the module's and the
    harness's conversion too), or (_MISSING, why not) in the words of a spec problem."""
    try:
        return HyperType(type_).convert(value), ""
    except TypeError:
        return _MISSING, f"must be {HyperType(type_).article}, got {_describe(value)}"
    except ValueError as e:
        return _MISSING, str(e)


def _parse_hyper_value(fields: _Fields, key: str, type_: Optional[str], none_hint: str = "") -> Optional[HyperValue]:
    """An optional value of the hyperparameter's type (`default`, `test_base`), or None (absent,
    or wrong: reported; `none_hint` is added when the YAML value is null)."""
    if not fields.has(key):
        return None
    raw = fields.pop(key)
    if type_ is None:
        return None  # the type's own problem is already reported
    value, why = _hyper_value(type_, raw)
    if value is _MISSING:
        fields.problems.add(fields.value_line(key), fields.path(key), why + (none_hint if raw is None else ""))
        return None
    return value


def _parse_choices(fields: _Fields, type_: Optional[str], key: str = "choices") -> Optional[Tuple[HyperValue, ...]]:
    """`choices` (or `test`): a non-empty list of values of the hyperparameter's type."""
    value = fields.pop(key)
    line, field = fields.value_line(key), fields.path(key)
    if not isinstance(value, list) or not value:
        fields.problems.add(line, field, f"must be a non-empty list, got {_describe(value)}")
        return None
    if type_ is None:
        return None  # the type's own problem is already reported
    choices = []
    item_lines = getattr(value, "item_lines", [])
    for i, item in enumerate(value):
        converted, why = _hyper_value(type_, item)
        if converted is _MISSING:
            item_line = item_lines[i] if i < len(item_lines) else line
            fields.problems.add(item_line, f"{field}[{i}]", why)
        else:
            choices.append(converted)
    return tuple(choices) if len(choices) == len(value) else None


def _parse_hyperparameter(problems: _Problems, name: Any, value: Any, field: str, line: int) -> Optional[Hyperparameter]:
    """One `hyperparameters` entry: {type, default, doc, choices, test, test_base}."""
    start = len(problems)
    _check_identifier(problems, name, field, line)
    mapping = _as_mapping(problems, value, field, line, HYPERPARAMETER_SHAPE)
    if mapping is None:
        return None
    fields = _Fields(problems, mapping, field, line, HYPERPARAMETER_KEYS)
    type_ = _pop_choice(fields, "type", HYPERPARAMETER_TYPES)

    default = _parse_hyper_value(fields, "default", type_, " (leave `default` out to make the hyperparameter required)")
    choices = _parse_choices(fields, type_) if fields.has("choices") else None
    test_values = _parse_choices(fields, type_, "test") if fields.has("test") else None
    test_base = _parse_hyper_value(fields, "test_base", type_)
    if choices is not None:
        for key, values in (("default", [default]), ("test", test_values or []), ("test_base", [test_base])):
            outside = [v for v in values if v is not None and v not in choices]
            if outside:
                message = (f"{outside!r} not among" if key == "test" else f"{outside[0]!r} is not one of")
                problems.add(fields.value_line(key), fields.path(key), f"{message} the choices {list(choices)!r}")

    doc = _pop_string(fields, "doc", "")
    fields.finish()
    if len(problems) > start:
        return None
    return Hyperparameter(name, type_, default, doc, choices, problems.loc(line), test_values, test_base)


def _parse_state(problems: _Problems, name: Any, value: Any, field: str, line: int) -> Optional[State]:
    """One `states` entry: {per, init, dtype, doc}."""
    start = len(problems)
    _check_identifier(problems, name, field, line)
    mapping = _as_mapping(problems, value, field, line, STATE_SHAPE)
    if mapping is None:
        return None
    fields = _Fields(problems, mapping, field, line, STATE_KEYS)
    per = _pop_choice(fields, "per", STATE_PERS)

    type_ = fields.pop("type", "float")
    if type_ not in STATE_TYPES:
        problems.add(fields.value_line("type"), fields.path("type"),
                     f"must be {' or '.join(STATE_TYPES)}, got {_describe(type_)}")
    elif type_ == "int" and per not in (None, "row"):
        problems.add(fields.value_line("type"), fields.path("type"),
                     "int states are per row only (a counter or step number per row; use per: row)")
    if per == "table" and fields.has("dtype"):
        problems.add(fields.value_line("dtype"), fields.path("dtype"),
                     "a per-table state is one float32 per table; dtype applies to element and row states only")

    init = fields.pop("init", 0.0)
    if isinstance(init, bool) or not isinstance(init, (int, float)):
        problems.add(fields.value_line("init"), fields.path("init"), f"must be a number, got {_describe(init)}")
    elif type_ == "int" and (not float(init).is_integer() or not INT64_MIN <= init <= INT64_MAX):
        problems.add(fields.value_line("init"), fields.path("init"), f"must be an integer for an int state, got {init!r}")
    else:
        init = float(init)

    if type_ == "int" and fields.has("dtype"):
        problems.add(fields.value_line("dtype"), fields.path("dtype"),
                     "an int state is stored as int64; dtype applies to float states only")
    dtype = fields.pop("dtype", "fp32")
    if dtype == "float32":  # the only value before bf16/fp16 storage existed: still accepted
        dtype = "fp32"
    if dtype not in STATE_DTYPES:
        hint = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16"}.get(dtype) if isinstance(dtype, str) else None
        problems.add(
            fields.value_line("dtype"),
            fields.path("dtype"),
            f"must be {' or '.join(STATE_DTYPES)} (the storage type; arithmetic is float32), got {_describe(dtype)}"
            + (f" (did you mean '{hint}'?)" if hint else ""),
        )

    doc = _pop_string(fields, "doc", "")
    fields.finish()
    if len(problems) > start:
        return None
    return State(name, per, init, dtype, doc, problems.loc(line), type_)


def _parse_temporary(problems: _Problems, name: Any, value: Any, field: str, line: int) -> Optional[Temporary]:
    """One `temporaries` entry: {per: element}."""
    start = len(problems)
    _check_identifier(problems, name, field, line)
    mapping = _as_mapping(problems, value, field, line, "{per: element}")
    if mapping is None:
        return None
    fields = _Fields(problems, mapping, field, line, TEMPORARY_KEYS)
    per = _pop_choice(
        fields,
        "per",
        TEMPORARY_PERS,
        "only per-element temporaries are supported for now",
    )
    fields.finish()
    if len(problems) > start:
        return None
    return Temporary(name, per, problems.loc(line))


def _parse_section(fields: _Fields, key: str, shape: str, parse_entry) -> Tuple[Any, ...]:
    """An optional `name -> {...}` section (hyperparameters, states, temporaries)."""
    value = fields.pop(key, None)
    problems = fields.problems
    mapping = _as_mapping(
        problems, value, fields.path(key), fields.value_line(key), f"of name -> {shape}", allow_null=True
    )
    if mapping is None:
        return ()
    entries = []
    for name, entry in mapping.items():
        parsed = parse_entry(problems, name, entry, _join(key, name), mapping.key_lines[name])
        if parsed is not None:
            entries.append(parsed)
    return tuple(entries)


# --------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------

# (the code generator uses these two as well)
REDUCTION_CALL_RE = re.compile(r"\b(" + "|".join(ROW_REDUCTIONS) + r")\s*\(")  # group 1: row_sum, ...
_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
WORD_RE = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")  # any C++ identifier in a snippet


def blank_comments(code: str) -> str:
    """`code` with C/C++ comments replaced by spaces (line breaks kept)."""
    return _COMMENT_RE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), code)


def matching_paren(code: str, open_index: int) -> Optional[int]:
    """Index of the `)` closing the `(` at `open_index`, or None."""
    depth = 0
    for i in range(open_index, len(code)):
        if code[i] == "(":
            depth += 1
        elif code[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return None


def _parse_snippet(fields: _Fields, key: str, what: str) -> Optional[Tuple[str, Loc]]:
    """A non-empty string of code and the Loc of its first line."""
    code = fields.pop(key)
    if code is _MISSING:
        return None
    if not isinstance(code, str) or not code.strip():
        fields.problems.add(
            fields.value_line(key), fields.path(key), f"must be a non-empty string of {what}, got {_describe(code)}"
        )
        return None
    return code, fields.problems.loc(fields.code_line(key))


def _parse_stage(fields: _Fields, kind: str, when: Optional[snippets.Source] = None) -> Optional[Stage]:
    """One `row:`/`element:` snippet, with its row-reduction checks; `when` is its guard."""
    parsed = _parse_snippet(fields, kind, "code")
    if parsed is None:
        return None
    code, loc = parsed
    source = fields.source(kind, code)
    fields.problems.stage_sources.append(snippets.StageSource(kind, source, when))
    return Stage(kind, code, loc, source_field=source.field, starts=source.starts,
                 when=when.code.strip() if when is not None else "")


def _parse_when(fields: _Fields) -> Optional[snippets.Source]:
    """A stage's `when:` guard, one line of C (checked with the stages: hyperparameters only)."""
    if not fields.has("when"):
        return None
    parsed = _parse_snippet(fields, "when", "C condition over hyperparameters")
    if parsed is None:
        return None
    code, _ = parsed
    if "\n" in code.strip():
        fields.problems.add(fields.value_line("when"), fields.path("when"), "must be one line")
        return None
    return fields.source("when", code.strip())


def _parse_update_item(problems: _Problems, item: Any, field: str, line: int) -> Optional[Stage]:
    """One `update` list item: a one-key mapping {row: CODE} or {element: CODE}."""
    mapping = _as_mapping(problems, item, field, line, "{row: CODE} or {element: CODE}")
    if mapping is None:
        return None
    fields = _Fields(problems, mapping, field, line, STAGE_KINDS + ("when",))
    kinds = [k for k in mapping if k in STAGE_KINDS]
    when = _parse_when(fields)
    stage = None
    if len(kinds) == 1:
        stage = _parse_stage(fields, kinds[0], when)
    elif len(kinds) > 1:
        problems.add(line, field, "a stage has exactly one key, row or element; split it into two stages")
        for kind in kinds:
            fields.pop(kind)
    elif not [k for k in mapping if k != "when"]:
        problems.add(line, field, "a stage needs one key, row or element")
    fields.finish()  # any other key is reported as unknown
    return stage


def _parse_stage_list(fields: _Fields, key: str, expected: str, parse_item) -> tuple:
    """A non-empty list of stages under `key` (each item parsed by `parse_item(problems, item,
    field, line)`, None for a bad one), in order."""
    problems = fields.problems
    value = fields.pop(key)
    line, field = fields.value_line(key), fields.path(key)
    if not isinstance(value, list) or not value:
        problems.add(line, field, f"must be a non-empty list of {expected}, got {_describe(value)}")
        return ()
    item_lines = getattr(value, "item_lines", [])
    stages = []
    for i, item in enumerate(value):
        item_line = item_lines[i] if i < len(item_lines) else line
        stage = parse_item(problems, item, f"{field}[{i}]", item_line)
        if stage is not None:
            stages.append(stage)
    return tuple(stages)


def _parse_update(fields: _Fields) -> Tuple[Stage, ...]:
    """`update`: a non-empty list of stages, run in order."""
    return _parse_stage_list(fields, "update", "{row: CODE} / {element: CODE}", _parse_update_item)


def _parse_stages(fields: _Fields) -> Tuple[Stage, ...]:
    """`update`, or the top-level `row:`/`element:` shorthand (row first)."""
    shorthand = [kind for kind in STAGE_KINDS if fields.has(kind)]
    if fields.has("update"):
        for kind in shorthand:
            fields.pop(kind)
            fields.problems.add(
                fields.key_line(kind),
                fields.path(kind),
                "cannot be combined with `update`; move it into the `update` list",
            )
        return _parse_update(fields)
    if not shorthand:
        fields.problems.add(fields.line, "update", "missing required key (or the `row`/`element` shorthand)")
        return ()
    stages = (_parse_stage(fields, kind) for kind in shorthand)
    return tuple(s for s in stages if s is not None)


# --------------------------------------------------------------------------
# Whole-table stages
# --------------------------------------------------------------------------

PARTNER_CALL_RE = re.compile(r"\bpartner\s*\(")


def _parse_table_item(problems: _Problems, item: Any, field: str, line: int):
    """One `table` list item: {element: CODE} with an optional `when: COND}, or a reduce stage
    {reduce: max|min, of: EXPR, into: STATE, over: table|all, when: COND}."""
    mapping = _as_mapping(problems, item, field, line, "{element: CODE, when: COND} or {reduce: max|min, of: EXPR, "
                                                       "into: STATE, over: table|all, when: COND}")
    if mapping is None:
        return None
    if "reduce" in mapping:
        return _parse_table_reduction(problems, mapping, field, line)
    fields = _Fields(problems, mapping, field, line, TABLE_STAGE_KINDS + ("when",))
    when = _parse_when(fields)
    if "row" in mapping:
        fields.pop("row")
        problems.add(mapping.key_lines["row"], _join(field, "row"),
                     "a whole-table stage is `element:` code (run once per element of every row); row "
                     "reductions and per-row updates belong in `update`")
    if "element" not in mapping:
        if "row" not in mapping:
            problems.add(line, field, "a whole-table stage needs `element: CODE` (or `reduce:`, `of:` and `into:`)")
        fields.finish()
        return None
    parsed = _parse_snippet(fields, "element", "code")
    fields.finish()
    if parsed is None:
        return None
    code, loc = parsed
    source = fields.source("element", code)
    problems.stage_sources.append(snippets.StageSource("table", source, when))
    pairs = PARTNER_CALL_RE.search(blank_comments(code)) is not None
    return TableStage(code, loc, source_field=source.field, starts=source.starts,
                      when=when.code.strip() if when is not None else "", pairs=pairs)


def _parse_table_reduction(problems: _Problems, mapping: _Mapping, field: str, line: int) -> Optional[TableReduction]:
    """A reduce stage of `table:` (docs/spec-language.md, "Per-table states")."""
    start = len(problems)
    fields = _Fields(problems, mapping, field, line, TABLE_REDUCE_KEYS)
    when = _parse_when(fields)
    op = fields.pop("reduce")
    if op == "sum":
        problems.add(fields.value_line("reduce"), fields.path("reduce"),
                     "must be max or min: a float sum's value depends on the order of its additions, which "
                     "differs between the CPU and the GPU (max and min are exact in any order)")
        op = None
    elif op not in REDUCE_OPS:
        problems.add(fields.value_line("reduce"), fields.path("reduce"),
                     f"must be {' or '.join(REDUCE_OPS)}, got {_describe(op)}")
        op = None
    over = fields.pop("over", "table")
    if over not in REDUCE_OVERS:
        problems.add(fields.value_line("over"), fields.path("over"),
                     f"must be {' or '.join(REDUCE_OVERS)} (each table's own rows, or the rows of all tables), "
                     f"got {_describe(over)}")
    into = fields.pop("into")
    if into is not _MISSING:
        if not isinstance(into, str):
            problems.add(fields.value_line("into"), fields.path("into"),
                         f"must be the name of a per-table state, got {_describe(into)}")
        else:
            style, vline, vcol = mapping.value_marks.get("into", (None, fields.value_line("into"), 0))
            problems.reduce_targets.append((into, vline, vcol + 1, fields.path("into")))
    parsed = _parse_snippet(fields, "of", "C expression")
    source = None
    if parsed is not None:
        code, loc = parsed
        if "\n" in code.strip():
            problems.add(fields.value_line("of"), fields.path("of"), "must be one line (one C expression)")
        else:
            source = fields.source("of", code.strip())
            problems.stage_sources.append(snippets.StageSource("reduce", source, when))
    fields.finish()
    if len(problems) > start or source is None:
        return None
    return TableReduction(op, source.code, into, over, loc, source_field=source.field, starts=source.starts,
                          when=when.code.strip() if when is not None else "")


def _parse_table(fields: _Fields) -> Tuple[Tuple[TableStage, ...], Tuple[TableReduction, ...]]:
    """`table`: an optional non-empty list of whole-table stages, run in order: element stages
    first, then reduce stages (the order in which a step runs them)."""
    if not fields.has("table"):
        return (), ()
    items = _parse_stage_list(fields, "table", "{element: CODE, when: COND} / {reduce: ..., of: ..., into: ...}",
                              _parse_table_item)
    elements = tuple(i for i in items if isinstance(i, TableStage))
    reductions = tuple(i for i in items if isinstance(i, TableReduction))
    seen_reduce = None
    for i, item in enumerate(items):
        if isinstance(item, TableReduction):
            seen_reduce = item
        elif seen_reduce is not None:
            fields.problems.add(item.loc.line, item.source_field,
                                "an element stage after a reduce stage: at each step the whole-table element "
                                "stages run first, then the reduce stages; list the reduce stages last")
    return elements, reductions


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------


def _compiles_as_python(fields: _Fields, key: str, code: str, loc) -> bool:
    """Whether the Python snippet under `key` compiles; if not, the problem at its line."""
    try:
        compile(code, loc.file, "exec", dont_inherit=True)
    except SyntaxError as e:
        fields.problems.add(loc.line + (e.lineno or 1) - 1, fields.path(key), f"not valid Python: {e.msg}")
        return False
    except ValueError as e:  # e.g. a NUL character
        fields.problems.add(loc.line, fields.path(key), f"not valid Python: {e}")
        return False
    return True


def _python_snippet(fields: _Fields, key: str) -> Optional[Reference]:
    """A Python snippet under `key` that must at least compile; its source is kept for the
    problems' positions (`<key>_source`)."""
    parsed = _parse_snippet(fields, key, "Python code")
    if parsed is None:
        return None
    code, loc = parsed
    if not _compiles_as_python(fields, key, code, loc):
        return None
    setattr(fields.problems, f"{key}_source", fields.source(key, code))
    return Reference(code, loc)


def _parse_reference(fields: _Fields) -> Optional[Reference]:
    """`reference`: Python code that must at least compile."""
    return _python_snippet(fields, "reference")


def _parse_stage_reference(fields: _Fields, key: str, wanted: bool, missing: str, only: str) -> Optional[Reference]:
    """A reference that some `table` stages require and nothing else allows: `missing` is the
    problem without it where `wanted`, `only` the problem with it where not."""
    if not fields.has(key):
        if wanted:
            fields.problems.add(fields.key_line("table"), key, missing)
        return None
    if not wanted:
        fields.pop(key)
        fields.problems.add(fields.key_line(key), key, only)
        return None
    return _python_snippet(fields, key)


def _parse_table_reference(fields: _Fields, has_table: bool) -> Optional[Reference]:
    """`table_reference`: Python for the whole-table element stages; required with them, only with them."""
    return _parse_stage_reference(
        fields, "table_reference", has_table,
        "missing: a spec with `table` stages needs a `table_reference` (Python run once per table and step, "
        "before the step's forward)",
        "only with `table` element stages (it is their reference)")


def _parse_table_state_reference(fields: _Fields, has_reductions: bool) -> Optional[Reference]:
    """`table_state_reference`: Python for the reduce stages of `table:`; required with them, only with them."""
    return _parse_stage_reference(
        fields, "table_state_reference", has_reductions,
        "missing: a spec with `reduce` stages in `table` needs a `table_state_reference` (Python run once per "
        "step over all tables, before the step's forward)",
        "only with `reduce` stages in `table` (it is their reference)")


def _parse_dense_gradient(fields: _Fields, states: Any) -> bool:
    """`dense_gradient`: optional bool (default false); a dense-gradient spec has no states."""
    value = fields.pop("dense_gradient", False)
    line, field = fields.value_line("dense_gradient"), fields.path("dense_gradient")
    if not isinstance(value, bool):
        fields.problems.add(line, field, f"must be true or false, got {_describe(value)}")
        return False
    if value and states:
        # the update runs on a zeroed gradient buffer, not on the weights: a state would change
        # every step without any optimizer step to belong to
        fields.problems.add(line, field, "a dense-gradient spec cannot declare states "
                            f"({', '.join(s.name for s in states)}); its update only writes the gradient")
    return value


# --------------------------------------------------------------------------
# Whole document
# --------------------------------------------------------------------------


def _declared_names(doc: _Mapping) -> snippets.Declared:
    """What the spec declares, read from the document itself, so that the snippet checker
    resolves names even where an entry has problems of its own."""
    declared = snippets.Declared()

    def entries(section):
        value = doc.get(section)
        if not isinstance(value, _Mapping):
            return []
        return [(k, v, (value.key_lines[k], value.key_cols.get(k, 0) + 1)) for k, v in value.items() if isinstance(k, str)]

    for name, _, where in entries("hyperparameters"):
        declared.hyperparameters[name] = where
    for name, value, where in entries("states"):
        per = value.get("per") if isinstance(value, dict) else None
        declared.states[name] = (per if per in STATE_PERS else None, where)
    for name, _, where in entries("temporaries"):
        declared.temporaries[name] = where
    return declared


def _declared_types(doc: _Mapping) -> Tuple[dict, List[str]]:
    """Each declared hyperparameter's, state's and temporary's type in the snippets (int64, float or
    bool, as the kernels declare them), and the states' names: for tbegen/snippet_types.py."""
    types: dict = {}
    states: List[str] = []
    words = {"float": snippet_types.FLOAT, "int": snippet_types.INT64, "bool": snippet_types.BOOL}
    for section in ("hyperparameters", "states", "temporaries"):
        value = doc.get(section)
        if not isinstance(value, _Mapping):
            continue
        for name, entry in value.items():
            if not isinstance(name, str):
                continue
            word = entry.get("type", "float") if isinstance(entry, dict) else "float"
            types[name] = words.get(word, snippet_types.FLOAT) if section != "temporaries" else snippet_types.FLOAT
            if section == "states":
                states.append(name)
    return types, states


def _check_code(problems: _Problems, doc: _Mapping) -> None:
    """The snippet checker (tbegen/snippets.py) over the stages and the reference, then, where the
    stages are otherwise sound, the types of their expressions (tbegen/snippet_types.py)."""
    declared = _declared_names(doc)
    stage_findings = snippets.check_stages(problems.stage_sources, declared)
    for finding in stage_findings:
        problems.add_finding(finding)
    if not any(not f.warning for f in stage_findings):
        types, states = _declared_types(doc)
        for finding in snippet_types.check_types(problems.stage_sources, types, states):
            problems.add_finding(finding)
    if problems.reference_source is not None:
        for finding in snippets.check_reference(problems.reference_source, declared):
            problems.add_finding(finding)
    if problems.table_reference_source is not None:
        for finding in snippets.check_reference(problems.table_reference_source, declared, table=True):
            problems.add_finding(finding)
    if problems.table_state_reference_source is not None:
        for finding in snippets.check_reference(problems.table_state_reference_source, declared, reduce=True):
            problems.add_finding(finding)
    for name, line, col, field in problems.reduce_targets:
        per = declared.states.get(name, (None, None))[0]
        if name not in declared.states:
            known = declared.table_states()
            problems.add(line, field, f"unknown per-table state {name!r}" + snippets._suggest(name, known), col)
        elif per != "table" and per is not None:
            problems.add(line, field, f"{name!r} is a per-{per} state: a reduce stage writes a per-table state "
                                      f"(declare one with `per: table`)", col)


def _parse_document(doc: Any, problems: _Problems, stem: Optional[str],
                    check_snippets: bool = True) -> Optional[OptimizerSpec]:
    """The top-level mapping -> OptimizerSpec (None when anything is wrong)."""
    if doc is None:
        problems.add(1, "spec", "empty spec; expected a mapping with name, summary, update and reference")
        return None
    if not isinstance(doc, _Mapping):
        problems.add(1, "spec", f"must be a mapping, got {_describe(doc)}")
        return None
    fields = _Fields(problems, doc, "", doc.line, TOP_KEYS)
    name = _parse_name(fields, stem)
    summary = _parse_summary(fields)
    hyperparameters = _parse_section(fields, "hyperparameters", HYPERPARAMETER_SHAPE, _parse_hyperparameter)
    states = _parse_section(fields, "states", STATE_SHAPE, _parse_state)
    temporaries = _parse_section(fields, "temporaries", "{per: element}", _parse_temporary)
    stages = _parse_stages(fields)
    reference = _parse_reference(fields)
    raw_table = doc.get("table")
    raw_items = raw_table if isinstance(raw_table, list) else []
    has_reduce = any(isinstance(i, dict) and "reduce" in i for i in raw_items)
    has_elements = fields.has("table") and (not has_reduce or any(
        not (isinstance(i, dict) and "reduce" in i) for i in raw_items))
    table_stages, table_reductions = _parse_table(fields)
    table_reference = _parse_table_reference(fields, has_elements)
    table_state_reference = _parse_table_state_reference(fields, has_reduce)
    dense_gradient = _parse_dense_gradient(fields, states)
    if dense_gradient and fields.has("table"):
        problems.add(fields.key_line("table"), "table", "a dense-gradient spec has no optimizer step, so no "
                     "whole-table stages")
    fields.finish()
    _check_unique_names(problems, doc)
    if check_snippets:
        _check_code(problems, doc)
    if problems.items:
        return None
    return OptimizerSpec(
        name=name,
        summary=summary,
        path=problems.path,
        hyperparameters=hyperparameters,
        states=tuple(s for s in states if s.per != "table"),
        temporaries=temporaries,
        stages=stages,
        reference=reference,
        loc=problems.loc(fields.key_line("name")),
        dense_gradient=dense_gradient,
        table_stages=table_stages,
        table_reference=table_reference,
        table_reductions=table_reductions,
        table_state_reference=table_state_reference,
        table_states=tuple(s for s in states if s.per == "table"),
    )


def load_spec_text(text: str, path: str = "<string>", warnings: Optional[List[SpecProblem]] = None,
                   check_snippets: bool = True, run_reference: bool = False) -> OptimizerSpec:
    """Parse a spec from a string; `path` is only used in Locs and messages.

    When `path` ends in .yaml/.yml, `name` must equal its stem, as for files.
    Raises SpecError listing every problem found. Warnings (a declared name never used) are
    appended to `warnings` when a list is given. `check_snippets=False` skips the snippet
    checker (tbegen/snippets.py): only for tests that must show what the checker prevents.
    `run_reference=True` (`tbegen validate`, `tbegen test`) then runs the references of a spec
    that is otherwise valid on a tiny synthetic batch (tbegen/reference_check.py: it imports
    torch and executes the spec's Python) and reports what they raise or leave of the wrong
    kind or shape.
    """
    path = str(path)
    problems = _Problems(path, text)
    doc = _load_yaml(text, problems)
    if doc is _MISSING:
        problems.raise_if_any()
    _report_duplicate_keys(problems, doc)
    stem = Path(path).stem if Path(path).suffix in SPEC_SUFFIXES else None
    spec = _parse_document(doc, problems, stem, check_snippets)
    if spec is not None and run_reference:
        sources = {key: getattr(problems, f"{key}_source") for key in
                   ("reference", "table_reference", "table_state_reference")
                   if getattr(problems, f"{key}_source") is not None}
        for finding in reference_check.check_references(spec, sources):
            problems.add_finding(finding)
    if warnings is not None:
        warnings.extend(sorted(problems.warnings, key=lambda p: (p.line, p.col or 0)))
    problems.raise_if_any()
    return spec


def load_spec(path: StrPath, warnings: Optional[List[SpecProblem]] = None,
              run_reference: bool = False) -> OptimizerSpec:
    """Load and check one spec file (`run_reference`: see load_spec_text). Raises SpecError (and
    OSError if unreadable)."""
    text = Path(path).read_text(encoding="utf-8")
    return load_spec_text(text, str(path), warnings, run_reference=run_reference)


# --------------------------------------------------------------------------
# Finding specs
# --------------------------------------------------------------------------


def list_specs(search_dir: Optional[StrPath] = None) -> List[Path]:
    """The spec files in `search_dir` (default: the repository's optimizers/), sorted."""
    directory = Path(search_dir) if search_dir is not None else DEFAULT_SPEC_DIR
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.suffix in SPEC_SUFFIXES and p.is_file())


def find_spec(name_or_path: StrPath, search_dir: Optional[StrPath] = None) -> Path:
    """Resolve an optimizer name (optimizers/NAME.yaml) or a path to a spec file.

    Raises SpecNotFoundError (a ValueError) naming the available optimizers.
    """
    text = os.fspath(name_or_path)
    candidate = Path(text)
    if candidate.suffix in SPEC_SUFFIXES:
        if candidate.is_file():
            return candidate
        raise SpecNotFoundError(f"no such spec file: {text}")
    directory = Path(search_dir) if search_dir is not None else DEFAULT_SPEC_DIR
    if OPTIMIZER_NAME_RE.fullmatch(text):
        for suffix in SPEC_SUFFIXES:
            path = directory / f"{text}{suffix}"
            if path.is_file():
                return path
    available = ", ".join(p.stem for p in list_specs(directory)) or "(none)"
    raise SpecNotFoundError(
        f"unknown optimizer {text!r}: expected a name from {directory} or a path to a "
        f".yaml file; available: {available}"
    )
