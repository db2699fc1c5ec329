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

from gpu.attention import (DECODE_NUM_STAGES, _decode_attention_kernel, _decode_reduce_kernel, decode_attention,
                           use_split_k)
from gpu.device import usable_memory

GB = 1e9


# ------------------------------------------------------------------------------------------ timing


def time_s(device: torch.device, fn: Callable[[], object], *, rep_ms: float = 20, cpu_iters: int = 1,
           graph: bool = True) -> dict:
    """Median seconds per call of ``fn``: CUDA-graph replays on a GPU (falling back to event timing,
    ``do_bench``, where capture fails, and saying so; events only with ``graph=False``), perf_counter on
    the CPU."""
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
    if not graph:
        return {"s": do_bench(fn, rep=rep_ms, return_mode="median") / 1e3, "method": "events"}
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


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """One block of BLOCK elements per program, read once and written once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


def stream_read(x: torch.Tensor, out: torch.Tensor, block: int = 4096, num_warps: int = 4) -> None:
    programs = out.numel()
    iters = triton.cdiv(x.numel(), programs * block)
    _read_kernel[(programs,)](x, out, x.numel(), BLOCK=block, ITERS=iters, num_warps=num_warps)


def stream_copy(x: torch.Tensor, y: torch.Tensor, block: int = 8192) -> None:
    _copy_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK=block, num_warps=8)


def ceilings(device: torch.device, nbytes: int, rep_ms: float, every_way: bool | None = None) -> dict:
    """Copy (device to device, bytes read + written) and read-only streaming (bytes read) bandwidth of a
    bf16 tensor of ``nbytes``, each the best of several ways (a ceiling is what the device can do; one
    way alone can fall short of it: on an H200 torch's copy captured in a CUDA graph moved 2.7 TB/s and a
    read kernel of 4 programs per SM 2.4 TB/s, while decode attention read 4.6 TB/s). Every way is kept
    in ``variants`` (a way that fails is recorded with its error); each read kernel's sum is checked
    against torch's. ``every_way``: all the ways (default on a GPU; the CPU runs one of each)."""
    gpu = device.type == "cuda"
    every_way = gpu if every_way is None else every_way
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if gpu else 1
    want = float(src.sum(dtype=torch.float64))
    scale = 1e-3 * float(src.abs().sum(dtype=torch.float64))

    def checked_read(programs: int, block: int, warps: int):
        partial = torch.empty(programs, dtype=torch.float32, device=device)

        def run():
            stream_read(src, partial, block, warps)

        run()
        total = float(partial.sum(dtype=torch.float64))
        if abs(total - want) > scale:
            raise RuntimeError(f"the read kernel's sum {total} is not the tensor's {want}: its figure would be wrong")
        return run

    def checked_copy():
        dst.zero_()
        stream_copy(src, dst)
        if not torch.equal(dst, src):
            raise RuntimeError("the copy kernel's output is not its input: its figure would be wrong")
        return lambda: stream_copy(src, dst)

    copies = {"torch copy_": lambda: (lambda: dst.copy_(src))}
    reads = {}
    if every_way:
        copies["triton copy, one 16 KiB block per program"] = checked_copy
        for per_sm, block, warps in ((4, 4096, 4), (16, 4096, 8), (64, 2048, 4)):
            programs = per_sm * (sms if gpu else 4)
            reads[f"triton sum, {programs} programs x {block} elements, {warps} warps"] = (
                lambda p=programs, b=block, w=warps: checked_read(p, b, w))
        reads["torch sum (fp32 accumulation)"] = lambda: (lambda: src.sum(dtype=torch.float32))
    else:
        reads["triton sum, 16 programs x 1024 elements, 4 warps"] = lambda: checked_read(16, 1024, 4)

    def best(makers: dict, moved: int) -> dict:
        rows = []
        for name, make in makers.items():
            try:
                fn = make()
                timings = [time_s(device, fn, rep_ms=rep_ms)]
                if gpu and timings[0]["method"] == "cuda_graph":  # graph memcpy nodes can run slower than
                    timings.append(time_s(device, fn, rep_ms=rep_ms, graph=False))  # launched copies
            except Exception as e:  # noqa: BLE001 - one way failing leaves the others' figures
                rows.append({"way": name, "error": f"{e.__class__.__name__}: {str(e)[:200]}"})
                continue
            rows += [{"way": name, "median_s": t["s"], "gb_per_s": moved / t["s"] / GB, "method": t["method"]}
                     for t in timings]
        ok = [r for r in rows if "error" not in r]
        if not ok:
            raise RuntimeError(f"no way of measuring this ceiling ran: {rows}")
        top = max(ok, key=lambda r: r["gb_per_s"])
        return {"median_s": top["median_s"], "gb_per_s": top["gb_per_s"], "method": top["method"], "way": top["way"],
                "variants": rows}

    return {"bytes": nbytes, "copy": best(copies, 2 * nbytes), "read": best(reads, nbytes)}


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
                deadline: float, stage_variants: bool | None = None) -> list[dict]:
    """Paged and contiguous decode attention at every (batch, context) that fits, with the paging overhead
    (paged / contiguous time, default launch: prefetching the next tile's block ids). On a GPU each
    point is timed at the default pipeline depth (variants ``paged``, ``contiguous``) and at Triton's
    default of 3 stages (``paged_3_stages``, ``contiguous_3_stages``), in alternation, so the choice of
    ``DECODE_NUM_STAGES`` is measured at every shape (``stage_variants``: default on a GPU only). Stops at
    ``deadline`` (perf_counter), listing the points not measured."""
    default = DECODE_NUM_STAGES if device.type == "cuda" else None
    variants = {"paged": ("paged", {}), "contiguous": ("contiguous", {})}
    if device.type == "cuda" if stage_variants is None else stage_variants:
        variants.update({"paged_3_stages": ("paged", {"num_stages": 3}),
                         "contiguous_3_stages": ("contiguous", {"num_stages": 3})})
    shapes, rows = grid_shapes(device, batches, contexts, heads)
    for i, (b, c) in enumerate(shapes):
        if time.perf_counter() > deadline:
            rows += [{"batch": bb, "context": cc, "skipped": "section budget spent"} for bb, cc in shapes[i:]]
            break
        bench = DecodeBench(device, heads, b, c)
        t = bench.measure(variants, rounds, rep_ms)
        for name, (layout, launch) in variants.items():
            twin = "contiguous" + name.removeprefix(layout)  # the contiguous kernel launched alike
            rows.append(bench.row(layout, t[name], ceil, variant=name, num_stages=launch.get("num_stages", default),
                                  paging_overhead=t["paged" + name.removeprefix(layout)]["time_s"] / t[twin]["time_s"]))
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
