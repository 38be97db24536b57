"""Every environment variable tbegen reads is documented for its users.

The switches (TBEGEN_*) are read by the package (tbegen/_env.py's env_choice and env_flag, os.environ.get) and by
the runtime headers (getenv, opt_in_switch, switch_or, env_switch, env_is_zero, env_is_one): a
name in quotes there. Each must appear in README.md or docs/*.md, where a user finds what it does
(docs/module.md's "Kernel-choice switches", docs/placements.md for the cache's). Preprocessor
macros named TBEGEN_* (#ifdef, defined(...)) are not environment variables and are left out."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sources():
    return [p for p in list((ROOT / "tbegen").rglob("*.py")) + list((ROOT / "templates").rglob("*"))
            if p.is_file()]


def read_variables():
    names, macros = set(), set()
    for p in _sources():
        text = p.read_text(errors="replace")
        names |= set(re.findall(r"[\"'](TBEGEN_[A-Z0-9_]+)[\"']", text))
        macros |= set(re.findall(r"(?:#\s*ifn?def\s+|defined\s*\(\s*)(TBEGEN_[A-Z0-9_]+)", text))
        macros |= set(re.findall(r"_MACRO\s*=\s*[\"'](TBEGEN_[A-Z0-9_]+)[\"']", text))
    return names - macros


def test_the_reader_finds_the_known_switches():
    names = read_variables()
    for known in ("TBEGEN_BUILD_DIR", "TBEGEN_CACHE_BACKING", "TBEGEN_CACHE_ROW_STATES", "TBEGEN_LANE_GROUPS",
                  "TBEGEN_VBE_GRAD_OFFSETS", "TBEGEN_RANGES"):
        assert known in names, known
    assert "TBEGEN_OPS_PART" not in names and "TBEGEN_CPU_FP32_WEIGHTS_ONLY" not in names  # (macros)


def test_every_variable_is_documented():
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    missing = sorted(n for n in read_variables() if n not in docs)
    assert not missing, f"environment variables read by tbegen but named in no doc (README.md, docs/*.md): {missing}"
