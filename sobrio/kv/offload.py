"""KV offload tiers: blocks evicted from the pool go to host RAM, and from RAM to disk, encrypted per tenant.

The pool calls `on_evict` before it reuses a cached block (its eviction hook): a block whose request
allowed offload (`note_offloadable`) is copied into the RAM tier (a byte budget, LRU). A block pushed out
of RAM goes to the disk tier (a directory, a byte budget, LRU) on a writer thread, sealed with its tenant's
key (kv/sealing.py). A prefix lookup that misses the pool asks `restore` for the next blocks: those in RAM
are copied into fresh pool blocks at once; those on disk are read and decrypted on a reader thread into
RAM (`prefetch`), and the scheduler holds the request back (`loading`) until they are there or their
deadline passes, so a step never waits on the disk.

A disk file is `<name>.kvb`: a header (magic, layout version, model id, tenant digest, block hash) and the
sealed block. On start the index is rebuilt from the headers; files of another model or layout are
ignored. Faults (a full disk, a truncated, deleted or tampered file) make misses, never errors: each is
logged once, without content, and counted (`stats`); a block that could not be read leaves the index, so it
is recomputed and never asked for again. A read-only or vanished directory turns the disk tier off (one log
line) until a probe, at most every `DiskTier.probe_interval_s`, can write there again (one more line).
A request waits for the disk once, up to `PREFETCH_DEADLINE_S` from its first lookup (kv/manager.py), and
asks for no more blocks than the RAM tier holds: the rest of its prompt is computed.
"""

import hashlib
import logging
import queue
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from sobrio.errors import ConfigError, where
from sobrio.kv.cache import KVCache
from sobrio.kv.disk_tier import DiskTier, Stats
from sobrio.kv.sealing import TenantKeys, read_master_key, tenant_digest
from sobrio.paths import cache_dir

logger = logging.getLogger("sobrio.kv.offload")

READ_THREADS = 4
PREFETCH_DEADLINE_S = 2.0  # a request waits at most this long for its blocks from disk, then computes them
class BlockCodec:
    """A block's bytes across every layer (keys, values, a quantized cache's scales, a draft's cache),
    gathered and scattered through numpy views of the cache tensors: a block is two contiguous runs per
    tensor, and numpy's slicing costs a fifth of torch's per-op overhead (60 tensors: 57 us, not 264)."""

    def __init__(self, caches: list[KVCache]):
        self.tensors = [t for c in caches for t in c.layers + (c.scale_layers or [])]
        self.parts = [(t, t[:, 0].numel() * t.element_size()) for t in self.tensors]
        self.views = [t.view(torch.uint8).reshape(2, t.shape[1], -1).numpy() for t in self.tensors]
        self.block_nbytes = sum(n for _, n in self.parts)

    def gather(self, block_id: int) -> np.ndarray:
        out = np.empty(self.block_nbytes, dtype=np.uint8)
        offset = 0
        for view in self.views:
            n = 2 * view.shape[2]
            out[offset:offset + n].reshape(2, -1)[:] = view[:, block_id]
            offset += n
        return out

    def scatter(self, block_id: int, source: np.ndarray) -> None:
        assert source.size == self.block_nbytes
        offset = 0
        for view in self.views:
            n = 2 * view.shape[2]
            view[:, block_id] = source[offset:offset + n].reshape(2, -1)
            offset += n


def _work(offload_ref, jobs: queue.Queue) -> None:
    """A worker thread: run the jobs of one queue until "stop", or until its tiers are gone."""
    while True:
        try:
            kind, payload = jobs.get(timeout=1.0)
        except queue.Empty:
            if offload_ref() is None:
                return
            continue
        try:
            offload = offload_ref()
            if kind == "stop" or offload is None:
                return
            offload.run_job(kind, payload)
        except Exception as exc:  # noqa: BLE001 - the tiers must never take the engine down
            logger.error("KV offload: %s job failed: %s at %s", kind, type(exc).__name__, where(exc))
        finally:
            offload = None
            jobs.task_done()


