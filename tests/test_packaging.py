"""What `pip install .` puts into site-packages: the command line inside the ``kvsim`` package (not a
top-level ``cli`` module), and the console script ``sim`` pointing at it."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "cli.py", "kvsim", "sim", "gpu", "traces", "reports")


def test_kvsim_cli_is_the_checkouts_cli():
    import cli
    import kvsim.cli

    assert (ROOT / "kvsim" / "cli.py").samefile(ROOT / "cli.py")
    assert Path(kvsim.cli.__file__).read_text() == Path(cli.__file__).read_text()
    assert type(kvsim.cli.app) is type(cli.app)


def test_wheel_holds_no_top_level_cli_module(tmp_path):
    pytest.importorskip("setuptools", minversion="77")
    src = tmp_path / "src"
    for name in SOURCES:  # a copy: the build writes build/ and *.egg-info beside the sources
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(p, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    if r.returncode != 0 and "No module named pip" in r.stderr:
        pytest.skip("pip is not installed in this environment")
    assert r.returncode == 0, r.stderr
    wheel = zipfile.ZipFile(next((tmp_path / "dist").glob("kvsim-*.whl")))
    names = wheel.namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"kvsim", "sim", "gpu", "traces", "reports", next(t for t in top if t.endswith(".dist-info"))}, top
    assert "kvsim/cli.py" in names and wheel.read("kvsim/cli.py") == (ROOT / "cli.py").read_bytes()  # the file, not a link
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    cfg = configparser.ConfigParser()
    cfg.read_string(wheel.read(entry).decode())
    assert dict(cfg["console_scripts"]) == {"sim": "kvsim.cli:main"}
