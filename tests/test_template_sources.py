"""Rules the template sources keep that no compiler checks.

Error messages: host code formats numbers with TBEGEN_CHECK / tbegen::message (host.h), which use
std::to_string, never with TORCH_CHECK's or TORCH_WARN's own formatting (c10::str, an ostream). On
the GPU machine, formatting an integer through an ostream inside an nvcc-compiled object crashed
the process (a segmentation fault in std::ostream::_M_insert<long>) where it should have raised:
the managed-memory operators did, until run K found it (benchmarks/NOTES-gpu.md).
"""

import re
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
TORCH_MACRO = re.compile(r"\b(TORCH_CHECK|TORCH_WARN|TORCH_WARN_ONCE|TORCH_INTERNAL_ASSERT)\s*\(")


def _code_lines(path: Path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("//", 1)[0]
        if code.strip():
            yield number, code


def test_torch_message_macros_take_prebuilt_messages():
    offenders = []
    for path in sorted(p for p in TEMPLATES.rglob("*") if p.is_file()):
        for number, code in _code_lines(path):
            if not TORCH_MACRO.search(code):
                continue
            # host.h's fail(what): the message is already a string
            if path.name == "host.h" and "TORCH_CHECK(false, what)" in code:
                continue
            if "::tbegen::message(" in code:
                continue
            offenders.append(f"{path.relative_to(TEMPLATES)}:{number}: {code.strip()}")
    assert not offenders, "use TBEGEN_CHECK or TORCH_WARN(::tbegen::message(...)):\n" + "\n".join(offenders)


def test_the_rule_sees_a_formatting_macro(tmp_path):
    # the pattern matches the forms the rule forbids
    for bad in ('TORCH_CHECK(n > 0, "got ", n);', 'TORCH_WARN("GPU ", device);', "TORCH_WARN_ONCE (x);"):
        assert TORCH_MACRO.search(bad)