class KVOffload:
    """The RAM and disk tiers behind one pool. Called from the engine's thread; the disk's reads and
    writes run on threads of their own."""

    def __init__(self, codec: BlockCodec, ram_bytes: int, disk_bytes: int, folder: Path | None,
                 keys: TenantKeys | None, model_id: str, locate=lambda block_hash: None):
        self.codec = codec
        self.ram_capacity = max(1, ram_bytes // codec.block_nbytes)
        self.ram: OrderedDict[bytes, tuple[str, np.ndarray]] = OrderedDict()  # hash -> (tenant, bytes)
        self.lock = threading.Lock()
        self.offloadable: dict[bytes, str] = {}  # pool blocks whose request allowed offload -> tenant
        self.stats = Stats()
        self.model_id = hashlib.sha256(model_id.encode()).digest()[:16]
        self.disk = None
        if disk_bytes and folder is not None and keys is not None:
            self.disk = DiskTier(folder, disk_bytes, self.model_id, keys, self.stats)
        self.pending: dict[bytes, float] = {}  # hashes being read from disk -> deadline
        self.writing: set[bytes] = set()  # hashes queued for the disk
        self.unpersisted: OrderedDict[bytes, str] = OrderedDict()  # pool blocks to write to disk when idle
        self.shredded: set[str] = set()  # tenants forgotten: writes of theirs still queued are dropped
        self.locate = locate  # block hash -> the pool block holding it (None: not in the pool)
        self.progress = threading.Event()  # set as blocks arrive from disk (the engine waits on it, not spins)
        # Two threads: reads (a request waits on them) never queue behind writes (nobody waits on those).
        self.readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="sobrio-kv-read")
        self.jobs, self.reads = queue.Queue(), queue.Queue()
        # The threads hold the tiers weakly: an engine dropped without `close` frees them, and they end.
        for name, jobs in (("write", self.jobs), ("read", self.reads)):
            threading.Thread(target=_work, args=(weakref.ref(self), jobs), name=f"sobrio-kv-offload-{name}",
                             daemon=True).start()
        weakref.finalize(self, self.readers.shutdown, wait=False)

    # ---- from the pool and the cache manager ----
    def note_offloadable(self, block_hash: bytes, tenant: str | None) -> None:
        """A block just computed for a request that allows offload: kept in RAM when evicted, and on disk
        once the engine is idle (`persist`) or closes, so a restart finds it."""
        self.offloadable[block_hash] = tenant or ""
        if self._writable(block_hash):
            self.unpersisted[block_hash] = tenant or ""

    def _writable(self, block_hash: bytes) -> bool:
        """There is a disk tier, and this block is neither on it nor on its way."""
        return (self.disk is not None and block_hash not in self.disk.index and block_hash not in self.writing
                and self.disk.usable())

    def _queue_write(self, block_hash: bytes, tenant: str, data: np.ndarray) -> None:
        self.writing.add(block_hash)
        self.jobs.put(("write", (block_hash, tenant, data)))

    def persist(self, limit: int | None = 128) -> bool:
        """Queue disk writes of pool blocks not on disk yet, `limit` at a time (the copy is taken here,
        on the engine's thread, before the block can change); True if some are left. Called while the
        engine is idle: writing through during steps cost 7% of the tokens/s of 32 requests in flight on
        two cores (the writer thread competes for the cores and the GIL)."""
        count = 0
        while self.unpersisted and (limit is None or count < limit):
            block_hash, tenant = self.unpersisted.popitem(last=False)
            block_id = self.locate(block_hash)
            if block_id is None or not self._writable(block_hash):
                continue  # evicted meanwhile: the RAM tier has it, and writes it when it spills or closes
            self._queue_write(block_hash, tenant, self.codec.gather(block_id))
            count += 1
        return bool(self.unpersisted)

    def on_evict(self, block_hash: bytes, block_id: int) -> None:
        """The pool reuses this block: keep a copy in RAM if its request allowed offload."""
        tenant = self.offloadable.pop(block_hash, None)
        self.unpersisted.pop(block_hash, None)
        if tenant is None:
            return
        with self.lock:
            if block_hash in self.ram:
                self.ram.move_to_end(block_hash)
                return
            self.ram[block_hash] = (tenant, self.codec.gather(block_id))
            self.stats.stored["ram"] += 1
            self._spill()

    def put(self, block_hashes: list[bytes], tenant: str | None, blocks: list[np.ndarray]) -> None:
        """Blocks computed elsewhere (a disaggregated prefill core's), into RAM: the prefix lookup restores
        them as it does offloaded ones."""
        with self.lock:
            for block_hash, data in zip(block_hashes, blocks):
                assert data.nbytes == self.codec.block_nbytes, "a block of another layout"
                self.ram[block_hash] = (tenant or "", data)
                self.ram.move_to_end(block_hash)
            self._spill()

    def _spill(self) -> None:
        """Past the RAM budget, the least recently used blocks leave RAM, for the disk if it lacks them
        (called with the lock held)."""
        while len(self.ram) > self.ram_capacity:
            block_hash, (tenant, data) = self.ram.popitem(last=False)
            if self._writable(block_hash):
                self._queue_write(block_hash, tenant, data)

    def restore(self, block_hashes: list[bytes], tenant: str | None, allocate, register,
                read_disk: bool = True) -> list[int]:
        """Pool blocks for the leading `block_hashes` held in RAM (copied in, registered); when the next one
        is on disk and `read_disk` (the request's wait has not passed its deadline), start reading it and
        what follows it (see `loading`). While some are still being read, none: the request waits for them
        all (copying the first ones in at every step starved the reader)."""
        if read_disk and self.loading(block_hashes):
            return []
        blocks = []
        for block_hash in block_hashes:
            with self.lock:
                entry = self.ram.get(block_hash)
                if entry is not None:
                    self.ram.move_to_end(block_hash)
            if entry is None:
                break
            block_id = allocate()
            if block_id is None:
                return blocks  # the pool is full: the rest is computed (or found later)
            self.codec.scatter(block_id, entry[1])
            register(block_id, block_hash)
            self.offloadable[block_hash] = entry[0]
            self.stats.hits["ram"] += 1
            blocks.append(block_id)
        rest = block_hashes[len(blocks):]
        if not rest or rest[0] in self.pending:
            return blocks
        self.stats.misses["ram"] += 1
        if read_disk and self.disk is not None and rest[0] in self.disk:
            self.prefetch(rest, tenant or "")
        elif self.disk is not None:
            self.stats.misses["disk"] += 1  # the blocks from here on are computed
        return blocks

    def prefetch(self, block_hashes: list[bytes], tenant: str) -> None:
        """Read the leading blocks found on disk into RAM, no more than the RAM tier holds (more would push
        the first ones out before the request could take them)."""
        on_disk = []
        for block_hash in block_hashes[:self.ram_capacity]:
            if block_hash not in self.disk:
                break
            on_disk.append(block_hash)
        deadline = time.monotonic() + PREFETCH_DEADLINE_S
        for block_hash in on_disk:
            self.pending[block_hash] = deadline
        self.reads.put(("read", (on_disk, tenant)))

    def loading(self, block_hashes: list[bytes]) -> bool:
        """Whether any of these blocks is being read from disk (and its deadline has not passed)."""
        now = time.monotonic()
        for block_hash in block_hashes:
            deadline = self.pending.get(block_hash)
            if deadline is not None:
                if now <= deadline:
                    return True
                self.pending.pop(block_hash, None)
        return False

    def forget_tenant(self, tenant: str) -> None:
        """Crypto-shred: the tenant's key material goes now; its RAM copies and files follow."""
        with self.lock:
            for block_hash in [h for h, (t, _) in self.ram.items() if t == tenant]:
                del self.ram[block_hash]
        for table in (self.offloadable, self.unpersisted):
            for block_hash in [h for h, t in table.items() if t == tenant]:
                del table[block_hash]
        if self.disk is not None:
            self.shredded.add(tenant)  # before the key goes: a queued write would make the tenant a new one
            self.disk.keys.forget(tenant_digest(tenant))
            self.jobs.put(("forget", tenant))

    # ---- the worker threads ----
    def run_job(self, kind: str, payload) -> None:
        if kind == "write":
            block_hash, tenant, data = payload
            if tenant not in self.shredded and self.disk.write(block_hash, tenant, data.tobytes()):
                self.stats.stored["disk"] += 1
            self.writing.discard(block_hash)
        elif kind == "read":
            self._read(*payload)
        elif kind == "forget":
            self.disk.forget_tenant(payload)

    def _read(self, block_hashes: list[bytes], tenant: str) -> None:
        """Read, check and decrypt a run of blocks into RAM, `READ_THREADS` files at a time (a cold disk
        serves several reads at once faster than one after another), stopping at the first miss."""
        start = time.perf_counter()
        try:
            for plain, block_hash in zip(self.readers.map(lambda h: self.disk.read(h, tenant), block_hashes),
                                         block_hashes):
                if plain is None:
                    break
                data = np.frombuffer(plain, dtype=np.uint8)  # read-only: only ever copied into the pool
                with self.lock:
                    self.ram[block_hash] = (tenant, data)
                    self._spill()
                self.stats.hits["disk"] += 1
                self.stats.loads += 1
        finally:
            self.stats.load_seconds += time.perf_counter() - start
            for block_hash in block_hashes:
                self.pending.pop(block_hash, None)
            self.progress.set()

    def wait(self, timeout: float) -> None:
        """Block the engine's thread until a disk read finishes (or `timeout`): with nothing else to run, a
        step that only waits for the disk must not spin, holding the GIL the reader thread needs."""
        self.progress.wait(timeout)
        self.progress.clear()

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for the queued disk writes (a clean shutdown, tests)."""
        deadline = time.monotonic() + timeout
        while (self.jobs.unfinished_tasks or self.reads.unfinished_tasks) and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        """Write what the disk lacks (the pool's offloadable blocks, the RAM tier), wait for it, stop."""
        self.persist(limit=None)
        with self.lock:
            for block_hash, (tenant, data) in self.ram.items():
                if self._writable(block_hash):
                    self._queue_write(block_hash, tenant, data)
        self.flush()
        self.jobs.put(("stop", None))
        self.reads.put(("stop", None))

    def snapshot(self) -> dict:
        with self.lock:
            ram_bytes = sum(d.nbytes for _, d in self.ram.values())
        return {"hits_ram": self.stats.hits["ram"], "hits_disk": self.stats.hits["disk"],
                "misses_ram": self.stats.misses["ram"], "misses_disk": self.stats.misses["disk"],
                "stored_ram": self.stats.stored["ram"],
                "stored_disk": self.stats.stored["disk"], "ram_bytes": ram_bytes,
                "disk_bytes": self.disk.nbytes if self.disk is not None else 0,
                "load_seconds": self.stats.load_seconds, "loads": self.stats.loads,
                "auth_failures": self.stats.auth_failures, "disk_errors": self.stats.disk_errors}


def open_offload(cache_config, model: str, caches: list, manager) -> KVOffload | None:
    """The tiers the flags ask for, hooked to the cache manager's pool; None without --kv-offload-ram.
    The disk tier needs a master key (a ConfigError that never shows a key, otherwise)."""
    if not cache_config.kv_offload_ram:
        return None
    codec = BlockCodec([c for c in caches if c is not None])
    folder = keys = None
    if cache_config.kv_offload_disk:
        master = read_master_key(cache_config.kv_offload_key_file)
        if master is None:
            raise ConfigError("--kv-offload-disk needs a master key: $SOBRIO_KV_MASTER_KEY (64 hex digits) or "
                              "--kv-offload-key-file", option="--kv-offload-disk")
        folder = Path(cache_config.kv_offload_dir or cache_dir() / "kv-offload")
        keys = TenantKeys(master, folder / "keyring.json")
    layout = ";".join(f"{t.dtype}{tuple(t[:, 0].shape)}" for t, _ in codec.parts)
    offload = KVOffload(codec, cache_config.kv_offload_ram, cache_config.kv_offload_disk or 0, folder, keys,
                        f"{model}|{cache_config.block_size}|{layout}", manager.pool.prefix_cache.block_of.get)
    manager.offload = offload
    manager.pool.add_eviction_hook(offload.on_evict)
    logger.info("KV offload: RAM tier %d block(s) of %d bytes%s", offload.ram_capacity, codec.block_nbytes,
                f", disk tier {cache_config.kv_offload_disk} bytes in {folder}" if folder else "")
    return offload
