"""The torch executor: runs each ``StepPlan`` of the simulator's scheduler for real and returns its
measured duration. It makes no decision: which sequences run, how many tokens each computes and which
slots hold their cache all come from the plan.

Per step::

    swap_out / swap_in block pairs -> copy between the device pool and host swap space
    plan -> StepInputs: token ids, positions, slot_mapping (one slot per new token),
            the decode batch (n == 1: query row, seq_len, block table | slab start)
            and the prefill batch (n > 1: first row, n, seq_len, block table | slab start)
    model forward: store K/V through slot_mapping, attention over the pool, greedy next tokens

Sliding-window layers (``ModelShape.layer_windows``) attend with their window. KV groups
(``KvCache.groups``): with the simulator's hybrid allocator (``sim/hybrid.py``) each layer reads and writes
through its own group's block tables, as the allocator placed them (``group_tables``: a window group's
tables hold only the pages it kept, -1 for the blocks it freed, whose pages other sequences reuse), with
one ``slot_mapping`` row per group; the kernels never read a block wholly before the window. Otherwise one
group of every layer: the plan's tables (window layers read them through the mask, vLLM's fallback).

Timing (``step_time_s``): on a GPU, CUDA events around the step's launches (the GPU's time, idle gaps
waiting for the host included) and the host's time to enqueue them, per step in ``step_log``; a step
whose host time reaches 90 % of its GPU time is ``host_bound`` (the GPU waited for Python). Decode-only
steps run as CUDA graphs captured per (batch bucket, context bucket) (``DecodeGraphs``), so an eager
8-layer step's ~700 launches do not set its time. On the CPU the step's wall time (host time only).
Step inputs reach the GPU from pinned host memory.

Token bookkeeping mirrors ``sim.core.Sequence``: each sequence knows prompt + generated token ids;
an entry computes ``tokens[num_computed : num_computed + n]`` and, when that reaches the last known
token, samples one more. A sequence preempted by recompute therefore re-prefills its prompt *and* the
tokens it had generated, exactly as the scheduler planned it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from gpu.attention import decode_attention, decode_attention_torch, prefill_attention, prefill_attention_ref
from gpu.device import default_attention, default_dtype, host_and_device_s, resolve_device, synchronize
from gpu.kv_cache import KvCache, KvGroups, interpreting, store_kv, store_kv_ref, token_slots
from gpu.model import LlamaModel, ModelShape
from sim.catalog import GpuSpec, ModelSpec
from sim.config import Scenario, ScenarioError
from sim.core import StepPlan
from sim.policy import ResolvedPolicy
from sim.workload import RequestTable


@dataclass
class Layout:
    """Where a batch's sequences keep their cache: block tables (paged) or slab starts (contiguous)."""

    block_tables: torch.Tensor | None  # [num_seqs, max_num_blocks] int32
    slab_starts: torch.Tensor | None  # [num_seqs] int64


@dataclass
class DecodeBatch:
    query_loc: torch.Tensor  # [num_seqs] int32: the token row of each sequence's query
    seq_lens: torch.Tensor  # [num_seqs] int32
    max_seq_len: int
    layouts: list[Layout]  # per KV group


@dataclass
class PrefillBatch:
    query_start: torch.Tensor  # [num_seqs] int32: first token row
    num_new: torch.Tensor  # [num_seqs] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    max_num_new: int
    layouts: list[Layout]  # per KV group
    max_seq_len: int = 0


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_groups, num_tokens] int64: each new token's slot in each KV group
    decode: DecodeBatch | None
    prefill: PrefillBatch | None
    sample_rows: torch.Tensor  # [num_sampled] int64
    sample_seq_ids: list[int]


class PoolAttention:
    """The model's attention for one step: store the new K/V into the pool, then attend over it."""

    def __init__(self, inputs: StepInputs, cache: KvCache, backend: str, windows: tuple[int, ...] = ()) -> None:
        if backend not in ("triton", "torch"):
            raise ValueError(f"attention backend {backend!r}: expected triton or torch")
        self.inputs = inputs
        self.cache = cache
        self.triton = backend == "triton"
        self.windows = windows  # per layer: its sliding window (0: full); () all full

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        x, bs = self.inputs, self.cache.block_size
        w = self.windows[layer] if self.windows else 0
        g = self.cache.groups.layer_group[layer]
        k_cache, v_cache = self.cache.layer(layer)
        if self.triton:
            store_kv(k, v, k_cache, v_cache, x.slot_mapping[g])
        else:
            store_kv_ref(k, v, k_cache, v_cache, x.slot_mapping[g], skip_negative=False)
        out = torch.empty_like(q)
        if x.decode is not None:
            d = x.decode
            fn = decode_attention if self.triton else decode_attention_torch
            lay = d.layouts[g]
            fn(q, k_cache, v_cache, d.seq_lens, d.query_loc, max_seq_len=d.max_seq_len, block_size=bs,
               block_tables=lay.block_tables, slab_starts=lay.slab_starts, out=out, window=w)
        if x.prefill is not None:
            p = x.prefill
            kw = {"max_num_new": p.max_num_new, "max_seq_len": p.max_seq_len} if self.triton else {}
            lay = p.layouts[g]
            (prefill_attention if self.triton else prefill_attention_ref)(
                q, k_cache, v_cache, p.query_start, p.num_new, p.seq_lens, block_size=bs,
                block_tables=lay.block_tables, slab_starts=lay.slab_starts, out=out, window=w, **kw)
        return out


