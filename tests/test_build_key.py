"""The build cache's key covers what the compiler sees and nothing else (issue 10): editing a
spec's reference, summary, docs or YAML comments rebuilds nothing; editing its code does."""

from pathlib import Path

import pytest
import torch

from tbegen import build
from tbegen.spec import load_spec_text

SPEC = Path(__file__).resolve().parent.parent / "optimizers" / "rowwise_adagrad.yaml"


def key_of(text: str) -> str:
    spec = load_spec_text(text, str(SPEC))
    return build.cache_key(spec.name, build.spec_files(spec, with_cuda=True), with_cuda=True)


def test_only_compiled_changes_change_the_key():
    text = SPEC.read_text()
    base = key_of(text)
    # the reference moved before the stages and changed: every #line number of the stages moves
    body, reference = text.split("reference: |\n")
    moved = body.replace("update:\n", "reference: |\n" + reference.replace("w = keep", "w = 1.0 * keep") + "update:\n")
    assert moved != text
    assert key_of(moved) == base
    assert key_of(text.replace("summary: Adagrad", "summary: The Adagrad")) == base
    assert key_of(text.replace("doc: Step size.", "doc: The step size.")) == base
    assert key_of("# a comment\n# another\n" + text) == base
    assert key_of(text.replace("// L2 decay (mode 1) adds", "// L2 decay (mode 1) also adds")) == base
    # code changes the key
    assert key_of(text.replace("w *= clamp;", "w *= clamp * 1.0f;")) != base
    # defaults are not compiled (the module passes hyperparameters at run time)
    assert key_of(text.replace("default: 0.01", "default: 0.02")) == base


def test_comment_stripping_never_hides_code():
    assert build.compiled_text('x = 1;  // why\n// header\ny = 2;') == "x = 1;\ny = 2;"
    assert build.compiled_text('#line 17 "a.yaml"\n  #line 50') == '#line "a.yaml"\n#line'
    for text in ['s = "http://x";', "/* a // b */ x = 1;", "// c \\", "x = 1; // it's */"]:
        assert build.compiled_text(text) == text
    assert build.compiled_text("// c \\\ny = 1;") != build.compiled_text("// c\ny = 1;")


def test_cuda_code_choice_and_its_flags(monkeypatch):
    """build.cuda_code: machine code where a GPU is, PTX only where none is (a CUDA build there is a
    compile-and-link check), $TBEGEN_CUDA_CODE to choose; the choice is part of a CUDA build's key."""
    monkeypatch.delenv("TBEGEN_CUDA_CODE", raising=False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a+PTX")
    assert build.cuda_code() == ("sass" if torch.cuda.is_available() else "ptx")
    monkeypatch.setenv("TBEGEN_CUDA_CODE", "ptx")
    assert build.cuda_flags() == build.CUDA_FLAGS + ["-gencode=arch=compute_80,code=compute_80",
                                                     "-gencode=arch=compute_90a,code=compute_90a"]
    files = {"k/ops.cpp": "int f() { return 1; }\n"}
    ptx_key, cpu_key = build.cache_key("k", files, True), build.cache_key("k", files, False)
    monkeypatch.setenv("TBEGEN_CUDA_CODE", "sass")
    assert build.cuda_flags() == build.CUDA_FLAGS  # (cpp_extension adds the -gencode for sm_XY)
    assert build.cache_key("k", files, True) != ptx_key and build.cache_key("k", files, False) == cpu_key
    monkeypatch.setenv("TBEGEN_CUDA_CODE", "cubin")
    with pytest.raises(ValueError, match="TBEGEN_CUDA_CODE='cubin': expected 'sass' \\(machine code\\) or 'ptx'"):
        build.cuda_code()
    monkeypatch.setenv("TBEGEN_CUDA_CODE", "ptx")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "Hopper")
    with pytest.raises(ValueError, match="'Hopper' is not an architecture number"):
        build.cuda_flags()
