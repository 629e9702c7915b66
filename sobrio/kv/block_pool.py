"""KV blocks: a free list in LRU order and reference counts, over a prefix cache of their contents.

When its last owner lets go, a block joins the free list but stays in the prefix cache, so a later request
with the same prefix (and salt) takes it back instead of recomputing; a free block handed out for new
content is evicted from the cache then (least recently freed first).
"""

from collections import OrderedDict
from dataclasses import dataclass

from sobrio.kv.prefix_cache import EvictionHook, PrefixCache


@dataclass
class Block:
    block_id: int
    ref_count: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # evict from the front
        self.prefix_cache = PrefixCache()
        self.queries = 0  # prompt tokens looked up in the cache
        self.hits = 0  # of those, tokens found

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self) -> int:
        """Take the least recently freed block, evicting whatever it cached."""
        assert self.free, "no free KV block"
        block_id = next(iter(self.free))
        self.prefix_cache.evict(block_id)  # first: a hook that raises leaves the block free and cached
        del self.free[block_id]
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.ref_count = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """Take one more reference to a block (a cache hit or a shared prefix)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; the last one puts it on the free list (newest last)."""
        for block_id in reversed(block_ids):  # tail blocks first, so a prefix outlives its extensions
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} released twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None

    # ---- the prefix cache, as the manager sees it ----
    def lookup(self, block_hashes: list[bytes]) -> list[int]:
        """The cached blocks for the longest prefix of these hashes."""
        return self.prefix_cache.lookup(block_hashes)

    def register(self, block_id: int, block_hash: bytes, salt: str | None = None) -> None:
        """Remember a full, computed block under its hash (first writer wins)."""
        if self.enable_prefix_caching:
            assert self.blocks[block_id].ref_count > 0, "only a block in use has just been computed"
            self.prefix_cache.register(block_id, block_hash, salt)

    def add_eviction_hook(self, hook: EvictionHook) -> None:
        """Call hook(block_hash, block_id) whenever a cached block is about to be reused for new content."""
        self.prefix_cache.add_eviction_hook(hook)

    def purge(self, salt: str) -> int:
        """Make every block cached under this salt unfindable; frees nothing. Those already free now hold
        nothing worth keeping: they move to the front of the free list, to be reused before cached ones.
        Returns how many blocks were forgotten."""
        purged = self.prefix_cache.purge(salt)
        for block_id in purged:
            if block_id in self.free:
                self.free.move_to_end(block_id, last=False)
        return len(purged)
