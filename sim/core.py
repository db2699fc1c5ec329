"""Core types shared by the scheduler, the KV managers and the executors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim.clock import DecodeClock


# Where a sequence is (``Sequence.state``): exactly one of the scheduler's queues, or done. The scheduler
# asserts the state a sequence leaves whenever it moves one, so a sequence can never be in two queues.
NEW, WAITING, RUNNING, SWAPPED, DONE = range(5)

_MISSING = object()  # StepPlan._memoized: not read yet

GROUP_SLOTS = 64  # order key = request id * GROUP_SLOTS + index in its group (groups of at most 63)


class Group:
    """The sequences of one request that asked for several outputs (parallel samples) or beams.

    The leader prefills the prompt alone; at its first sample the others fork from it (sharing its blocks,
    or copying into slabs reserved at admission). They are preempted and swapped together, and the
    request finishes when all of them have."""

    __slots__ = ("kind", "width", "members", "reserved", "num_finished", "keep_probability", "rng", "swapped")

    def __init__(self, kind: str, width: int, keep_probability: float = 1.0, rng=None) -> None:
        self.kind = kind  # "parallel" | "beam"
        self.width = width
        self.members: list[Sequence] = []  # the live sequences, leader first
        self.reserved: list[int] = []  # contiguous: slab starts held for the members still to fork
        self.num_finished = 0
        self.keep_probability = keep_probability
        self.rng = rng
        self.swapped: list[Sequence] = []  # the members swapped out together, when the group is


class Sequence:
    """One request while the server holds it.

    Token bookkeeping follows vLLM v1: the sequence *knows* ``num_tokens`` = prompt + generated tokens,
    of which ``num_computed_tokens`` have their K/V in the cache. A step that computes the last known
    token samples one more output token. So a fresh request prefills its prompt, a decode computes one
    token, and a request preempted by recompute re-prefills prompt + generated tokens. The last output
    token is sampled but never computed, so at most ``prompt + output - 1`` slots are ever filled.

    NOTE: sequences in the decode phase advance in lockstep, so the scheduler puts them on a shared
    ``clock.DecodeClock``: while ``clock`` is set, the stored counters are offsets and every clock tick adds one
    computed and one output token to all of them at once (O(1) per step, not O(batch)). The properties
    below always give the true values.
    """

    __slots__ = ("seq_id", "request_id", "order", "group", "arrival_s", "prompt_tokens", "output_tokens",
                 "max_kv_tokens",
                 "_computed", "_output", "clock", "state",
                 "block_table", "cpu_blocks", "slab_start", "slab_tokens", "slab_rounded",
                 "first_token_s", "last_token_s", "num_preemptions",
                 "prefix_ids", "hash_block", "block_hashes", "num_registered", "prefix_hit_tokens")

    def __init__(self, request_id: int, arrival_s: float, prompt_tokens: int, output_tokens: int,
                 prefix_ids=None, hash_block: int = 0, seq_id: int | None = None, index: int = 0) -> None:
        self.seq_id = request_id if seq_id is None else seq_id  # unique; a request's first sequence: its id
        self.request_id = request_id
        self.order = request_id * GROUP_SLOTS + index  # FCFS: by arrival, then by place in the group
        self.group: Group | None = None
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        # slots this request will ever fill: everything but its last output token (a field, not a
        # property: read for every block a decode adds; prompt and output lengths never change)
        self.max_kv_tokens = prompt_tokens + output_tokens - 1
        self._computed = 0
        self._output = 0
        self.clock: DecodeClock | None = None  # the decode clock it is on, if any
        self.state = NEW
        self.block_table: list[int] = []  # paged: physical block ids, in token order
        self.cpu_blocks: list[int] | tuple = ()  # paged, swapped out: CPU swap-space block ids (assigned, never
        # grown in place: no list per sequence until one is swapped)
        self.slab_start: int | None = None  # contiguous: first token slot of the slab
        self.slab_tokens = 0  # contiguous: slots the policy reserved
        self.slab_rounded = 0  # contiguous: slots the allocator actually took (buddy rounding)
        self.first_token_s: float | None = None
        self.last_token_s = 0.0
        self.num_preemptions = 0
        # prefix caching (sharing.py): the prompt's content ids, its blocks' hashes, how many are cached
        self.prefix_ids = prefix_ids  # hash ids of hash_block-token segments, or None
        self.hash_block = hash_block
        self.block_hashes: list | None = None
        self.num_registered = 0
        self.prefix_hit_tokens: int | None = None  # at first admission

    @property
    def num_computed_tokens(self) -> int:
        c = self.clock
        return self._computed if c is None else self._computed + c.ticks

    @num_computed_tokens.setter
    def num_computed_tokens(self, v: int) -> None:
        c = self.clock
        self._computed = v if c is None else v - c.ticks

    @property
    def num_output_tokens(self) -> int:
        c = self.clock
        return self._output if c is None else self._output + c.ticks

    @num_output_tokens.setter
    def num_output_tokens(self, v: int) -> None:
        c = self.clock
        self._output = v if c is None else v - c.ticks

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_output_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.prompt_tokens + self._output - self._computed  # the clock adds to both alike

    @property
    def in_decode(self) -> bool:
        """Past its prefill: it has sampled a token and computes one token per step."""
        return self._output > 0 and self.num_uncomputed_tokens == 1 if self.clock is None else True

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, prompt={self.prompt_tokens}, out={self.num_output_tokens}/"
                f"{self.output_tokens}, computed={self.num_computed_tokens})")


class _SeqView:
    """What a recorded plan keeps of a sequence."""

    __slots__ = ("seq_id", "num_computed_tokens", "block_table", "slab_start")

    def __init__(self, seq_id: int, num_computed_tokens: int, block_table, slab_start) -> None:
        self.seq_id, self.num_computed_tokens = seq_id, num_computed_tokens
        self.block_table, self.slab_start = block_table, slab_start


@dataclass(init=False)
class StepPlan:
    """Everything an executor sees of one step: for each scheduled sequence its id, the tokens it
    computes now (a prefill chunk, or 1 for a decode), the tokens already cached, and where its cache
    lives; and the step's totals, which the scheduler keeps without visiting every sequence.

    Per-sequence fields are read from the live sequences on first use: they are valid until the step
    completes (an executor reads them while running the step). ``swap_out`` / ``swap_in`` are (source
    block, destination block) pairs copied before the step runs (GPU->CPU and CPU->GPU); then the
    ``copy_blocks`` / ``copy_slots`` copies (forks, copy-on-write), all before the forward pass.
    ``host_loads``: GPU blocks filled from the prefix cache's CPU tier (``sim/offload.py``) before it.

    A plan is read-only once made (nothing assigns to its fields; executors write notes into ``extra``).
    NOTE: not a frozen dataclass, whose ``__init__`` sets each field through ``object.__setattr__``: the
    scheduler makes one per step, positionally, and plain attribute stores cost a third of that; the
    compiled build (sim/native.py) makes it a C struct whose fields compiled readers load directly."""

    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int  # tokens of multi-token chunks
    num_decode_tokens: int  # one-token steps (decodes, and single-token chunks)
    num_sampled: int  # sequences that sample a token at the end of this step
    decode_context_tokens: int  # keys the one-token steps read (cached context + the token itself)
    prefill_attention_pairs: int  # query-key pairs of multi-token chunks (causal among themselves)
    block_size: int
    paged: bool
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    copy_blocks: tuple[tuple[int, int], ...] = ()  # (source, destination) block copies (copy-on-write)
    copy_slots: tuple[tuple[int, int, int], ...] = ()  # (source slot, destination slot, slots): slab copies
    forks: tuple[tuple[int, int], ...] = ()  # (source, target) sequence ids: target's history is source's
    num_preempted: int = 0
    _decoding: Any = ()  # the scheduler's clocked decode group (each computes one token), not copied
    _entries: Any = ()  # the other scheduled (Sequence, new tokens) pairs, not copied
    extra: dict = field(default_factory=dict, compare=False)  # executors' notes (e.g. a scratch plan's size)
    host_loads: tuple[int, ...] = ()  # blocks loaded from the CPU tier (over the host link, like a swap-in)
    _contexts: Any = field(default=None, compare=False, repr=False)  # () -> the clocked decodes' sorted keys
    # and their sum (DecodeClock.decode_contexts), for window groups' keys; None: sort _decoding

    def __init__(self, num_seqs: int, num_tokens: int, num_prefill_tokens: int, num_decode_tokens: int,
                 num_sampled: int, decode_context_tokens: int, prefill_attention_pairs: int, block_size: int,
                 paged: bool, swap_out: tuple[tuple[int, int], ...] = (), swap_in: tuple[tuple[int, int], ...] = (),
                 copy_blocks: tuple[tuple[int, int], ...] = (), copy_slots: tuple[tuple[int, int, int], ...] = (),
                 forks: tuple[tuple[int, int], ...] = (), num_preempted: int = 0, _decoding: Any = (),
                 _entries: Any = (), extra: dict | None = None, host_loads: tuple[int, ...] = (),
                 _contexts: Any = None) -> None:
        self.num_seqs = num_seqs
        self.num_tokens = num_tokens
        self.num_prefill_tokens = num_prefill_tokens
        self.num_decode_tokens = num_decode_tokens
        self.num_sampled = num_sampled
        self.decode_context_tokens = decode_context_tokens
        self.prefill_attention_pairs = prefill_attention_pairs
        self.block_size = block_size
        self.paged = paged
        self.swap_out = swap_out
        self.swap_in = swap_in
        self.copy_blocks = copy_blocks
        self.copy_slots = copy_slots
        self.forks = forks
        self.num_preempted = num_preempted
        self._decoding = _decoding
        self._entries = _entries
        self.extra = {} if extra is None else extra
        self.host_loads = host_loads
        self._contexts = _contexts
        self._memo: dict | None = None  # the per-sequence fields, once read (not a field: not compared)

    def _memoized(self, name: str) -> Any:
        memo = self._memo
        if memo is None:
            memo = self._memo = {}
        got = memo.get(name, _MISSING)
        if got is _MISSING:
            got = memo[name] = self._compute(name, memo)
        return got

    def _compute(self, name: str, memo: dict) -> Any:
        if name == "num_new_tokens":
            return (1,) * len(self._decoding) + tuple(n for _, n in self._entries)
        seqs = memo.get("_seqs")  # the sequences as the first per-sequence read finds them
        if seqs is None:
            seqs = memo["_seqs"] = (*self._decoding, *(s for s, _ in self._entries))  # decodes first
        if name == "seq_ids":
            return tuple(s.seq_id for s in seqs)
        if name == "num_computed_tokens":
            return tuple(s.num_computed_tokens for s in seqs)
        if name == "block_tables":
            return tuple(s.block_table for s in seqs) if self.paged else None
        assert name == "slab_starts", name
        return None if self.paged else tuple(s.slab_start for s in seqs)

    @classmethod
    def from_entries(cls, seq_ids, num_new_tokens, num_computed_tokens, num_sampled, block_size, *,
                     block_tables=None, slab_starts=None, **fields) -> "StepPlan":
        """A plan given sequence by sequence, holding its own copies (not live sequences): for plans
        recorded to replay later, or built by hand (tests, warm-up steps)."""
        paged = block_tables is not None
        entries = [(_SeqView(int(sid), int(c), list(block_tables[i]) if paged else None,  # ints: typed fields
                             None if paged or slab_starts is None else slab_starts[i]), n)
                   for i, (sid, n, c) in enumerate(zip(seq_ids, num_new_tokens, num_computed_tokens))]
        one = [(n, c) for n, c in zip(num_new_tokens, num_computed_tokens) if n == 1]
        many = [(n, c) for n, c in zip(num_new_tokens, num_computed_tokens) if n > 1]
        return cls(num_seqs=len(entries), num_tokens=int(sum(num_new_tokens)),  # ints, not numpy's (typed fields)
                   num_prefill_tokens=int(sum(n for n, _ in many)), num_decode_tokens=len(one),
                   num_sampled=int(num_sampled), decode_context_tokens=int(sum(c + 1 for _, c in one)),
                   prefill_attention_pairs=int(sum(n * c + n * (n + 1) // 2 for n, c in many)),
                   block_size=int(block_size), paged=paged, _entries=entries, **fields)

    def snapshot(self) -> "StepPlan":
        """This plan with its per-sequence fields copied out of the live sequences."""
        return StepPlan.from_entries(self.seq_ids, self.num_new_tokens, self.num_computed_tokens, self.num_sampled,
                                     self.block_size, block_tables=self.block_tables, slab_starts=self.slab_starts,
                                     swap_out=self.swap_out, swap_in=self.swap_in, copy_blocks=self.copy_blocks,
                                     copy_slots=self.copy_slots, forks=self.forks, num_preempted=self.num_preempted,
                                     extra=dict(self.extra), host_loads=self.host_loads)

    @property
    def host_link_blocks(self) -> int:
        """Blocks this step moves over the host link before its forward: swaps and CPU-tier loads."""
        return len(self.swap_in) + len(self.swap_out) + len(self.host_loads)

    @property
    def seq_ids(self) -> tuple[int, ...]:
        return self._memoized("seq_ids")

    @property
    def num_new_tokens(self) -> tuple[int, ...]:
        return self._memoized("num_new_tokens")

    @property
    def num_computed_tokens(self) -> tuple[int, ...]:
        return self._memoized("num_computed_tokens")

    @property
    def block_tables(self) -> tuple[list[int], ...] | None:
        return self._memoized("block_tables")

    @property
    def slab_starts(self) -> tuple[int, ...] | None:
        return self._memoized("slab_starts")
