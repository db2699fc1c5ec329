"""A policy resolved once, and the policy decisions that are not the scheduler's order of work.

``resolve_policy`` turns a scenario's policy into the numbers everything else uses -- the KV pool, the
token budget, the admission watermark, the swap space -- once, for the engine, the GPU executor and
calibration alike. ``make_kv`` builds its KV manager (``kv.KvManager``), whose contiguous slabs follow
``kv.Reservation``; ``Preemption`` decides where a preempted sequence's cache goes and owns the swap
space; ``rejection_reasons`` says up front which requests can never be served.

A new reservation rule touches ``kv.Reservation`` and config; a new preemption mode, ``Preemption``
and config.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.catalog import GIB, GPUS, GpuSpec, ModelSpec
from sim.config import PolicyConfig, Scenario, ScenarioError
from sim.hybrid import HybridContiguousKv, HybridPagedKv
from sim.kv import (BlockPool, BuddyAllocator, CapacityError, ContiguousKv, FifoBlockPool, FirstFitAllocator, KvManager,
                    KvPool, PagedKv, Reservation, kv_pool)
from sim.layouts import KvLayout, LayoutError, kv_layout
from sim.schema import EXCEEDS_KV_POOL, EXCEEDS_MAX_MODEL_LEN, PREFILL_EXCEEDS_TOKEN_BUDGET
from sim.offload import HostTier
from sim.sharing import SharedBlockPool, SharedPagedKv


@dataclass(frozen=True)
class ResolvedPolicy:
    """One policy with every derived number fixed: what the engine, the GPU executor and calibration read."""

    policy: PolicyConfig
    pool: KvPool  # the KV pool this policy gets (the same memory for every policy, in its block size)
    max_model_len: int
    max_num_batched_tokens: int  # the token budget of a step
    watermark_blocks: int  # blocks kept free at admission (paged)
    swap_blocks: int | None  # CPU swap space in blocks; None: the policy never swaps
    width: int = 1  # sequences per request: parallel samples or beams
    sharing: bool = False  # blocks are reference-counted (prefix caching, samples or beams; paged)
    layout: KvLayout | None = None  # the model's KV groups (sim/layouts.py); None: the classic single group

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def paged(self) -> bool:
        return self.policy.allocator.kind == "paged"


def token_budget(policy: PolicyConfig, model: ModelSpec) -> int:
    if policy.max_num_batched_tokens is not None:
        return policy.max_num_batched_tokens
    return 2048 if policy.prefill == "chunked" else max(2048, model.max_model_len)


def resolve_policy(scenario: Scenario, model: ModelSpec, gpu: GpuSpec, policy: PolicyConfig) -> ResolvedPolicy:
    """The policy as this scenario runs it (see ``ResolvedPolicy``)."""
    layout = policy_layout(scenario.name, model, gpu, policy, scenario.tensor_parallel)
    sampling = scenario.sampling
    width = 1 if sampling is None else (sampling.n if sampling.kind == "parallel" else sampling.width)
    if width > policy.max_num_seqs:  # a group runs as a unit: it could never be admitted
        raise ScenarioError(f"{scenario.name}: policy {policy.name}: max_num_seqs={policy.max_num_seqs} is below the "
                            f"{width} sequences a request runs as (sampling); raise max_num_seqs to at least {width}")
    budget = token_budget(policy, model)
    if width > 1 and budget < policy.max_num_seqs:  # (a budget of 2 decoded 4 beams 2 at a time, out of lockstep:
        # the decodes spend it one sequence at a time, and a group's members stepped apart without a word)
        raise ScenarioError(f"{scenario.name}: policy {policy.name}: max_num_batched_tokens={budget} is below "
                            f"max_num_seqs={policy.max_num_seqs}: a step could not decode every sequence of a group "
                            f"(sampling) together; raise it to at least {policy.max_num_seqs} (vLLM refuses a token "
                            f"budget below max_num_seqs)")
    if layout is not None and not layout.single:
        where = f"{scenario.name}: policy {policy.name}"
        kinds = sorted({g.kind for g in layout.groups})
        groups = (f"{model.name} has {len(layout.groups)} KV groups ({', '.join(kinds)})" if len(layout.groups) > 1
                  else f"{model.name}'s one KV group is {kinds[0]}")
        # (Mamba layers have no full-attention form: hybrid_allocator: false is no way out for them)
        unhybrid = "" if "mamba" in kinds else "set hybrid_allocator: false or "
        if width > 1:
            raise ScenarioError(f"{where}: parallel sampling and beam search are not simulated with sliding-window, "
                                f"chunked or Mamba KV groups yet ({groups}); {unhybrid}drop sampling")
        if policy.prefix_caching and any(g.kind == "mamba" for g in layout.groups):
            raise ScenarioError(f"{where}: prefix_caching: {model.name} has Mamba layers, whose state is not cached "
                                f"by prefix (only its attention groups could be); set prefix_caching: false")
        if policy.kv_offload is not None:
            raise ScenarioError(f"{where}: kv_offload (a CPU tier) is not simulated with sliding-window, chunked or "
                                f"Mamba KV groups yet ({groups}); {unhybrid}drop it")
    try:
        pool = kv_pool(model, gpu, tp=scenario.tensor_parallel, gpu_memory_utilization=scenario.gpu_memory_utilization,
                       block_size=policy.block_size, max_num_seqs=policy.max_num_seqs,
                       runtime_overhead_gib=scenario.runtime_overhead_gib,
                       activation_tokens=scenario.activation_reserve_tokens,
                       slot_bytes=None if layout is None else layout.slot_bytes)
    except CapacityError as e:
        raise ScenarioError(f"{scenario.name}: {e}") from None
    off = policy.kv_offload
    if off is not None and int(off.cpu_gib * GIB) < pool.block_size * pool.kv_bytes_per_token:
        raise ScenarioError(f"{scenario.name}: policy {policy.name}: kv_offload.cpu_gib {off.cpu_gib} holds no block "
                            f"({pool.block_size * pool.kv_bytes_per_token:,} bytes each)")
    return resolved(policy, pool, model, width, layout)


def policy_layout(where: str, model: ModelSpec, gpu: GpuSpec, policy: PolicyConfig, tp: int) -> KvLayout | None:
    """The policy's KV layout (``sim/layouts.py``); None for a classic model at its own dtype (as before)."""
    fp8 = policy.kv_cache_dtype == "fp8"
    if fp8 and not gpu.fp8:
        has = "none in the catalog" if gpu.name in GPUS else "none (an inline gpu gets it with fp8: true)"
        raise ScenarioError(f"{where}: policy {policy.name}: kv_cache_dtype: fp8 needs a GPU with fp8 support; "
                            f"{gpu.name} has {has} (use kv_cache_dtype: auto)")
    if not model.modern and not fp8:
        return None
    try:
        return kv_layout(model, tp, policy.block_size, 1 if fp8 else None, policy.hybrid_allocator)
    except LayoutError as e:
        raise ScenarioError(f"{where}: policy {policy.name}: {e}") from None


