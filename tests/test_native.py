"""The compiled build (sim/native.py): keyed by the exact sources, never stale, off on request, and giving
the very results plain Python gives (that check runs where a build exists: CI builds one and runs the
suite on it)."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sim import native

ROOT = Path(__file__).resolve().parents[1]


def test_the_key_changes_with_any_source_byte(tmp_path, monkeypatch):
    src = tmp_path / "sim"
    src.mkdir()
    for p in native._SIM.glob("*.py"):
        (src / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(native, "_SIM", src)
    before = native.source_key()
    assert native.source_key() == before  # the same bytes, the same key
    p = src / "clock.py"
    p.write_bytes(p.read_bytes() + b"\n")
    assert native.source_key() != before  # a source edited since the build: another directory, no build
    p.write_bytes(p.read_bytes()[:-1])
    assert native.source_key() == before
    (src / "newmodule.py").write_text("x = 1\n")  # a module the compiled ones may read the types of
    assert native.source_key() != before
    now = native.source_key()
    for version in ("0.0.0-test1", "0.0.0-test2", ""):  # another librt, or none: another key
        monkeypatch.setattr(native, "runtime_version", lambda v=version: v)
        assert native.source_key() != now
        now = native.source_key()


def test_runtime_version_reads_librts_dist_info_and_says_when_it_is_missing(monkeypatch):
    pytest.importorskip("librt.vecs", reason="librt is not installed")
    from importlib.metadata import version

    assert native.runtime_version() == version("librt")
    monkeypatch.setitem(sys.modules, "librt", None)
    assert native.runtime_version() == ""


def _fake_build(d: Path, modules=native.MODULES, meta=True) -> None:
    (d / "sim").mkdir(parents=True)
    for m in modules:
        (d / "sim" / f"{m.split('.')[1]}{native._SUFFIX}").write_bytes(b"")
    if meta:
        (d / "build.json").write_text("{}")


@pytest.mark.parametrize("case", ["none", "no build.json", "a module missing", "disabled", "no librt"])
def test_install_uses_only_a_whole_build_of_these_sources(tmp_path, monkeypatch, case):
    monkeypatch.setenv("KVSIM_NATIVE_DIR", str(tmp_path))
    monkeypatch.delenv("KVSIM_NATIVE", raising=False)
    monkeypatch.setattr(sys, "modules", {k: v for k, v in sys.modules.items() if k not in native.MODULES})
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    d = native.build_dir()
    if case == "no build.json":
        _fake_build(d, meta=False)
    elif case == "a module missing":
        _fake_build(d, modules=native.MODULES[:-1])
    elif case == "disabled":
        _fake_build(d)
        monkeypatch.setenv("KVSIM_NATIVE", "0")
    elif case == "no librt":  # built in another environment: this one lacks the compiled modules' runtime
        monkeypatch.setattr(native, "runtime_version", lambda: "")
        _fake_build(native.build_dir())
    before = list(sys.meta_path)
    assert native.install() is False
    assert sys.meta_path == before


def test_install_puts_a_whole_build_first_and_finds_only_its_modules(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_NATIVE_DIR", str(tmp_path))
    monkeypatch.delenv("KVSIM_NATIVE", raising=False)
    monkeypatch.setattr(sys, "modules", {k: v for k, v in sys.modules.items() if k not in native.MODULES})
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(native, "runtime_version", lambda: "0.0.0-test")  # (librt comes with mypy, for a build)
    d = native.build_dir()
    _fake_build(d)
    (d / f"abc123__mypyc{native._SUFFIX}").write_bytes(b"")  # the library the modules share
    assert native.install() is True
    finder = sys.meta_path[0]
    assert isinstance(finder, native._Finder)
    spec = finder.find_spec("sim.engine")
    assert spec.origin == str(d / "sim" / f"engine{native._SUFFIX}")
    assert finder.find_spec("abc123__mypyc").origin == str(d / f"abc123__mypyc{native._SUFFIX}")
    assert finder.find_spec("sim.run") is None  # not compiled: its source, as ever


def test_install_does_nothing_once_a_module_is_imported(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    importlib.import_module("sim.engine")  # imported: the process keeps the engine it has
    _fake_build(native.build_dir())
    assert native.install() is False


def test_building_without_mypy_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_NATIVE_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "mypy", None)  # import mypy fails
    monkeypatch.setitem(sys.modules, "mypy.version", None)
    with pytest.raises(native.NativeBuildError, match=r"needs mypy: pip install 'kvsim\[native\]'"):
        native.build(log=lambda m: None)
    assert not any(tmp_path.iterdir())  # nothing half-built left behind


def test_a_build_folder_that_is_a_file_is_said_before_compiling(tmp_path, monkeypatch):
    """KVSIM_NATIVE_DIR naming a file was a FileExistsError after the whole compile."""
    (tmp_path / "f").write_text("")
    monkeypatch.setenv("KVSIM_NATIVE_DIR", str(tmp_path / "f"))
    compiled = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: compiled.append(a))  # (build imports it when called)
    with pytest.raises(native.NativeBuildError, match=f"{tmp_path / 'f'}: not a writable folder"):
        native.build(log=lambda m: None)
    assert not compiled


def test_sim_compile_without_mypy_is_one_clear_error(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != "KVSIM_NATIVE"}, "KVSIM_NATIVE_DIR": str(tmp_path),
           "PYTHONPATH": str(tmp_path / "nomypy")}
    (tmp_path / "nomypy" / "mypy").mkdir(parents=True)
    (tmp_path / "nomypy" / "mypy" / "__init__.py").write_text("raise ImportError('no mypy here')\n")
    r = subprocess.run([sys.executable, "cli.py", "compile"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "error: the compiled build needs mypy: pip install 'kvsim[native]'" in r.stderr
    assert "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "cli.py", "compile", "--status"], cwd=ROOT, env=env, capture_output=True,
                       text=True)
    assert r.returncode == 0 and "plain Python" in r.stdout  # (no build; why depends on librt: below)


def test_compile_status_without_librt_says_what_to_install(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cli import app

    monkeypatch.setenv("KVSIM_NATIVE_DIR", str(tmp_path))
    monkeypatch.delenv("KVSIM_NATIVE", raising=False)
    monkeypatch.setattr(native, "runtime_version", lambda: "")
    r = CliRunner().invoke(app, ["compile", "--status"])
    assert r.exit_code == 0, r.output
    assert "none without librt (pip install 'kvsim[native]'): plain Python" in r.output


@pytest.mark.parametrize("text", ["{trunc", '{"mypy": "x"}', "[]"])
def test_compile_status_with_a_damaged_build_record_says_so(tmp_path, monkeypatch, text):
    from typer.testing import CliRunner

    from cli import app

    monkeypatch.setenv("KVSIM_NATIVE_DIR", str(tmp_path))
    monkeypatch.delenv("KVSIM_NATIVE", raising=False)
    d = native.build_dir()
    d.mkdir(parents=True)
    (d / "build.json").write_text(text)
    r = CliRunner().invoke(app, ["compile", "--status"])
    assert r.exit_code == 0 and r.exception is None, r.output
    assert "build.json: unreadable" in r.output and "run sim compile again" in r.output


@pytest.mark.parametrize("value, off", [("0", True), ("false", True), ("OFF", True), ("no", True), ("1", False),
                                        ("", False), ("yes", False)])
def test_kvsim_native_turns_the_build_off_in_its_usual_words(monkeypatch, value, off):
    monkeypatch.setenv("KVSIM_NATIVE", value)
    assert native.disabled() is off and native.status()["disabled"] is off


def test_an_unknown_kvsim_native_value_says_the_build_stays_on(monkeypatch, capsys):
    """KVSIM_NATIVE=banana left the build on without a word."""
    monkeypatch.setenv("KVSIM_NATIVE", "banana")
    monkeypatch.setenv("KVSIM_NATIVE_WARNED", "")  # (restored after: the function sets it)
    assert native.disabled() is False and native.disabled() is False
    assert capsys.readouterr().err.count("KVSIM_NATIVE='banana' is neither off") == 1


def test_bytecode_is_written_for_every_package_and_read_back(tmp_path):
    """``sim compile`` also writes the pure-Python modules' bytecode: a run under PYTHONDONTWRITEBYTECODE
    (as in many containers) then loads it instead of compiling every module again."""
    for name in ("sim", "traces/sub"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "__init__.py").write_text("X = 1\n")
    (tmp_path / "cli.py").write_text("Y = 2\n")
    assert native.write_bytecode(tmp_path) == []
    tag = sys.implementation.cache_tag
    for f in ("sim/__pycache__/__init__", "traces/sub/__pycache__/__init__", "__pycache__/cli"):
        assert (tmp_path / f"{f}.{tag}.pyc").is_file(), f
    # the source changed behind the bytecode's back (same size, same time): a run that reads the bytecode
    # sees the old value, which shows it did not compile the source again
    st = (tmp_path / "sim" / "__init__.py").stat()
    (tmp_path / "sim" / "__init__.py").write_text("X = 9\n")
    os.utime(tmp_path / "sim" / "__init__.py", ns=(st.st_atime_ns, st.st_mtime_ns))
    code = "import sys, sim; print(sim.X, sys.flags.dont_write_bytecode)"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert r.stdout.split() == ["1", "1"], (r.stdout, r.stderr)


def test_bytecode_not_writable_is_said_not_raised(tmp_path, monkeypatch):
    """A folder compileall cannot write (a read-only install) is named, not raised."""
    import compileall

    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "__init__.py").write_text("X = 1\n")
    monkeypatch.setattr(compileall, "compile_dir", lambda *a, **k: False)  # what it returns on a write error
    assert native.write_bytecode(tmp_path) == [str(tmp_path / "sim")]


SCENARIO = {"name": "native", "model": "llama-2-7b", "gpu": "a100-40gb", "record_steps": True,
            "workload": {"arrival": {"kind": "gamma", "rate": 30.0, "cv": 3.0}, "num_requests": 400, "seed": 5,
                         "prompt": {"kind": "lognormal", "mean": 900, "cv": 0.8, "max": 3000},
                         "output": {"kind": "lognormal", "mean": 200, "cv": 1.2, "max": 900},
                         "shared_prefixes": {"lengths": [300, 600], "popularity": [2, 1]}},
            "policies": ["fastertransformer", "orca-pow2", "vllm", "vllm-v1",
                         {"preset": "vllm", "name": "swap", "preemption": "swap", "swap_space_gib": 0.5},
                         {"preset": "vllm", "name": "apc", "prefix_caching": True},
                         {"preset": "vllm", "name": "b1", "block_size": 1}]}

# sliding-window layers (sim/hybrid.py and sim/layouts.py, compiled too: a slab manager subclassing a compiled
# one), in pages and in slabs, with prefix caching
HYBRID = {"name": "native-hybrid", "model": "gemma-3-27b", "gpu": "h100", "record_steps": True,
          "workload": {"arrival": {"kind": "poisson", "rate": 6.0}, "lengths": "sharegpt", "num_requests": 150,
                       "seed": 2, "shared_prefixes": {"lengths": [700, 1500], "popularity": [1, 1]}},
          "policies": [{"preset": "vllm", "name": "paged", "block_size": 4},
                       {"preset": "orca-oracle", "name": "slabs"},
                       {"preset": "vllm-v1", "name": "apc", "prefix_caching": True}]}

_DIGEST = """
import hashlib, json, sys
from sim import native, run
from sim.config import parse_scenario
out = {"native": native.active()}
for spec in json.loads(sys.argv[1]):
    r = run(parse_scenario(spec))
    for name, p in r.policies.items():
        h = hashlib.sha256()
        for df in (p.requests, p.timeline, p.steps, p.groups):
            if df is not None:
                h.update(df.to_csv(float_format="%r").encode())  # every bit of every float, and every dtype
                h.update(str(df.dtypes.to_dict()).encode())
        h.update(json.dumps(p.summary, sort_keys=True, default=repr).encode())  # 1 and 1.0 differ
        out[spec["name"] + "/" + name] = h.hexdigest()
