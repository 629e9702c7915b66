"""A tensor-parallel group over torch.distributed (gloo on CPU): its collectives, and what they cost.

Rank 0 runs the scheduler; each step it broadcasts the step's plain inputs (`StepInputs`) and every rank runs
the same forward, whose row-parallel layers all-reduce and whose LM head all-gathers. The rendezvous is a
TCPStore that rank 0 serves: it waits for each rank's "ready" key a second at a time, so a rank that dies
while loading is noticed at once instead of after the collective's timeout.
"""

import logging
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from sobrio.distributed.shm_allreduce import ShmAllReduce

logger = logging.getLogger(__name__)

IDLE_TIMEOUT = timedelta(days=7)  # a rank waits this long for the next step (an idle server sends none)


@dataclass
class CommStats:
    """One kind of collective since start: count, bytes each rank put in, seconds spent (the TP benchmark)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


def serve_store(host: str, size: int, timeout: float = 600.0) -> dist.TCPStore:
    """Rank 0's rendezvous store, on a free port (`store.port`) the other ranks are told."""
    return dist.TCPStore(host, 0, size, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False)


class TPGroup:
    def __init__(self, rank: int, size: int, store: dist.Store, alive=lambda: True, timeout: float = 600.0,
                 same_host: bool = False):
        """Join the group of `store` (rank 0's own, or a client of it); rank 0 waits up to `timeout` seconds
        for the others, asking `alive()` (are they all still running?) between tries. `same_host` (rank 0
        knows it: its ranks are its children): all-reduces through shared memory."""
        self.rank, self.size = rank, size
        self.stats = {"all_reduce": CommStats(), "all_gather": CommStats()}
        if dist.is_initialized():
            raise RuntimeError("this process already holds a tensor-parallel group: one tensor-parallel engine per "
                               "process (close the other first)")
        self.open = True
        self.shm = ShmAllReduce(0, size, alive=alive) if rank == 0 and same_host else None
        if rank == 0:
            store.set("shm", self.shm.name if self.shm else "")
        store.set(f"ready/{rank}", "1")
        if rank == 0:
            self._wait_for_ranks(store, alive, timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
        self.store = store  # rank 0's serves the others until the group closes
        if rank != 0 and (name := store.get("shm").decode()):
            self.shm = ShmAllReduce(rank, size, name)

    @classmethod
    def join(cls, rank: int, size: int, host: str, port: int, timeout: float = 600.0) -> "TPGroup":
        """A rank other than 0: connect to rank 0's store."""
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timedelta(seconds=timeout))
        return cls(rank, size, store)

    def _wait_for_ranks(self, store, alive, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for rank in range(1, self.size):
            while not store.check([f"ready/{rank}"]):
                if not alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} exited while starting")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel rank {rank} not ready after {timeout:.0f}s")
                time.sleep(0.1)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel layer's partial output, in place."""
        start = time.perf_counter()
        if self.shm is not None and self.shm.fits(tensor):
            self.shm.all_reduce(tensor)
        else:
            dist.all_reduce(tensor)
        self._count("all_reduce", tensor, start)
        return tensor

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's slice of the logits, side by side, the padding rows cut: [rows, vocab_size]."""
        start = time.perf_counter()
        logits = logits.contiguous()
        if self.shm is not None and self.shm.fits(logits):
            parts = self.shm.all_gather(logits)
        else:
            parts = [torch.empty_like(logits) for _ in range(self.size)]
            dist.all_gather(parts, logits)
        self._count("all_gather", logits, start)
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def broadcast(self, message=None):
        """Rank 0's message (a step's inputs; None: stop) to every rank; the others pass nothing."""
        box = [message]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _count(self, kind: str, tensor: torch.Tensor, start: float) -> None:
        stats = self.stats[kind]
        stats.calls += 1
        stats.bytes += tensor.numel() * tensor.element_size()
        stats.seconds += time.perf_counter() - start

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.open and dist.is_initialized():
            dist.destroy_process_group()
        self.open = False
