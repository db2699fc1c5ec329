"""KV-cache serving simulator: contiguous vs paged KV cache, static vs continuous batching.

Light dependencies only: this package never imports torch. ``import sim`` loads nothing more: the names
below (``from sim import run``) are imported when first used, so that a command that does not simulate
does not pay for pandas.
"""

import importlib
import sys
import types

from sim import native as _native

_native.install()  # the compiled hot modules, if `sim compile` built them from these very sources (sim/native.py)

_EXPORTS = {"Scenario": "sim.config", "ScenarioError": "sim.config", "load_scenario": "sim.config",
            "run": "sim.run", "write_results": "sim.run", "RunResult": "sim.run"}
__all__ = ["Scenario", "ScenarioError", "load_scenario", "run", "write_results", "RunResult"]


class _Package(types.ModuleType):
    def __getattr__(self, name: str):
        if name not in _EXPORTS:
            raise AttributeError(f"module 'sim' has no attribute {name!r}")
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        super().__setattr__(name, value)
        return value

    def __setattr__(self, name: str, value) -> None:
        # NOTE: importing the submodule sim.run binds it as sim.run; the export keeps the name (as it
        # always has: ``from sim import run`` is the function, the module is sys.modules["sim.run"])
        if not (name in _EXPORTS and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
