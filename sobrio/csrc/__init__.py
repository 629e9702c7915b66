"""Optional C++ operators, built with torch's cpp_extension on the machine that runs them.

`load()` compiles once (about a minute on 2 cores; `make install` does it) and caches the build under
torch's extension folder; if no compiler is there it returns None and callers keep the PyTorch path.
"""

import functools
import hashlib
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


@functools.cache
def load():
    if os.environ.get("SOBRIO_DISABLE_CPP"):
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        folder = Path(__file__).parent
        sources = [str(folder / name) for name in ("paged_attention.cpp", "cpu_ops.cpp")]
        # torch rebuilds when a source or a flag changes, not a header: the header's hash is a flag.
        header = hashlib.sha256((folder / "vec.h").read_bytes()).hexdigest()[:12]
        return load_extension(name="sobrio_cpu_ops", sources=sources,
                              extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno",
                                            f"-DSOBRIO_VEC_H={header}"],
                              extra_include_paths=[str(folder)],
                              extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, or headers missing: keep the PyTorch path
        logger.warning("C++ operators unavailable (%s); using the PyTorch attention path", type(exc).__name__)
        return None
