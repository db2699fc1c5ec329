"""Core types shared by the scheduler, the KV managers and the executors."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property


class Sequence:
    """One request while the server holds it.

    Token bookkeeping follows vLLM v1: the sequence *knows* ``num_tokens`` = prompt + generated tokens,
    of which ``num_computed_tokens`` have their K/V in the cache. A step that computes the last known
    token samples one more output token. So a fresh request prefills its prompt, a decode computes one
    token, and a request preempted by recompute re-prefills prompt + generated tokens. The last output
    token is sampled but never computed, so at most ``prompt + output - 1`` slots are ever filled.
    """

    __slots__ = ("seq_id", "arrival_s", "prompt_tokens", "output_tokens", "num_computed_tokens",
                 "num_output_tokens", "block_table", "cpu_blocks", "slab_start", "slab_tokens", "slab_rounded",
                 "first_token_s", "last_token_s", "num_preemptions")

    def __init__(self, seq_id: int, arrival_s: float, prompt_tokens: int, output_tokens: int) -> None:
        self.seq_id = seq_id
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.block_table: list[int] = []  # paged: physical block ids, in token order
        self.cpu_blocks: list[int] = []  # paged, swapped out: CPU swap-space block ids
        self.slab_start: int | None = None  # contiguous: first token slot of the slab
        self.slab_tokens = 0  # contiguous: slots the policy reserved
        self.slab_rounded = 0  # contiguous: slots the allocator actually took (buddy rounding)
        self.first_token_s: float | None = None
        self.last_token_s = 0.0
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_output_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

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
    lives. ``block_tables`` are views of the sequences' tables, valid until the step completes.

    ``swap_out`` / ``swap_in`` are (source block, destination block) pairs copied before the step runs
    (GPU->CPU and CPU->GPU)."""

    seq_ids: tuple[int, ...]
    num_new_tokens: tuple[int, ...]
    num_computed_tokens: tuple[int, ...]
    num_sampled: int  # sequences that sample a token at the end of this step
    block_size: int
    block_tables: tuple[list[int], ...] | None = None  # paged
    slab_starts: tuple[int, ...] | None = None  # contiguous
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    num_preempted: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @cached_property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @cached_property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens) and self.num_sampled == len(self.seq_ids)

    @cached_property
    def num_prefill_tokens(self) -> int:
        return sum(n for n in self.num_new_tokens if n > 1)

    @cached_property
    def num_decode_tokens(self) -> int:
        return sum(1 for n in self.num_new_tokens if n == 1)

    @cached_property
    def decode_context_tokens(self) -> int:
        """Keys a one-token step reads, summed over such sequences (the cached context plus itself)."""
        return sum(c + 1 for n, c in zip(self.num_new_tokens, self.num_computed_tokens) if n == 1)

    @cached_property
    def prefill_attention_pairs(self) -> int:
        """Query-key pairs of multi-token chunks: n new tokens over c cached ones, causal among themselves."""
        return sum(n * c + n * (n + 1) // 2 for n, c in zip(self.num_new_tokens, self.num_computed_tokens) if n > 1)
