"""KV-cache serving simulator: contiguous vs paged KV cache, static vs continuous batching.

Light dependencies only: this package never imports torch.
"""

from sim.config import Scenario, ScenarioError, load_scenario
from sim.run import RunResult, run, write_results

__all__ = ["Scenario", "ScenarioError", "load_scenario", "run", "write_results", "RunResult"]
