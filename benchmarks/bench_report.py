"""Report size and build time for a long run: the quickstart scenario with 20,000 requests.

    python benchmarks/bench_report.py [--requests 20000] [--out runs/bench-report]

Simulates every quickstart policy on the same requests, writes the result folder and its report.html,
then prints the report's size (bytes, of which plotly.js), how long the report took to build, and the
figure payload per section. The bound to hold: under 10 MB (README, "Reports").
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plotly.offline import get_plotlyjs  # noqa: E402

from reports.html import write_report  # noqa: E402
from sim.config import load_scenario  # noqa: E402
from sim.run import run, write_results  # noqa: E402

SIZE_BOUND_BYTES = 10_000_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-report")
    a = ap.parse_args()

    base = load_scenario(ROOT / "scenarios" / "quickstart.yaml")
    scen = base.model_copy(update={"workload": base.workload.model_copy(update={"num_requests": a.requests})})
    t0 = time.perf_counter()
    result = run(scen)
    t1 = time.perf_counter()
    write_results(result, a.out, report=False)
    t2 = time.perf_counter()
    report = write_report(a.out)
    t3 = time.perf_counter()
    page = report.read_text(encoding="utf-8")
    size = report.stat().st_size
    print(f"{a.requests:,} requests x {len(scen.policies)} policies: simulated in {t1 - t0:.1f} s, "
          f"results written in {t2 - t1:.1f} s, report built in {t3 - t2:.1f} s")
    print(f"report.html: {size:,} bytes (plotly.js {len(get_plotlyjs().encode()):,}), bound {SIZE_BOUND_BYTES:,}: "
          f"{'ok' if size < SIZE_BOUND_BYTES else 'OVER'}")
    for m in re.finditer(r"<h3>([^<]*)</h3>.*?<script type=\"application/json\"[^>]*>(.*?)</script>", page, re.S):
        print(f"  {m.group(1):<40} {len(m.group(2).encode()):>10,} bytes")
    print(f"  -> {report}")
    if size >= SIZE_BOUND_BYTES:
        sys.exit(1)


if __name__ == "__main__":
    main()
