"""The engine's hot modules compiled with mypyc: the same source, the same results, in less time.

``sim compile`` (``build``) compiles ``MODULES`` from this package's own sources into a cache directory
named by a key of the bytes of every source file under ``sim/`` and of the interpreter. ``import sim`` (``install``)
loads the compiled modules only from the directory of the current key, so a source edited since the build
runs as plain Python until ``sim compile`` is run again: a stale build is never used. The key also holds the
version of mypy's runtime library (``librt``, which the compiled modules import): the cache is per user, so
an environment without librt, or with another version, finds no build and runs plain Python. ``KVSIM_NATIVE=0``
(or false, off, no) turns a build off; ``KVSIM_NATIVE_DIR`` moves the cache (default ``$XDG_CACHE_HOME/kvsim/native``).

Plain Python stays the reference: the compiled build must give bit-identical results (the test suite runs
on it in CI), and nothing else in the project depends on it. mypyc checks the annotations at run time
(an ``int`` parameter refuses a numpy integer) and turns an int passed as a ``float`` into a float, so
these modules annotate only what is always exactly that type.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

from sim.trace_paths import switch, user_cache

MODULES = ("sim.core", "sim.clock", "sim.kv", "sim.scheduler", "sim.engine", "sim.metrics", "sim.steptime", "sim.sharing",
           "sim.hybrid", "sim.layouts")
_SIM = Path(__file__).resolve().parent
_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # this interpreter's ABI (e.g. .cpython-311-x86_64-linux-gnu.so)


class NativeBuildError(Exception):
    """``sim compile`` could not build: what is missing, and how to get it."""


def cache_root() -> Path:
    if os.environ.get("KVSIM_NATIVE_DIR"):
        return Path(os.environ["KVSIM_NATIVE_DIR"])
    return user_cache("native")


def runtime_version() -> str:
    """The installed version of librt, mypy's runtime library, whose C API the compiled modules link to
    (``sim/buffers.py``); "" when it is missing. Read from its ``dist-info`` folder's name: no import."""
    try:
        spec = importlib.util.find_spec("librt")
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.submodule_search_locations:
        return ""
    for loc in spec.submodule_search_locations:
        for p in sorted(Path(loc).parent.glob("librt-*.dist-info")):
            return p.name[len("librt-"):-len(".dist-info")]
    return "unknown"


