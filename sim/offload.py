"""A CPU tier for the prefix cache (``kv_offload: {cpu_gib: N}``; vLLM's offloading connector, LMCache).

A cached block that the GPU pool evicts (allocation reuses it) moves to host memory instead of being
forgotten; a prefix lookup that misses on the GPU but finds the block here loads it back over the host
link (priced like a swap-in by the step that loads it) instead of recomputing it. The host pool holds
``capacity`` blocks of the GPU's page size, least recently used first out.

A block's content lives in exactly one tier: a load takes the block out of the host pool (it becomes a
GPU-cached block again), and a GPU registration of a hash drops any host copy, so hit counts never count
one block twice. Stores (device -> host on eviction) are counted, not priced: they run asynchronously
after the step, as the offloading connectors do; loads are synchronous and priced.
"""

from __future__ import annotations

from collections import OrderedDict


class HostTier:
    """LRU host pool of cached blocks, keyed by their chained hash: hash -> (identity, parent hash)."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"the host tier holds {capacity_blocks} blocks: cpu_gib is too small for one block")
        self.capacity = capacity_blocks
        self.entries: OrderedDict[int, tuple] = OrderedDict()  # least recently used first
        self.num_stored = 0  # blocks copied device -> host (evictions kept)
        self.num_loaded = 0  # blocks copied host -> device (hits)
        self.num_dropped = 0  # host blocks the LRU let go

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, h: int) -> bool:
        return h in self.entries

    def store(self, h: int, identity, parent_hash: int | None) -> None:
        """A block the GPU evicted: keep it (most recently used), dropping the LRU block when full."""
        e = self.entries
        if h in e:
            e.move_to_end(h)
            return
        if len(e) >= self.capacity:
            e.popitem(last=False)
            self.num_dropped += 1
        e[h] = (identity, parent_hash)
        self.num_stored += 1

    def find(self, h: int, identity, parent_hash: int | None) -> bool:
        """Whether the host holds this block (a hash collision is a miss, as on the GPU)."""
        got = self.entries.get(h)
        return got is not None and got == (identity, parent_hash)

    def take(self, h: int) -> None:
        """Load a found block back to the device: it leaves the host pool."""
        del self.entries[h]
        self.num_loaded += 1

    def discard(self, h: int) -> None:
        """The GPU computed this block again: its host copy is redundant."""
        self.entries.pop(h, None)
