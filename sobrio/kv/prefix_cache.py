"""Prefix cache: which block holds the KV of which content, so a request with a known prefix skips computing it.

A full, computed block is named by a hash chaining its parent's hash, its token ids and the request's cache
salt. The cache maps such hashes to block ids; it neither owns blocks nor counts references (the block
pool does). Two things hang on it:
- eviction hooks, called when the pool hands a cached block out for new content, before that content
  overwrites it (an offload tier copies the block out there);
- `purge(salt)`, which forgets every block cached under one salt (deleting a tenant calls it).
"""

import hashlib
from collections.abc import Callable

EvictionHook = Callable[[bytes, int], None]  # (block hash, block id) of a block about to be reused


def hash_block(parent: bytes | None, token_ids: list[int], salt: str | None) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update((salt or "").encode())
    h.update(b"|")
    h.update(",".join(map(str, token_ids)).encode())
    return h.digest()


class PrefixCache:
    """Block hash <-> block id for the blocks whose content is findable, indexed by cache salt.

    Invariant: `block_of` and `hash_of` are inverse maps (a hash names one block, a block holds one hash).
    """

    def __init__(self) -> None:
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.salt_of: dict[bytes, str] = {}  # salted hashes only: purge's index
        self.hashes_of_salt: dict[str, set[bytes]] = {}
        self.eviction_hooks: list[EvictionHook] = []

    def __len__(self) -> int:
        return len(self.block_of)

    def add_eviction_hook(self, hook: EvictionHook) -> None:
        self.eviction_hooks.append(hook)

    def lookup(self, block_hashes: list[bytes]) -> list[int]:
        """The cached blocks for the longest prefix of these hashes."""
        found = []
        for block_hash in block_hashes:
            block_id = self.block_of.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def register(self, block_id: int, block_hash: bytes, salt: str | None) -> bool:
        """Make a full, computed block findable under its hash; False if another block already holds that
        content (first writer wins: this one stays a plain block)."""
        if block_hash in self.block_of:
            return False
        assert block_id not in self.hash_of, f"block {block_id} is cached twice"
        self.block_of[block_hash] = block_id
        self.hash_of[block_id] = block_hash
        if salt is not None:
            self.salt_of[block_hash] = salt
            self.hashes_of_salt.setdefault(salt, set()).add(block_hash)
        return True

    def evict(self, block_id: int) -> None:
        """The pool reuses this block for new content: forget what it held, telling the hooks first."""
        block_hash = self.hash_of.get(block_id)
        if block_hash is None:
            return
        for hook in self.eviction_hooks:
            hook(block_hash, block_id)
        self._forget(block_hash)

    def purge(self, salt: str) -> list[int]:
        """Forget every block cached under this salt, so later lookups with it miss; other salts keep theirs.
        Returns the blocks forgotten. Their contents and reference counts are untouched: a request still
        using one keeps reading it until it lets go, and the block then frees as a plain one."""
        purged = []
        for block_hash in list(self.hashes_of_salt.get(salt, ())):
            purged.append(self.block_of[block_hash])
            self._forget(block_hash)
        assert salt not in self.hashes_of_salt
        return purged

    def _forget(self, block_hash: bytes) -> None:
        del self.hash_of[self.block_of.pop(block_hash)]
        salt = self.salt_of.pop(block_hash, None)
        if salt is not None:
            hashes = self.hashes_of_salt[salt]
            hashes.discard(block_hash)
            if not hashes:
                del self.hashes_of_salt[salt]
