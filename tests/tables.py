"""Small hand-made result tables, shaped like the files `sim run` writes (and a sweep's tidy table)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from sim.schema import MEMORY_CLASSES as CLASSES


def timeline_table(policy: str, n: int, bin_s: float = 1.0, seed: int = 0) -> pd.DataFrame:
    """A timeline.parquet-like table for one policy: n contiguous bins, memory shares summing to 1."""
    rng = np.random.default_rng(seed)
    shares = rng.dirichlet(np.ones(len(CLASSES)), size=n)
    df = pd.DataFrame({"bin_start_s": np.arange(n) * bin_s, "bin_s": bin_s,
                       "mean_running": rng.uniform(0, 20, n), "mean_running_requests": rng.uniform(0, 20, n),
                       "mean_waiting": rng.uniform(0, 50, n),
                       "num_sampled": rng.integers(0, 500, n).astype(float),
                       "num_finished": rng.integers(0, 3, n).astype(float),
                       "num_preempted": rng.integers(0, 2, n).astype(float), "policy": policy})
    for k, c in enumerate(CLASSES):
        df[f"memory.{c}"] = shares[:, k]
    return df


def requests_table(policy: str, n: int, seed: int = 0) -> pd.DataFrame:
    """A requests.parquet-like table: n finished requests and two that are not."""
    rng = np.random.default_rng(seed)
    out_tok = rng.integers(1, 400, n + 2)
    ttft = rng.lognormal(5, 1, n + 2)
    e2el = ttft + rng.uniform(20, 40, n + 2) * (out_tok - 1)
    status = ["finished"] * n + ["rejected", "unfinished"]
    return pd.DataFrame({"policy": policy, "status": pd.Categorical(status), "output_tokens": out_tok,
                         "ttft_ms": ttft, "e2el_ms": e2el,
                         "tpot_ms": np.where(out_tok > 1, (e2el - ttft) / np.maximum(out_tok - 1, 1), np.nan),
                         "normalized_latency_s": e2el / 1e3 / out_tok})


def snapshot_table(policy: str, runs: list[tuple[int, str]], waiting: int = 3) -> pd.DataFrame:
    """A kv_snapshots.parquet-like table from (length, class) runs laid end to end from slot 0."""
    lengths = [r[0] for r in runs]
    return pd.DataFrame({"policy": policy, "time_s": 12.5, "num_waiting": waiting, "num_running": 2,
                         "start": np.cumsum([0] + lengths[:-1]), "length": lengths,
                         "memory_class": pd.Categorical([r[1] for r in runs], categories=list(CLASSES))})


def policies_table(names_presets: list[tuple[str, str | None]]) -> pd.DataFrame:
    rows = {}
    for i, (name, preset) in enumerate(names_presets):
        shares = np.roll([0.4, 0.2, 0.1, 0.2, 0.1], i)
        rows[name] = {"preset": preset, **{f"memory.{c}": s for c, s in zip(CLASSES, shares)}}
    return pd.DataFrame.from_dict(rows, orient="index")


def sweep_table(rates=(1.0, 2.0, 4.0), policies=("orca-oracle", "vllm"), **extra) -> pd.DataFrame:
    rows = []
    for p_i, p in enumerate(policies):
        for r in rates:
            rows.append({"workload.arrival.rate": r, "policy": p, "seed": 0, "request_throughput": r * 0.9,
                         "mean_normalized_latency_s": 0.03 * (1 + p_i) * r ** 2, **extra})
    return pd.DataFrame(rows)
