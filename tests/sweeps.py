"""A sweep file's inline base scenario, for the sweep tests: OPT-13B on an A100-40GB, Poisson arrivals."""

from __future__ import annotations


def base_yaml(policies: str, lengths: str = "alpaca", num_requests: int = 60, seed: int | None = None,
              name: str | None = None) -> str:
    """The top of a sweep file (``name:`` when given, then ``base:``); axes and capacity go after it."""
    seed_key = f", seed: {seed}" if seed is not None else ""
    return ((f"name: {name}\n" if name else "") + "base:\n  name: tiny\n  model: opt-13b\n  gpu: a100-40gb\n"
            f"  workload: {{arrival: {{kind: poisson, rate: 2.0}}, lengths: {lengths}, num_requests: {num_requests}"
            f"{seed_key}}}\n  policies: {policies}\n")