def resolved(policy: PolicyConfig, pool: KvPool, model: ModelSpec, width: int = 1,
             layout: KvLayout | None = None) -> ResolvedPolicy:
    """``resolve_policy`` for a given pool (tests and tools that size pools themselves)."""
    paged = policy.allocator.kind == "paged"
    watermark = int(policy.allocator.watermark * pool.num_blocks) if paged else 0
    swap = None
    if paged and (policy.preemption == "swap" or width > 1):  # groups swap whenever the space holds them
        swap = int(policy.swap_space_gib * GIB) // (pool.block_size * pool.kv_bytes_per_token)
    return ResolvedPolicy(policy, pool, model.max_model_len, token_budget(policy, model), watermark, swap, width,
                          paged and (width > 1 or policy.prefix_caching), layout)


def make_kv(r: ResolvedPolicy) -> KvManager:
    """The policy's KV manager; sharing (prefix caching, samples or beams) needs reference counts."""
    a, pool = r.policy.allocator, r.pool
    if r.layout is not None and not r.layout.single:  # several KV groups (sim/hybrid.py)
        if a.kind == "paged":
            caching = r.policy.prefix_caching  # reference-counted pages with a prefix cache (sim/sharing.py)
            blocks = (SharedBlockPool if caching else FifoBlockPool)(pool.num_blocks, pool.block_size, r.watermark_blocks)
            return HybridPagedKv(r.layout, blocks, caching,
                                 r.max_num_batched_tokens if r.policy.prefill == "chunked" else None)
        alloc = BuddyAllocator(pool.num_slots) if a.placement == "buddy" else FirstFitAllocator(pool.num_slots)
        return HybridContiguousKv(r.layout, alloc, Reservation(a.reserve, r.max_model_len))
    if a.kind == "paged":
        if r.sharing:
            off = r.policy.kv_offload
            tier = None
            if off is not None:
                block_bytes = pool.block_size * pool.kv_bytes_per_token
                tier = HostTier(max(1, int(off.cpu_gib * GIB) // block_bytes))  # (resolve_policy refuses < 1)
            return SharedPagedKv(SharedBlockPool(pool.num_blocks, pool.block_size, r.watermark_blocks),
                                 r.policy.prefix_caching, tier)
        return PagedKv(BlockPool(pool.num_blocks, pool.block_size, r.watermark_blocks))
    alloc = BuddyAllocator(pool.num_slots) if a.placement == "buddy" else FirstFitAllocator(pool.num_slots)
    return ContiguousKv(alloc, Reservation(a.reserve, r.max_model_len))


def _table(kv: KvManager, seq) -> list[int]:
    """The pages ``seq`` holds: its block table, or (several KV groups, sim/hybrid.py) every group's."""
    return kv.table(seq) if hasattr(kv, "table") else seq.block_table


class Preemption:
    """What preempting a running sequence does with its cache. "Preempted" means the cache left GPU
    memory: freed (recompute: the sequence re-prefills prompt + generated tokens) or copied to the CPU
    swap space this object owns (swap; it comes back before any new admission).

    A lone sequence swaps under ``preemption: swap`` while the swap space holds it, else recomputes. A
    group of samples or beams swaps whole whenever the swap space holds its blocks (vLLM v0 swaps
    multi-sequence groups), else each member recomputes on its own, as separate requests would (vLLM
    v1's view of parallel samples), sharing again only through the prefix cache."""

    def __init__(self, mode: str, swap_blocks: int | None, block_size: int) -> None:
        self.mode = mode
        self.swap_pool = BlockPool(swap_blocks, block_size) if swap_blocks is not None else None

    def swap_out(self, kv: KvManager, members: list, group: bool) -> list[tuple[int, int]] | None:
        """Copy ``members``' blocks (each shared block once) to the swap space and free them on the GPU;
        returns the (GPU, CPU) block copies, or None: recompute (the caller frees)."""
        pool = self.swap_pool
        if pool is None or not (group or self.mode == "swap"):
            return None
        tables = [_table(kv, m) for m in members]
        unique = list(dict.fromkeys(b for t in tables for b in t))
        if not pool.can_allocate(len(unique)):
            return None
        where = dict(zip(unique, pool.allocate(len(unique))))
        for m, t in zip(members, tables):
            m.cpu_blocks = [where[b] for b in t]
            kv.free(m)
        return list(where.items())

    def can_swap_in(self, kv: KvManager, seq, num_new: int) -> bool:
        return kv.can_admit(seq, num_new)

    def swap_in(self, kv: KvManager, seq, num_new: int) -> list[tuple[int, int]]:
        """Bring one sequence back with room for ``num_new`` tokens; returns the (CPU, GPU) copies."""
        kv.admit(seq, num_new)
        pairs = list(zip(seq.cpu_blocks, _table(kv, seq)))
        self.swap_pool.free(seq.cpu_blocks)
        seq.cpu_blocks = ()
        return pairs

    def can_swap_in_group(self, kv: SharedPagedKv, members: list) -> bool:
        return kv.can_swap_in_group(members)

    def swap_in_group(self, kv: SharedPagedKv, members: list) -> list[tuple[int, int]]:
        """Bring a swapped group back, its sharing intact; returns the (CPU, GPU) copies."""
        return kv.swap_in_group(members, self.swap_pool)


def rejection_reasons(r: ResolvedPolicy, kv: KvManager, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """Why each request can never be served (``sim.metrics`` reason codes; 0 = it can). Checked up
    front, so the simulation always progresses: a request admitted alone always fits, and the oldest
    running one is never preempted."""
    policy = r.policy
    reason = np.zeros(len(prompt), dtype=np.int8)
    total = prompt + output
    over_pool = kv.never_fits(prompt, output, r.width)
    if policy.batching == "continuous" and policy.prefill != "chunked":
        # a prefill is never split: a preempted (recomputed) request re-prefills all its tokens
        prefill_max = total - 1 if kv.kind == "paged" else prompt
        reason[prefill_max > r.max_num_batched_tokens] = PREFILL_EXCEEDS_TOKEN_BUDGET
    reason[over_pool] = EXCEEDS_KV_POOL
    reason[total > r.max_model_len] = EXCEEDS_MAX_MODEL_LEN
    return reason
