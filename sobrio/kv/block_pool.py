"""KV blocks: a free list in LRU order, reference counts, and content hashes for prefix caching.

A block whose tokens are all computed gets a hash chaining its parent's hash, its token ids and the
request's cache salt. When its last owner lets go it joins the free list but keeps its hash, so a later
request with the same prefix (and salt) takes it back instead of recomputing; a free block handed out for
new content loses its old hash then (eviction, least recently freed first).
"""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


def hash_block(parent: bytes | None, token_ids: list[int], salt: str | None) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update((salt or "").encode())
    h.update(b"|")
    h.update(",".join(map(str, token_ids)).encode())
    return h.digest()


@dataclass
class BlockPool:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    blocks: list[Block] = field(init=False)
    free: "OrderedDict[int, None]" = field(init=False)  # LRU order: evict from the front
    cached: dict[bytes, int] = field(init=False)  # block hash -> block id
    queries: int = 0  # prompt tokens looked up in the cache
    hits: int = 0  # of those, tokens found

    def __post_init__(self) -> None:
        assert self.num_blocks > 0
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free = OrderedDict((i, None) for i in range(self.num_blocks))
        self.cached = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self) -> int:
        """Take the least recently freed block, evicting whatever it cached."""
        assert self.free, "no free KV block"
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
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

    def lookup(self, block_hashes: list[bytes]) -> list[int]:
        """The cached blocks for the longest prefix of these hashes."""
        found = []
        for block_hash in block_hashes:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Remember a full, computed block under its hash (first writer wins)."""
        if not self.enable_prefix_caching:
            return
        self.blocks[block_id].block_hash = block_hash
        self.cached.setdefault(block_hash, block_id)
