"""The README's comparison with the PagedAttention paper: sustainable rates, vLLM's multiple of each baseline
beside the paper's, and the memory breakdown beside its Fig. 2.

    python benchmarks/paper_comparison.py --run                       # run the six §6.2 sweeps, then print
    python benchmarks/paper_comparison.py runs/opt-13b-sharegpt ...   # print from sweep folders already written

``--run`` runs ``sim sweep scenarios/vllm-paper/<setup>.sweep.yaml --out runs/<setup> --no-resume`` for the six
setups (OPT-13B/66B/175B x ShareGPT/Alpaca; about 40 s each on 2 cores) and then prints from those folders.
The baselines are the fair ones: ``orca-*`` share vLLM's scheduler and differ only in the KV manager (README,
"The PagedAttention paper's experiments"); a sweep that also ran ``orca-*-mixed`` gets their columns too.

For each folder: every policy's sustainable request rate (capacity.parquet, mean and standard deviation over
seeds), vLLM's rate as a multiple of each (the paper's headline, beside its published ranges), and whether
vLLM sustains at least as much as every Orca variant; then, for the first folder, the time-weighted memory
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
from sim.schema import MEMORY_CLASSES  # noqa: E402

SETUPS = ["opt-13b-sharegpt", "opt-66b-sharegpt", "opt-175b-sharegpt", "opt-13b-alpaca", "opt-66b-alpaca",
          "opt-175b-alpaca"]
BASELINES = ["fastertransformer", "orca-max", "orca-pow2", "orca-oracle",
             "orca-max-mixed", "orca-pow2-mixed", "orca-oracle-mixed"]
SHORT = {"fastertransformer": "FT", "orca-max": "Max", "orca-pow2": "Pow2", "orca-oracle": "Oracle",
         "orca-max-mixed": "Max mixed", "orca-pow2-mixed": "Pow2 mixed", "orca-oracle-mixed": "Oracle mixed",
         "vllm": "vLLM"}


def published_range(policy: str) -> str:
    lo, hi = SHAREGPT_RATE_RATIOS.get(policy, (None, None))
    if hi is None:
        return "-"
    return f"up to {hi:g}×" if lo is None else f"{lo:g}–{hi:g}×"


def capacity_stats(folder: Path):
    run = load_run(folder)
    if run.capacity is None:
        raise SystemExit(f"{folder}: no capacity.parquet (run `sim sweep` with a capacity search)")
    stats = over_seeds(run.capacity, ["policy"], "sustainable_request_rate").set_index("policy")
    status = run.capacity.groupby("policy")["status"].agg(lambda s: ",".join(sorted(set(map(str, s)))))
    name = (run.sweep_info or {}).get("name", folder.name)
    return name, stats, status


def capacity_rows(folders: list[Path]) -> tuple[list[str], list[str]]:
    """The rates table (mean ± std over seeds, vLLM's multiple of each baseline) and one line per setup
    saying whether vLLM sustains at least what every Orca variant does."""
    data = [capacity_stats(f) for f in folders]
    present = [p for p in BASELINES if any(p in stats.index for _, stats, _ in data)]
    head = (f"| sweep | {' | '.join(SHORT[p] for p in present + ['vllm'])} | "
            + " | ".join(f"vLLM ÷ {SHORT[p]}" for p in present) + " |")
    rows = [head, "|---" + "|---:" * (2 * len(present) + 1) + "|"]
    checks = []
    for name, stats, status in data:
        def rate(p: str) -> str:
            if p not in stats.index:
                return "-"
            return f"{stats.loc[p, 'mean']:.3g} ± {stats.loc[p, 'std']:.2g}" + (
                "" if status[p] == "found" else f" ({status[p]})")

        vllm = stats.loc["vllm", "mean"]
        ratio = {p: vllm / stats.loc[p, "mean"] for p in present if p in stats.index}
        rows.append(f"| {name} | {' | '.join(rate(p) for p in present + ['vllm'])} | "
                    + " | ".join(f"{ratio[p]:.2f}×" if p in ratio else "-" for p in present) + " |")
        orcas = {p: r for p, r in ratio.items() if p.startswith("orca-")}
        below = [f"{SHORT[p]} {r:.3f}×" for p, r in orcas.items() if r < 1]
        checks.append(f"{name}: vLLM ≥ every Orca variant: " + ("yes" if not below else "NO (" + ", ".join(below) + ")")
                      + f"; lowest vLLM ÷ Orca {min(orcas.values()):.3f}×" if orcas else f"{name}: no Orca variant")
    cells = ["paper, ShareGPT (3 models)"] + [""] * (len(present) + 1) + [published_range(p) for p in present]
    rows.append("| " + " | ".join(cells) + " |")
    return rows, checks


def memory_rows(folder: Path, rate: float) -> list[str]:
    """Mean time-weighted memory shares at ``rate`` (over seeds) beside the paper's Fig. 2 bars."""
    sweep = load_run(folder).sweep
    if not (sweep["workload.arrival.rate"] == rate).any():
        raise SystemExit(f"{folder}: no sweep point at rate {rate}")
    top = sweep["workload.arrival.rate"].max()  # vLLM is far from full at a rate that saturates Orca
    rows = []
    order = [p for p in BASELINES + ["vllm"] if (sweep.policy == p).any()]
    for p, r in [(p, rate) for p in order] + [("vllm", top)]:
        at = sweep[(sweep["workload.arrival.rate"] == r) & (sweep.policy == p)]
        shares = [over_seeds(at, ["policy"], f"memory.{c}")["mean"].iloc[0] for c in MEMORY_CLASSES]
        ours = " / ".join(f"{100 * v:.1f}" for v in shares)
        paper = FIG2.get(p)
        published = (" / ".join(f"{paper.shares_pct[c]:.1f}" if c in paper.shares_pct else "—"
                                for c in MEMORY_CLASSES[:4]) if paper else "-")
        rows.append(f"| {p} at {r:g} req/s | {ours} | {published} |")
    return rows


def run_sweeps(out_root: Path, workers: int | None) -> list[Path]:
    """``sim sweep`` each of the six setups into ``out_root/<setup>`` (no reuse: the simulator may have changed)."""
    from rich.console import Console

    from kvsim import sweep_to_dir

    folders = []
    for setup in SETUPS:
        out = out_root / setup
        result, _ = sweep_to_dir(ROOT / "scenarios" / "vllm-paper" / f"{setup}.sweep.yaml", out, workers=workers,
                                 resume=False, report=True, console=Console(stderr=True))
        if result.failures:
            raise SystemExit(f"{setup}: {len(result.failures)} runs failed, e.g. {result.failures[0]}")
        print(f"{setup}: {result.num_runs:,} runs, {result.wall_s:.1f} s", file=sys.stderr)
        folders.append(out)
    return folders


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*", type=Path, help="sweep folders (default with --run: runs/<setup>)")
    ap.add_argument("--run", action="store_true", help="run the six setups' sweeps first")
    ap.add_argument("--out", type=Path, default=ROOT / "runs", help="with --run: where the sweep folders go")
    ap.add_argument("-j", "--workers", type=int, default=None, help="with --run: simulations at once")
    ap.add_argument("--memory-rate", type=float, default=2.0, help="swept rate of the memory breakdown (req/s)")
    a = ap.parse_args()
    folders = run_sweeps(a.out, a.workers) if a.run else a.folders
    if not folders:
        ap.error("give sweep folders, or --run")
    rows, checks = capacity_rows(folders)
    print("\n".join(rows))
    print()
    print("\n".join(checks))
    print()
    print(f"Memory at {a.memory_rate:g} req/s, {folders[0].name} (% of the KV pool: "
          + " / ".join(MEMORY_CLASSES) + "; paper: Fig. 2, no free class)")
    print("| policy | ours | paper (Fig. 2) |\n|---|---|---|")
    print("\n".join(memory_rows(folders[0], a.memory_rate)))


if __name__ == "__main__":
    main()
