"""tbegen's readers of its own environment variables (TBEGEN_*), each checked: a value that is
not one of the variable's choices is refused with a message naming the variable, never taken as
some default (a typo must not time or run one path under another's name). The switches of the
CUDA runtime headers are read in C++ (any_width::env_switch, opt_in_switch, switch_or)."""

from __future__ import annotations

import os
from typing import Sequence


def env_choice(name: str, choices: Sequence[str], unset: str) -> str:
    """Environment variable `name`, checked: one of `choices`; unset or empty gives `choices[0]`
    (described as `unset` in the error)."""
    value = os.environ.get(name, "")
    if value == "":
        return choices[0]
    if value not in choices:
        raise ValueError(f"tbegen: {name} must be one of {list(choices)} (or unset: {unset}), got {value!r}")
    return value


def env_flag(name: str, default: bool) -> bool:
    """Environment variable `name` as an on/off switch: "1" on, "0" off, unset or empty `default`;
    anything else refused."""
    flag = os.environ.get(name, "")
    if flag not in ("", "0", "1"):
        raise ValueError(f"tbegen: {name} must be 0 or 1 (or unset), got {flag!r}")
    return default if flag == "" else flag == "1"
