"""The process's resident memory as the kernel counts it, handing freed heap memory back to it, and zeroed
memory that costs nothing until written.

Loading frees many transient tensors (each read from the checkpoint, the packing's checks); glibc keeps the
small ones' memory in its heap (its mmap threshold rises to 32 MB after the first large free), where it
still counts as resident until `malloc_trim` returns it: 30 MB after loading a 100 MB test model.
"""

import contextlib
import ctypes
import ctypes.util
import functools
import math
import mmap
import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

POPULATE_CHUNK = 32 << 20  # bytes a madvise call maps: the process's mmap lock is never held long
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range in now, as a write would, without changing its contents
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
HEAP_KEPT = 1 << 30  # free bytes at the heap's top that glibc keeps for reuse once `reuse_step_buffers` runs


def zeros_on_touch(shape: tuple[int, ...], dtype: "torch.dtype") -> "torch.Tensor":
    """A zeroed tensor on a fresh anonymous memory map, whose pages the kernel maps (zeroed) when first
    written, instead of writing the zeros now: `torch.zeros` wrote every page of a 2 GB KV cache at start
    (0.4-0.5 s of a 1B model's start on a 2-core Zen 4). A map of its own, not the heap's memory: its pages
    are the kernel's zero pages whatever ran before, and it is page-aligned for `populate_in_background`.
    (torch imported here: this module is read before it.)"""
    import torch

    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the map alive


def proc_bytes(path: str, field: str) -> int | None:
    """A `Field:   123 kB` line of a /proc file in bytes, or None where it is not there."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def process_resident() -> int:
    """This process's resident memory (VmRSS) in bytes, or 0 where /proc does not say."""
    return proc_bytes("/proc/self/status", "VmRSS") or 0


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_freed_memory() -> None:
    """Return the heap's free pages to the kernel (glibc's malloc_trim; nothing elsewhere)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def reuse_step_buffers() -> bool:
    """Have glibc serve large allocations from its heap and keep them there once freed (up to HEAP_KEPT), so
    that a model step's large activations (a gate_up output for a whole prompt chunk) reuse the pages the step
    before used. By default each allocation past 32 MB is a fresh memory map whose every page faults in
    zeroed, and is unmapped when freed (what that cost: docs/memory.md, "A step's buffers"). Called once the
    weights are loaded, so their memory is laid out as before; the engine core's `malloc_trim` every 30 s
    still returns what is free. False where the C library is not glibc."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, HEAP_KEPT))


def populate_in_background(tensors: "list[torch.Tensor]") -> threading.Thread:
    """Map the pages of `tensors` (`zeros_on_touch`'s) on a thread of their own at the lowest priority: the
    memory a KV cache reserves is then resident soon after start, as before, so a host short of memory fails
    early rather than under load, and resident memory does not creep up as new blocks are first used; the
    start and the first requests do not wait for it. Contents are unchanged, so requests may write the tensors
    meanwhile. Where the kernel lacks the call (before 5.14), pages are mapped as they are first written."""
    spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
    thread = threading.Thread(target=_populate, args=(spans, tensors), name="sobrio-populate", daemon=True)
    thread.start()
    return thread


def _populate(spans: list[tuple[int, int]], keep: list) -> None:
    """`keep`: the tensors, alive until their pages are mapped."""
    libc = _libc()
    if libc is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: this thread only
    for address, nbytes in spans:
        start = address - address % mmap.PAGESIZE
        end = address + nbytes
        for chunk in range(start, end, POPULATE_CHUNK):
            size = min(POPULATE_CHUNK, end - chunk)
            if libc.madvise(ctypes.c_void_p(chunk), ctypes.c_size_t(size), MADV_POPULATE_WRITE) != 0:
                return  # an older kernel: first writes map the pages
