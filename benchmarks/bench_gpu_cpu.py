"""The GPU backend end to end on the CPU: the tiny model (2 layers, hidden 256, 8 query heads over 2 KV
heads) replays the first requests of the Azure 2023 conv trace (lengths capped), calibrates on the CPU
and validates the calibrated simulation against the replay.

    python benchmarks/bench_gpu_cpu.py [--requests 30] [--max-prompt 256] [--max-output 32] [--time-scale 50]

Prints, per policy (orca-max and vllm on the same KV pool of about 3,900 tokens), the simulated and
replayed figures with their relative errors, the per-step MAPE, the calibration's held-back error, and
wall times. CPU timings on a shared machine are noisy: the load average is printed with them.
Data: Azure LLM inference trace 2023 (Patel et al., Splitwise, ISCA 2024), CC-BY-4.0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sim.trace_paths import locate  # noqa: E402  (searched in $KVSIM_TRACES, then ../shared/traces)

AZURE = locate("azure_2023/AzureLLMInferenceTrace_conv.csv")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--time-scale", type=float, default=50.0,
                    help="arrivals this many times faster than the trace (50: the 30 requests come within 0.4 s)")
    ap.add_argument("--trace", default=str(AZURE))
    ap.add_argument("--out", default="runs/bench-gpu-cpu")
    ap.add_argument("--quick", action="store_true", help="a coarser calibration grid")
    a = ap.parse_args()
    if not Path(a.trace).exists():
        print(f"the Azure conv trace is not at {a.trace} (give --trace)", file=sys.stderr)
        return 2
    from rich.console import Console

    from gpu.azure import azure_requests
    from gpu.validate import print_validation, validate_to_dir

    requests = azure_requests(a.trace, a.requests, max_prompt_tokens=a.max_prompt, max_output_tokens=a.max_output,
                              time_scale=a.time_scale)
    t0 = time.perf_counter()
    result, paths = validate_to_dir(ROOT / "scenarios" / "tiny-cpu.yaml", "cpu", a.out, requests=requests,
                                    quick=a.quick, report=False)
    wall = time.perf_counter() - t0
    print_validation(result, Console())
    for layout, fit in result["profile"]["fit"].items():
        hb = fit["held_back"]
        print(f"calibration {layout}: held-back MAPE {hb['mape']:.1%} over {hb['num_points']} points")
    print(f"{requests.source}: {len(requests)} requests; calibrate + simulate + replay {wall:.1f} s wall; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; files in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
