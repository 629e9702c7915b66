"""Per-request KV bookkeeping on top of the block pool: block tables, prefix hits, hashing full blocks.

It knows tokens and blocks, nothing of models: a request is anything with the fields used below.
"""

import time

from sobrio.kv.block_pool import BlockPool
from sobrio.kv.offload import PREFETCH_DEADLINE_S
from sobrio.kv.prefix_cache import hash_block


class KVCacheManager:
    def __init__(self, pool: BlockPool, sliding_window: int | None = None):
        self.pool = pool
        self.block_size = pool.block_size
        self.offload = None  # kv/offload.py's tiers behind the pool, when configured
        # Every layer attends over at most this many positions (None: some layer sees the whole context):
        # blocks wholly behind it are freed as a request advances (`free_outside_window`).
        self.sliding_window = sliding_window

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def apply_prefix_hits(self, req) -> None:
        """Point a request that has nothing computed at the cached blocks of its longest cached prefix.

        The last token is always recomputed: the step needs its logits.
        """
        assert req.num_computed_tokens == 0 and not req.block_table
        if not self.pool.enable_prefix_caching:
            return
        tokens = req.all_token_ids
        hashes = self._prompt_hashes(req, (len(tokens) - 1) // self.block_size)
        hits = self.pool.lookup(hashes)
        for block_id in hits:
            self.pool.touch(block_id)
        if self.offload is not None and len(hits) < len(hashes):
            hits = hits + self.offload.restore(hashes[len(hits):], req.cache_salt, self._free_block,
                                               lambda block_id, h: self.pool.register(block_id, h, req.cache_salt),
                                               read_disk=self._may_wait(req))
            if req.kv_load_deadline is None and self.offload.loading(hashes[len(hits):]):
                req.kv_load_deadline = time.monotonic() + PREFETCH_DEADLINE_S  # one wait per request
        req.block_table = list(hits)
        req.block_hashes = hashes[:len(hits)]
        req.prompt_block_hashes = hashes
        req.num_computed_tokens = len(hits) * self.block_size
        self.pool.queries += len(tokens)
        self.pool.hits += req.num_computed_tokens

    def _prompt_hashes(self, req, num_blocks: int) -> list[bytes]:
        """The chained hashes of the first num_blocks blocks; kept from an earlier admission attempt when
        the tokens have not changed since (a held-back request is looked up again every step)."""
        if len(req.prompt_block_hashes) == num_blocks:
            return req.prompt_block_hashes
        tokens, hashes, parent = req.all_token_ids, [], hash_root(req)
        for j in range(num_blocks):
            parent = hash_block(parent, tokens[j * self.block_size:(j + 1) * self.block_size], req.cache_salt)
            hashes.append(parent)
        return hashes

    def _free_block(self) -> int | None:
        """A block for a restored one, while the pool has some free."""
        return self.pool.allocate() if self.pool.num_free else None

    def loading(self, req) -> bool:
        """Whether blocks this request would compute are on their way from the disk tier, and it may still
        wait for them."""
        return self.offload is not None and self._may_wait(req) and self.offload.loading(self.uncomputed_hashes(req))

    @staticmethod
    def _may_wait(req) -> bool:
        """A request waits for the disk tier until one deadline from its first read, then computes."""
        return req.kv_load_deadline is None or time.monotonic() < req.kv_load_deadline

    def uncomputed_hashes(self, req) -> list[bytes]:
        """Hashes of the full blocks this request still has to compute (empty once its prefill is done)."""
        return req.prompt_block_hashes[req.num_computed_tokens // self.block_size:]

    def allocate_slots(self, req, num_new_tokens: int) -> bool:
        """Grow the block table to hold num_new_tokens more; False (and no change) if blocks run out."""
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_table)
        if need > self.pool.num_free:
            return False
        req.block_table.extend(self.pool.allocate() for _ in range(need))
        return True

    def cache_full_blocks(self, req) -> None:
        """Hash every block that became full of computed tokens, so later requests can reuse it."""
        if not self.pool.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        if len(req.block_hashes) >= num_full:
            return
        tokens = req.all_token_ids
        while len(req.block_hashes) < num_full:
            j = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else hash_root(req)
            block_hash = hash_block(parent, tokens[j * self.block_size:(j + 1) * self.block_size], req.cache_salt)
            self.pool.register(req.block_table[j], block_hash, req.cache_salt)
            if self.offload is not None and req.kv_offload:
                self.offload.note_offloadable(block_hash, req.cache_salt)
            req.block_hashes.append(block_hash)

    def purge(self, salt: str) -> int:
        """Forget the cached blocks of one cache salt (a deleted tenant); requests using them keep them."""
        if self.offload is not None:
            self.offload.forget_tenant(salt)
        return self.pool.purge(salt)

    def free_outside_window(self, req) -> None:
        """Give back the blocks no layer will read again: every position below `num_computed_tokens - window
        + 1`, the first key the next query (at `num_computed_tokens`) sees. Their ids stay in the table as
        placeholders (positions index it), never read again: attention starts at the window (vLLM v1's
        sliding-window manager does the same with a null block). A hashed block stays findable in the prefix
        cache until it is reused, like any freed block."""
        if self.sliding_window is None:
            return
        first_needed = max(0, req.num_computed_tokens - self.sliding_window + 1)
        behind = min(first_needed // self.block_size, len(req.block_table))
        if behind > req.num_freed_blocks:
            self.pool.release(req.block_table[req.num_freed_blocks:behind])
            req.num_freed_blocks = behind

    def free(self, req) -> None:
        self.pool.release(req.block_table[req.num_freed_blocks:])
        req.block_table = []
        req.block_hashes = []
        req.num_freed_blocks = 0


def hash_root(req) -> bytes | None:
    """The parent of a request's first block hash: its LoRA adapter's, so two adapters (or an adapter and the
    base model) never share a block; None for the base model."""
    adapter = req.sampling_params.lora_request
    return None if adapter is None else adapter.hash_root
