"""Fleets: replicas of the simulated server behind a router (``cluster:`` in a scenario)."""

from sim.cluster.fleet import Fleet, fleet_runs, run_fleet

__all__ = ["Fleet", "fleet_runs", "run_fleet"]