print(json.dumps(out))
"""


@pytest.mark.skipif(not native.active(), reason="no compiled build of these sources in this process "
                    "(`sim compile` makes one; CI runs the suite on it)")
def test_the_compiled_build_gives_plain_pythons_results_to_the_bit(tmp_path):
    """Seven policies (static, continuous, chunked, swap, prefix caching, block size 1) under bursty load
    with shared prefixes, and a sliding-window model in pages, in slabs and prefix-cached: per-request table,
    timeline, steps, KV groups and summary, hashed, in each engine."""
    got = {}
    for flag in ("1", "0"):
        env = {**os.environ, "KVSIM_NATIVE": flag}
        r = subprocess.run([sys.executable, "-c", _DIGEST, json.dumps([SCENARIO, HYBRID])], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        got[flag] = json.loads(r.stdout)
    assert got["1"].pop("native") is True and got["0"].pop("native") is False
    assert len(got["1"]) == 10 and got["1"] == got["0"]


@pytest.mark.skipif(not native.active(), reason="no compiled build of these sources in this process")
def test_every_module_of_the_build_runs_compiled():
    """All of ``MODULES`` (the hybrid KV managers and their layouts too), not only the engine."""
    for m in native.MODULES:
        assert importlib.import_module(m).__file__.endswith(native._SUFFIX), m


def test_the_float_buffers_stand_in_gives_librts_results_to_the_bit(tmp_path):
    """sim/buffers.py: without mypy's runtime library (plain Python, no ``kvsim[native]``) the recorder's
    buffers are ``array('d')``s; the same runs as with librt's ``vec[float]``, to the bit."""
    pytest.importorskip("librt.vecs", reason="librt is not installed: every other test runs on the stand-in")
    got = {}
    env = {**os.environ, "KVSIM_NATIVE": "0"}
    for case, prefix in (("librt", ""), ("stand-in", "import sys; sys.modules['librt'] = None\n")):
        code = prefix + _DIGEST + "import sim.buffers; print(type(sim.buffers.vec).__name__)\n"
        r = subprocess.run([sys.executable, "-c", code, json.dumps([SCENARIO])], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        digests, kind = r.stdout.splitlines()
        got[case] = json.loads(digests), kind
    assert got["librt"][1] != "_ArrayVec" and got["stand-in"][1] == "_ArrayVec"
    assert len(got["librt"][0]) == 8 and got["librt"][0] == got["stand-in"][0]
