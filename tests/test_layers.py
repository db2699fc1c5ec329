"""The layers point one way (README, Architecture): every import of every module, lazy ones inside functions
included, read from the source (ast), checked against the allowed directions. A new module is checked
without being listed; a new wrong-way import fails here, naming the file and line."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sim", "traces", "reports", "gpu", "kvsim")

# what each layer may import of the project (a module, or a package and everything in it)
ALLOWED = {
    "cli": {"sim", "traces", "reports", "gpu", "kvsim"},  # the command line wires everything
    "kvsim": {"sim", "traces", "reports", "gpu", "kvsim"},  # the facade: the same wiring, for Python
    "gpu": {"gpu", "sim"},
    "traces": {"traces", "sim.workload", "sim.config", "sim.trace_paths", "sim.schema", "sim.userfile"},  # the
    # request table, its settings, where traces live, how counts are printed, and what says a file is unchanged
    "reports": {"reports", "sim.schema"},  # result files, and the schema they are written in
    "sim": {"sim"},
}
# entry scripts below the top: each wires what it runs as the command line does (through the facade)
ENTRY_SCRIPTS = {"gpu.check": {"kvsim"}}


def _modules() -> dict[str, Path]:
    """Every project module by dotted name (``kvsim/cli.py`` is a link to ``cli.py``: read once)."""
    out = {"cli": ROOT / "cli.py"}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.is_symlink():
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported project module, line) for each import in the file, resolved to the module it loads."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # ``from sim import trace_paths`` loads the module sim.trace_paths
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found += [(t, node.lineno) for t in targets if t.split(".")[0] in ("cli", *PACKAGES)]
    return found


@functools.cache
def _edges() -> dict[str, list[tuple[str, int]]]:
    """Each module's project imports (read once for the tests below)."""
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _allowed(importer: str, target: str) -> bool:
    rules = ALLOWED[importer.split(".")[0]] | ENTRY_SCRIPTS.get(importer, set())
    return any(target == r or target.startswith(r + ".") for r in rules)


def test_every_import_points_down_the_layers():
    modules = _modules()
    wrong = [f"{modules[name].relative_to(ROOT)}:{line}: {name} imports {target}"
             for name, found in _edges().items() for target, line in found if not _allowed(name, target)]
    assert not wrong, "imports against the layers (README, Architecture):\n" + "\n".join(wrong)


def test_the_import_reader_sees_imports_lazy_and_relative():
    """The check above reads what it must: top-level and in-function imports, ``from pkg import module``."""
    edges = {name: {t for t, _ in found} for name, found in _edges().items()}
    assert {"sim", "reports", "gpu", "kvsim", "traces"} <= {t.split(".")[0] for t in edges["cli"]}
    assert "sim.run" in edges["gpu.replay"] and "sim.schema" in edges["reports.figures"]
    assert "sim.trace_paths" in edges["traces.fetch"]  # from sim import trace_paths
    assert not _allowed("sim.workload", "traces.workload") and not _allowed("reports.figures", "sim.kv")
    assert not _allowed("traces.read", "sim.engine") and not _allowed("gpu.replay", "reports.console")


# ---------------------------------------------------------------------------------- the wiring, exercised

TABLE = "arrival_s,prompt_tokens,output_tokens\n0,100,20\n0.5,200,10\n1.0,50,40\n"


def _table_scenario(tmp_path, make_scenario):
    (tmp_path / "t.csv").write_text(TABLE)
    return make_scenario(workload={"kind": "table", "path": str(tmp_path / "t.csv")}, policies=["vllm"])


def test_a_trace_workload_is_read_by_the_reader_passed_in(tmp_path, make_scenario):
    import kvsim
    from sim.config import ScenarioError
    from sim.run import run
    from sim.workload import load_requests

    s = _table_scenario(tmp_path, make_scenario)
    with pytest.raises(ScenarioError, match=r"t\.csv: a trace workload needs the trace readers.*kvsim\.run"):
        run(s)
    assert list(load_requests(s, kvsim.read_trace).prompt_tokens) == [100, 200, 50]
    assert kvsim.run(s).policies["vllm"].summary["num_finished"] == 3


def test_a_sweep_carries_the_reader_to_its_workers(tmp_path, make_scenario):
    """Tasks take the reader along (by reference: a worker process imports it); without one, each run
    fails with the message that says so."""
    import pickle

    import kvsim
    from sim.executors import SerialExecutor
    from sim.sweep.output import run_sweep
    from sim.sweep.spec import load_sweep
    from sim.sweep.tasks import make_task

    (tmp_path / "t.csv").write_text(TABLE)
    path = tmp_path / "s.yaml"
    path.write_text("base:\n  name: tiny\n  model: opt-13b\n  gpu: a100-40gb\n"
                    "  workload: {kind: table, path: t.csv}\n  policies: [vllm]\n"
                    "axes:\n  policies.*.block_size: [8, 16]\n")
    payload = make_task(_table_scenario(tmp_path, make_scenario), 0).payload(kvsim.read_trace)
    assert pickle.loads(pickle.dumps(payload))["read_trace"] is kvsim.read_trace
    result, paths = kvsim.sweep_to_dir(path, tmp_path / "with", workers=1, report=False)
    assert not result.failures and list(result.table["num_finished"]) == [3, 3] and "report" not in paths
    without = run_sweep(load_sweep(path), tmp_path / "without", SerialExecutor())
    assert len(without.failures) == 2 and all("trace readers" in e for _, e in without.failures)


def test_starting_loads_no_table_or_plotting_library():
    """``import sim``, ``import kvsim`` and the command line's start load none of pandas, pyarrow, plotly:
    each is loaded where it is needed (start-up time, README Speed)."""
    import subprocess
    import sys

    code = ("import sys, sim, kvsim, cli; "
            "print(sorted(m for m in ('pandas', 'pyarrow', 'plotly', 'numpy', 'scipy', 'simpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
