"""KV transfer between a prefill core and a decode core (disaggregated serving), through the KV layer's own
block export/import: the offload tiers' `BlockCodec` gathers a block's bytes on the prefill side; on the
decode side they land in its RAM tier, where the prefix lookup (`KVOffload.restore`) copies them into pool
blocks exactly as it does blocks offloaded earlier. The decode core computes only the prompt's last partial
block and the last token.

Two connectors:
- shared memory (one host): the prefill core writes the blocks into a POSIX shared-memory segment and
  names it in the request's `kv_transfer_params`; the decode core copies them out and unlinks it.
- TCP (any host): the prefill core keeps the blocks and serves them on a ZMQ socket at `kv_ip:kv_port`; the
  decode core asks for them by transfer id, once.
Exports nobody takes (a request aborted between the two) expire after `EXPORT_TTL_S`. The blocks are KV
tensors in RAM only, never written to a disk.
"""

import logging
import os
import threading
import time
import uuid
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import zmq

logger = logging.getLogger("sobrio.kv.transfer")

EXPORT_TTL_S = 60.0
PULL_TIMEOUT_MS = 10_000


def _untracked(segment: shared_memory.SharedMemory) -> shared_memory.SharedMemory:
    """Python's resource tracker would unlink a segment when the process that opened it exits (and warn): the
    connector decides when a segment goes, so it is taken off the tracker's list."""
    resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001 - the name the tracker keeps
    return segment


class KVConnector:
    """One per engine core; exports for the prefill role, imports for the decode role."""

    def __init__(self, connector: str, ip: str, port: int):
        self.kind = "shm" if connector == "SharedMemoryConnector" else "tcp"
        self.ip, self.port = ip, port
        self.exports: dict[str, tuple[float, object]] = {}  # id -> (time, segment or list of block bytes)
        self.lock = threading.Lock()
        self.server: threading.Thread | None = None
        self.address = ""
        self.bytes_sent = self.bytes_received = 0
        self.seconds_exporting = self.seconds_importing = 0.0

    # ---- the prefill side ----
    def export(self, blocks: list[np.ndarray], block_hashes: list[bytes]) -> dict:
        """The blocks of a finished prefill: kept for the decode core; what it needs to fetch them."""
        start = time.perf_counter()
        self._expire()
        transfer_id = uuid.uuid4().hex
        params = {"connector": self.kind, "id": transfer_id, "hashes": [h.hex() for h in block_hashes]}
        if not blocks:
            return params
        nbytes = sum(b.nbytes for b in blocks)
        if self.kind == "shm":
            segment = _untracked(shared_memory.SharedMemory(create=True, size=nbytes))
            view = np.ndarray((nbytes,), dtype=np.uint8, buffer=segment.buf)
            offset = 0
            for block in blocks:
                view[offset:offset + block.nbytes] = block
                offset += block.nbytes
            del view
            params["name"], stored = segment.name, segment
        else:
            self._serve()
            params["address"], stored = self.address, [b.tobytes() for b in blocks]
        params["block_nbytes"] = blocks[0].nbytes
        with self.lock:
            self.exports[transfer_id] = (time.monotonic(), stored)
        self.bytes_sent += nbytes
        self.seconds_exporting += time.perf_counter() - start
        return params

    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            old = [k for k, (t, _) in self.exports.items() if now - t > EXPORT_TTL_S]
            stale = [self.exports.pop(k)[1] for k in old]
        for stored in stale:
            _release(stored)

    def _serve(self) -> None:
        """Start the TCP server thread on first use."""
        if self.server is not None:
            return
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        port = sock.bind_to_random_port(f"tcp://{self.ip}") if not self.port else self.port
        if self.port:
            sock.bind(f"tcp://{self.ip}:{self.port}")
        self.address = f"tcp://{self.ip}:{port}"
        self.server = threading.Thread(target=self._answer, args=(sock,), name="sobrio-kv-transfer", daemon=True)
        self.server.start()
        logger.info("KV transfer: serving exported blocks at %s", self.address)

    def _answer(self, sock) -> None:
        while True:
            peer, _, transfer_id = sock.recv_multipart()
            with self.lock:
                entry = self.exports.pop(transfer_id.decode(), None)
            sock.send_multipart([peer, b"", *(entry[1] if entry else [])])

    # ---- the decode side ----
    def fetch(self, params: dict) -> list[np.ndarray]:
        """The blocks a prefill core exported, in order, as uint8 arrays; [] when they are gone (the decode
        core computes)."""
        start = time.perf_counter()
        try:
            blocks = self._fetch_shm(params) if params["connector"] == "shm" else self._fetch_tcp(params)
        except (OSError, zmq.ZMQError, TimeoutError) as exc:
            logger.warning("KV transfer %s failed (%s): the decode core computes the prompt", params.get("id"),
                           type(exc).__name__)
            return []
        self.bytes_received += sum(b.nbytes for b in blocks)
        self.seconds_importing += time.perf_counter() - start
        return blocks

    @staticmethod
    def _fetch_shm(params: dict) -> list[np.ndarray]:
        if "name" not in params:
            return []
        segment = _untracked(shared_memory.SharedMemory(name=params["name"]))
        try:
            data = np.frombuffer(segment.buf, dtype=np.uint8).copy()
        finally:
            segment.close()
            _unlink(segment)
        size = params["block_nbytes"]
        return [data[i:i + size] for i in range(0, len(data), size)]

    @staticmethod
    def _fetch_tcp(params: dict) -> list[np.ndarray]:
        if "address" not in params:
            return []
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(params["address"])
            sock.send(params["id"].encode())
            if not sock.poll(PULL_TIMEOUT_MS):
                raise TimeoutError(params["address"])
            return [np.frombuffer(frame, dtype=np.uint8) for frame in sock.recv_multipart()]
        finally:
            sock.close()

    def snapshot(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "seconds_exporting": self.seconds_exporting, "seconds_importing": self.seconds_importing,
                "exports_held": len(self.exports)}

    def close(self) -> None:
        with self.lock:
            stale = [stored for _, stored in self.exports.values()]
            self.exports.clear()
        for stored in stale:
            _release(stored)


def _release(stored) -> None:
    if isinstance(stored, shared_memory.SharedMemory):
        stored.close()
        _unlink(stored)


def _unlink(segment: shared_memory.SharedMemory) -> None:
    try:
        os.unlink(f"/dev/shm/{segment.name.lstrip('/')}")
    except FileNotFoundError:
        pass  # the other side was first


def open_connector(config) -> KVConnector | None:
    transfer = config.kv_transfer_config
    if not transfer.enabled:
        return None
    return KVConnector(transfer.get("kv_connector"), transfer.get("kv_ip"), transfer.get("kv_port"))
