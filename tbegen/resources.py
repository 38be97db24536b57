"""Where tbegen's data lives: the optimizer specs, the templates and the runtime sources.

tbegen runs from two places, and finds the same files in both:

- a checkout (or an editable install of one): the project's own optimizers/ and templates/,
  beside the tbegen/ package, and generated/ as the committed render;
- an installed wheel or sdist: the same two folders shipped inside the package, as
  tbegen/_data/optimizers and tbegen/_data/templates (pyproject.toml maps them there), and
  generated/ in the current directory, where `tbegen render` writes by default.

`DATA_ROOT` is the folder holding optimizers/ and templates/ in either case, so a spec's path
relative to it ("optimizers/adagrad.yaml") is the same from both, and so is every rendered file
(and with it the build cache key).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

PACKAGE_DIR = Path(__file__).resolve().parent
SHIPPED_DATA = PACKAGE_DIR / "_data"


def _checkout_root() -> Optional[Path]:
    """The project's root when tbegen runs from a checkout (its folders beside the package)."""
    root = PACKAGE_DIR.parent
    if (root / "pyproject.toml").is_file() and (root / "optimizers").is_dir() and (root / "templates").is_dir():
        return root
    return None


CHECKOUT_ROOT = _checkout_root()
DATA_ROOT = CHECKOUT_ROOT if CHECKOUT_ROOT is not None else SHIPPED_DATA
SPEC_DIR = DATA_ROOT / "optimizers"
TEMPLATES_DIR = DATA_ROOT / "templates"
STATIC_INCLUDE_DIR = TEMPLATES_DIR / "include"
COMMON_HEADER = STATIC_INCLUDE_DIR / "tbegen" / "common.h"


def default_generated_dir() -> Path:
    """Where `tbegen render` writes and `tbegen check` compares by default: the project's
    generated/ in a checkout, else generated/ in the current directory."""
    if CHECKOUT_ROOT is not None:
        return CHECKOUT_ROOT / "generated"
    return Path.cwd() / "generated"


def missing_data() -> Optional[str]:
    """A sentence naming what an installation lacks (specs or templates), or None when complete."""
    missing = [str(p) for p in (SPEC_DIR, COMMON_HEADER) if not p.exists()]
    if not missing:
        return None
    return ("tbegen's data files are missing (" + ", ".join(missing) + "): this installation is "
            "incomplete; reinstall tbegen from a wheel or sdist built with its pyproject.toml, or run "
            "from a checkout")
