"""The process's resident memory as the kernel counts it, and handing freed heap memory back to it.

Loading frees many transient tensors (each read from the checkpoint, the packing's checks); glibc keeps the
small ones' memory in its heap (its mmap threshold rises to 32 MB after the first large free), where it
still counts as resident until `malloc_trim` returns it: 30 MB after loading a 100 MB test model.
"""

import ctypes
import ctypes.util
import functools


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
