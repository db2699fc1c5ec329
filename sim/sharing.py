"""Block sharing: reference-counted blocks, automatic prefix caching, forks with copy-on-write.

Used instead of the plain paged pool when a policy enables ``prefix_caching`` or the workload asks for
parallel sampling or beam search (the exclusive pool stays the fast default).

Prefix identity. A trace names each prompt's content by hash ids of ``H``-token segments (Mooncake:
one id per 512 tokens; the shared-prefix generator: one per 16). A KV block of ``B`` tokens at token
``p`` is named by the ids of the segments it touches and ``p``'s offset in the first one; when ``B``
divides ``H`` that is (id, sub-block) -- 512 / 16 = 32 sub-blocks per Mooncake id. When ``B`` does not
divide ``H`` a block may straddle two segments and is named by both, so it matches only a request whose
two segments both match. Only *full* blocks are ever cached: those of the prompt that ids cover, as they are
computed, and, when a request is preempted by recompute, every other block it computed (its unnamed prompt
blocks and its generated ones, which only it can find: ``extend_block_hashes``). A block's hash chains
its identity to the previous block's hash, as vLLM's does; a hit also compares the stored identity and
parent block, so a hash collision can only cause a miss, never a wrong block::

    prompt   |<- seg a0 (H) ->|<- seg a1 (H) ->|<- seg a2 ..
    blocks   |b0|b1|b2| .. |bk|..                      identity(b_i) = ((ids touched), offset)
    hash     h0 = hash((None, id0)), h_i = hash((h_{i-1}, id_i))
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from sim.core import Sequence
from sim.kv import BlockPool, PagedKv, block_ids, blocks_for
from sim.offload import HostTier


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading entries ``a`` and ``b`` share (bisection over slices: C-speed comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def block_identities(hash_ids: np.ndarray, hash_block: int, block_size: int, prompt_tokens: int) -> list[tuple]:
    """Identities of a prompt's full blocks that the hash ids cover, in order (see the module doc)."""
    out = []
    n_ids = len(hash_ids)
    ids = hash_ids.tolist()
    H, B = hash_block, block_size
    for i in range(prompt_tokens // B):
        start = i * B
        j0, j1 = start // H, (start + B - 1) // H
        if j1 >= n_ids:
            break
        out.append((ids[j0] if j0 == j1 else tuple(ids[j0:j1 + 1]), start - j0 * H))
    return out


def prompt_block_hashes(seq: Sequence, block_size: int) -> list[tuple[int, tuple]]:
    """(hash, identity) of each of ``seq``'s cacheable blocks, computed once (the chain of the module's
    doc; with several KV groups every group's pages of a block share it, sim/hybrid.py): its named prompt
    blocks, then any that :func:`extend_block_hashes` added."""
    if seq.block_hashes is None:
        out, h = [], None
        ids = seq.prefix_ids
        if ids is not None and len(ids):
            for ident in block_identities(ids, seq.hash_block, block_size, seq.prompt_tokens):
                h = hash((h, ident))
                out.append((h, ident))
        seq.block_hashes = out
    return seq.block_hashes


def extend_block_hashes(seq: Sequence, block_size: int, n: int) -> list[tuple[int, tuple]]:
    """``seq``'s block hashes, extended to its first ``n`` full blocks: the blocks no content id names (a
    prompt's unnamed part, and its generated tokens) are ``seq``'s own, identity ``("seq", seq_id, i)``,
    chained after the named ones. vLLM hashes every full block by its tokens, generated ones included; tokens
    no id names are taken to match no other request's, so such a block can only be found by ``seq`` itself:
    after a recompute preemption, what it had computed and the pool has not evicted since."""
    out = prompt_block_hashes(seq, block_size)
    h = out[-1][0] if out else None
    for i in range(len(out), n):
        ident = ("seq", seq.seq_id, i)
        h = hash((h, ident))
        out.append((h, ident))
    return out


class _Counts(Mapping):
    """Reference counts of the held blocks, read-only, from the pool's ``held`` flags (a block's holder)
    and ``multi`` (the count of each block with two holders or more); a block no one holds reads 0."""

    __slots__ = ("pool",)

    def __init__(self, pool: "SharedBlockPool") -> None:
        self.pool = pool

    def __getitem__(self, b: int) -> int:
        pool = self.pool
        c = pool.multi.get(b)
        if c is not None:
            return c
        held = pool.held
        return 1 if 0 <= b < len(held) and held[b] else 0

    def __contains__(self, b) -> bool:
        held = self.pool.held
        return 0 <= b < len(held) and held[b]

    def __iter__(self):
        return (b for b, h in enumerate(self.pool.held) if h)

    def __len__(self) -> int:
        return self.pool.num_held


class SharedBlockPool:
    """Reference-counted blocks with an automatic prefix cache (vLLM v1's design); the same interface as
    ``kv.BlockPool`` (``num_free``, ``free_blocks``, ``can_allocate``, ``allocate``, ``free``) plus
    ``incref``, ``lookup`` and ``register``.

    Guarantees: ``ref_cnt[b]`` equals the number of block tables holding ``b``; a block with no holder
    is in the free queue, least recently freed first, and a cached one (it has a key) stays findable
    there until allocation takes it (eviction). Freeing a table queues its blocks tail first, so a
    chain's tail is evicted before its head. With a CPU ``tier`` an evicted cached block moves there."""

    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int = 0,
                 tier: HostTier | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        # Compact: memory follows the blocks ever used, not the pool's size. The free queue is the blocks
        # never handed out, [_fresh, num_blocks) in id order, then the freed ones, least recently freed
        # first -- the same order as one queue of range(num_blocks) with freed ids appended.
        # NOTE: the freed ones are a list with a moving head, ``_q[_h:]``: the head moving past a place
        # allocates its block. A cached block taken back from the queue (``incref``) leaves its place there,
        # stale: ``_revived`` counts such places per block, and the head skips them (a block's stale place
        # comes before any later one, so the first place of it the head meets is the stale one). An
        # OrderedDict did the same at ~10x the cost per block.
        # holders: ``held[b]`` while some table holds block b (a flag per block ever lent: [0, _fresh)), and b
        # is in ``multi`` (with its count) while two or more do. NOTE: a set of the held blocks was 5x the
        # cost per block: the churn of a KV pool (every block taken and given back) left its table full of
        # deleted entries, which each insertion probed through.
        self.held: list[bool] = []
        self.num_held = 0
        self.multi: dict[int, int] = {}
        self.ref_cnt = _Counts(self)  # block -> holders (0 when free)
        self._fresh = 0
        self._q: list[int] = []
        self._h = 0
        self._revived: dict[int, int] = {}  # block -> its stale places in _q[_h:]
        self._stale = 0  # stale places in _q[_h:]
        self.key: dict[int, tuple] = {}  # block -> (hash, identity, parent block, parent hash) while cached
        self.cache: dict[int, int] = {}  # hash -> block
        self.num_evicted = 0
        self.tier = tier

    def _queued(self) -> list[int]:
        """The freed blocks in the queue, in order."""
        stale, out = dict(self._revived), []
        for b in self._q[self._h:]:
            if stale.get(b):
                stale[b] -= 1
            else:
                out.append(b)
        return out

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._fresh + len(self._q) - self._h - self._stale

    @property
    def free_blocks(self) -> list[int]:
        """The free block ids, next to be allocated first (materialises them: tests and small pools)."""
        return list(range(self._fresh, self.num_blocks)) + self._queued()

    def free_state(self) -> tuple[list[int], int]:
        """The free blocks compactly: (freed ids, first never-allocated id), as ``kv.BlockPool``'s."""
        return self._queued(), self._fresh

    def can_allocate(self, n: int, admission: bool = False) -> bool:
        return n <= (self.num_blocks - self._fresh + len(self._q) - self._h - self._stale
                     - (self.watermark_blocks if admission else 0))

    def allocate(self, n: int) -> list[int]:
        f = self._fresh
        fresh = self.num_blocks - f
        queued = len(self._q) - self._h - self._stale
        if n > fresh + queued:
            raise RuntimeError(f"allocate({n}) with {fresh + queued} free blocks")
        k = min(n, fresh)  # never-used blocks first: no holder, no key
        out = block_ids(f, f + k)
        self._fresh = f + k
        held = self.held
        held.extend([True] * k)
        if k < n:
            q, h, m = self._q, self._h, n - k
            if not self._stale:  # the next m places are all live
                taken = q[h:h + m]
                h += m
            else:
                taken, revived = [], self._revived
                while len(taken) < m:
                    b = q[h]
                    r = revived.get(b)
                    if r:  # a stale place
                        if r == 1:
                            del revived[b]
                        else:
                            revived[b] = r - 1
                        self._stale -= 1
                    else:
                        taken.append(b)
                    h += 1
            self._h = h
            key = self.key
            if key:
                for b in taken:
                    kb = key.pop(b, None)
                    if kb is not None:  # evict: the least recently freed cached block goes first
                        if self.cache.get(kb[0]) == b:
                            del self.cache[kb[0]]
                            if self.tier is not None:
                                self.tier.store(kb[0], kb[1], kb[3])
                        self.num_evicted += 1
            for b in taken:
                if held[b]:
                    raise AssertionError(f"block {b} free and held")
                held[b] = True
            out += taken
        self.num_held += n
        return out

    def _enqueue(self, blocks) -> None:
        q = self._q
        if self._h > len(q) // 2:  # drop the consumed front once it outgrows the rest
            del q[:self._h]
            self._h = 0
        q.extend(blocks)

    def free(self, block_ids: list[int]) -> None:
        held, multi = self.held, self.multi
        if not multi:  # no block has two holders: each of these goes back to the queue
            for b in block_ids:
                if not held[b]:
                    raise AssertionError(f"block {b} of {block_ids} freed with no holder")
                held[b] = False
            self.num_held -= len(block_ids)
            self._enqueue(block_ids[::-1])
        else:
            back = []
            for b in reversed(block_ids):
                c = multi.get(b)
                if c is not None:  # another holder keeps it
                    if c == 2:
                        del multi[b]
                    else:
                        multi[b] = c - 1
                else:
                    if not held[b]:
                        raise AssertionError(f"block {b} freed with no holder")
                    held[b] = False
                    back.append(b)
            self.num_held -= len(back)
            self._enqueue(back)
        assert len(self._q) - self._h - self._stale + self.num_held == self._fresh, "blocks ever lent != freed + held"

    def incref(self, b: int) -> None:
        multi = self.multi
        c = multi.get(b)
        if c is not None:
            multi[b] = c + 1
        elif self.held[b]:
            multi[b] = 2
        else:  # a cached block comes back from the free queue: its place goes stale
            self._revived[b] = self._revived.get(b, 0) + 1
            self._stale += 1
            self.held[b] = True
            self.num_held += 1

    def lookup(self, h: int, identity, parent: int | None) -> int | None:
        b = self.cache.get(h)
        if b is None:
            return None
        _, ident, par, _ = self.key[b]
        return b if ident == identity and par == parent else None  # a collision is a miss

    def register(self, b: int, h: int, identity, parent: int | None, parent_hash: int | None = None) -> None:
        if b not in self.key and h not in self.cache:
            self.key[b] = (h, identity, parent, parent_hash)
            self.cache[h] = b
            if self.tier is not None:
                self.tier.discard(h)  # one tier holds a block at a time


class SharedPagedKv(PagedKv):
    """Paged blocks that sequences may share: prefix-cache hits, forked samples and beams.

    Accounting stays physical: ``alloc`` counts held blocks once; the scheduler's ``filled`` (a sum over
    sequences) is corrected by ``shared_filled``, and ``capped`` by the shared part, because a block
    with several holders is immutable (a holder that writes into it copies it first) and every holder
    counts the same slots for it."""

    def __init__(self, pool: SharedBlockPool, caching: bool, tier: HostTier | None = None) -> None:
        super().__init__(pool)
        self.caching = caching
        self.tier = pool.tier = tier  # the CPU tier of the prefix cache (sim/offload.py), or None
        self.loads = []  # blocks loaded from the tier for the step being planned
        # first admissions (what the hit rates count): prompt tokens, and those found on the GPU / the CPU
        self.admitted_prompt_tokens = self.hit_tokens_gpu = self.hit_tokens_cpu = 0
        self.shared_filled = 0
        self.shared_blocks = 0  # extra references: blocks the holders would need without sharing
        self._shared: dict[int, tuple[int, int]] = {}  # block -> (filled, capped) each extra holder counts
        self.num_copies = 0  # copy-on-write block copies
        self.copies = []  # (source, destination) of this step, for the executor

    # -- helpers ---------------------------------------------------------------------------------

    def _sync_alloc(self) -> None:
        self.alloc = (self.pool.num_blocks - self.pool.num_free) * self.block_size
        assert self.shared_blocks >= 0 and self.shared_filled >= 0 and 0 <= self.capped <= self.alloc, (
            f"shared KV accounting: shared blocks {self.shared_blocks}, shared filled {self.shared_filled}, "
            f"capped {self.capped}, alloc {self.alloc}")

    def _check(self) -> None:
        pass  # alloc is the pool's own count here (see _sync_alloc)

    def _hold(self, seq: Sequence, b: int, index: int) -> None:
        """``seq`` takes another reference to ``b``, its ``index``-th block."""
        pool = self.pool
        if pool.ref_cnt[b] >= 1:  # already held: the slots exist once, count the extra holder out
            B = self.block_size
            filled = min(B, max(0, seq.num_computed_tokens - index * B))
            capped = min(B, max(0, seq.max_kv_tokens - index * B))
            if b not in self._shared:
                self._shared[b] = (filled, capped)
            f, c = self._shared[b]
            self.shared_filled += f
            self.capped -= c
            self.shared_blocks += 1
        pool.incref(b)

    def _release(self, seq: Sequence, blocks: list[int]) -> None:
        pool, shared = self.pool, self._shared
        if shared:  # NOTE: a block is a key of _shared exactly while it has two holders or more
            ref = pool.ref_cnt
            for b in blocks:
                fc = shared.get(b)
                if fc is not None:
                    self.shared_filled -= fc[0]
                    self.capped += fc[1]
                    self.shared_blocks -= 1
                    if ref[b] == 2:
                        del shared[b]
        pool.free(blocks)

    def _needs_copy(self, seq: Sequence, num_new: int) -> bool:
        """The next token lands in a block that others hold too: it must be copied first."""
        c, table = seq.num_computed_tokens, seq.block_table
        return bool(num_new and table and c % self.block_size and c < len(table) * self.block_size
                    and self.pool.ref_cnt[table[c // self.block_size]] > 1)

    # -- the manager interface ---------------------------------------------------------------------

    def _needed(self, seq: Sequence, num_new: int) -> int:
        return super()._needed(seq, num_new) + self._needs_copy(seq, num_new)

    def can_admit(self, seq: Sequence, num_new: int, hits: list | tuple = ()) -> bool:
        # cached blocks now in the free queue, and CPU-tier hits (a (hash, identity, parent hash) each): a block each
        revived = sum(1 for b in hits if type(b) is tuple or self.pool.ref_cnt[b] == 0)
        # NOTE: a sequence swapped back in (or recomputed) brings its computed tokens: they need blocks too
        # (counting only the new tokens admitted it into a pool that could not hold it: "allocate(n) with m")
        held = max(seq.num_computed_tokens, len(hits) * self.block_size)
        need = max(0, blocks_for(held + num_new, self.block_size) - len(seq.block_table) - len(hits))
        if not hits:
            need += self._needs_copy(seq, num_new)
        return self.pool.can_allocate(need + revived, admission=True)

    def admit(self, seq: Sequence, num_new: int, hits: list | tuple = ()) -> None:
        gpu = hits
        if hits:
            if self.tier is not None:  # GPU hits first, then the CPU tier's
                gpu = [b for b in hits if type(b) is not tuple]
            for i, b in enumerate(gpu):
                seq.block_table.append(b)
                seq.num_computed_tokens = (i + 1) * self.block_size  # so the holder counts the block full
                self._hold(seq, b, i)
            if len(gpu) < len(hits):
                self._load(seq, hits[len(gpu):])
            self.capped += min(len(hits) * self.block_size, seq.max_kv_tokens)
        if self.tier is not None and seq.prefix_hit_tokens is None:  # a request's first admission
            self.admitted_prompt_tokens += seq.prompt_tokens
            self.hit_tokens_gpu += len(gpu) * self.block_size
            self.hit_tokens_cpu += (len(hits) - len(gpu)) * self.block_size
        self.grow(seq, num_new)

    def _load(self, seq: Sequence, found: list[tuple] | tuple) -> None:
        """CPU-tier hits: each leaves the host pool for a fresh GPU block (one holder), cached on the GPU
        again; the step copies them in before its forward (``loads``)."""
        for h, _, _ in found:
            # (the tier is set: found holds its hits) out of the host pool before allocating: an eviction
            # cannot drop them
            self.tier.take(h)  # type: ignore[union-attr]
        blocks = self.pool.allocate(len(found))
        parent = seq.block_table[-1] if seq.block_table else None
        for (h, ident, parent_hash), b in zip(found, blocks):
            seq.block_table.append(b)
            self.pool.register(b, h, ident, parent, parent_hash)
            parent = b
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        self.loads.extend(blocks)

    def grow(self, seq: Sequence, num_new: int) -> None:
        if self._needs_copy(seq, num_new):
            self._copy_on_write(seq)
        n = PagedKv._needed(self, seq, num_new)
        if n:
            self._add_blocks(seq, self.pool.allocate(n))
        self._sync_alloc()

    def _copy_on_write(self, seq: Sequence) -> None:
        B, table = self.block_size, seq.block_table
        i = seq.num_computed_tokens // B
        old = table[i]
        new = self.pool.allocate(1)[0]
        self.copies.append((old, new))
        self.num_copies += 1
        self._release(seq, [old])  # this holder leaves the shared block for its own copy: its slots,
        table[i] = new  # which its own counts already include, now exist twice physically

    def add_blocks(self, seqs: list[Sequence]) -> None:
        super().add_blocks(seqs)
        self._sync_alloc()

    def free(self, seq: Sequence) -> None:
        B, cap = self.block_size, seq.max_kv_tokens
        self.capped -= min(len(seq.block_table) * B, cap)
        self._release(seq, seq.block_table)
        seq.block_table = []
        self._sync_alloc()

    def fork(self, parent, child) -> None:
        """``child`` shares every block of ``parent`` (its samples or beams start from the same cache)."""
        self._share_table(child, parent.block_table)
        self.capped += min(len(child.block_table) * self.block_size, child.max_kv_tokens)

    def _share_table(self, seq: Sequence, table: list[int]) -> None:
        seq.block_table = []
        for i, b in enumerate(table):
            seq.block_table.append(b)
            self._hold(seq, b, i)

    def reassign(self, moves: list[tuple]) -> list:
        """Beam search: each (target, source) pair gives ``target`` the source's history (as it was
        before any move). All the new references are taken before any old table is let go, so no block
        passes through the free queue. Nothing is copied now: a shared block is copied when written."""
        before = {id(s): list(s.block_table) for _, s in moves}
        old = []
        for target, source in moves:
            table, mine = before[id(source)], target.block_table  # the same length: beams move in lockstep
            # NOTE: beams' histories coalesce, so the two share a long prefix, which the target keeps as it
            # is (taking and letting go of each of its blocks again changes nothing but the time: at
            # block_size 1 that was most of a beam search's run)
            k = _common_prefix(mine, table)
            target.block_table = new = mine[:k]
            for i in range(k, len(table)):
                b = table[i]
                new.append(b)
                self._hold(target, b, i)
            old.append((target, mine[k:]))
        for target, blocks in old:
            self._release(target, blocks)
        self._sync_alloc()
        return []

    def can_swap_in_group(self, members: list) -> bool:
        """Room for the group's blocks and a new block for each member, as vLLM v0 asks (``_can_swap``:
        "conservatively ... every sequence will allocate at least one free block right after the swap-in").
        Where that is more than the pool can ever give (up-front admission lets a group fill the pool;
        vLLM drops such a group), what its next step needs: a new block for each member whose token starts
        one, and a copy for each but one holder of a shared, partly filled last block. (Asking for the
        former, such a group never came back and the scheduler stalled.)"""
        unique = len({b for m in members for b in m.cpu_blocks})
        pool = self.pool
        if unique + len(members) <= pool.num_blocks - pool.watermark_blocks:
            return pool.can_allocate(unique + len(members), admission=True)
        B = self.block_size
        need = 0
        last: dict[int, int] = {}
        for m in members:
            if m.num_computed_tokens % B == 0:
                need += 1
            else:
                b = m.cpu_blocks[-1]
                last[b] = last.get(b, 0) + 1
        need += sum(n - 1 for n in last.values())
        return pool.can_allocate(unique + need, admission=True)

    def swap_in_group(self, members: list, swap_pool: BlockPool) -> list[tuple[int, int]]:
        """Bring a swapped group back, its sharing intact; returns the (CPU, GPU) copies."""
        unique = list(dict.fromkeys(c for m in members for c in m.cpu_blocks))
        where = dict(zip(unique, self.pool.allocate(len(unique))))  # each allocated block: one holder
        placed: set[int] = set()
        for m in members:
            table = [where[c] for c in m.cpu_blocks]
            m.block_table = []
            for j, b in enumerate(table):
                m.block_table.append(b)
                if b in placed:
                    self._hold(m, b, j)  # a later holder of a shared block
                placed.add(b)
            self.capped += min(len(table) * self.block_size, m.max_kv_tokens)
            m.cpu_blocks = ()
        swap_pool.free(unique)
        self._sync_alloc()
        return list(where.items())

    # -- the prefix cache ----------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks holding ``seq``'s longest cached prefix (at least one token is always left to
        compute, as vLLM does, so the step samples)."""
        if not self.caching or seq.num_computed_tokens:
            return []
        hits, parent = [], None
        limit = (seq.num_tokens - 1) // self.block_size  # (a recomputed sequence: its generated tokens too)
        hashes = prompt_block_hashes(seq, self.block_size)[:limit]
        for h, ident in hashes:
            b = self.pool.lookup(h, ident, parent)
            if b is None:
                break
            hits.append(b)
            parent = b
        tier = self.tier
        if tier is not None:  # the rest of the chain from the CPU tier: (hash, identity, parent hash) each
            for i in range(len(hits), len(hashes)):
                h, ident = hashes[i]
                parent_hash = hashes[i - 1][0] if i else None
                if not tier.find(h, ident, parent_hash):
                    break
                hits.append((h, ident, parent_hash))
        return hits

    def _reached(self, hashes: list, n: int) -> int | None:
        """The cached block a lookup of the chain ``hashes[:n]`` reaches, or None."""
        b = None
        for h, ident in hashes[:n]:
            b = self.pool.lookup(h, ident, b)
            if b is None:
                return None
        return b

    def keep(self, seq: Sequence) -> None:
        """``seq`` is preempted by recompute: make every full block it computed findable before it is freed
        (:func:`extend_block_hashes`), so that coming back it finds what was not evicted meanwhile."""
        extend_block_hashes(seq, self.block_size, min(seq.num_computed_tokens // self.block_size,
                                                       len(seq.block_table)))
        self.register(seq)

    def register(self, seq: Sequence, upto: int | None = None) -> None:
        """Make ``seq``'s newly computed full prompt blocks findable (and those :meth:`keep` named); ``upto``:
        its tokens computed once the step being planned runs (vLLM v1 caches a step's blocks as it schedules
        them, so a request admitted later in the same step finds them)."""
        if not self.caching:
            return
        hashes = prompt_block_hashes(seq, self.block_size)
        done = min(len(hashes), (seq.num_computed_tokens if upto is None else upto) // self.block_size,
                   len(seq.block_table))
        table, pool = seq.block_table, self.pool
        reached: int | None = -1  # the block a lookup of the chain so far reaches (None: none; -1: not known)
        for i in range(seq.num_registered, done):
            h, ident = hashes[i]
            parent = parent_hash = None
            if i:
                parent, parent_hash = table[i - 1], hashes[i - 1][0]
                if pool.cache.get(parent_hash) != parent:
                    # two requests computed the same block at once, and only the other's copy is cached: chain
                    # to the copy a lookup reaches, or this chain could never be found (vLLM keeps both copies
                    # under the hash, and its lookup follows hashes). Found as match_prefix walks, identities
                    # and parents checked, so a hash collision still cannot join two chains.
                    if reached == -1:
                        reached = self._reached(hashes, i)
                    if reached is not None:
                        parent = reached
            pool.register(table[i], h, ident, parent, parent_hash)
            reached = pool.lookup(h, ident, parent)  # (carried forward: no walk from the root per block)
        seq.num_registered = max(seq.num_registered, done)
