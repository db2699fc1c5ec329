"""Core types shared by the scheduler, the KV managers and the executors."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


class Clock:
    """Decode steps taken so far by the scheduler's *clocked* sequences (see ``Sequence``)."""

    __slots__ = ("ticks",)

    def __init__(self) -> None:
        self.ticks = 0


class Sequence:
    """One request while the server holds it.

    Token bookkeeping follows vLLM v1: the sequence *knows* ``num_tokens`` = prompt + generated tokens,
    of which ``num_computed_tokens`` have their K/V in the cache. A step that computes the last known
    token samples one more output token. So a fresh request prefills its prompt, a decode computes one
    token, and a request preempted by recompute re-prefills prompt + generated tokens. The last output
    token is sampled but never computed, so at most ``prompt + output - 1`` slots are ever filled.

    NOTE: sequences in the decode phase advance in lockstep, so the scheduler puts them on a shared
    ``Clock``: while ``clock`` is set, the stored counters are offsets and every clock tick adds one
    computed and one output token to all of them at once (O(1) per step, not O(batch)). The properties
    below always give the true values.
    """

    __slots__ = ("seq_id", "arrival_s", "prompt_tokens", "output_tokens", "_computed", "_output", "clock",
                 "block_table", "cpu_blocks", "slab_start", "slab_tokens", "slab_rounded",
                 "first_token_s", "last_token_s", "num_preemptions")

    def __init__(self, seq_id: int, arrival_s: float, prompt_tokens: int, output_tokens: int) -> None:
        self.seq_id = seq_id
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self._computed = 0
        self._output = 0
        self.clock: Clock | None = None
        self.block_table: list[int] = []  # paged: physical block ids, in token order
        self.cpu_blocks: list[int] = []  # paged, swapped out: CPU swap-space block ids
        self.slab_start: int | None = None  # contiguous: first token slot of the slab
        self.slab_tokens = 0  # contiguous: slots the policy reserved
        self.slab_rounded = 0  # contiguous: slots the allocator actually took (buddy rounding)
        self.first_token_s: float | None = None
        self.last_token_s = 0.0
        self.num_preemptions = 0

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

    @property
    def max_kv_tokens(self) -> int:
        """Slots this request will ever fill: everything but its last output token."""
        return self.prompt_tokens + self.output_tokens - 1

    @property
    def remaining_output_tokens(self) -> int:
        return self.output_tokens - self.num_output_tokens

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, prompt={self.prompt_tokens}, out={self.num_output_tokens}/"
                f"{self.output_tokens}, computed={self.num_computed_tokens})")


@dataclass(frozen=True)
class StepPlan:
    """Everything an executor sees of one step: for each scheduled sequence its id, the tokens it
    computes now (a prefill chunk, or 1 for a decode), the tokens already cached, and where its cache
    lives; and the step's totals, which the scheduler keeps without visiting every sequence.

    Per-sequence fields are read from the live sequences on first use: they are valid until the step
    completes (an executor reads them while running the step). ``swap_out`` / ``swap_in`` are (source
    block, destination block) pairs copied before the step runs (GPU->CPU and CPU->GPU)."""

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
    num_preempted: int = 0
    _decoding: object = ()  # the scheduler's clocked decode group (each computes one token), not copied
    _entries: object = ()  # the other scheduled (Sequence, new tokens) pairs, not copied

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode_tokens == self.num_seqs == self.num_sampled

    @cached_property
    def _seqs(self) -> tuple:
        return (*self._decoding, *(s for s, _ in self._entries))  # decodes first

    @cached_property
    def seq_ids(self) -> tuple[int, ...]:
        return tuple(s.seq_id for s in self._seqs)

    @cached_property
    def num_new_tokens(self) -> tuple[int, ...]:
        return (1,) * len(self._decoding) + tuple(n for _, n in self._entries)

    @cached_property
    def num_computed_tokens(self) -> tuple[int, ...]:
        return tuple(s.num_computed_tokens for s in self._seqs)

    @cached_property
    def block_tables(self) -> tuple[list[int], ...] | None:
        return tuple(s.block_table for s in self._seqs) if self.paged else None

    @cached_property
    def slab_starts(self) -> tuple[int, ...] | None:
        return None if self.paged else tuple(s.slab_start for s in self._seqs)
