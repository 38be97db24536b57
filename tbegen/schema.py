"""A JSON Schema (draft 2020-12) of the spec format, for editors (`tbegen schema`).

Built from the loader's own tables (tbegen/spec.py: the keys, types, `per` values, name
patterns), so the two cannot drift apart on the format's shape. The schema checks structure
only: what it cannot express (names used in snippets, reductions, the reference) is the loader's
and the snippet checker's job, so a spec that satisfies the schema may still fail
`tbegen validate`; a spec `tbegen validate` accepts always satisfies the schema.

Point an editor at it, e.g. with the YAML language server's modeline at the top of a spec:

    # yaml-language-server: $schema=tbegen-spec.schema.json
"""

from __future__ import annotations

import json
from typing import Any, Dict

from . import spec as sp

SCHEMA_ID = "urn:tbegen:optimizer-spec"

_JSON_TYPES = {"float": "number", "int": "integer", "bool": "boolean"}


def _anchored(pattern: str) -> str:
    return f"^{pattern}$"


def _code(description: str) -> Dict[str, Any]:
    return {"type": "string", "minLength": 1, "pattern": r"\S", "description": description}


def _hyperparameter() -> Dict[str, Any]:
    by_type = [
        {
            "if": {"properties": {"type": {"const": t}}, "required": ["type"]},
            "then": {
                "properties": {
                    "default": {"type": _JSON_TYPES[t]},
                    "choices": {"items": {"type": _JSON_TYPES[t]}},
                    "test": {"items": {"type": _JSON_TYPES[t]}},
                    "test_base": {"type": _JSON_TYPES[t]},
                }
            },
        }
        for t in sp.HYPERPARAMETER_TYPES
    ]
    return {
        "type": "object",
        "description": "A scalar passed to every update call; leave `default` out to make it required.",
        "properties": {
            "type": {"enum": list(sp.HYPERPARAMETER_TYPES), "description": "float (C++ float), int (int64_t) or bool"},
            "default": {"description": "value used when the caller gives none"},
            "doc": {"type": "string", "description": "one-line description"},
            "choices": {"type": "array", "minItems": 1, "description": "the only values allowed"},
            "test": {"type": "array", "minItems": 1, "description": "values worth a numerical test case each"},
            "test_base": {"description": "the value it takes in every other numerical test case (a decay switched on)"},
        },
        "required": ["type"],
        "additionalProperties": False,
        "allOf": by_type,
    }


def _state() -> Dict[str, Any]:
    return {
        "type": "object",
        "description": "Optimizer state saved between steps.",
        "properties": {
            "per": {"enum": list(sp.STATE_PERS), "description": "element: one value per weight; row: one per table row; "
                                                             "table: one float per table (read-only in `update`, "
                                                             "set by `reduce` stages of `table`)"},
            "type": {"enum": list(sp.STATE_TYPES), "default": "float",
                     "description": "float, or int: an exact int64 per-row value (counters, step numbers)"},
            "init": {"type": "number", "description": "initial value (default 0)"},
            "dtype": {"enum": list(sp.STATE_DTYPES), "default": "fp32",
                      "description": "storage type (arithmetic is float32; narrow states are rounded stochastically)"},
            "doc": {"type": "string"},
        },
        "required": ["per"],
        "additionalProperties": False,
    }


def _temporary() -> Dict[str, Any]:
    return {
        "type": "object",
        "description": "Per-element scratch value carried between stages, never saved.",
        "properties": {"per": {"enum": list(sp.TEMPORARY_PERS)}},
        "required": ["per"],
        "additionalProperties": False,
    }


def _section(entry: Dict[str, Any], description: str) -> Dict[str, Any]:
    return {
        "type": ["object", "null"],
        "description": description,
        "propertyNames": {"pattern": _anchored(sp.IDENTIFIER_RE.pattern)},
        "additionalProperties": entry,
    }