def source_key() -> str:
    """The build's name: every source file of the package (a compiled module reads the others' types), the
    interpreter and librt's version (a build links to its C API, which checks its version at import: another
    librt, or none, has no build, and runs plain Python until ``sim compile``)."""
    h = hashlib.sha256(f"{sys.implementation.cache_tag} {_SUFFIX} {sys.version} librt {runtime_version()}".encode())
    for p in sorted(_SIM.rglob("*.py")):
        h.update(p.relative_to(_SIM).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def build_dir() -> Path:
    return cache_root() / source_key()


def _files(d: Path) -> dict[str, Path]:
    """Module name -> extension file of a finished build: the compiled modules' shims (``sim/``) and
    the library they share (top level, named by mypyc)."""
    files = {f"sim.{p.name[:-len(_SUFFIX)]}": p for p in (d / "sim").glob(f"*{_SUFFIX}")}
    files.update({p.name[:-len(_SUFFIX)]: p for p in d.glob(f"*{_SUFFIX}")})
    return files


class _Finder:
    """Finds the compiled modules of one build before the path finder finds their sources."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(self, name, path=None, target=None):
        p = self.files.get(name)
        return None if p is None else importlib.util.spec_from_file_location(name, p)


def disabled() -> bool:
    """``KVSIM_NATIVE`` turns the build off: 0, false, off or no (``trace_paths.switch``; was: only "0",
    "false" left it on). Another value than those or 1, true, on, yes leaves it on, and says so once: the
    process notes it in its environment, which a sweep's workers inherit."""
    v = switch("KVSIM_NATIVE")
    if v not in ("on", "off") and not os.environ.get("KVSIM_NATIVE_WARNED"):  # (KVSIM_NATIVE=banana left the
        os.environ["KVSIM_NATIVE_WARNED"] = "1"  # build on without a word)
        sys.stderr.write(f"kvsim: KVSIM_NATIVE={v!r} is neither off (0, false, off, no) nor on (1, true, on, yes): "
                         f"the compiled build stays on\n")
    return v == "off"


def install() -> bool:
    """Called by ``import sim``: use the build of the current sources, if there is one and before any of
    its modules is imported. Returns whether it is used."""
    if disabled() or any(m in sys.modules for m in MODULES):
        return False
    if not runtime_version():  # no librt here: a build (made where it was) cannot load
        return False
    try:
        d = build_dir()
        if not (d / "build.json").is_file():
            return False
    except (OSError, RuntimeError):  # an unreadable cache or source, no home directory: plain Python
        return False
    files = _files(d)
    if not all(m in files for m in MODULES):
        return False
    sys.meta_path.insert(0, _Finder(files))
    return True


def active() -> bool:
    """Whether the compiled modules run in this process (imports ``sim.engine`` to find out)."""
    import sim.engine

    return str(getattr(sim.engine, "__file__", "")).endswith(_SUFFIX)


def describe() -> str:
    """One line for benchmarks and reports: which engine this process (and its children) runs."""
    if active():
        return "engine: the compiled build (sim compile); KVSIM_NATIVE=0 runs plain Python"
    return "engine: plain Python (`sim compile` builds the compiled one)"


def status() -> dict:
    """What ``sim compile --status`` prints: the build for these sources, if any, and whether it runs."""
    import json

    d = build_dir()
    meta, damaged = None, None
    if (d / "build.json").is_file():
        try:
            meta = json.loads((d / "build.json").read_text())
            if not isinstance(meta, dict) or not {"mypy", "python", "built_at", "seconds"} <= set(meta):
                raise ValueError("not the record a build writes")
        except (OSError, ValueError) as e:  # (JSONDecodeError is a ValueError): was a traceback
            meta, damaged = None, f"{d / 'build.json'}: unreadable ({e.__class__.__name__}); run sim compile again"
    return {"key": source_key(), "librt": runtime_version() or None, "dir": str(d), "built": meta is not None,
            "build": meta, "damaged": damaged, "disabled": disabled()}


def build(log=print) -> Path:
    """Compile ``MODULES`` into ``build_dir()`` (kept if it exists). Needs mypy (``pip install
    'kvsim[native]'``) and a C compiler; raises NativeBuildError, saying which is missing, otherwise."""
    import json
    import shutil
    import subprocess
    import tempfile
    import time

    dest = build_dir()
    if (dest / "build.json").is_file():
        log(f"already built for these sources: {dest}")
        return dest
    for d in (dest.parent, *dest.parent.parents):  # checked before compiling (a file there was a FileExistsError
        if d.exists():  # after the three minutes)
            if not (d.is_dir() and os.access(d, os.W_OK | os.X_OK)):
                raise NativeBuildError(f"{d}: not a writable folder, where the build goes "
                                       "($KVSIM_NATIVE_DIR, else the user cache)")
            break
    try:
        import mypy.version
    except ImportError:
        raise NativeBuildError("the compiled build needs mypy: pip install 'kvsim[native]' (the mypy range "
                               "these sources pass, pinned in pyproject.toml)") from None
    with tempfile.TemporaryDirectory(prefix="kvsim-native-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(_SIM, src / "sim", ignore=shutil.ignore_patterns("__pycache__", f"*{_SUFFIX}"))
        paths = [f"sim/{m.split('.')[1]}.py" for m in MODULES]
        cmd = [sys.executable, "-m", "mypyc", "--ignore-missing-imports", "--follow-imports=silent", *paths]
        log(f"compiling {', '.join(MODULES)} with mypy {mypy.version.__version__} (a minute or two) ...")
        t0 = time.perf_counter()
        r = subprocess.run(cmd, cwd=src, capture_output=True, text=True)
        if r.returncode != 0:
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
            raise NativeBuildError(f"mypyc failed (exit {r.returncode}); its last lines:\n{tail}\n"
                                   "it needs a C compiler (gcc or clang) with the Python headers, and sources "
                                   "that pass its type checks")
        if not all(m in _files(src) for m in MODULES):
            raise NativeBuildError(f"mypyc ran but left no extension for some of {', '.join(MODULES)}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))  # beside dest: renamed whole
        (staged / "sim").mkdir()
        for p in src.glob(f"*{_SUFFIX}"):
            shutil.copy2(p, staged / p.name)
        for p in (src / "sim").glob(f"*{_SUFFIX}"):
            shutil.copy2(p, staged / "sim" / p.name)
        (staged / "build.json").write_text(json.dumps({
            "key": source_key(), "modules": list(MODULES), "mypy": mypy.version.__version__,
            "python": sys.version.split()[0], "suffix": _SUFFIX, "seconds": round(time.perf_counter() - t0, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
        try:
            staged.rename(dest)  # whole or not at all
        except OSError:  # another build won meanwhile: keep it
            shutil.rmtree(staged, ignore_errors=True)
    log(f"built: {dest}")
    return dest


PACKAGES = ("sim", "traces", "reports", "gpu", "kvsim")  # the project's packages, beside cli.py


def write_bytecode(root: Path | None = None) -> list[str]:
    """Byte-compile the project's Python sources under ``root`` (this checkout or install) into their
    ``__pycache__`` folders, as Python itself does at a first import -- unless ``PYTHONDONTWRITEBYTECODE``
    is set (many container images set it), when every run compiles every module again: 7 % of the
    instructions of a trace's whole ``sim run``. Python reads the files even then, and ignores one whose source has changed
    since. Returns the folders or files that could not be written (a read-only install: nothing to do)."""
    import compileall

    root = root or _SIM.parent
    failed = []
    for name in PACKAGES:
        d = root / name
        if d.is_dir() and not compileall.compile_dir(d, quiet=2, workers=1):
            failed.append(str(d))
    cli = root / "cli.py"
    if cli.is_file() and not compileall.compile_file(cli, quiet=2):
        failed.append(str(cli))
    return failed
