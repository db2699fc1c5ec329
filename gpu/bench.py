"""Bandwidth measurements of the device check: copy and read-only streaming ceilings, decode attention
(paged and contiguous) over a batch x context grid, the paging overhead at matched pipeline depths, and
the compiled kernels' registers, shared memory and spills.

Timing on a GPU: ``triton.testing.do_bench_cudagraph`` (the calls captured in a CUDA graph and replayed,
so launch gaps are out of the figure), the median per-iteration time; paged and contiguous measured in
alternation (round after round) so that a clock or temperature drift hits both; a burn of matrix
products first to bring the clocks up. On the CPU (the interpreter) the same code runs small shapes
with ``perf_counter``: the figures prove the pipeline, nothing about a GPU.

Bytes: decode attention counts the K and V it must read once (2 x batch x context x H_kv x D x 2 B);
copy counts bytes read + written; the read baseline counts bytes read.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import triton
import triton.language as tl

from gpu.attention import _decode_attention_kernel, _decode_reduce_kernel, decode_attention, use_split_k
from gpu.device import usable_memory

GB = 1e9


# ------------------------------------------------------------------------------------------ timing


def time_s(device: torch.device, fn: Callable[[], object], *, rep_ms: float = 20, cpu_iters: int = 1) -> dict:
    """Median seconds per call of ``fn``: CUDA-graph replays on a GPU (falling back to event timing,
    ``do_bench``, where capture fails, and saying so), perf_counter on the CPU."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(cpu_iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return {"s": statistics.median(times), "method": "perf_counter"}
    from triton.testing import do_bench, do_bench_cudagraph

    torch.cuda.synchronize()  # inputs made on the default stream; the bench captures on a side stream
    try:
        ms = do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
        return {"s": ms / 1e3, "method": "cuda_graph"}
    except Exception as e:  # noqa: BLE001 - recorded: the figure then includes launch gaps
        torch.cuda.synchronize()
        ms = do_bench(fn, rep=rep_ms, return_mode="median")
        return {"s": ms / 1e3, "method": f"events (graph capture failed: {e.__class__.__name__}: {str(e)[:120]})"}


