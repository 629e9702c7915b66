"""The disk tier of the KV offload (kv/offload.py): sealed blocks as files in one directory, under a byte
budget, LRU by last use; and the counters both tiers keep for /metrics.

A file is `<name>.kvb`: a header (magic, layout version, model id, tenant digest, block hash) and the sealed
block. On start the index is rebuilt from the headers; files of another model or layout are ignored.
Faults (a full disk, a truncated, deleted or tampered file) make misses, never errors: each is logged once,
without content, and counted; a read-only or vanished directory turns the tier off until a probe can write
there again.
"""

import errno
import hashlib
import logging
import os
import struct
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from sobrio.kv.sealing import TenantKeys, seal, tenant_digest, unseal

logger = logging.getLogger("sobrio.kv.offload")  # one logger for both tiers: operators filter on it

LAYOUT_VERSION = 1
MAGIC = b"SOBRIOKV"
HEADER = struct.Struct("<8sI16s16s16s")  # magic, layout version, model id, tenant digest, block hash
# errors that say the directory itself cannot be used (read-only, not ours, gone): the tier turns off
DIRECTORY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR})


@dataclass
class Stats:
    """What /metrics shows of the tiers (sobrio:kv_offload_*)."""

    hits: Counter = field(default_factory=Counter)  # per tier
    misses: Counter = field(default_factory=Counter)  # per tier: lookups past the pool whose next block it lacked
    stored: Counter = field(default_factory=Counter)  # per tier
    load_seconds: float = 0.0
    loads: int = 0
    auth_failures: int = 0
    disk_errors: int = 0


