"""tbegen as users install it: the wheel and the sdist carry every spec, template and runtime
source, and an unpacked wheel, run from outside the checkout, finds them and renders the same
files as the checkout. (.ci/check_installed.sh goes further: it installs the wheel into a fresh
virtual environment and builds and trains an optimizer there.)"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tbegen import resources

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(resources.CHECKOUT_ROOT is None, reason="needs the project checkout")


def _data_files(folder: str):
    """The project's files under folder (optimizers/ or templates/), relative to it."""
    base = ROOT / folder
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(ROOT)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"could not build a wheel here (pip wheel failed: {proc.stderr.strip()[-300:]})")
    (path,) = out.glob("tbegen-*.whl")
    return path


def test_the_wheel_ships_every_spec_and_template(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("optimizers", "templates"):
        expected = _data_files(folder)
        assert expected, folder
        missing = [f for f in expected if f"tbegen/_data/{folder}/{f}" not in names]
        assert not missing, f"the wheel lacks {folder}/ files: {missing}"


def test_the_sdist_ships_every_spec_and_template(tmp_path):
    from setuptools import build_meta

    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        name = build_meta.build_sdist(str(tmp_path))
    finally:
        os.chdir(cwd)
    with tarfile.open(tmp_path / name) as tar:
        names = set(tar.getnames())
    top = name[: -len(".tar.gz")]
    for folder in ("optimizers", "templates"):
        missing = [f for f in _data_files(folder) if f"{top}/{folder}/{f}" not in names]
        assert not missing, f"the sdist lacks {folder}/ files: {missing}"


def test_an_unpacked_wheel_finds_its_data_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    work = tmp_path / "work"
    work.mkdir()
    # PYTHONPATH puts the unpacked wheel ahead of the editable install (whose finder comes last)
    env = dict(os.environ, PYTHONPATH=str(site))
    code = ("import tbegen, tbegen.resources as r, tbegen.spec as s;"
            "assert tbegen.__file__.startswith(%r), tbegen.__file__;"
            "assert r.CHECKOUT_ROOT is None and r.missing_data() is None;"
            "print(len(s.list_specs()))") % str(site)
    proc = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == len(_data_files("optimizers"))
    proc = subprocess.run([sys.executable, "-m", "tbegen", "render", "--optimizer", "adagrad"], cwd=work, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rendered = work / "generated" / "adagrad"
    committed = ROOT / "generated" / "adagrad"
    names = sorted(p.name for p in committed.iterdir())
    assert sorted(p.name for p in rendered.iterdir()) == names
    for n in names:
        assert (rendered / n).read_text() == (committed / n).read_text(), n
