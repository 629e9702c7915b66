"""The process's resident memory as the kernel counts it, handing freed heap memory back to it, zeroed
memory that costs nothing until written, and a model's weights moved to huge pages once it serves.

Loading frees many transient tensors (each read from the checkpoint, the packing's checks); glibc keeps the
small ones' memory in its heap (its mmap threshold rises to 32 MB after the first large free), where it
still counts as resident until `malloc_trim` returns it: 30 MB after loading a 100 MB test model.
"""

import collections
import contextlib
import ctypes
import ctypes.util
import errno
import functools
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

POPULATE_CHUNK = 32 << 20  # bytes a madvise call maps: the process's mmap lock is never held long
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range in now, as a write would, without changing its contents
MADV_COLLAPSE = 25  # Linux 6.1: back a range with transparent huge pages now, its contents copied
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and most arm64 kernels
SPAN_GAP = 64 << 10  # regions this close count as one span
COLLAPSE_TRIES = 8  # pages that must all fail before the collapse stops (a kernel without it, THP off)
COLLAPSE_RETRIES = 3  # more tries of a page the kernel refused for now (EAGAIN)
MEMORY_RETRIES = 3  # later passes over the pages refused for want of a free 2 MB block (ENOMEM)
MEMORY_RETRY_S = 60.0  # seconds before each such pass: page cache and other processes' memory move meanwhile
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
QUIET_POLL_S = 0.05  # how often a collapse waiting for a quiet moment looks again
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


def mapped_bytes(addresses: Iterable[int]) -> int | None:
    """Resident bytes of the memory maps holding these addresses (each map once), from /proc/self/smaps:
    exact for tensors on maps of their own (`zeros_on_touch`: the KV cache, whose pages a thread maps after
    the start); None where /proc does not say."""
    wanted = set(addresses)
    total, found = 0, False
    try:
        with open("/proc/self/smaps") as f:
            holds = False  # whether the map whose fields follow holds one of the addresses
            for line in f:
                head = line.split(maxsplit=1)[0] if line.strip() else ""
                if "-" in head and not head.endswith(":"):
                    start, end = (int(a, 16) for a in head.split("-"))
                    holds = any(start <= a < end for a in wanted)
                elif holds and head == "Rss:":
                    total, found = total + int(line.split()[1]) * 1024, True
    except OSError:
        return None
    return total if found else None


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True) if name else None
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


def memory_spans(regions: Iterable[tuple[int, int]], gap: int = SPAN_GAP) -> list[tuple[int, int]]:
    """(address, bytes) regions as sorted address ranges [start, end), those `gap` bytes apart or closer merged
    (allocator headers and page rounding lie between a model's tensors)."""
    spans: list[list[int]] = []
    for start, end in sorted({(address, address + nbytes) for address, nbytes in regions if nbytes > 0}):
        if spans and start - spans[-1][1] <= gap:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [(start, end) for start, end in spans]


