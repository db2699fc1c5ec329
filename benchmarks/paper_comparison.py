"""The README's comparison with the PagedAttention paper, printed from sweep folders (no simulation).

    python benchmarks/paper_comparison.py runs/opt-13b-sharegpt runs/opt-66b-sharegpt runs/opt-175b-sharegpt \
        [--memory-rate 2.0]

For each folder written by `sim sweep scenarios/vllm-paper/<setup>.sweep.yaml`: every policy's sustainable
request rate (capacity.parquet, mean and standard deviation over seeds) and vLLM's rate as a multiple of each
(the paper's headline, beside its published ranges); then, for the first folder, the time-weighted memory
breakdown at one swept rate (sweep.parquet, mean over seeds) beside the paper's Fig. 2. Markdown tables.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from reports.figures import over_seeds  # noqa: E402
from reports.paper import FIG2, SHAREGPT_RATE_RATIOS  # noqa: E402
from reports.results import load_run  # noqa: E402
from sim.kv import MEMORY_CLASSES  # noqa: E402

ORDER = ["fastertransformer", "orca-max", "orca-pow2", "orca-oracle", "vllm"]
SHORT = {"fastertransformer": "FT", "orca-max": "Max", "orca-pow2": "Pow2", "orca-oracle": "Oracle", "vllm": "vLLM"}


def published_range(policy: str) -> str:
    lo, hi = SHAREGPT_RATE_RATIOS.get(policy, (None, None))
    if hi is None:
        return "-"
    return f"up to {hi:g}×" if lo is None else f"{lo:g}–{hi:g}×"


def capacity_rows(folder: Path) -> list[str]:
    """One markdown row per setup: rates (mean ± std over seeds) and vLLM's multiple of each."""
    run = load_run(folder)
    if run.capacity is None:
        raise SystemExit(f"{folder}: no capacity.parquet (run `sim sweep` with a capacity search)")
    stats = over_seeds(run.capacity, ["policy"], "sustainable_request_rate").set_index("policy")
    status = run.capacity.groupby("policy")["status"].agg(lambda s: ",".join(sorted(set(map(str, s)))))
    rates = " | ".join(f"{stats.loc[p, 'mean']:.3g} ± {stats.loc[p, 'std']:.2g}" + (
        "" if status[p] == "found" else f" ({status[p]})") for p in ORDER)
    vllm = stats.loc["vllm", "mean"]
    ratios = " | ".join(f"{vllm / stats.loc[p, 'mean']:.2f}×" for p in ORDER[:-1])
    name = (run.sweep_info or {}).get("name", folder.name)
    return [f"| {name} | {rates} | {ratios} |"]


def memory_rows(folder: Path, rate: float) -> list[str]:
    """Mean time-weighted memory shares at ``rate`` (over seeds) beside the paper's Fig. 2 bars."""
    sweep = load_run(folder).sweep
    if not (sweep["workload.arrival.rate"] == rate).any():
        raise SystemExit(f"{folder}: no sweep point at rate {rate}")
    top = sweep["workload.arrival.rate"].max()  # vLLM is far from full at a rate that saturates Orca
    rows = []
    for p, r in [(p, rate) for p in ORDER] + [("vllm", top)]:
        at = sweep[(sweep["workload.arrival.rate"] == r) & (sweep.policy == p)]
        shares = [over_seeds(at, ["policy"], f"memory.{c}")["mean"].iloc[0] for c in MEMORY_CLASSES]
        ours = " / ".join(f"{100 * v:.1f}" for v in shares)
        paper = FIG2.get(p)
        published = (" / ".join(f"{paper.shares_pct[c]:.1f}" if c in paper.shares_pct else "—"
                                for c in MEMORY_CLASSES[:4]) if paper else "-")
        rows.append(f"| {p} at {r:g} req/s | {ours} | {published} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--memory-rate", type=float, default=2.0, help="swept rate of the memory breakdown (req/s)")
    a = ap.parse_args()
    print(f"| sweep | {' | '.join(SHORT[p] for p in ORDER)} | " + " | ".join(f"vLLM ÷ {SHORT[p]}" for p in ORDER[:-1])
          + " |")
    print("|---" + "|---:" * (2 * len(ORDER) - 1) + "|")
    for f in a.folders:
        print("\n".join(capacity_rows(f)))
    print("| paper, ShareGPT (3 models) | | | | | | " + " | ".join(published_range(p) for p in ORDER[:-1]) + " |")
    print()
    print(f"Memory at {a.memory_rate:g} req/s, {a.folders[0].name} (% of the KV pool: "
          + " / ".join(MEMORY_CLASSES) + "; paper: Fig. 2, no free class)")
    print("| policy | ours | paper (Fig. 2) |\n|---|---|---|")
    print("\n".join(memory_rows(a.folders[0], a.memory_rate)))


if __name__ == "__main__":
    main()