def warmup_burn(device: torch.device, seconds: float) -> dict:
    """bf16 matrix products for ``seconds``, so that the clocks are up before the first measurement."""
    if device.type != "cuda" or seconds <= 0:
        return {"seconds": 0.0}
    a = torch.randn((8192, 8192), device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        n += 10
    return {"seconds": time.perf_counter() - t0, "matmuls": n}


# ------------------------------------------------------------------------------------------ ceilings


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Each program sums ITERS blocks of BLOCK elements (strided by the grid) and writes one float: the
    bytes read are the whole tensor, the bytes written negligible."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = (i * tl.num_programs(0) + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def stream_read(x: torch.Tensor, out: torch.Tensor, block: int = 4096) -> None:
    programs = out.numel()
    iters = triton.cdiv(x.numel(), programs * block)
    _read_kernel[(programs,)](x, out, x.numel(), BLOCK=block, ITERS=iters)


def ceilings(device: torch.device, nbytes: int, rep_ms: float) -> dict:
    """Copy (device to device, bytes read + written) and read-only streaming (bytes read) bandwidth of a
    bf16 tensor of ``nbytes``; the read kernel's sum is checked against torch's."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy = time_s(device, lambda: dst.copy_(src), rep_ms=rep_ms)
    programs = 4 * (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4)
    partial = torch.empty(programs, dtype=torch.float32, device=device)
    block = 4096 if device.type == "cuda" else 1024
    read = time_s(device, lambda: stream_read(src, partial, block), rep_ms=rep_ms)
    total, want = float(partial.sum(dtype=torch.float64)), float(src.sum(dtype=torch.float64))
    if abs(total - want) > 1e-3 * float(src.abs().sum(dtype=torch.float64)):
        raise RuntimeError(f"the read kernel's sum {total} is not the tensor's {want}: its figure would be wrong")
    return {"bytes": nbytes,
            "copy": {"median_s": copy["s"], "gb_per_s": 2 * nbytes / copy["s"] / GB, "method": copy["method"]},
            "read": {"median_s": read["s"], "gb_per_s": nbytes / read["s"] / GB, "method": read["method"],
                     "programs": programs}}


# ------------------------------------------------------------------------------------------ decode


class DecodeBench:
    """One shape of decode attention (bf16, blocks of 16): the same K/V read through a shuffled block
    table (paged) or from consecutive slabs (contiguous)."""

    def __init__(self, device, heads: tuple[int, int, int], batch: int, ctx: int, block_size: int = 16) -> None:
        num_heads, kv_heads, dim = heads
        self.device, self.batch, self.ctx, self.block_size = device, batch, ctx, block_size
        blocks = -(-ctx // block_size)
        self.k = torch.empty((batch * blocks * block_size, kv_heads, dim), dtype=torch.bfloat16,
                             device=device).normal_()
        self.v = torch.empty_like(self.k).normal_()
        self.q = torch.randn((batch, num_heads, dim), dtype=torch.bfloat16, device=device)
        self.out = torch.empty_like(self.q)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.loc = torch.arange(batch, dtype=torch.int32, device=device)
        perm = torch.randperm(batch * blocks, device=device).to(torch.int32).view(batch, blocks)
        slabs = torch.arange(batch, device=device, dtype=torch.int64) * blocks * block_size
        self.layouts = {"paged": {"block_tables": perm}, "contiguous": {"slab_starts": slabs}}
        self.kv_bytes = 2 * batch * ctx * kv_heads * dim * self.k.element_size()
        self.split_k = use_split_k(batch, kv_heads, ctx, torch.device(device))

    @staticmethod
    def nbytes(heads: tuple[int, int, int], batch: int, ctx: int, block_size: int = 16) -> int:
        """Device memory the bench allocates (K and V, the rest is small)."""
        return 2 * batch * (-(-ctx // block_size) * block_size) * heads[1] * heads[2] * 2

    def call(self, layout: str, **launch) -> Callable[[], object]:
        def run():
            decode_attention(self.q, self.k, self.v, self.seq_lens, self.loc, max_seq_len=self.ctx,
                             block_size=self.block_size, out=self.out, **self.layouts[layout], **launch)
        return run

    def measure(self, variants: dict[str, tuple[str, dict]], rounds: int, rep_ms: float) -> dict[str, dict]:
        """``variants``: name -> (layout, launch options); each timed ``rounds`` times, in alternation;
        per variant the median over rounds (and the spread) and the timing method."""
        fns = {name: self.call(layout, **launch) for name, (layout, launch) in variants.items()}
        for fn in fns.values():  # compile and warm up each once before any timing
            fn()
        times: dict[str, list[float]] = {name: [] for name in fns}
        methods = {}
        for _ in range(rounds):
            for name, fn in fns.items():
                t = time_s(self.device, fn, rep_ms=rep_ms)
                times[name].append(t["s"])
                methods[name] = t["method"]
        return {name: {"time_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "method": methods[name]}
                for name, ts in times.items()}

    def row(self, layout: str, t: dict, ceil: dict, **extra) -> dict:
        gb = self.kv_bytes / t["time_s"] / GB
        return {"batch": self.batch, "context": self.ctx, "layout": layout, "split_k": self.split_k, **extra,
                **t, "kv_bytes": self.kv_bytes, "gb_per_s": gb,
                "fraction_of_copy": gb / ceil["copy"]["gb_per_s"], "fraction_of_read": gb / ceil["read"]["gb_per_s"]}


def grid_shapes(device: torch.device, batches, contexts, heads, memory_fraction: float = 0.4) -> tuple[list, list]:
    """The (batch, context) points whose K/V fit in ``memory_fraction`` of the free device memory, and
    the ones left out (with why)."""
    cap = None
    mem = usable_memory(device)
    if mem is not None:
        cap = int(mem["free_bytes"] * memory_fraction)
    keep, skipped = [], []
    for b in batches:
        for c in contexts:
            need = DecodeBench.nbytes(heads, b, c)
            if cap is not None and need > cap:
                skipped.append({"batch": b, "context": c, "skipped": f"K/V of {need / 2**30:.1f} GiB > "
                                f"{memory_fraction:.0%} of the free {mem['free_gib']:.1f} GiB"})
            else:
                keep.append((b, c))
    return keep, skipped


def decode_grid(device: torch.device, heads, batches, contexts, ceil: dict, *, rounds: int, rep_ms: float,
                deadline: float) -> list[dict]:
    """Paged and contiguous decode attention at every (batch, context) that fits, with the paging overhead
    (paged / contiguous time, default launch: prefetching the next tile's block ids). Stops at
    ``deadline`` (perf_counter), listing the points not measured."""
    shapes, rows = grid_shapes(device, batches, contexts, heads)
    for i, (b, c) in enumerate(shapes):
        if time.perf_counter() > deadline:
            rows += [{"batch": bb, "context": cc, "skipped": "section budget spent"} for bb, cc in shapes[i:]]
            break
        bench = DecodeBench(device, heads, b, c)
        t = bench.measure({"paged": ("paged", {}), "contiguous": ("contiguous", {})}, rounds, rep_ms)
        over = t["paged"]["time_s"] / t["contiguous"]["time_s"]
        rows += [bench.row(name, t[name], ceil, paging_overhead=over) for name in ("paged", "contiguous")]
        del bench
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def matched_overhead(device: torch.device, heads, shape: tuple[int, int], configs, ceil: dict, *, rounds: int,
                     rep_ms: float, deadline: float) -> dict:
    """The paging overhead at one shape with both kernels compiled alike: for each (num_stages, block_n,
    num_warps), paged (block ids prefetched one tile ahead, and not) against contiguous; and best against
    best over all configurations."""
    bench = DecodeBench(device, heads, *shape)
    rows, left = [], []
    for i, (stages, block_n, warps) in enumerate(configs):
        if time.perf_counter() > deadline:
            left = [dict(num_stages=s, block_n=n, num_warps=w) for s, n, w in configs[i:]]
            break
        launch = {"num_stages": stages, "block_n": block_n, "num_warps": warps}
        try:
            t = bench.measure({"paged": ("paged", launch), "paged_no_prefetch": ("paged", {**launch, "prefetch": False}),
                               "contiguous": ("contiguous", launch)}, rounds, rep_ms)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory at a deep pipeline: recorded
            rows.append({**launch, "error": f"{e.__class__.__name__}: {str(e)[:200]}"})
            continue
        for name in t:
            rows.append(bench.row("paged" if name.startswith("paged") else "contiguous", t[name], ceil, **launch,
                                  prefetch=name == "paged", variant=name,
                                  paging_overhead=t[name]["time_s"] / t["contiguous"]["time_s"]))
    ok = [r for r in rows if "error" not in r]
    best = {}
    for v in ("paged", "paged_no_prefetch", "contiguous"):
        cand = [r for r in ok if r["variant"] == v]
        if cand:
            r = min(cand, key=lambda r: r["time_s"])
            best[v] = {k: r[k] for k in ("num_stages", "block_n", "num_warps", "time_s", "gb_per_s")}
    out = {"batch": shape[0], "context": shape[1], "rows": rows, "best": best}
    if "paged" in best and "contiguous" in best:
        out["best_paged_over_best_contiguous"] = best["paged"]["time_s"] / best["contiguous"]["time_s"]
    if left:
        out["not_measured"] = {"reason": "section budget spent", "configs": left}
    return out


# ------------------------------------------------------------------------------------------ resources


def compiled_resources(kernels=(_decode_attention_kernel, _decode_reduce_kernel)) -> list[dict]:
    """Registers, spills, shared memory, warps and stages of every compiled variant of ``kernels`` that
    ran in this process (Triton's per-device caches). Guarded: Triton's internals change between
    versions; what cannot be read is said, not guessed."""
    rows = []
    for fn in kernels:
        caches = getattr(fn, "device_caches", None)
        name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", str(fn))
        if caches is None:
            rows.append({"kernel": name, "unavailable": "no compiled kernels (the interpreter runs them uncompiled)"})
            continue
        for _device, entry in list(caches.items()):
            cache = entry[0] if isinstance(entry, tuple) else entry
            for key, k in list(getattr(cache, "items", lambda: [])()):
                row = {"kernel": name}
                try:
                    if hasattr(k, "_init_handles"):
                        k._init_handles()
                    md = k.metadata
                    row.update(n_regs=getattr(k, "n_regs", None), n_spills=getattr(k, "n_spills", None),
                               shared_bytes=getattr(md, "shared", None), num_warps=getattr(md, "num_warps", None),
                               num_stages=getattr(md, "num_stages", None))
                    consts = getattr(getattr(k, "src", None), "constants", None) or {}
                    names = list(getattr(fn, "arg_names", []))
                    ce = {}
                    for ck, cv in consts.items():
                        idx = ck[0] if isinstance(ck, tuple) else ck
                        label = names[idx] if isinstance(idx, int) and idx < len(names) else str(idx)
                        if label in ("PAGED", "PARTITION_SIZE", "BLOCK_N", "PREFETCH", "BLOCK_SIZE", "UPCAST"):
                            ce[label] = cv if isinstance(cv, (int, float, bool, str)) else str(cv)
                    row["constexprs"] = ce
                except Exception as e:  # noqa: BLE001
                    row["unavailable"] = f"{e.__class__.__name__}: {str(e)[:160]}"
                rows.append(row)
    return rows
