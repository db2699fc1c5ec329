"""KV managers for models of several layer groups (``sim/layouts.py``): sliding-window, chunked-local and
Mamba layers beside full attention. Single-group models keep ``kv.PagedKv`` / ``kv.ContiguousKv``.

Units. One *slot* is one token of one group's page (``KvLayout.slot_bytes``); the pool has
``num_blocks * block_size`` of them and the five memory classes add up to it exactly, as for the classic
managers. A sequence of ``c`` cached tokens fills ``c - first_g * block_size`` slots in each attention
group ``g`` (blocks before ``first_g`` were freed) and its Mamba state's pages whole (state counts as token
states). The scheduler counts ``c`` once per sequence and multiplies by ``fill_rate`` (the attention groups);
``shared_filled`` is the correction (the hook prefix sharing uses): the freed window blocks' slots minus
the Mamba states'. The contiguous manager computes it from its live sequences' sorted contexts, and for a
decode span in closed form (``span_shared_filled``).

Window slack: a window group's blocks between the window's start and its first kept block's start hold
tokens no query reads any more (at most one block per group and sequence); they stay token states until
the block is freed at the sequence's next block crossing. Group padding (a group with fewer layers than
``group_size``) is invisible in slots and shows in the capacity.

``HybridPagedKv``: per-group block tables from one pool of equal-sized pages (vLLM's rule). Blocks that
leave a window or local chunk are freed when the sequence next takes a block (the same moment on the
scheduler's fast decode path and its general path, so exact and fast stepping agree). Mamba state: a
fixed number of pages per sequence, taken at admission. Prefix caching (``caching``, on a
``sharing.SharedBlockPool``): each group's page of a full prompt block is cached under the block's hash;
a hit follows each group's rule (``match_prefix``) and freed pages stay findable until evicted.

``HybridContiguousKv``: one slab per request covering every group: full groups reserve the policy's
length, window groups ``min(length, W)`` (a ring buffer), chunked groups ``min(length, C)``, Mamba groups
their state.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import numpy as np

from sim.buffers import append, vec
from sim.core import Sequence
from sim.kv import (SLOT_EXTERNAL, SLOT_FREE, SLOT_INTERNAL, SLOT_RESERVED, SLOT_TOKEN, ContiguousKv,
                    FifoBlockPool, _merge_runs, blocks_for)
from sim.layouts import KvLayout, first_kept, window_runs
from sim.outputs import Columns
from sim.sharing import SharedBlockPool, extend_block_hashes, prompt_block_hashes


class _CrossingPool:
    """What the scheduler's decode fast path and span limit ask of ``kv.pool``, in block crossings: a
    crossing sequence takes at most one page per attention group (conservative: a window group at its
    steady state frees one as it takes one). When this says no, the scheduler's general path asks
    ``can_grow`` per sequence, which is exact.

    NOTE: a decode span assumes free memory only shrinks, so that a request kept out for memory stays
    out; window groups free pages at block crossings. So while the last admission asked was refused,
    ``num_free`` is 0: the span ends before the next crossing, where admission is asked again."""

    def __init__(self, pool: Any, per: int, kv: "HybridPagedKv") -> None:  # (the manager's ``blocks``)
        self._pool, self._per, self._kv = pool, per, kv
        self.block_size = pool.block_size

    def can_allocate(self, n: int, admission: bool = False) -> bool:
        return self._pool.can_allocate(n * self._per, admission)

    @property
    def num_free(self) -> int:
        return 0 if self._kv.refused else self._pool.num_free // self._per

    @property
    def num_evicted(self) -> int:
        return self._pool.num_evicted  # prefix caching's evictions (a sharing.SharedBlockPool)


class _Pages:
    """What ``HybridPagedKv`` keeps of one live sequence: ``end``, the token blocks it has pages for;
    ``firsts``, per class, its first kept block (those before left a window); ``tables``, per class, the pages
    of blocks ``firsts[i] .. end - 1``, a row of one page per group of the class per block; ``state``, its
    Mamba state's pages. (A class, not a list: the compiled build reads and writes its fields unboxed, at
    every block crossing of every decoding sequence.)"""

    def __init__(self, end: int, firsts: list[int], tables: list[list[int]], state: list[int]) -> None:
        self.end = end
        self.firsts = firsts
        self.tables = tables
        self.state = state


class HybridPagedKv:
    kind = "paged"
    copies: tuple = ()
    loads: tuple = ()  # blocks loaded from a CPU tier for the planned step (no CPU tier with several groups)
    slides = True  # window and chunked groups free pages at crossings, inside decode spans too
    num_copies = 0  # no copy-on-write: only full prompt blocks are shared, and no sequence writes into one
    span_shared_filled = None  # (slabs only: HybridContiguousKv's)

    def __init__(self, layout: KvLayout, pool: FifoBlockPool | SharedBlockPool, caching: bool = False,
                 prefill_cap: int | None = None) -> None:
        """``prefill_cap``: the most tokens one step prefills for a sequence (a chunked policy's token
        budget; None: its whole prompt at once): ``never_fits`` needs it."""
        self.layout = layout
        self.blocks: Any = pool  # (either kind: their own bookkeeping, as ``kv.PagedKv.pool``)
        self._prefill_cap = prefill_cap
        self.block_size: int = pool.block_size  # typed: the pool is not (compiled code then adds ints as ints)
        B = self.block_size
        self.capacity: int = pool.num_blocks * B
        classes: dict[tuple[str, int], int] = {}  # groups of one kind and window move alike: one table each
        for g in layout.groups:
            if g.attention:
                classes[(g.kind, g.window)] = classes.get((g.kind, g.window), 0) + 1
        # (a group of the class, groups in it): a table row holds one page of each of the class's groups
        self.classes = [(next(g for g in layout.groups if (g.kind, g.window) == key), n) for key, n in classes.items()]
        self.state_pages = sum(g.state_pages for g in layout.groups if not g.attention)
        self.fill_rate = sum(classes.values())  # attention groups
        self._spec = [(i, g.kind == "sliding", g.window, n) for i, (g, n) in enumerate(self.classes)]  # span_blocks' view
        self._sizes = [(i, n) for i, (_, n) in enumerate(self.classes)]
        self._window_min = min([g.window for g, _ in self.classes if g.window] or [1 << 62])  # no page leaves below
        self._class_groups = [n for _, n in self.classes]
        self.pool = _CrossingPool(pool, max(1, self.fill_rate), self)
        self.refused = False  # the last admission asked (can_admit) was refused for memory
        self.alloc = 0
        self.capped = 0
        self.rounding = 0
        self.held = 0
        self._st: dict[Sequence, _Pages] = {}  # each live sequence's pages
        self._first_sum = 0  # over live sequences and attention groups: first kept block
        self._states = 0  # live sequences holding a Mamba state
        self._pages = [0] * len(self.classes)  # pages each class's tables hold, a shared page once per holder
        # prefix caching (``pool`` a sharing.SharedBlockPool): see "Prefix caching" below
        self.caching = caching
        self._extra = [0] * len(self.classes)  # per class: references beyond a page's first holder
        self.shared_blocks = 0  # their sum (the pages sharing saves)
        self._hit_order = sorted(range(len(self.classes)), key=lambda k: self.classes[k][0].window > 0)  # full first
        if caching:
            assert isinstance(pool, SharedBlockPool) and not self.state_pages, "prefix caching: attention groups only"
        else:  # the decode fast path takes a span's pages in one call: right only for a FIFO (span_blocks)
            assert isinstance(pool, FifoBlockPool), "a hybrid manager's pool is a FifoBlockPool"

    # ------------------------------------------------------------------ the rule

    def _change(self, seq: Sequence, num_new: int, c: int | None = None) -> tuple[int, list[int], int, int] | None:
        """(new end, new firsts, pages to take, pages to free) if ``seq``, ``c`` tokens cached (default: as
        it says), writes ``num_new`` more; None if it needs no page."""
        st = self._st.get(seq)
        if c is None:
            c = seq.num_computed_tokens
        B = self.block_size
        end = -(-(c + num_new) // B)  # (kv.blocks_for, in ints: it takes numpy arrays too, so it is untyped)
        if st is None:
            if not c:  # a new request with no hit: every block of every group (the common admission)
                return end, [0] * len(self.classes), self.fill_rate * end + self.state_pages, 0
            firsts = [first_kept(g, c, B) for g, _ in self.classes]
            take = self.state_pages
            for f, (_, n) in zip(firsts, self.classes):
                take += n * (end - f)
            return end, firsts, take, 0
        end0 = st.end
        if end <= end0:
            return None
        firsts, take, freed = [], 0, 0
        for (g, n), f0 in zip(self.classes, st.firsts):
            f = first_kept(g, c, B) if g.window else 0
            if f < f0:
                f = f0
            firsts.append(f)
            freed += n * ((f if f < end0 else end0) - f0)
            take += n * (end - (f if f > end0 else end0))
        return end, firsts, take, freed

    def never_fits(self, prompt_tokens: np.ndarray, output_tokens: np.ndarray, width: int = 1) -> np.ndarray:
        """Per request: an upper bound of the pages it can ever hold exceeds the pool above the watermark,
        so that a request admitted alone always fits, after a preemption too. A full group holds the blocks
        of up to total - 1 tokens (the last token's KV is never written). A step that writes ``n`` tokens
        from ``c`` keeps, in a window (or local chunk) group of ``W``, the blocks from the one holding
        c + 1 - W (the chunk's start) to the one holding c + n - 1: at most (n + W - 2) // B + 2. ``n`` is
        1 for a decode and, for a prefill, up to total - 1: after a recompute preemption the prompt and the
        tokens generated so far -- capped by a chunked policy's token budget. (Under swap preemption too: a
        full swap space falls back to recompute. Sized for the prompt alone, a request admitted under swap
        could never be readmitted after such a fallback, and the scheduler stalled.)"""
        B = self.block_size
        n = last = np.asarray(prompt_tokens) + np.asarray(output_tokens) - 1
        total = blocks_for(last, B)
        if self._prefill_cap is not None:
            n = np.minimum(n, self._prefill_cap)
        need = self.state_pages + sum(k * (total if not g.window else np.minimum(total, (n + g.window - 2) // B + 2))
                                      for g, k in self.classes)
        return need > self.blocks.num_blocks - self.blocks.watermark_blocks

    def can_admit(self, seq: Sequence, num_new: int, hits=()) -> bool:
        if hits:  # the hit's pages are there (those in the free queue leave it): the rest are new
            ch = self._change(seq, num_new, len(hits) * self.block_size)
            assert ch is not None  # (a sequence taking a hit holds no pages yet)
            hit = self._hit_pages(hits)
            need = ch[2] - hit
            pool = self.blocks
            if pool.can_allocate(need, admission=True) and not pool.can_allocate(need + hit, admission=True):
                held = pool.held  # (counted only when it decides)
                need += sum(1 for row in hits for pages in row if pages is not None for b in pages if not held[b])
        else:
            ch = self._change(seq, num_new)
            need = 0 if ch is None else ch[2] - self._freeable(seq, ch)
        ok = self.blocks.can_allocate(need, admission=True)
        self.refused = not ok
        return ok

    def can_grow(self, seq: Sequence, num_new: int) -> bool:
        ch = self._change(seq, num_new)
        return ch is None or self.blocks.can_allocate(ch[2] - self._freeable(seq, ch))

    def _freeable(self, seq: Sequence, ch: tuple[int, list[int], int, int]) -> int:
        """Pages the change ``ch`` frees (it gives back ``ch[3]``; with prefix caching, one that another
        sequence holds too stays held)."""
        if not self.caching or not ch[3]:
            return ch[3]
        multi, st = self.blocks.multi, self._st[seq]  # (held by this sequence: by it alone unless in multi)
        return sum(1 for (_, n), f, f0, table in zip(self.classes, ch[1], st.firsts, st.tables) if f > f0
                   for b in table[:n * (min(f, st.end) - f0)] if b not in multi)

    def admit(self, seq: Sequence, num_new: int, hits=()) -> None:
        if hits:
            self._take_hit(seq, hits)
        self.grow(seq, num_new)

    def grow(self, seq: Sequence, num_new: int, c: int | None = None) -> None:
        ch = self._change(seq, num_new, c)
        if ch is None:
            return
        end, firsts, take, freed = ch
        B, cap, blocks = self.block_size, seq.max_kv_tokens, self.blocks
        st = self._st.get(seq)
        if st is None:  # the state's pages, then each class's, in one call (the same pages as one by one)
            new = blocks.allocate(take)
            p = self.state_pages
            tables, pages, top, capped, first_sum = [], self._pages, min(end * B, cap), p * B, 0
            for i, (_, n) in enumerate(self.classes):
                f = firsts[i]
                m = n * (end - f)
                tables.append(new[p:p + m])
                p += m
                pages[i] += m
                capped += n * (top - min(f * B, cap))
                first_sum += n * f
            self._st[seq] = _Pages(end, firsts, tables, new[:self.state_pages])
            self._states += 1
            self.capped += capped
            self._first_sum += first_sum
            self.alloc += take * B  # the state's pages included
            return
        end0, firsts0, tables = st.end, st.firsts, st.tables
        pages = self._pages
        # NOTE: every class frees before any takes: a chunked group may free more pages at a chunk's start
        # than the others take, and can_grow counted them free (where the pool has the pages anyway, the
        # same pages are taken either way: frees join the free queue's tail, pages are taken from its head)
        for i, ((g, n), f, f0, table) in enumerate(zip(self.classes, firsts, firsts0, tables)):
            if f > f0:  # blocks that left the window: freed
                drop = n * (f - f0)
                self._drop(i, table[:drop])
                del table[:drop]
                self.capped -= n * (min(f * B, cap) - min(f0 * B, cap))
                self._first_sum += drop
                pages[i] -= drop
        for i, ((g, n), f, table) in enumerate(zip(self.classes, firsts, tables)):
            start = f if f > end0 else end0
            table.extend(blocks.allocate(n * (end - start)))
            pages[i] += n * (end - start)
            self.capped += n * (min(end * B, cap) - min(start * B, cap))
        self.alloc += (take - freed) * B
        st.end, st.firsts = end, firsts

    def add_blocks(self, seqs: list[Sequence]) -> None:
        """The scheduler's decode fast path: each of ``seqs`` crosses into a new block (``span_blocks``)."""
        self.span_blocks([seqs])

    def span_blocks(self, ticks: list[list[Sequence]], alloc_out: list[int] | None = None,
                    capped_out: list[int] | None = None, filled: list[int] | None = None, filled0: int = 0,
                    shared_out: list[int] | None = None) -> None:
        """Each tick's crossing sequences, tick after tick (a decode span's ticks, or one tick of the fast
        path): each crosses into a new block. Within a decode span the sequences' counters have not advanced
        yet: a crossing sequence has exactly its blocks' tokens cached, which is what is used (``grow(seq, 1,
        end * B)``, unrolled: the hot path of decoding). After tick j (from 1) it appends ``alloc`` and
        ``capped`` to ``alloc_out`` and ``capped_out``, takes from ``filled[j]`` the growth of
        ``shared_filled`` since ``filled0`` (the slots of pages that left a window), and appends
        ``shared_blocks`` to ``shared_out`` (each where given: ``DecodeClock.place_span_blocks``).

        NOTE: the pages of all the ticks are taken in one call. The caller has checked that the pool holds a
        page per attention group and crossing (``pool.can_allocate``, ``DecodeClock.span``) without the
        pages freed meanwhile, so the pages taken one group and tick at a time would be the same ones:
        those at the head of the free queue, which the window pages freed meanwhile (appended at its tail)
        never reach. The frees follow in the same order as one at a time (with prefix caching, one call per
        table, as ``grow`` frees: a call frees its pages tail first).
        NOTE: pages are moved as objects (``list[Any]``): read from a ``list[int]``, the compiled build
        unboxes an id and boxes it again into a new int object per page (and a slice per table cost an
        allocation, a copy and a free); the figures after each tick go straight to the caller's lists."""
        B, blocks, spec, st_of, caching = self.block_size, self.blocks, self._spec, self._st, self.caching
        per = self.fill_rate
        m = 0
        for seqs in ticks:
            m += len(seqs)
        new: list[Any] = blocks.allocate(per * m)
        alloc, capped, first_sum, shared = self.alloc, self.capped, self._first_sum, self.shared_blocks
        dropped: list[int] = []
        p, pages, extra = 0, self._pages, self._extra
        base = self._states * self.state_pages
        multi: Any = blocks.multi if caching else None
        grown, wmin, sizes = per * B, self._window_min, self._sizes
        j = 0
        for seqs in ticks:
            alloc += grown * len(seqs)
            for seq in seqs:
                st = st_of[seq]
                end0 = st.end
                st.end = end0 + 1
                c = end0 * B
                tables = st.tables
                x = seq.max_kv_tokens - c  # capped grows by the new blocks' slots the request will fill
                capped += grown if x >= B else per * x if x > 0 else 0
                if c < wmin:  # no window is full yet: nothing leaves (layouts.first_kept is 0)
                    for i, n in sizes:
                        row: list[Any] = tables[i]
                        for q in range(p, p + n):
                            row.append(new[q])
                        p += n
                    continue
                firsts = st.firsts
                cap = seq.max_kv_tokens
                for i, sliding, window, n in spec:
                    table: list[Any] = tables[i]
                    if window and c >= window:  # layouts.first_kept, inlined (0 while the window is not full)
                        f = (c + 1 - window) // B if sliding else c // window * window // B
                        f0 = firsts[i]
                        if f > f0:
                            drop = n * (f - f0)
                            if caching:  # a page others hold stays (``_drop``); one call per table
                                gone = table[:drop]
                                k = sum(1 for b in gone if b in multi)
                                if k:
                                    extra[i] -= k
                                    shared -= k
                                    alloc += k * B
                                    capped += k * B
                                blocks.free(gone)
                            else:
                                dropped += table[:drop]
                            del table[:drop]
                            alloc -= drop * B
                            capped -= n * ((f * B if f * B < cap else cap) - (f0 * B if f0 * B < cap else cap))
                            first_sum += drop
                            pages[i] -= drop
                            firsts[i] = f
                    for q in range(p, p + n):
                        table.append(new[q])
                    p += n
            j += 1
            if alloc_out is not None:
                alloc_out.append(alloc)
            if capped_out is not None:
                capped_out.append(capped)
            if filled is not None:
                filled[j] = filled[j] - (B * (first_sum - base + shared) - filled0)
            if shared_out is not None:
                shared_out.append(shared)
        for i, n in enumerate(self._class_groups):
            pages[i] += n * m
        if dropped:
            blocks.free(dropped)
        self.alloc, self.capped, self._first_sum, self.shared_blocks = alloc, capped, first_sum, shared

    def free(self, seq: Sequence) -> None:
        st = self._st.pop(seq, None)
        if st is None:
            return
        B, cap, pages, caching = self.block_size, seq.max_kv_tokens, self._pages, self.caching
        top = min(st.end * B, cap)
        held = capped = first_sum = 0
        for i, (_, n) in enumerate(self.classes):
            f, table = st.firsts[i], st.tables[i]
            pages[i] -= len(table)
            if caching:
                self._drop(i, table)
            else:
                self.blocks.free(table)
            held += len(table)
            capped += n * (top - min(f * B, cap))
            first_sum += n * f
        self.alloc -= held * B
        self.capped -= capped
        self._first_sum -= first_sum
        if st.state:
            self.blocks.free(st.state)
            self.alloc -= len(st.state) * B
            self.capped -= len(st.state) * B
        self._states -= 1

    def table(self, seq: Sequence) -> list[int]:
        """Every page ``seq`` holds (swap copies them); ``seq.block_table`` is not kept (one list per group)."""
        st = self._st.get(seq)
        return [] if st is None else [b for t in st.tables for b in t] + st.state

    def group_tables(self, seq_ids) -> list[list[list[int]]]:
        """Read-only, for the GPU replay (``gpu/executor.py``): per attention group of ``layout.groups``, in
        order, each of ``seq_ids``' (live sequences) pages by token block, -1 for the blocks it freed."""
        st_of = {s.seq_id: st for s, st in self._st.items()}
        keys = [(g.kind, g.window) for g, _ in self.classes]
        seen: dict[tuple[str, int], int] = {}
        out = []
        for g in self.layout.groups:
            if g.attention:
                i = keys.index((g.kind, g.window))
                q = seen[keys[i]] = seen.get(keys[i], -1) + 1  # the class's q-th group: page q of each row
                n = self.classes[i][1]
                out.append([[-1] * st_of[s].firsts[i] + st_of[s].tables[i][q::n] for s in seq_ids])
        return out

    @property
    def shared_filled(self) -> int:
        """Filled slots = fill_rate x the scheduler's cached tokens - this: each attention group holds a
        sequence's tokens from its first kept block on, and each Mamba state fills its pages; a page shared
        by prefix caching is a full prompt block that every holder counts: its extra holders are taken out."""
        return self.block_size * (self._first_sum - self._states * self.state_pages + self.shared_blocks)

    def group_labels(self) -> list[tuple[str, int, int]]:
        """(kind, window, groups) of each ``group_slots`` entry: the attention classes, then Mamba state."""
        out = [(g.kind, g.window, n) for g, n in self.classes]
        mamba = sum(1 for g in self.layout.groups if not g.attention)
        return out + [("mamba", 0, mamba)] if mamba else out

    def group_slots(self) -> list[int]:
        """Slots each ``group_labels`` entry holds now (pages x block size; they add up to ``alloc``)."""
        B = self.block_size
        if self.caching:  # a shared page counts once
            out = [(p - x) * B for p, x in zip(self._pages, self._extra)]
        else:
            out = [p * B for p in self._pages]
        return out + [self._states * self.state_pages * B] if self.state_pages else out

    # ------------------------------------------------------------------ prefix caching

    def _drop(self, i: int, pages: list[int]) -> None:
        """Give back pages of class ``i`` (left a window, or the sequence is done). With prefix caching a
        page another sequence holds too stays held, now by one fewer: it stops counting as shared."""
        if self.caching:
            multi = self.blocks.multi
            k = sum(1 for b in pages if b in multi)
            if k:
                self._share(i, -k)
        self.blocks.free(pages)

    def _share(self, i: int, k: int) -> None:
        """``k`` more references (fewer if negative) to pages of class ``i`` that others hold too. Every
        holder counts a shared page in its own ``alloc`` and ``capped`` (a full prompt block: ``B`` slots
        each), so the extra holders' are taken out here and ``shared_filled`` takes out their tokens."""
        B = self.block_size
        self._extra[i] += k
        self.shared_blocks += k
        self.alloc -= k * B
        self.capped -= k * B

    def _hit_pages(self, hits: list) -> int:
        return sum(len(pages) for row in hits for pages in row if pages is not None)

    def match_prefix(self, seq: Sequence) -> list:
        """The longest cached prefix that every group accepts (vLLM's hybrid coordinator), at least one
        token left to compute, as ``sharing.SharedPagedKv.match_prefix``. One entry per hit block:
        per class, the pages of the block (one per group of the class) if the class still needs it at the
        hit's length, else None.

        The rule, per class (``layouts.first_kept`` at the hit's length ``h`` blocks): a full group needs
        blocks ``[0, h)`` cached, a sliding group only those covering the last ``W - 1`` tokens before the
        hit, a chunked group those of the current chunk; blocks before may be gone (freed as they slid
        out, then evicted). The hit is the largest ``h`` every class accepts: each class in turn lowers
        ``h`` to the largest it accepts at most ``h``, until none does (vLLM: the full group first, then the
        others limited to its hit). A class's largest: if a needed block is missing, every ``h`` from it up
        needs it too, so the next candidate is that block's index."""
        if not self.caching or seq.num_computed_tokens:
            return []
        B = self.block_size
        hashes = prompt_block_hashes(seq, B)[:(seq.num_tokens - 1) // B]
        h = len(hashes)
        if not h:
            return []
        lookup = self.blocks.lookup
        found: dict[tuple[int, int], list[int] | None] = {}

        def cached(k: int, n: int, i: int):
            """The pages of block ``i`` in class ``k`` (its ``n`` groups), or None if one is not cached."""
            key = (k, i)
            if key not in found:
                hb, ident = hashes[i]
                parent = hashes[i - 1][0] if i else None
                pages: list[int] = []
                for j in range(n):
                    b = lookup(hash((hb, k, j)), ident, parent)
                    if b is None:
                        break
                    pages.append(b)
                found[key] = pages if len(pages) == n else None
            return found[key]

        accepts = [-1] * len(self.classes)  # the h each class last accepted
        while h and any(a != h for a in accepts):
            for k in self._hit_order:
                if accepts[k] == h:
                    continue
                g, n = self.classes[k]
                if not g.window:  # a full group: its longest run of cached blocks from the start
                    i = 0
                    while i < h and cached(k, n, i) is not None:
                        i += 1
                    h = i
                else:
                    while h:
                        i = h - 1
                        first = first_kept(g, h * B, B)
                        while i >= first and cached(k, n, i) is not None:
                            i -= 1
                        if i < first:
                            break  # the class accepts h
                        h = i
                accepts[k] = h
        if not h:
            return []
        cols: list[list] = []
        for k, (g, _) in enumerate(self.classes):  # per class: None before the blocks it needs
            f = first_kept(g, h * B, B)
            cols.append([None] * f + [found[(k, i)] for i in range(f, h)])
        return list(zip(*cols))

    def _take_hit(self, seq: Sequence, hits: list) -> None:
        """``seq`` (nothing cached yet) takes the hit's pages: its tables start as the hit's blocks."""
        B, cap, blocks = self.block_size, seq.max_kv_tokens, self.blocks
        h = len(hits)
        held = blocks.held
        firsts, tables = [], []
        for i, (g, n) in enumerate(self.classes):
            f = first_kept(g, h * B, B)
            table = [b for row in hits[f:] for b in row[i]]
            n_held = sum(1 for b in table if held[b])
            for b in table:
                blocks.incref(b)
            firsts.append(f)
            tables.append(table)
            self._pages[i] += len(table)
            self.alloc += len(table) * B
            self.capped += n * (min(h * B, cap) - min(f * B, cap))
            self._first_sum += n * f
            if n_held:
                self._share(i, n_held)
        state = blocks.allocate(self.state_pages) if self.state_pages else []
        self._st[seq] = _Pages(h, firsts, tables, state)
        self._states += 1
        seq.num_computed_tokens = h * B

    def keep(self, seq: Sequence) -> None:
        """``seq`` is preempted by recompute: every full block it computed becomes findable before it is
        freed, as ``sharing.SharedPagedKv.keep``."""
        st = self._st.get(seq)
        if st is not None:
            extend_block_hashes(seq, self.block_size, min(seq.num_computed_tokens // self.block_size, st.end))
        self.register(seq)

    def register(self, seq: Sequence, upto: int | None = None) -> None:
        """Make ``seq``'s newly computed full prompt blocks (and those :meth:`keep` named) findable: each
        group's page of block ``i`` under the block's hash, the class and the group (every group has its own
        copy of the block), its identity and its parent's hash (a window page's parent page may be gone, so
        the parent is checked by hash). ``upto``: as ``sharing.SharedPagedKv.register``."""
        st = self._st.get(seq)
        if not self.caching or st is None:
            return
        B = self.block_size
        hashes = prompt_block_hashes(seq, B)
        done = min(len(hashes), (seq.num_computed_tokens if upto is None else upto) // B, st.end)
        register = self.blocks.register
        for i in range(seq.num_registered, done):
            hb, ident = hashes[i]
            parent = hashes[i - 1][0] if i else None
            for k, ((_, n), f, table) in enumerate(zip(self.classes, st.firsts, st.tables)):
                if i >= f:
                    row = (i - f) * n
                    for j in range(n):
                        register(table[row + j], hash((hb, k, j)), ident, parent)
        seq.num_registered = max(seq.num_registered, done)

    # ------------------------------------------------------------------ pictures

    def capture(self, seqs: list) -> tuple:
        out = []
        for s in seqs:
            st = self._st.get(s)
            if st is not None:
                out.append((tuple(st.firsts), tuple(tuple(t) for t in st.tables), tuple(st.state),
                            s.num_computed_tokens, min(st.end * self.block_size, s.max_kv_tokens)))
        return out, self.blocks.free_state()

    def segments(self, captured: tuple, blocked: bool) -> np.ndarray:
        """(start slot, length, class) runs covering the pool, as ``kv.PagedKv.segments`` draws them: page j
        of a class of n groups holds token block ``first + j // n`` (token states up to the sequence's
        filled count, reserved slots up to its cap, then internal fragmentation; a whole block of tokens is
        one run); a Mamba state page is token states whole; a page that prefix caching shares is drawn once.
        NOTE: in numpy over all pages at once (a Python tuple per page and per free page was a tenth of a
        2,000-request Gemma-3 run, and an H200's millions of free pages would take seconds)."""
        B = self.block_size
        seqs, (free, fresh) = captured
        lens, firsts, per, fills, caps, tables, state = [], [], [], [], [], [], []
        for fs, tabs, st, filled, cap in seqs:
            for (_, n), f, table in zip(self.classes, fs, tabs):
                lens.append(len(table))
                firsts.append(f)
                per.append(n)
                fills.append(filled)
                caps.append(cap)
                tables.append(table)
            state.extend(st)
        count = np.array(lens, dtype=np.int64)
        total = int(count.sum())
        blocks = np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=total)
        j = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)  # place in its table
        lo = (np.repeat(np.array(firsts, dtype=np.int64), count) + j // np.repeat(np.array(per, dtype=np.int64), count)) * B
        filled = np.repeat(np.array(fills, dtype=np.int64), count)
        cap = np.repeat(np.array(caps, dtype=np.int64), count)
        if self.caching:  # a page several holders share: drawn by the first
            _, first = np.unique(blocks, return_index=True)
            blocks, lo, filled, cap = blocks[first], lo[first], filled[first], cap[first]
        whole = lo + B <= filled  # a full block of tokens (the sequence's cap is past it): one run
        f = np.where(whole, B, np.clip(filled - lo, 0, B))
        r = np.where(whole, B, np.clip(cap - lo, 0, B))
        base = blocks * B
        pages = np.asarray(state, dtype=np.int64) * B
        free = np.asarray(free, dtype=np.int64)
        idle = SLOT_EXTERNAL if blocked else SLOT_FREE
        k, q, m = len(base), len(pages), len(free)
        return _merge_runs(
            np.concatenate([base, base + f, base + r, pages, free * B, [fresh * B]]),
            np.concatenate([f, r - f, B - r, np.full(q, B, dtype=np.int64), np.full(m, B, dtype=np.int64),
                            [(self.blocks.num_blocks - fresh) * B]]),
            np.concatenate([np.full(k, SLOT_TOKEN), np.full(k, SLOT_RESERVED), np.full(k, SLOT_INTERNAL),
                            np.full(q, SLOT_TOKEN), np.full(m + 1, idle)]).astype(np.int64))


class HybridContiguousKv(ContiguousKv):
    """One slab per request over all groups (see the module's doc); slots as ``HybridPagedKv``'s."""

    def __init__(self, layout: KvLayout, allocator, reservation) -> None:
        super().__init__(allocator, reservation)
        self.layout = layout
        self._full = sum(1 for g in layout.groups if g.attention and not g.window)
        self._windows = [g.window for g in layout.groups if g.attention and g.window]
        self._state = sum(g.state_pages for g in layout.groups if not g.attention) * layout.block_size
        self._live: dict[Sequence, None] = {}
        wins: dict[tuple[str, int], int] = {}
        for g in layout.groups:
            if g.attention and g.window:
                wins[(g.kind, g.window)] = wins.get((g.kind, g.window), 0) + 1
        self._window_counts = [(w, self._windows.count(w)) for w in sorted(set(self._windows))]
        self._labels = ([("full", 0, self._full)] if self._full else []) + [(k, w, n) for (k, w), n in wins.items()]
        mamba = sum(1 for g in layout.groups if not g.attention)
        if mamba:
            self._labels.append(("mamba", 0, mamba))
        self._held = [0] * len(self._labels)  # slots of the slabs taken, per label (group_slots)
        # seq -> (slab_for, _fill_cap, _split): a request's lengths never change
        self._sizes: dict[Sequence, tuple[int, int, list[int]]] = {}

    def _size(self, seq: Sequence) -> tuple[int, int, list[int]]:
        got = self._sizes.get(seq)
        if got is None:
            t = self.reservation.tokens(seq.prompt_tokens, seq.output_tokens)
            split = [n * t if k == "full" else self._state if k == "mamba" else n * min(t, w) for k, w, n in self._labels]
            got = self._sizes[seq] = (self._slots(t), self._slots(min(t, seq.max_kv_tokens)), split)
        return got

    def _split(self, seq: Sequence) -> list[int]:
        """A slab of ``seq``'s reservation per ``group_labels`` entry (they add up to ``slab_for``)."""
        return self._size(seq)[2]

    def group_labels(self) -> list[tuple[str, int, int]]:
        return list(self._labels)

    def group_slots(self) -> list[int]:
        """Slots each ``group_labels`` entry's share of the slabs holds (before allocator rounding)."""
        return list(self._held)

    def _slots(self, tokens: int) -> int:
        """Slots of ``tokens`` tokens over the groups: full groups all, window groups at most their window."""
        return self._full * tokens + sum([m * (tokens if tokens < w else w) for w, m in self._window_counts]) + self._state

    def slab_for(self, seq: Sequence) -> int:
        return self._size(seq)[0]

    def never_fits(self, prompt_tokens: np.ndarray, output_tokens: np.ndarray, width: int = 1) -> np.ndarray | bool:
        tokens = self.reservation.column(prompt_tokens, output_tokens)
        slab = self._full * tokens + sum(np.minimum(tokens, w) for w in self._windows) + self._state
        a = self.allocator
        if hasattr(a, "roots"):
            order = np.ceil(np.log2(np.maximum(slab, 1))).astype(np.int64)
            room = sum(np.where(order <= o, np.left_shift(1, np.maximum(o - order, 0)), 0) for _, o in a.roots)
        else:
            room = self.capacity // np.maximum(slab, 1)
        return (room < width) | (self.capacity == 0)

    def _fill_cap(self, seq: Sequence) -> int:
        return self._size(seq)[1]

    def _take_slab(self, seq: Sequence) -> int:
        start = super()._take_slab(seq)
        n = self.slab_for(seq)  # the parent counted min(n, max_kv); count what the request will fill instead
        self.capped += self._fill_cap(seq) - min(n, seq.max_kv_tokens)
        self._live[seq] = None
        self._held = [a + b for a, b in zip(self._held, self._split(seq))]
        return start

    def free(self, seq: Sequence) -> None:
        if seq.slab_start is None:
            return
        self.capped += min(seq.slab_tokens, seq.max_kv_tokens) - self._fill_cap(seq)
        self._live.pop(seq, None)
        self._held = [a - b for a, b in zip(self._held, self._split(seq))]
        super().free(seq)
        del self._sizes[seq]

    def hold(self, seq: Sequence) -> None:
        self.capped += min(seq.slab_tokens, seq.max_kv_tokens) - self._fill_cap(seq)
        self._live.pop(seq, None)
        super().hold(seq)

    def release(self, seq: Sequence) -> None:
        self.capped -= min(seq.slab_tokens, seq.max_kv_tokens) - self._fill_cap(seq)
        self._live[seq] = None
        super().release(seq)

    def _shared(self, k: int, ctx: tuple | None = None) -> list[int]:
        """``shared_filled`` once each live sequence has ``j`` more tokens cached, for j = 0 .. k: the cached
        tokens minus the slots they fill (``_slots``), summed over sorted contexts and their sum (window
        sizes counted once each; plain integers: batches are small, and numpy's per-call overhead dominated).
        ``ctx``: the live sequences' cached tokens as ``offs[i] + d`` (``offs`` sorted, their sum, ``d``),
        when the caller keeps them so; else they are sorted here."""
        if ctx is None:
            c = sorted([s.num_computed_tokens for s in self._live])
            ctx = (c, sum(c), 0)
        offs: list[int] = ctx[0]  # (typed: unpacked from a bare tuple, every sum below was Python's generic one)
        offset_sum: int = ctx[1]
        d: int = ctx[2]
        n, full, state = len(offs), self._full, self._state
        total = offset_sum + n * d
        out: list[int] = []  # (one pass per window size, no list per term: this runs at every decode span)
        for j in range(k + 1):
            x = total + n * j  # the cached tokens, of which the full groups fill all
            out.append(x - full * x - n * state)
        for w, m in self._window_counts:  # sum of min(c + j, w): those below w - j grow, the rest hold w
            for j0, j1, base, slope in window_runs(offs, offset_sum, d, w, k + 1):
                for q in range(j0, j1):
                    out[q] -= m * (base + q * slope)
        return out

    @property
    def shared_filled(self) -> int:  # type: ignore[override]  # (ContiguousKv: a plain 0; mypyc takes this)
        """``_shared(0)``, without sorting: the cached tokens minus the slots they fill now."""
        logical = windows = n = 0  # (typed loops: ``sum`` of a list took Python's generic path, every step)
        for s in self._live:
            c = s.num_computed_tokens
            logical += c
            n += 1
            for w, m in self._window_counts:
                windows += m * (c if c < w else w)
        return logical - (self._full * logical + n * self._state + windows)

    def span_shared_filled(self, k: int, ctx: tuple | None = None) -> list[int]:
        """``shared_filled`` now and after each of the next ``k`` decode steps of every live sequence (a
        decode span: the scheduler's ``complete_span``; window groups stop filling at W, so it is not linear).
        ``ctx``: the decode clock's keys (``DecodeClock.decode_contexts``: cached tokens + 1), used when the
        clock holds exactly the live sequences: every clock member holds a slab, so equal counts mean the
        same sequences (in a span every running sequence decodes on the clock; a slab kept for a KV transfer,
        sim/cluster/disagg.py, makes the counts differ, and then the contexts are sorted here)."""
        if not self._live:
            return [0] * (k + 1)
        if ctx is not None and len(ctx[0]) == len(self._live):
            return self._shared(k, (ctx[0], ctx[1], ctx[2] - 1))
        return self._shared(k)

class GroupTimeline:
    """Slots each KV-group class holds over time (``group_labels`` / ``group_slots`` of the managers above),
    for the report's memory figure split by group (``kv_groups.parquet``). The engine's recorder adds the
    current split after each step, span or idle gap with its duration; ``table`` bins them like the
    timeline: per bin, the mean of the records over the time each spends in it (a record at its end
    state, split across the bins it covers, as the timeline splits its memory columns)."""

    def __init__(self, kv) -> None:
        self.kv = kv
        self.labels = kv.group_labels()
        self._rows = vec[float](capacity=1024)

    def add(self, start_s: float, duration_s: float) -> None:
        # (appended one by one, unboxed: a tuple of them given to an array's extend cost about three times as much)
        rows = append(append(self._rows, start_s), duration_s)
        for x in self.kv.group_slots():
            rows = append(rows, float(x))
        self._rows = rows

    def table(self, bin_s: float) -> Columns:
        """One row per time bin and group class: ``bin_start_s``, ``group`` (its label: kind and window),
        ``kind``, ``window``, ``groups`` (how many groups the class has), ``slots`` (the mean over the bin)."""
        k = len(self.labels)
        rows = np.frombuffer(memoryview(self._rows), dtype=np.float64).reshape(-1, k + 2)
        labels = [(f"{kind} W={window:,}" if kind == "sliding" else f"{kind} C={window:,}" if kind == "chunked"
                   else "Mamba state" if kind == "mamba" else kind) + f" ({n} group{'s' * (n != 1)})"
                  for kind, window, n in self.labels]
        names, kinds = sorted(labels), sorted({kind for kind, _, _ in self.labels})  # the categories
        keep, means = np.zeros(0, dtype=np.int64), []
        if len(rows):
            # each record's time in each bin it covers (most lie inside one; an idle gap or a long span may
            # cross several: charged whole to its first bin, a bin's mean was off by up to a record's weight)
            start, end = rows[:, 0], rows[:, 0] + rows[:, 1]
            first = (start // bin_s).astype(np.int64)
            count = np.maximum((end // bin_s).astype(np.int64) - first, 0) + 1
            rec = np.repeat(np.arange(len(rows)), count)
            idx = first[rec] + (np.arange(len(rec)) - np.repeat(np.cumsum(count) - count, count))
            lo, hi = idx * bin_s, (idx + 1) * bin_s
            part = np.clip(np.minimum(end[rec], hi) - np.maximum(start[rec], lo), 0.0, None)
            whole = count[rec] == 1
            part[whole] = rows[rec[whole], 1]  # inside one bin: its duration as recorded
            dur = np.bincount(idx, weights=part)
            keep = np.flatnonzero(dur > 0)
            means = [np.bincount(idx, weights=part * rows[rec, j + 2], minlength=len(dur))[keep] / dur[keep]
                     for j in range(k)]
        m = len(keep)
        rep = lambda values, dtype: np.repeat(np.array(values, dtype=dtype), m)  # noqa: E731
        return Columns({"bin_start_s": np.tile(keep * bin_s, k).astype(np.float64),
                        "group": rep([names.index(x) for x in labels], np.int64),
                        "kind": rep([kinds.index(kd) for kd, _, _ in self.labels], np.int64),
                        "window": rep([w for _, w, _ in self.labels], np.int64),
                        "groups": rep([n for _, _, n in self.labels], np.int64),
                        "slots": np.concatenate(means) if means else np.zeros(0)},
                       {"group": names, "kind": kinds})
