"""A failed build, reported in the spec's terms.

The generated sources carry `#line` directives naming the YAML file, so a compiler already
reports a mistake in a snippet at the right spec *line*; its column, though, counts from the start
of the generated line, whose indentation (and, for a row reduction, rewriting) differs from the
YAML's. This module walks the `#line` directives of the sources that were compiled to find the
generated text of that spec line, aligns it with the snippet line the spec loader recorded
(`Stage.starts`), and turns the compiler's column into the YAML's. The result is a few
FILE:LINE:COL: FIELD: error: MESSAGE lines (the spec checker's format); the full compiler output
is kept in a log file whose path the message gives.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

# how many errors the message shows (the log has them all)
SHOWN = 5

# GCC/Clang: FILE:LINE:COL: error: MESSAGE
_GCC_RE = re.compile(r"^(?P<file>[^:\n]+):(?P<line>\d+):(?P<col>\d+): (?:fatal )?error: (?P<msg>.*)$")
# nvcc's front end: FILE(LINE): error: MESSAGE, then the source line and a caret line
_NVCC_RE = re.compile(r"^(?P<file>[^(\n]+)\((?P<line>\d+)\): error: (?P<msg>.*)$")
_LINE_RE = re.compile(r'^\s*#line (\d+) "([^"\n]*)"\s*$')


class CompileError(RuntimeError):
    """The compiler rejected an optimizer's generated sources; the message is the short report."""

    def __init__(self, message: str, log_path: Path):
        super().__init__(message)
        self.log_path = log_path

    def __reduce__(self):
        # (raised in the parallel build's worker processes and passed back to the caller)
        return (CompileError, (str(self), self.log_path))


@dataclass(frozen=True)
class Diagnostic:
    file: str
    line: int
    col: Optional[int]  # 1-based, None when the compiler gave none
    message: str


def parse_diagnostics(log: str) -> List[Diagnostic]:
    """The error diagnostics of a compiler log, in order (notes and warnings are left out)."""
    found = []
    lines = log.splitlines()
    for i, text in enumerate(lines):
        m = _GCC_RE.match(text.strip())
        if m:
            found.append(Diagnostic(m["file"], int(m["line"]), int(m["col"]), m["msg"]))
            continue
        m = _NVCC_RE.match(text.strip())
        if m:
            col = None
            # nvcc prints the offending (generated) line and a caret under the column
            if i + 2 < len(lines) and lines[i + 2].strip() == "^":
                col = lines[i + 2].index("^") + 1
            found.append(Diagnostic(m["file"], int(m["line"]), col, m["msg"]))
    return found


def generated_lines(files: Dict[str, str]) -> Dict[Tuple[str, int], List[str]]:
    """(file named by #line, line number) -> the generated lines that the compiler numbers so."""
    out: Dict[Tuple[str, int], List[str]] = {}
    for text in files.values():
        current: Optional[Tuple[str, int]] = None
        for raw in text.splitlines():
            m = _LINE_RE.match(raw)
            if m:
                current = (m.group(2), int(m.group(1)))
                continue
            if current is not None:
                out.setdefault(current, []).append(raw)
                current = (current[0], current[1] + 1)
    return out


def _snippet_line(stages, line: int) -> Optional[Tuple[str, str, int]]:
    """(field, code line, its 0-based file column) of the snippet line at spec line `line`."""
    for stage in stages:
        for (file_line, offset), code in zip(stage.starts, stage.code.splitlines()):
            if file_line == line:
                return stage.source_field, code, offset
    return None


def yaml_column(generated: List[str], code: str, col: int) -> Optional[int]:
    """The 0-based column within `code` (the snippet line) of column `col` (1-based) of whichever
    generated line contains it best: the one sharing the longest run of text around that column."""
    best = None
    p = col - 1
    for text in generated:
        matcher = difflib.SequenceMatcher(None, text, code, autojunk=False)
        for a, b, size in matcher.get_matching_blocks():
            # (a column just past a run counts too: "expected ';'" points after the last token)
            if size and a <= p <= a + size and (best is None or size > best[0]):
                best = (size, b + (p - a))
    return None if best is None else best[1]


def _stages_of(spec_file: str, spec_root: Path):
    """The stages of the spec file a #line directive names (None if it cannot be read)."""
    from .spec import SpecError, load_spec_text

    path = Path(spec_file)
    if not path.is_absolute():
        path = spec_root / path
    try:
        spec = load_spec_text(path.read_text(encoding="utf-8"), str(path), check_snippets=False)
        # (all carry source_field, code and starts)
        return spec.stages + spec.table_stages + spec.table_reductions
    except (OSError, SpecError, UnicodeDecodeError):
        return None


def describe(d: Diagnostic, lines: Dict[Tuple[str, int], List[str]], stages) -> str:
    """One diagnostic as FILE:LINE[:COL]: [FIELD: ]error: MESSAGE, in YAML terms where it is in a spec."""
    where = _snippet_line(stages, d.line) if stages else None
    if where is None:
        col = f":{d.col}" if d.col is not None else ""
        return f"{d.file}:{d.line}{col}: error: {d.message}"
    field, code, offset = where
    col_in_code = yaml_column(lines.get((d.file, d.line), []), code, d.col) if d.col is not None else None
    col = f":{offset + col_in_code + 1}" if col_in_code is not None else ""
    return f"{d.file}:{d.line}{col}: {field}: error: {d.message}"


def report(name: str, flavour: str, log: str, files: Dict[str, str], log_path: Path,
           spec_root: Path) -> str:
    """The short message for a failed build of optimizer `name` (the full log is at log_path)."""
    diagnostics = parse_diagnostics(log)
    lines = generated_lines(files)
    stages_by_file: dict = {}
    shown: List[str] = []
    for d in diagnostics:
        if d.file.endswith((".yaml", ".yml")) and d.file not in stages_by_file:
            stages_by_file[d.file] = _stages_of(d.file, spec_root)
        text = describe(d, lines, stages_by_file.get(d.file))
        if text not in shown:  # a template instantiated for several row views repeats its errors
            shown.append(text)
    head = f"tbegen: the compiler rejected optimizer '{name}' ({flavour} build)"
    if not shown:
        body = ["(no error line found in the compiler's output; see the log)"]
    else:
        body = shown[:SHOWN] + ([f"... and {len(shown) - SHOWN} more"] if len(shown) > SHOWN else [])
    return "\n".join([head + ":"] + body + [f"full compiler log: {log_path}"])