def spec_schema() -> Dict[str, Any]:
    """The JSON Schema of one optimizer spec file."""
    stage = {
        "type": "object",
        "description": "One stage: exactly one key, row (once per row) or element (once per element), "
                       "and optionally when (a guard).",
        "properties": {
            **{kind: _code(f"C-like code run per {kind}") for kind in sp.STAGE_KINDS},
            "when": _code("a C condition over hyperparameters only; the stage runs when it holds"),
        },
        "additionalProperties": False,
        "oneOf": [{"required": [kind]} for kind in sp.STAGE_KINDS],
    }
    table_stage = {
        "type": "object",
        "description": "One whole-table stage: element code run over every element of every row of every "
                       "table before the forward of a step at which `when` holds.",
        "properties": {
            **{kind: _code(f"C-like code run per {kind} of every row") for kind in sp.TABLE_STAGE_KINDS},
            "when": _code("a C condition over hyperparameters and step; the stage runs at the steps where it holds"),
        },
        "required": list(sp.TABLE_STAGE_KINDS),
        "additionalProperties": False,
    }
    reduce_stage = {
        "type": "object",
        "description": "One reduce stage: sets a per-table state to the max or min over the rows of each table "
                       "(over: table) or of all tables (over: all) of a row expression, before the forward of a "
                       "step at which `when` holds, after that step's whole-table element stages.",
        "properties": {
            "reduce": {"enum": list(sp.REDUCE_OPS)},
            "of": _code("a C expression over per-row and per-table states, hyperparameters, step and D"),
            "into": {"type": "string", "pattern": _anchored(sp.IDENTIFIER_RE.pattern),
                     "description": "the per-table state it sets"},
            "over": {"enum": list(sp.REDUCE_OVERS), "default": "table"},
            "when": _code("a C condition over hyperparameters and step; the stage runs at the steps where it holds"),
        },
        "required": ["reduce", "of", "into"],
        "additionalProperties": False,
    }
    properties = {
        "name": {"type": "string", "pattern": _anchored(sp.OPTIMIZER_NAME_RE.pattern),
                 "description": "the optimizer's name; equals the file's stem"},
        "summary": {"type": "string", "minLength": 1, "pattern": r"^[^\n]+$", "description": "one line"},
        "hyperparameters": _section(_hyperparameter(), "name -> hyperparameter"),
        "states": _section(_state(), "name -> state"),
        "temporaries": _section(_temporary(), "name -> temporary"),
        "update": {"type": "array", "minItems": 1, "items": stage, "description": "the stages, run in order"},
        "row": _code("shorthand for update: [{row: ...}] (runs before `element`)"),
        "element": _code("shorthand for update: [{element: ...}]"),
        "reference": _code("float64 torch code: the update of the touched rows, for the tests"),
        "dense_gradient": {"type": "boolean",
                           "description": "no optimizer step: the update writes the weights' gradient"},
        "table": {"type": "array", "minItems": 1, "items": {"oneOf": [table_stage, reduce_stage]},
                  "description": "whole-table stages (element stages, then reduce stages), run in order before "
                                 "a step's forward"},
        "table_reference": _code("float64 torch code: the whole-table element stages of one step, once per table"),
        "table_state_reference": _code("float64 torch code: the reduce stages of one step, once over all tables"),
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "tbegen optimizer spec",
        "description": "One optimizer for tbegen's generated embedding kernels (docs/spec-language.md).",
        "type": "object",
        "properties": properties,
        "required": ["name", "summary", "reference"],
        "additionalProperties": False,
        # the stages come as `update`, or as the row/element shorthand, never both
        "anyOf": [{"required": ["update"]}, {"required": ["row"]}, {"required": ["element"]}],
        "dependentSchemas": {"update": {"not": {"anyOf": [{"required": ["row"]}, {"required": ["element"]}]}},
                             "table_reference": {"required": ["table"]},
                             "table_state_reference": {"required": ["table"]}},
    }


def schema_json() -> str:
    return json.dumps(spec_schema(), indent=2) + "\n"