def huge_pages_allowed() -> bool:
    """False where the administrator turned transparent huge pages off (`never`), the user did
    (SOBRIO_DISABLE_HUGE_PAGES=1), or the kernel has none."""
    if os.environ.get("SOBRIO_DISABLE_HUGE_PAGES") == "1":
        return False
    try:
        with open(THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_pages_in_background(regions: Iterable[tuple[int, int]], name: str, after: threading.Thread | None = None,
                             quiet: Callable[[], bool] | None = None) -> threading.Thread | None:
    """Move the memory of `regions` ((address, bytes): a model's weights) into transparent huge pages, on a
    thread of its own at the lowest priority, once `after` (the KV cache's mapping) ends. A decode step streams
    every weight, and in 4 KB pages each 4 KB of it costs a page-table walk too. Huge pages from the start
    would slow the load where fresh 2 MB pages are dear (a VM's), so the weights load in 4 KB pages and the
    kernel copies them over (`MADV_COLLAPSE`) whenever `quiet()` says no step runs; the contents do not change,
    so a step may start meanwhile. Only 2 MB pages wholly inside the weights' spans: nothing but the small
    gaps between tensors (`SPAN_GAP`) can become resident. None where huge pages are not allowed
    (`huge_pages_allowed`). Figures: docs/memory.md, "Weights in huge pages"."""
    if not huge_pages_allowed() or _libc() is None:
        logger.info("weights of %s stay in 4 KB pages (%s)", name, "no glibc" if _libc() is None else
                    "huge pages off: SOBRIO_DISABLE_HUGE_PAGES or THP never")
        return None
    spans = memory_spans(regions)
    thread = threading.Thread(target=_collapse, args=(spans, name, after, quiet), name="sobrio-huge-pages",
                              daemon=True)
    thread.start()
    return thread


def _collapse(spans: list[tuple[int, int]], name: str, after: threading.Thread | None,
              quiet: Callable[[], bool] | None) -> None:
    """The weights' memory stays alive for their model's life; if a model is dropped meanwhile, a call on
    freed memory fails or copies what is there, harmless either way."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: this thread only
    if after is not None:
        after.join()
    started = time.perf_counter()
    short: list[int] = []  # pages refused for want of free memory, tried again later
    done = to_huge_pages(spans, quiet, short)
    if done is None:
        logger.info("weights of %s stay in 4 KB pages: this kernel does not move them to huge pages", name)
        return
    logger.info("weights of %s in huge pages: %.2f of %.2f GB in %.1f s", name, done / 1e9,
                sum(end - start for start, end in spans) / 1e9, time.perf_counter() - started)
    if short:  # on a thread of its own: `ModelRunner.settle` waits for this one, not for the later passes
        threading.Thread(target=_retry_short, args=(short, name, quiet), name="sobrio-huge-pages-later",
                         daemon=True).start()


def _retry_short(short: list[int], name: str, quiet: Callable[[], bool] | None) -> None:
    """Later passes over the pages refused for want of memory (the thread's priority is its starter's, 19)."""
    for _ in range(MEMORY_RETRIES):
        time.sleep(MEMORY_RETRY_S)
        pages, short = short, []
        more = _move_pages(pages, quiet, short) or 0
        logger.info("weights of %s: %d more huge pages on a later try, %d still refused for want of memory", name,
                    more // HUGE_PAGE, len(short))
        if not short:
            return


def to_huge_pages(spans: list[tuple[int, int]], quiet: Callable[[], bool] | None = None,
                  short: list[int] | None = None) -> int | None:
    """Back the 2 MB pages that lie wholly inside `spans` with transparent huge pages (`MADV_COLLAPSE`, the
    contents copied), each once `quiet()` says so; the bytes moved, or None where the kernel refuses (before
    6.1, THP off). Pages refused for want of a free 2 MB block (ENOMEM) are added to `short`, for a later try."""
    pages = [page for start, end in spans for page in range(-(-start // HUGE_PAGE) * HUGE_PAGE,
                                                              end - HUGE_PAGE + 1, HUGE_PAGE)]
    return _move_pages(pages, quiet, short)


def _move_pages(pages: list[int], quiet: Callable[[], bool] | None, short: list[int] | None) -> int | None:
    """`to_huge_pages` on a list of 2 MB-aligned page addresses."""
    libc = _libc()
    if libc is None or not huge_pages_allowed():
        return None
    done, refused = 0, collections.Counter()
    for page in pages:
        error = _collapse_page(libc, page, quiet)
        if error == 0:
            done += 1
            continue
        refused[errno.errorcode.get(error, str(error))] += 1
        if error == errno.ENOMEM and short is not None:
            short.append(page)
        if refused.total() >= COLLAPSE_TRIES and done == 0 and error != errno.ENOMEM:
            return None
    if refused:
        logger.info("%d of %d huge pages refused by the kernel: %s", refused.total(), done + refused.total(),
                    ", ".join(f"{name} {count}" for name, count in refused.most_common()))
    return done * HUGE_PAGE


def _collapse_page(libc, page: int, quiet: Callable[[], bool] | None) -> int:
    """One 2 MB page moved once `quiet()` says so: 0, or the errno of the last try. A transient refusal
    (EAGAIN: a page locked or being migrated meanwhile) is tried again, up to COLLAPSE_RETRIES times."""
    for _ in range(COLLAPSE_RETRIES + 1):
        while quiet is not None and not quiet():
            time.sleep(QUIET_POLL_S)
        if libc.madvise(ctypes.c_void_p(page), ctypes.c_size_t(HUGE_PAGE), MADV_COLLAPSE) == 0:
            return 0
        error = ctypes.get_errno()
        if error != errno.EAGAIN:
            return error
        time.sleep(QUIET_POLL_S)
    return error
