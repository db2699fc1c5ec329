"""Trace reading speed and memory on a large generated Azure-2024-format file.

    python benchmarks/bench_traces.py [--rows 16800000] [--gzip] [--dir DIR] [--chunk-rows 1048576]

Writes a CSV with the Azure LLM inference columns (TIMESTAMP naive with 7 fractional digits, as the 2023
files write it; the 2024 files write "+00:00" and 6 digits, which parse as fast; ContextTokens,
GeneratedTokens: one week of Poisson arrivals, log-normal lengths) into a temporary
folder (or DIR, kept), then reads it in a fresh process with the trace reader, exactly as a scenario
would, and prints rows per second and that process's peak RSS (and its RSS after imports alone).
The file is generated, never committed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WEEK_S = 7 * 24 * 3600

# NOTE: the reader's own peak is VmHWM (this process's memory since exec); ru_maxrss would also carry
# the parent's peak across fork, and the parent has just held a generated chunk.
READER = """
import json, sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from traces.formats import open_trace
from traces.read import read_trace
def hwm_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
base = hwm_kib()
t0 = time.perf_counter()
t = read_trace(open_trace(Path({path!r})), chunk_rows={chunk_rows})
dt = time.perf_counter() - t0
print(json.dumps({{"rows": t.num_rows_read, "requests": len(t), "seconds": dt, "span_s": float(t.arrival_s[-1]),
                  "peak_rss_kib": hwm_kib(), "import_rss_kib": base}}))
"""


def write_azure_csv(path: Path, rows: int, compress: bool, seed: int = 0, chunk: int = 1_000_000) -> None:
    """``rows`` requests over one week from 2024-05-10 00:00, in the Azure 2024 CSV layout."""
    rng = np.random.default_rng(seed)
    start = np.datetime64("2024-05-10T00:00:00", "ns")
    t_s = 0.0
    opener = gzip.open if compress else open
    with opener(path, "wt", encoding="utf-8", newline="") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for done in range(0, rows, chunk):
            n = min(chunk, rows - done)
            arrivals = t_s + np.cumsum(rng.exponential(WEEK_S / rows, n))
            t_s = float(arrivals[-1])
            ns = start + (arrivals * 1e9).astype("timedelta64[ns]")
            us = np.datetime_as_string(ns, unit="us")  # 2024-05-10T00:00:00.123456
            tenth = ((ns.astype(np.int64) // 100) % 10).astype(str)  # the 7th fractional digit
            stamp = np.char.add(np.char.replace(us, "T", " "), tenth)
            ctx = np.maximum(1, rng.lognormal(7.0, 1.0, n)).astype(np.int64).astype(str)
            gen = np.maximum(1, rng.lognormal(5.0, 1.0, n)).astype(np.int64).astype(str)
            lines = np.char.add(np.char.add(np.char.add(np.char.add(stamp, ","), ctx), ","), gen)
            f.write("\n".join(lines.tolist()))
            f.write("\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16_800_000)
    ap.add_argument("--gzip", action="store_true", help="write and read a .csv.gz")
    ap.add_argument("--dir", type=Path, help="keep the generated file here (default: a temporary folder)")
    ap.add_argument("--chunk-rows", type=int, default=1 << 20)
    a = ap.parse_args()

    folder = a.dir or Path(tempfile.mkdtemp(prefix="kvsim-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ("AzureLLMInferenceTrace_bench.csv" + (".gz" if a.gzip else ""))
    try:
        t0 = time.perf_counter()
        write_azure_csv(path, a.rows, a.gzip)
        print(f"wrote {path.name}: {a.rows:,} rows, {path.stat().st_size / 2**20:,.0f} MiB in "
              f"{time.perf_counter() - t0:.1f} s")
        code = READER.format(root=str(ROOT), path=str(path), chunk_rows=a.chunk_rows)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        r = json.loads(out)
        print(f"read {r['rows']:,} rows ({r['requests']:,} requests, span {r['span_s'] / 86400:.2f} days) in "
              f"{r['seconds']:.1f} s: {r['rows'] / r['seconds']:,.0f} rows/s; peak RSS "
              f"{r['peak_rss_kib'] / 2**10:,.0f} MiB (after imports {r['import_rss_kib'] / 2**10:,.0f} MiB); "
              f"chunks of {a.chunk_rows:,} rows")
    finally:
        if a.dir is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
