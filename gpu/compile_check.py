"""Compile the kernels for NVIDIA targets on any machine (Triton ships ptxas): the configurations the
wrappers launch, with each one's shared memory against the target's limit and a count of its vector
(16-byte) and scalar 16-bit global loads in the PTX. The interpreter runs the same code but never
compiles it; this catches what only the compiler sees, before a GPU is at hand.

    TRITON_INTERPRET=0 python -m gpu.compile_check [--cc 90 80]      # prints JSON, exits 1 on a failure
"""

from __future__ import annotations

import argparse
import json
import re
import sys

SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}  # bytes one block may use, by compute capability


def configurations(dt: str, split_prefill: bool = True) -> list[tuple[str, dict]]:
    """(kernel, constexprs) as launched for Llama-3-8B heads (32 over 8, head dim 128), blocks of 16.
    ``split_prefill=False`` leaves out the split-over-keys prefill: the same tiles and main loop as the
    unsplit one (only its key range and epilogue differ), so the same shared memory."""
    prec = "ieee" if dt == "fp32" else "tf32"
    common = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, BLOCK_SIZE=16, UPCAST=False, PRECISION=prec)
    out = [("_prefill_attention_kernel", dict(NUM_QUERIES_PER_KV=4, NUM_HEADS=32, BLOCK_M=64, BLOCK_Q=16, PAGED=paged,
                                              SPLIT=split, **common))
           for paged in (True, False) for split in ((False, True) if split_prefill else (False,))]
    out += [("_decode_attention_kernel", dict(NUM_QUERIES_PER_KV=4, GROUP_PAD=16, PAGED=paged, PARTITION_SIZE=part,
                                              PREFETCH=True, **common))
            for paged in (True, False) for part in (0, 512)]
    out += [("_decode_reduce_kernel", dict(HEAD_DIM=128, BLOCK_D=128, PARTITION_SIZE=512, BLOCK_P=16, UPCAST=False)),
            ("_prefill_reduce_kernel", dict(NUM_HEADS=32, BLOCK_H=32, HEAD_DIM=128, BLOCK_D=128, UPCAST=False)),
            ("_store_kv_kernel", dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128))]
    return out


# What the JIT sees at run time (gpu.attention's wrappers launch on fresh, aligned tensors; these
# strides are multiples of 16 for head dims of 16 and more). Without it loads compile as scalars.
ALIGNED_INTS = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cs", "stride_ch", "stride_kt", "stride_kh",
                "stride_vt", "stride_vh")


def jit_alignment(arg_names: list[str], constexprs: dict) -> dict:
    """Divisibility-by-16 facts the JIT would specialise on: every pointer and the aligned strides."""
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(arg_names)
            if n not in constexprs and (n.endswith("_ptr") or n in ALIGNED_INTS)}


def compile_all(ccs: list[int], dtypes: list[str], split_prefill: bool = True) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gpu import attention, kv_cache
    from gpu.kv_cache import interpreting

    if interpreting():
        raise RuntimeError("run with TRITON_INTERPRET=0: interpreted kernels cannot be compiled")
    rows = []
    for cc in ccs:
        for dt in dtypes:
            p = f"*{dt}"
            types = dict(q_ptr=p, k_cache_ptr=p, v_cache_ptr=p, out_ptr=p, key_ptr=p, value_ptr=p,
                         part_out_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", query_loc_ptr="*i32",
                         seq_lens_ptr="*i32", block_tables_ptr="*i32", slab_starts_ptr="*i64", sm_scale="fp32",
                         query_start_ptr="*i32", num_new_ptr="*i32", slot_mapping_ptr="*i64")
            options = {"num_stages": 1} if dt == "fp32" else {}  # as gpu.attention launches fp32
            for name, ce in configurations(dt, split_prefill):
                fn = getattr(attention, name, None) or getattr(kv_cache, name)
                sig = {n: "constexpr" if n in ce else types.get(n, "i32") for n in fn.arg_names}
                row = {"kernel": name, "cc": cc, "dtype": dt,
                       **{k: ce[k] for k in ("PAGED", "PARTITION_SIZE") if k in ce}}
                try:
                    src = ASTSource(fn, sig, ce, jit_alignment(fn.arg_names, ce))
                    k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
                    ptx = k.asm["ptx"]
                    row.update(shared_bytes=k.metadata.shared, ok=bool(k.metadata.shared <= SHARED_LIMIT[cc]),
                               vector_loads=len(re.findall(r"cp\.async\.cg\.shared\.global|ld\.global(?:\.\w+)*\.v[24]", ptx)),
                               scalar_16bit_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.b16", ptx)))
                except Exception as e:  # noqa: BLE001 - reported, not raised: the point is the list
                    row.update(error=f"{e.__class__.__name__}: {str(e)[:300]}", ok=False)
                rows.append(row)
    return rows


def pipelines(cc: int = 90) -> list[dict]:
    """The bf16 decode kernel's software pipeline, paged (block ids prefetched a tile ahead, and not) and
    contiguous, at Triton's default ``num_stages`` and at 1-3: shared memory and asynchronous copies in
    the PTX. Equal figures mean the paging overhead compares like with like."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gpu import attention

    fn = attention._decode_attention_kernel
    types = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", out_ptr="*bf16", part_out_ptr="*fp32",
                 part_max_ptr="*fp32", part_sum_ptr="*fp32", query_loc_ptr="*i32", seq_lens_ptr="*i32",
                 block_tables_ptr="*i32", slab_starts_ptr="*i64", sm_scale="fp32")
    rows = []
    for paged, prefetch in ((True, True), (True, False), (False, True)):
        for stages in (None, 1, 2, 3):
            ce = dict(NUM_QUERIES_PER_KV=4, GROUP_PAD=16, PAGED=paged, PARTITION_SIZE=0, PREFETCH=prefetch,
                      HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, BLOCK_SIZE=16, UPCAST=False, PRECISION="tf32")
            sig = {n: "constexpr" if n in ce else types.get(n, "i32") for n in fn.arg_names}
            k = triton.compile(ASTSource(fn, sig, ce, jit_alignment(fn.arg_names, ce)), target=GPUTarget("cuda", cc, 32),
                               options={} if stages is None else {"num_stages": stages})
            rows.append({"layout": "paged" if paged else "contiguous", "prefetch": prefetch if paged else None,
                         "num_stages": stages or f"default ({k.metadata.num_stages})", "shared_bytes": k.metadata.shared,
                         "async_copies": len(re.findall(r"cp\.async\.cg\.shared\.global", k.asm["ptx"]))})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cc", type=int, nargs="*", default=[90, 80], choices=sorted(SHARED_LIMIT))
    ap.add_argument("--dtypes", nargs="*", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    ap.add_argument("--no-split-prefill", action="store_true", help="leave out the split-over-keys prefill "
                    "configurations (the unsplit ones' tiles: the same shared memory)")
    ap.add_argument("--pipelines", action="store_true", help="the decode kernel's pipeline depth per layout and "
                    "num_stages (bf16, the first --cc) instead")
    a = ap.parse_args(argv)
    if a.pipelines:
        print(json.dumps(pipelines(a.cc[0]), indent=1))
        return 0
    rows = compile_all(a.cc, a.dtypes, split_prefill=not a.no_split_prefill)
    print(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