def _staged(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor ready for ``device``: pinned on a GPU, so that its upload is an asynchronous DMA."""
    return t.pin_memory() if device.type == "cuda" else t


def _int_tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _staged(torch.as_tensor(np.asarray(values), dtype=dtype), device)


def upload(x, device: torch.device):
    """``x`` (``StepInputs`` or a part of it, built by ``TorchExecutor.stage``) with every tensor copied to
    ``device`` (non-blocking from pinned memory on a GPU; the same tensors on the CPU)."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=device.type == "cuda")
    if isinstance(x, list):
        return [upload(v, device) for v in x]
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: upload(getattr(x, f.name), device) for f in dataclasses.fields(x)})
    return x


@dataclass
class Launched:
    """A step whose work is enqueued: the sampled sequences and, on the device, the next token of each
    row (``rows`` picks the sampled rows out of it)."""

    sample_seq_ids: list[int]
    next_ids: torch.Tensor
    rows: list[int] | None = None  # None: next_ids holds exactly the sampled rows
    graph: tuple[int, int] | None = None  # the (batch, context) bucket of a graph replay


BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)
MIN_CONTEXT_BUCKET = 512


class DecodeGraphs:
    """The decode step (all sequences computing one token) as CUDA graphs, one per (batch bucket,
    context bucket): the batch padded to the next of ``BATCH_BUCKETS``, the longest context to the next
    power of two (at least 512), which fixes the block table's width and the attention's grid.

    Padded rows read slot 0 of block 0 (any valid memory: their output is dropped) and store to slot -1,
    which ``store_kv`` skips, so padding never touches the pool. One pinned host buffer per bucket holds
    the step's inputs (ids, positions, lengths, then per KV group slots and block tables, or slab starts)
    and reaches the GPU in one copy. With ``capture=False`` (the CPU, or a test) the same padded step runs
    eagerly."""

    def __init__(self, model: LlamaModel, cache: KvCache, paged: bool, capture: bool) -> None:
        self.model, self.cache, self.paged, self.capture = model, cache, paged, capture
        self.entries: dict[tuple[int, int], dict] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.max_batch = BATCH_BUCKETS[-1]
        self.capture_s = 0.0
        self.disabled: str | None = None  # why graphs were given up (a capture failed): eager from then on

    def bucket(self, num_seqs: int, max_seq_len: int) -> tuple[int, int] | None:
        """(padded batch, padded context) of a decode step, or None past the largest batch bucket."""
        if num_seqs > self.max_batch:
            return None
        b = next(x for x in BATCH_BUCKETS if x >= num_seqs)
        c = max(MIN_CONTEXT_BUCKET, 1 << (max_seq_len - 1).bit_length())
        bs = self.cache.block_size
        return b, -(-c // bs) * bs

    def _entry(self, key: tuple[int, int]) -> dict:
        if key in self.entries:
            return self.entries[key]
        B, C = key
        G = self.cache.groups.num_groups
        width = C // self.cache.block_size if self.paged else 1
        dev = self.model.device
        n = (3 + G) * B + (G * B * width if self.paged else B)
        host = torch.zeros(n, dtype=torch.int64, pin_memory=dev.type == "cuda")
        packed = torch.zeros(n, dtype=torch.int64, device=dev)
        e = {"B": B, "C": C, "G": G, "width": width, "host": host, "packed": packed}
        self._pad(e, 0)
        packed.copy_(host)
        loc = torch.arange(B, dtype=torch.int32, device=dev)
        rows = torch.arange(B, dtype=torch.int64, device=dev)

        def forward() -> torch.Tensor:
            seq_lens = packed[2 * B:3 * B].to(torch.int32)
            rest = packed[(3 + G) * B:]
            if self.paged:
                tables = rest.view(G, B, width).to(torch.int32)
                layouts = [Layout(tables[g], None) for g in range(G)]
            else:
                layouts = [Layout(None, rest)]
            x = StepInputs(packed[:B], packed[B:2 * B], packed[3 * B:(3 + G) * B].view(G, B),
                           DecodeBatch(loc, seq_lens, C, layouts), None, rows, [])
            logits = self.model.forward(x.input_ids, x.positions,
                                        PoolAttention(x, self.cache, "triton", self.model.shape.layer_windows), rows)
            return logits.argmax(dim=-1)

        e["forward"] = forward
        if self.capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compile and warm up eagerly (all rows padded: no pool writes)
                forward()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                e["out"] = forward()
            e["graph"] = graph
        self.entries[key] = e
        return e

    def _pad(self, e: dict, n: int) -> None:
        """Rows n .. B-1 of the host buffer as padding."""
        B, G, h = e["B"], e["G"], e["host"]
        for seg, value in ((0, 0), (1, 0), (2, 1)):
            h[seg * B + n:(seg + 1) * B] = value
        h[3 * B:(3 + G) * B].view(G, B)[:, n:] = -1
        rest = h[(3 + G) * B:]
        if self.paged:
            rest.view(G, B, e["width"])[:, n:] = 0
        else:
            rest[n:] = 0

    def prepare(self, plan: StepPlan) -> tuple[int, int] | None:
        """The bucket of a decode-only plan (its graph captured now, outside any timing), or None."""
        if self.disabled or plan.num_seqs == 0 or any(n != 1 for n in plan.num_new_tokens):
            return None
        key = self.bucket(plan.num_seqs, max(plan.num_computed_tokens) + 1)
        if key is not None and key not in self.entries:
            t0 = time.perf_counter()
            try:
                self._entry(key)
            except Exception as e:  # noqa: BLE001 - a capture that fails leaves the eager path, said in info()
                self.disabled = f"capture of bucket {key} failed: {e.__class__.__name__}: {str(e)[:300]}"
                self.entries.pop(key, None)
                if self.capture:
                    torch.cuda.synchronize()
                return None
            finally:
                self.capture_s += time.perf_counter() - t0
        return key

    def info(self) -> dict:
        """The buckets captured, the seconds capturing took, and why graphs were given up (if they were)."""
        return {"buckets": sorted(self.entries), "capture_s": self.capture_s, "captured": self.capture,
                "disabled": self.disabled}

    def fill(self, key: tuple[int, int], ids: list[int], positions: list[int], slots: list[list[int]],
             seq_lens: list[int], tables: list | None, plan: StepPlan) -> None:
        """Write a step's inputs into the bucket's pinned host buffer (host work, before the step's timing).
        ``slots``: per KV group, each row's slot; ``tables``: per KV group, each row's block table."""
        e = self.entries[key]
        B, G, n = e["B"], e["G"], len(ids)
        h = e["host"].numpy()  # a view: numpy writes lists without a torch call per row
        h[:n] = ids
        h[B:B + n] = positions
        h[2 * B:2 * B + n] = seq_lens
        h[3 * B:(3 + G) * B].reshape(G, B)[:, :n] = slots
        rest = h[(3 + G) * B:]
        if self.paged:
            rows = rest.reshape(G, B, e["width"])
            rows[:, :n] = 0
            for g, group in enumerate(tables):
                for i, t in enumerate(group):
                    rows[g, i, :len(t)] = t
        else:
            rest[:n] = plan.slab_starts
        self._pad(e, n)

    def replay(self, key: tuple[int, int]) -> torch.Tensor:
        """Copy the bucket's filled buffer to the device (one copy) and replay its graph: the next token of
        every row."""
        e = self.entries[key]
        e["packed"].copy_(e["host"], non_blocking=self.capture)
        if self.capture:
            e["graph"].replay()
            return e["out"]
        return e["forward"]()


class TorchExecutor:
    """Executes the plans of one policy's run on one device (the engine's ``Executor``).

    State: the model (shared across policies), this policy's KV pool, and each running sequence's token
    ids (seeded random prompt ids, then the greedy tokens generated). When ``output_tokens`` is given, a
    sequence that samples its last output token keeps only its generated tokens (``outputs``, int32),
    so a long trace does not hold every prompt."""

    def __init__(self, model: LlamaModel, cache: KvCache, prompt_tokens: Mapping[int, int] | Sequence[int],
                 *, paged: bool, attention: str, seed: int = 0,
                 output_tokens: Mapping[int, int] | Sequence[int] | None = None, prefix_hashes=None,
                 decode_graphs: bool | None = None) -> None:
        self.model = model
        self.cache = cache
        self.paged = paged
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.attention = attention
        self.seed = seed
        self.device = model.device
        self.prefix_hashes = prefix_hashes  # content ids of the prompts (traces' hash ids), when known
        self.tokens: dict[int, list[int]] = {}
        self.outputs: dict[int, np.ndarray] = {}  # finished sequences: their generated tokens
        self.origin: dict[int, int] = {}  # a forked sample's or beam's id -> its request's id
        self.num_steps = 0
        # (kind "graph" | "eager", sequences, new tokens, host prep s, host enqueue s, GPU s or None)
        self.step_log: list[tuple[str, int, int, float, float, float | None]] = []
        # decode steps as CUDA graphs: by default on a GPU with the Triton kernels; True elsewhere runs the
        # same padded step eagerly (the tests' check of the padding)
        if decode_graphs is None:
            decode_graphs = self.device.type == "cuda" and attention == "triton"
        if not paged and cache.groups.num_groups > 1:
            raise ValueError("several KV groups need a paged pool (each group has its own block tables)")
        if decode_graphs and attention != "triton":
            raise ValueError("decode graphs need the triton attention backend (store_kv skips padded slots)")
        self.graphs = DecodeGraphs(model, cache, paged, capture=self.device.type == "cuda") if decode_graphs else None
        self.graph_info: dict | None = None  # the graphs' info(), kept when release() drops them
        self.kv = None  # the engine's KV manager (bind_kv): the hybrid allocator's per-group tables

    def bind_kv(self, kv) -> None:
        """The engine's KV manager, whose per-group block tables (``sim.hybrid.HybridPagedKv``) the steps use."""
        self.kv = kv

    # ------------------------------------------------------------------------------------ tokens

    def request_of(self, seq_id: int) -> int:
        return self.origin.get(seq_id, seq_id)

    def prompt_ids(self, seq_id: int) -> list[int]:
        """The prompt's token ids, the same for every policy: random, seeded by (seed, request), except
        where the trace names the content (prefix hash ids): there a token follows from its segment's id
        and offset, so equal prefixes are equal tokens and a prefix-cache hit reuses the right K/V."""
        r = self.request_of(seq_id)
        n = int(self.prompt_tokens[r])
        vocab = self.model.shape.vocab_size
        ids = np.random.default_rng((self.seed, r)).integers(0, vocab, n)
        if self.prefix_hashes is not None:
            h, H = self.prefix_hashes.of(r).astype(np.int64), self.prefix_hashes.block_size
            named = min(n, len(h) * H)
            pos = np.arange(named)
            ids[:named] = (h[pos // H] * 1_000_003 + (pos % H) * 7919 + self.seed) % vocab
        return ids.tolist()

    def token_ids(self, seq_id: int) -> list[int]:
        if seq_id not in self.tokens:
            self.tokens[seq_id] = self.prompt_ids(seq_id)
        return self.tokens[seq_id]

    def generated(self, seq_id: int) -> list[int]:
        """The tokens generated so far for ``seq_id``."""
        if seq_id in self.outputs:
            return self.outputs[seq_id].tolist()
        return self.token_ids(seq_id)[int(self.prompt_tokens[self.request_of(seq_id)]):]

    # ------------------------------------------------------------------------------------ inputs

    def group_tables(self, plan: StepPlan) -> list | None:
        """Per KV group, each of the plan's sequences' block tables (None: slabs). Several groups (the
        hybrid allocator): the tables recorded with the plan (``extra["group_tables"]``, an open-loop
        replay) or the bound manager's now; one group: the plan's own."""
        if not plan.paged:
            return None
        tables = plan.extra.get("group_tables")
        if tables is None and hasattr(self.kv, "group_tables"):
            tables = self.kv.group_tables(plan.seq_ids)
        if tables is None:
            tables = [plan.block_tables]
        if len(tables) != self.cache.groups.num_groups:
            raise ValueError(f"the plan has block tables for {len(tables)} KV groups, the pool "
                             f"{self.cache.groups.num_groups}")
        return tables

    def host_inputs(self, plan: StepPlan) -> dict:
        """The step's inputs as host lists (all index arithmetic here, none on the device)."""
        B = plan.block_size
        tables = self.group_tables(plan)
        paged = tables is not None
        ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(len(tables) if paged else 1)]
        dec: list[tuple[int, int, int]] = []  # (entry, row, seq_len)
        pre: list[tuple[int, int, int, int]] = []  # (entry, first row, n, seq_len)
        sample_rows: list[int] = []
        sample_seq_ids: list[int] = []
        row = 0
        for i, (seq_id, n, c) in enumerate(zip(plan.seq_ids, plan.num_new_tokens, plan.num_computed_tokens)):
            toks = self.token_ids(seq_id)
            if c + n > len(toks):
                raise RuntimeError(f"plan asks sequence {seq_id} for tokens {c}..{c + n} but it knows {len(toks)}")
            ids.extend(toks[c:c + n])
            if n == 1:  # plain ints: a decode batch of hundreds costs microseconds, not numpy calls
                positions.append(c)
                if paged:
                    for group, t in zip(slots, tables):
                        group.append(t[i][c // B] * B + c % B)
                else:
                    slots[0].append(plan.slab_starts[i] + c)
                dec.append((i, row, c + 1))
            else:
                pos = np.arange(c, c + n, dtype=np.int64)
                positions.extend(pos.tolist())
                if paged:
                    for group, t in zip(slots, tables):
                        group.extend(token_slots(pos, B, t[i]).tolist())
                else:
                    slots[0].extend(token_slots(pos, B, None, plan.slab_starts[i]).tolist())
                pre.append((i, row, n, c + n))
            if c + n == len(toks):
                sample_rows.append(row + n - 1)
                sample_seq_ids.append(seq_id)
            row += n
        return {"ids": ids, "positions": positions, "slots": slots, "dec": dec, "pre": pre,
                "sample_rows": sample_rows, "sample_seq_ids": sample_seq_ids, "tables": tables}

    def stage(self, h: dict, plan: StepPlan) -> StepInputs:
        """The host inputs as host tensors (pinned on a GPU), ready for ``upload``: all of a step's host
        work, so that the timed part of an eager step is its copies and launches."""
        dev = self.device
        i64, i32 = torch.int64, torch.int32

        def layouts(entries: list) -> list[Layout]:
            """Per KV group, the entries' block tables (one array, one copy), or their slab starts."""
            if h["tables"] is None:
                return [Layout(None, _int_tensor([plan.slab_starts[e[0]] for e in entries], i64, dev))]
            groups = [[t[e[0]] for e in entries] for t in h["tables"]]
            arr = np.zeros((len(groups), len(entries), max(len(t) for g in groups for t in g)), dtype=np.int32)
            for k, g in enumerate(groups):
                for j, t in enumerate(g):
                    arr[k, j, :len(t)] = t
            staged = _staged(torch.from_numpy(arr), dev)
            return [Layout(staged[k], None) for k in range(len(groups))]

        dec, pre = h["dec"], h["pre"]
        decode = prefill = None
        if dec:
            lens = [e[2] for e in dec]
            decode = DecodeBatch(_int_tensor([e[1] for e in dec], i32, dev), _int_tensor(lens, i32, dev), max(lens),
                                 layouts(dec))
        if pre:
            prefill = PrefillBatch(_int_tensor([e[1] for e in pre], i32, dev), _int_tensor([e[2] for e in pre], i32, dev),
                                   _int_tensor([e[3] for e in pre], i32, dev), max(e[2] for e in pre), layouts(pre),
                                   max(e[3] for e in pre))
        return StepInputs(_int_tensor(h["ids"], i64, dev), _int_tensor(h["positions"], i64, dev),
                          _int_tensor(h["slots"], i64, dev), decode, prefill,
                          _int_tensor(h["sample_rows"], i64, dev), h["sample_seq_ids"])

    def prepare(self, plan: StepPlan) -> StepInputs:
        """Turn the plan into device tensors (all index arithmetic on the host, one copy each)."""
        return upload(self.stage(self.host_inputs(plan), plan), self.device)

    # ------------------------------------------------------------------------------------ run

    def _begin(self, plan: StepPlan) -> tuple[dict, tuple[int, int] | None]:
        """Host work before the device's: the inputs, and the decode graph's bucket (captured if new) with
        its pinned buffer filled, or the eager step's inputs staged in pinned memory. None of it is inside
        a step's timing: filling a graph's block tables row by row took about 13 us per sequence, and
        inside the events it read on an H200 as paged decode steps 1.9x slower than contiguous ones at
        256 sequences (reports/device_check_run1.json)."""
        h = self.host_inputs(plan)
        key = self.graphs.prepare(plan) if self.graphs is not None else None
        if key is not None:
            self.graphs.fill(key, h["ids"], h["positions"], h["slots"], [e[2] for e in h["dec"]], h["tables"], plan)
        else:
            h["staged"] = self.stage(h, plan)
        return h, key

    def _launch(self, plan: StepPlan, h: dict, key: tuple[int, int] | None) -> Launched:
        """Enqueue the step: swaps, copies, then the graph (decode) or the eager forward."""
        self.cache.swap_out(plan.swap_out)
        self.cache.swap_in(plan.swap_in)
        self.cache.copy_blocks(plan.copy_blocks, use_kernel=self.attention == "triton")
        self.cache.copy_slots(plan.copy_slots)
        if key is not None:
            return Launched(h["sample_seq_ids"], self.graphs.replay(key), rows=h["sample_rows"], graph=key)
        x = upload(h["staged"], self.device)
        logits = self.model.forward(x.input_ids, x.positions,
                                    PoolAttention(x, self.cache, self.attention, self.model.shape.layer_windows),
                                    x.sample_rows)
        return Launched(x.sample_seq_ids, logits.argmax(dim=-1))

    def _finish(self, launched: Launched) -> list[int]:
        """Wait for the next tokens and append them to their sequences."""
        vals = launched.next_ids.tolist()
        next_ids = vals if launched.rows is None else [vals[r] for r in launched.rows]
        for seq_id, t in zip(launched.sample_seq_ids, next_ids):
            toks = self.tokens[seq_id]
            toks.append(t)
            r = self.request_of(seq_id)
            prompt = int(self.prompt_tokens[r])
            if self.output_tokens is not None and len(toks) - prompt == self.output_tokens[r]:
                self.outputs[seq_id] = np.asarray(toks[prompt:], dtype=np.int32)
                del self.tokens[seq_id]
        self.num_steps += 1
        return next_ids

    def run(self, plan: StepPlan) -> list[int]:
        """Swap, copy, fork, prepare, forward, sample; the sampled tokens are appended to their sequences."""
        self.take_forks(plan)
        h, key = self._begin(plan)
        return self._finish(self._launch(plan, h, key))

    def take_forks(self, plan: StepPlan) -> None:
        """Samples and beams take their source's history (as it was before this step's moves); once a plan."""
        if not plan.forks or plan.extra.get("forks_taken"):
            return
        before = {src: list(self.token_ids(src)) for src, _ in plan.forks}
        for src, dst in plan.forks:
            self.tokens[dst] = list(before[src])
            self.origin[dst] = self.request_of(src)
        plan.extra["forks_taken"] = True

    def step_time_s(self, plan: StepPlan) -> float:
        """The step's measured seconds: on a GPU the CUDA-event time of its device work (swaps, copies,
        the inputs' copy, the forward), with the host's input preparation before it and the sync after
        it outside; on the CPU the wall time of all of it. Each step's figures go to ``step_log``."""
        self.take_forks(plan)
        for seq_id in plan.seq_ids:  # a prompt's ids are the trace's input, not part of the step
            self.token_ids(seq_id)
        t0 = time.perf_counter()
        h, key = self._begin(plan)
        prep = time.perf_counter() - t0
        launched, host, gpu = host_and_device_s(self.device, lambda: self._launch(plan, h, key))
        t1 = time.perf_counter()
        self._finish(launched)
        fin = time.perf_counter() - t1
        self.step_log.append(("graph" if key is not None else "eager", plan.num_seqs,
                              int(sum(plan.num_new_tokens)), prep, host, gpu))
        return gpu if gpu is not None else prep + host + fin

    def decode_span_s(self, plan: StepPlan, k: int) -> None:
        return None  # measured one step at a time

    def warmup(self, max_num_batched_tokens: int = 0) -> None:
        """Compile and run every kernel variant a replay can use (prefill, decode, split-K decode, mixed)
        on scratch sequences, and the largest prefill the policy can schedule (its activations then
        come from the allocator's cache), so that no measured step pays for either. Leaves no token state."""
        max_len = self.model.shape.max_model_len
        slots = self.cache.num_slots // (self.cache.groups.num_groups if self.paged else 1)  # per KV group
        # longer than one split-K partition where the pool and the model allow
        long_ctx = min(slots // 2, max_len - 2, 1100)
        steps = [((0, 1), (40, 24), (0, 0)),  # prefill
                 ((0, 1), (1, 1), (40, 24)),  # decode
                 ((2,), (long_ctx,), (0,)),  # long prefill
                 ((2, 3), (1, 9), (long_ctx, 0))]  # mixed: a long decode and a prefill
        prompts = {0: 40, 1: 24, 2: long_ctx, 3: 9}
        biggest = min(max_num_batched_tokens, slots - self.cache.block_size * (1 + slots // max_len))
        if biggest > 64:
            news = [max_len - 1] * (biggest // (max_len - 1)) + ([biggest % (max_len - 1)] if biggest % (max_len - 1) else [])
            ids = tuple(range(10, 10 + len(news)))
            steps.append((ids, tuple(news), (0,) * len(news)))
            prompts.update(zip(ids, news))
        saved = self.tokens, self.prompt_tokens, self.output_tokens, self.outputs
        self.tokens, self.prompt_tokens, self.output_tokens, self.outputs = {}, prompts, None, {}  # scratch sequences
        try:
            for seq_ids, news, cached in steps:
                plan = scratch_plan(seq_ids, news, cached, self.cache.block_size, self.paged,
                                    num_groups=self.cache.groups.num_groups)
                if plan.extra["num_slots"] <= self.cache.num_slots:
                    self.run(plan)
            synchronize(self.device)
        finally:
            self.tokens, self.prompt_tokens, self.output_tokens, self.outputs = saved

    def release(self) -> None:
        """Drop the KV pool and the graphs over it (the next policy's pool takes its memory); token state
        stays readable."""
        self.graph_info = self.graphs.info() if self.graphs is not None else None
        self.cache = None
        self.graphs = None


HOST_BOUND = 0.9  # a step is host-bound when enqueueing it took at least this share of its GPU time


def step_log_summary(log: list[tuple]) -> dict:
    """Per kind of step (``graph``: a captured decode step; ``eager``): steps, median and total host
    preparation, host enqueue and GPU seconds, and how many were host-bound (the GPU waited for the
    host's launches: enqueue time >= 90 % of the GPU time). GPU figures are None on the CPU."""
    out = {}
    for kind in sorted({r[0] for r in log}):
        rows = [r for r in log if r[0] == kind]
        prep = [r[3] for r in rows]
        host = [r[4] for r in rows]
        gpu = [r[5] for r in rows if r[5] is not None]
        bound = [r[4] >= HOST_BOUND * r[5] for r in rows if r[5] is not None]
        out[kind] = {"num_steps": len(rows), "median_prep_s": float(np.median(prep)), "total_prep_s": float(sum(prep)),
                     "median_host_s": float(np.median(host)), "total_host_s": float(sum(host)),
                     "median_gpu_s": float(np.median(gpu)) if gpu else None,
                     "total_gpu_s": float(sum(gpu)) if gpu else None,
                     "num_host_bound": int(sum(bound)) if gpu else None,
                     "host_bound_fraction": float(np.mean(bound)) if gpu else None}
    return out


def scratch_plan(seq_ids, news, cached, block_size: int, paged: bool, first_block: int = 0,
                 block_order: np.ndarray | None = None, num_groups: int = 1) -> StepPlan:
    """A plan over sequences laid out one after another from block ``first_block`` (whole blocks each):
    block tables (paged, through ``block_order`` when given, e.g. a permutation) or slab starts.
    Several KV groups (paged): each group its own copy of the layout, one after another
    (``extra["group_tables"]``). ``extra["num_slots"]`` is the pool size it needs."""
    nblocks = [-(-(c + n) // block_size) for n, c in zip(news, cached)]
    first = first_block + np.cumsum([0] + nblocks[:-1])
    tables = []
    for f, nb in zip(first, nblocks):
        ids = np.arange(f, f + nb)
        tables.append((block_order[ids] if block_order is not None else ids).tolist())
    span = first_block + sum(nblocks)
    extra = {"num_slots": span * block_size}
    if paged and num_groups > 1:
        extra["group_tables"] = [[[b + g * span for b in t] for t in tables] for g in range(num_groups)]
        extra["num_slots"] *= num_groups
    return StepPlan.from_entries(tuple(seq_ids), tuple(news), tuple(cached), len(seq_ids), block_size,
                    block_tables=tuple(tables) if paged else None,
                    slab_starts=None if paged else tuple(int(f) * block_size for f in first),
                    extra=extra)


class ReplayExecutors:
    """The ``ExecutorFactory`` of a replay: ``sim.run.run(scenario, executor=ReplayExecutors("cuda"))``.

    Builds the model once (the same seeded weights for every policy) and one KV pool per policy, sized by
    the simulator's ``KvPool``; the previous policy's pool is released first, so two never coexist.
    ``executors`` keeps each policy's executor (its pool dropped) for its generated tokens."""

    def __init__(self, device: str = "cpu", *, dtype: torch.dtype | None = None, attention: str | None = None,
                 seed: int = 0, warmup: bool = True) -> None:
        self.device = resolve_device(device)
        self.dtype = dtype or default_dtype(self.device)
        self.attention = attention or default_attention(self.device)
        if self.attention == "triton" and self.device.type == "cpu" and not interpreting():
            raise ScenarioError("--attention triton on the CPU needs Triton's interpreter (TRITON_INTERPRET=1 set "
                                "before the command; far too slow to time a replay): use --attention torch, the "
                                "CPU's default")
        self.seed = seed
        self.warmup = warmup
        self.model: LlamaModel | None = None
        self.executors: dict[str, TorchExecutor] = {}
        self._current: TorchExecutor | None = None

    def model_for(self, spec: ModelSpec) -> LlamaModel:
        shape = ModelShape.from_spec(spec)
        if self.model is None or self.model.shape != shape:
            self.model = None
            self.model = LlamaModel.random(shape, self.device, self.dtype, self.seed)
        return self.model

    @staticmethod
    def check_scenario(scenario: Scenario) -> None:
        """What the replay refuses of a whole scenario, before anything is simulated or allocated (the replay
        and the open loop call it first: a fleet was refused only after the simulation had run)."""
        if scenario.tensor_parallel != 1:
            raise ScenarioError(f"{scenario.name}: the replay runs on one device (tensor_parallel: 1), "
                                f"not {scenario.tensor_parallel}")
        fleet = scenario.cluster
        if fleet is not None and (fleet.disaggregated or sum(g.count for g in fleet.groups) > 1):
            # (replicas interleave their steps, and one KV pool is held at a time: an AttributeError mid-run)
            raise ScenarioError(f"{scenario.name}: cluster (a fleet of replicas) is simulator-only: the replay runs "
                                f"one server on one device; drop cluster to replay the server alone")
        for policy in scenario.policies:  # (checked here, not per policy as it ran: sim validate calibrated first)
            if policy.kv_offload is not None:
                raise ScenarioError(f"{scenario.name}: policy {policy.name}: kv_offload (the prefix cache's CPU tier) "
                                    "is simulator-only; the replay would read blocks it never loaded")
            if policy.kv_cache_dtype != "auto":
                raise ScenarioError(f"{scenario.name}: policy {policy.name}: kv_cache_dtype: {policy.kv_cache_dtype} "
                                    "is simulator-only: the kernels read keys and values in the model's dtype, so the "
                                    "replay's pool would hold twice the bytes the simulator sized (use kv_cache_dtype: "
                                    "auto)")

    @staticmethod
    def kv_groups(scenario: Scenario, policy: ResolvedPolicy, shape: ModelShape) -> KvGroups | None:
        """The pool's KV groups: the hybrid allocator's (paged, ``sim/hybrid.py``), else None (one group)."""
        layout = policy.layout
        if layout is None or layout.single:
            return None
        where = f"{scenario.name}: policy {policy.name}"
        if not policy.paged:
            raise ScenarioError(f"{where}: the replay runs several KV groups (hybrid_allocator: true) on a paged "
                                "allocator only; a contiguous slab's window groups are ring buffers the kernels do "
                                "not address (use a paged allocator or hybrid_allocator: false)")
        if policy.policy.preemption == "swap":
            raise ScenarioError(f"{where}: preemption: swap with several KV groups (hybrid_allocator: true) is "
                                "simulator-only: a window group swapped back in is re-placed from its current "
                                "window, which the copies out do not line up with (use preemption: recompute)")
        return KvGroups.of_layout(shape.layer_windows, shape.num_layers, layout)

    def __call__(self, scenario: Scenario, model: ModelSpec, gpu: GpuSpec, policy: ResolvedPolicy,
                 requests: RequestTable) -> TorchExecutor:
        pool = policy.pool
        self.check_scenario(scenario)
        if self._current is not None:
            self._current.release()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        llama = self.model_for(model)
        groups = self.kv_groups(scenario, policy, llama.shape)
        try:
            cache = KvCache(llama.shape, pool, self.device, self.dtype, groups)
        except torch.cuda.OutOfMemoryError:
            raise ScenarioError(f"{scenario.name}: the KV pool of {pool.num_slots:,} tokens does not fit on "
                                f"{self.device}: lower gpu_memory_utilization") from None
        ex = TorchExecutor(llama, cache, requests.prompt_tokens, paged=policy.paged,
                           attention=self.attention, seed=self.seed, output_tokens=requests.output_tokens,
                           prefix_hashes=requests.prefix_hashes)
        if self.warmup:  # the largest prefill matters where an allocator caches device memory
            ex.warmup(policy.max_num_batched_tokens if self.device.type == "cuda" else 0)
        self._current = self.executors[policy.name] = ex
        return ex
