"""The typed model (tbegen/model.py): its enums and the invariants checked where its objects are made."""

import math

import numpy as np
import pytest
import torch

from tbegen.model import (
    Hyperparameter,
    HyperType,
    Loc,
    Stage,
    StageKind,
    State,
    StatePer,
    StateType,
    Temporary,
)
from tbegen.spec import find_spec, load_spec

LOC = Loc("x.yaml", 1)


def test_enum_members_are_the_spec_words():
    assert HyperType("float") is HyperType.FLOAT and HyperType.FLOAT == "float"
    assert f"{HyperType.INT}" == "int" and str(StatePer.ROW) == "row" and f"{StageKind.ELEMENT:>8}" == " element"
    assert [t.cpp for t in HyperType] == ["float", "int64_t", "bool"]
    with pytest.raises(ValueError):
        StatePer("column")


@pytest.mark.parametrize(
    "type_,value,expected",
    [
        ("float", 1, 1.0), ("float", np.float32(0.5), 0.5), ("float", torch.tensor(2.0).item(), 2.0),
        ("int", np.int64(7), 7), ("int", -(2**63), -(2**63)), ("bool", True, True),
    ],
)
def test_convert_accepts(type_, value, expected):
    got = HyperType(type_).convert(value)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    "type_,value,error,message",
    [
        ("float", True, TypeError, "must be a float, got bool True"),
        ("float", "0.1", TypeError, "must be a float, got str '0.1'"),
        ("float", math.inf, ValueError, "must be finite, got inf"),
        ("float", math.nan, ValueError, "must be finite, got nan"),
        ("int", 1.0, TypeError, "must be an int, got float 1.0"),
        ("int", False, TypeError, "must be an int, got bool False"),
        ("int", 2**63, ValueError, "does not fit in int64: 9223372036854775808"),
        ("bool", 1, TypeError, "must be a bool, got int 1"),
    ],
)
def test_convert_rejects(type_, value, error, message):
    with pytest.raises(error, match=message):
        HyperType(type_).convert(value)


def test_loader_module_and_harness_share_the_conversion():
    """The module's check of a hyperparameter is HyperType.convert, with the module's words."""
    from tbegen.module import _convert_hyperparameter

    spec = load_spec(find_spec("adagrad"))
    with pytest.raises(ValueError, match="tbegen: hyperparameter 'eps' of optimizer 'adagrad' must be finite, got inf"):
        _convert_hyperparameter(spec, "eps", math.inf)
    assert _convert_hyperparameter(spec, "eps", np.float64(1e-6)) == 1e-6


def test_invariants_are_checked_where_objects_are_made():
    h = Hyperparameter("mode", "int", 0, "", (0, 1), LOC)
    assert h.type is HyperType.INT
    with pytest.raises(TypeError):
        Hyperparameter("lr", "float", "fast", "", None, LOC)
    with pytest.raises(ValueError, match="not among its choices"):
        Hyperparameter("mode", "int", 2, "", (0, 1), LOC)
    with pytest.raises(ValueError, match="not among its choices"):
        Hyperparameter("mode", "int", 0, "", (0, 1), LOC, test_values=(3,))
    s = State("counter", "row", 0.0, "fp32", "", LOC, "int")
    assert s.per is StatePer.ROW and s.type is StateType.INT and s.is_int
    with pytest.raises(ValueError, match="int states are per row only"):
        State("counter", "element", 0.0, "fp32", "", LOC, "int")
    with pytest.raises(ValueError, match="dtype"):
        State("m", "element", 0.0, "fp64", "", LOC)
    with pytest.raises(ValueError, match="per element only"):
        Temporary("t", "row", LOC)
    assert Stage("row", "x = 1;", LOC).kind is StageKind.ROW
    with pytest.raises(ValueError):
        Stage("column", "x = 1;", LOC)


def test_loaded_specs_carry_enum_members():
    spec = load_spec(find_spec("rowwise_adagrad_with_counter"))
    assert all(isinstance(h.type, HyperType) for h in spec.hyperparameters)
    assert all(isinstance(s.per, StatePer) and isinstance(s.type, StateType) for s in spec.states)
    assert all(isinstance(st.kind, StageKind) for st in spec.stages)
    assert {s.name for s in spec.int_row_states} == {"prev_iter"}  # (row_counter decays: a float)


def test_row_width_limits_have_one_source(tmp_path):
    """tbegen.layout reads kMaxD and kVectorMaxD from the runtime header the kernels compile."""
    from tbegen import layout

    text = layout.COMMON_HEADER.read_text()
    assert f"constexpr int64_t kMaxD = {layout.MAX_DIM};" in text
    assert f"constexpr int64_t kVectorMaxD = {layout.VECTOR_MAX_DIM};" in text
    damaged = tmp_path / "common.h"
    damaged.write_text(text.replace("kMaxD", "kMaxWidth"))
    with pytest.raises(RuntimeError, match="defines no `constexpr int64_t kMaxD = N;`"):
        layout.header_constant("kMaxD", damaged)
    with pytest.raises(ValueError, match=f"embedding dims must be from 1 to {layout.MAX_DIM}"):
        layout.make_layout([(10, layout.MAX_DIM + 1)])
