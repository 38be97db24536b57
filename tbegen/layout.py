"""Table layout: where each table lives in the flat weights buffer, and what each feature reads.

Shared by the runtime module and the harness, so that both call the operators the same way.
See docs/layout.md and templates/include/tbegen/common.h for the `features` columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import functools
import re
from pathlib import Path

import torch

from . import resources

POOLING = {"sum": 0, "mean": 1, "none": 2}

# The runtime header that defines the row-width limits for the kernels and the host checks.
COMMON_HEADER = resources.COMMON_HEADER


@functools.lru_cache(maxsize=None)
def _header_text(header: Path) -> str:
    return header.read_text()  # (read once: both limits come from it)


def header_constant(name: str, header: Path = COMMON_HEADER) -> int:
    """The value of `constexpr int64_t NAME = N;` in the runtime's common.h: the row-width limits
    have one source, read by the kernels, the host checks and this module alike."""
    match = re.search(rf"constexpr\s+int64_t\s+{name}\s*=\s*([0-9]+)\s*;", _header_text(header))
    if match is None:
        raise RuntimeError(f"tbegen: {header} defines no `constexpr int64_t {name} = N;` (the templates are damaged)")
    return int(match.group(1))


# The widest row the operators accept (kMaxD). Any width from 1 up is supported; on CUDA a layout
# whose widths or column offsets are not all multiples of 4, or whose widest row is over
# VECTOR_MAX_DIM (kVectorMaxD), takes the any-width kernels instead of the 4-wide ones.
MAX_DIM = header_constant("kMaxD")
VECTOR_MAX_DIM = header_constant("kVectorMaxD")


@dataclass(frozen=True)
class Layout:
    tables: Tuple[Tuple[int, int], ...]  # (rows, dim) per table
    feature_table_map: Tuple[int, ...]  # table of each feature
    table_offsets: Tuple[int, ...]  # start of each table in the weights buffer
    table_key_base: Tuple[int, ...]  # first linear key of each table
    weights_numel: int
    total_hash_size: int  # rows of all tables = number of linear keys
    total_D: int  # width of the pooled output (sum of the features' dims)
    max_D: int

    @property
    def num_features(self) -> int:
        return len(self.feature_table_map)

    def features_tensor(self, device="cpu") -> torch.Tensor:
        """int64 [F, 5]: weights offset, rows, dim, output offset, key base."""
        rows = []
        out = 0
        for t in self.feature_table_map:
            E, D = self.tables[t]
            rows.append([self.table_offsets[t], E, D, out, self.table_key_base[t]])
            out += D
        return torch.tensor(rows, dtype=torch.int64, device=device)

    def feature_out_offsets(self) -> Tuple[int, ...]:
        offs, out = [], 0
        for t in self.feature_table_map:
            offs.append(out)
            out += self.tables[t][1]
        return tuple(offs)


def make_layout(tables: Sequence[Tuple[int, int]], feature_table_map: Optional[Sequence[int]] = None) -> Layout:
    tables = tuple((int(E), int(D)) for E, D in tables)
    if not tables:
        raise ValueError("tbegen: at least one table is needed")
    for t, (E, D) in enumerate(tables):
        if E < 1:
            raise ValueError(f"tbegen: table {t} has {E} rows; each table needs at least one row")
        if D < 1 or D > MAX_DIM:
            raise ValueError(f"tbegen: table {t} has dim {D}; embedding dims must be from 1 to {MAX_DIM}")
    if feature_table_map is None:
        feature_table_map = range(len(tables))
    ftm = tuple(int(t) for t in feature_table_map)
    if not ftm:
        raise ValueError("tbegen: feature_table_map is empty")
    bad = [t for t in ftm if not 0 <= t < len(tables)]
    if bad:
        raise ValueError(f"tbegen: feature_table_map refers to table(s) {bad}, but there are {len(tables)} tables")
    offsets, keys = [], []
    w = k = 0
    for E, D in tables:
        offsets.append(w)
        keys.append(k)
        w += E * D
        k += E
    return Layout(
        tables=tables,
        feature_table_map=ftm,
        table_offsets=tuple(offsets),
        table_key_base=tuple(keys),
        weights_numel=w,
        total_hash_size=k,
        total_D=sum(tables[t][1] for t in ftm),
        max_D=max(D for _, D in tables),
    )
