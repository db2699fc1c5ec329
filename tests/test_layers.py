"""The layers point one way (README, Architecture): every import of every module, lazy ones inside functions
included, read from the source (ast), checked against the allowed directions. A new module is checked
without being listed; a new wrong-way import fails here, naming the file and line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sim", "traces", "reports", "gpu", "kvsim")

# what each layer may import of the project (a module, or a package and everything in it)
ALLOWED = {
    "cli": {"sim", "traces", "reports", "gpu", "kvsim"},  # the command line wires everything
    "kvsim": {"sim", "traces", "reports", "gpu", "kvsim"},  # the facade: the same wiring, for Python
    "gpu": {"gpu", "sim"},
    "traces": {"traces", "sim.workload", "sim.config", "sim.trace_paths"},  # the request table, its settings
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


def _allowed(importer: str, target: str) -> bool:
    rules = ALLOWED[importer.split(".")[0]] | ENTRY_SCRIPTS.get(importer, set())
    return any(target == r or target.startswith(r + ".") for r in rules)


def test_every_import_points_down_the_layers():
    modules = _modules()
    wrong = [f"{path.relative_to(ROOT)}:{line}: {name} imports {target}"
             for name, path in modules.items() for target, line in _imports(name, path, modules)
             if not _allowed(name, target)]
    assert not wrong, "imports against the layers (README, Architecture):\n" + "\n".join(wrong)


def test_the_import_reader_sees_imports_lazy_and_relative():
    """The check above reads what it must: top-level and in-function imports, ``from pkg import module``."""
    modules = _modules()
    edges = {name: {t for t, _ in _imports(name, path, modules)} for name, path in modules.items()}
    assert {"sim", "reports", "gpu", "kvsim", "traces"} <= {t.split(".")[0] for t in edges["cli"]}
    assert "sim.run" in edges["gpu.replay"] and "sim.schema" in edges["reports.figures"]
    assert "sim.trace_paths" in edges["traces.fetch"]  # from sim import trace_paths
    assert not _allowed("sim.workload", "traces.workload") and not _allowed("reports.figures", "sim.kv")
    assert not _allowed("traces.read", "sim.engine") and not _allowed("gpu.replay", "reports.console")