class DiskTier:
    """Sealed blocks as files in one directory, a byte budget, LRU by last use."""

    probe_interval_s = 5.0  # while off: how often to try writing to the directory again

    def __init__(self, folder: Path, budget: int, model_id: bytes, keys: TenantKeys, stats: Stats):
        self.folder, self.budget, self.model_id, self.keys, self.stats = folder, budget, model_id, keys, stats
        self.index: OrderedDict[bytes, tuple[Path, int]] = OrderedDict()  # block hash -> (file, bytes)
        self.nbytes = 0
        self.lock = threading.Lock()
        self.warned: set[str] = set()
        self.off: str | None = None  # why the tier is off (its directory is read-only or gone); None: on
        self.next_probe = 0.0
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._rebuild()
        except OSError as exc:
            self.turn_off("cannot open the directory", exc)

    def _rebuild(self) -> None:
        """The index from the directory's files, oldest use first; other models' and layouts' are ignored."""
        found = []
        for path in self.folder.glob("*.kvb"):
            try:
                with open(path, "rb") as f:
                    magic, version, model_id, _, block_hash = HEADER.unpack(f.read(HEADER.size))
                stat = path.stat()
            except (OSError, struct.error):
                continue
            if magic == MAGIC and version == LAYOUT_VERSION and model_id == self.model_id:
                found.append((stat.st_mtime, block_hash, path, stat.st_size))
        for _, block_hash, path, size in sorted(found):
            self.index[block_hash] = (path, size)
            self.nbytes += size
        if found:
            logger.info("KV disk tier: %d block(s) found in %s", len(found), self.folder)

    def fault(self, what: str, exc: OSError) -> None:
        """Log a condition once per kind (never a block's content or name), count it."""
        self.stats.disk_errors += 1
        kind = f"{what}: {exc.strerror or type(exc).__name__}"
        if kind not in self.warned:
            self.warned.add(kind)
            logger.warning("KV disk tier %s: %s; blocks it cannot hold are recomputed", self.folder, kind)

    def turn_off(self, what: str, exc: OSError) -> None:
        """The directory cannot be used: no reads or writes until `usable` finds it writable again. One log
        line per outage; a directory that has gone takes its index with it."""
        self.stats.disk_errors += 1
        if self.off is None:
            self.off = f"{what}: {exc.strerror or type(exc).__name__}"
            self.next_probe = time.monotonic() + self.probe_interval_s
            logger.warning("KV disk tier %s is off (%s); blocks are recomputed until it is writable again",
                           self.folder, self.off)
        if not self.folder.is_dir():
            self._clear()

    def _clear(self) -> None:
        with self.lock:
            self.index.clear()
            self.nbytes = 0

    def usable(self) -> bool:
        """Whether the tier is on; while off, a probe (at most every `probe_interval_s`) turns it back on
        once a file can be written in the directory again, and reads what the directory holds."""
        if self.off is None:
            return True
        now = time.monotonic()
        if now < self.next_probe:
            return False
        self.next_probe = now + self.probe_interval_s
        probe = self.folder / ".probe"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
            self._clear()
            self._rebuild()
        except OSError:
            return False
        logger.warning("KV disk tier %s is writable again: back on", self.folder)
        self.off = None
        return True

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.index and self.usable()

    def write(self, block_hash: bytes, tenant: str, data: bytes) -> bool:
        """Seal and store one block (False: the disk refused it, or the tier is off; logged once, counted)."""
        if not self.usable():
            return False
        digest = tenant_digest(tenant)
        header = HEADER.pack(MAGIC, LAYOUT_VERSION, self.model_id, digest, block_hash)
        blob = header + seal(self.keys.cipher(digest, create=True), data, header)
        path = self.folder / f"{hashlib.sha256(header).hexdigest()[:32]}.kvb"
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            tmp.replace(path)
        except OSError as exc:
            _unlink(tmp)
            if exc.errno in DIRECTORY_ERRNOS:
                self.turn_off("cannot write", exc)
            else:
                self.fault("cannot write", exc)  # a full disk: this block is lost, later ones may fit
            return False
        with self.lock:
            if block_hash in self.index:
                self.nbytes -= self.index.pop(block_hash)[1]
            self.index[block_hash] = (path, len(blob))
            self.nbytes += len(blob)
            victims = self._over_budget()
        for victim in victims:
            _unlink(victim)
        return True

    def _over_budget(self) -> list[Path]:
        victims = []
        while self.nbytes > self.budget and self.index:
            _, (victim, size) = self.index.popitem(last=False)
            self.nbytes -= size
            victims.append(victim)
        return victims

    def read(self, block_hash: bytes, tenant: str) -> bytes | None:
        """The block's plaintext, or None: missing, unreadable, or failing authentication. A block that
        cannot be read leaves the index (it is recomputed, never asked for again)."""
        with self.lock:
            entry = self.index.get(block_hash)
            if entry is not None:
                self.index.move_to_end(block_hash)
        if entry is None or self.off is not None:
            return None
        try:
            blob = entry[0].read_bytes()
        except OSError as exc:
            self.drop([block_hash])
            if self.folder.is_dir():
                self.fault("cannot read", exc)  # one file deleted or damaged
            else:
                self.turn_off("the directory has gone", exc)
            return None
        try:
            os.utime(entry[0])  # its last use, for the LRU order after a restart
        except OSError as exc:
            self.turn_off("cannot update", exc)  # a read-only directory: this read is still good
        cipher = self.keys.cipher(tenant_digest(tenant), create=False)
        header = blob[:HEADER.size]
        plain = None if cipher is None or len(blob) < HEADER.size else unseal(cipher, blob[HEADER.size:], header)
        if plain is None or header != HEADER.pack(MAGIC, LAYOUT_VERSION, self.model_id, tenant_digest(tenant),
                                                  block_hash):
            self.stats.auth_failures += 1
            self.drop([block_hash])
            return None
        return plain

    def drop(self, block_hashes) -> None:
        with self.lock:
            paths = []
            for block_hash in block_hashes:
                entry = self.index.pop(block_hash, None)
                if entry is not None:
                    self.nbytes -= entry[1]
                    paths.append(entry[0])
        for path in paths:
            _unlink(path)

    def forget_tenant(self, tenant: str) -> None:
        """Remove the tenant's files (its key is gone already: they were unreadable since), and any entry
        whose file has gone."""
        digest, gone = tenant_digest(tenant), []
        with self.lock:
            entries = list(self.index.items())
        for block_hash, (path, _) in entries:
            try:
                with open(path, "rb") as f:
                    if HEADER.unpack(f.read(HEADER.size))[3] == digest:
                        gone.append(block_hash)
            except (OSError, struct.error):
                gone.append(block_hash)
        self.drop(gone)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
