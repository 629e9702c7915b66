"""numpy's transparent huge pages off, set when `sobrio` is imported, before anything imports numpy.

numpy asks the kernel for transparent huge pages for each of its allocations from 4 MB up
(`madvise(MADV_HUGEPAGE)`). Where the kernel's THP defrag setting is `madvise` (its default), each first
write into such memory may then wait on memory compaction, which made a GGUF's load almost twice as long on a
2-core VM (docs/memory.md, "numpy without transparent huge pages"). PyTorch's own allocator does not ask.
`NUMPY_MADVISE_HUGEPAGE`, numpy's documented switch, wins where the user sets it.
"""

import os
import sys

SET_BY_USER = "NUMPY_MADVISE_HUGEPAGE" in os.environ
if not SET_BY_USER:
    os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"  # read by numpy when it is imported, here and in child processes
    if "numpy" in sys.modules:  # imported before sobrio: numpy's own switch, which the variable sets at import
        switch = getattr(getattr(sys.modules["numpy"], "_core", None), "multiarray", None)
        getattr(switch, "_set_madvise_hugepage", lambda enabled: None)(False)
