"""Shared by the kernel benchmarks (`quant_kernels.py`, `int4_kernels.py`): the best time of each kernel
over the same inputs, the kernels interleaved so that a burst of load on a shared machine hits every
kernel alike."""

import time
from collections.abc import Callable


def best_times(kernels: dict[str, Callable], inputs, repeats: int, threads: int) -> dict[str, float]:
    """Seconds of each kernel's best run; CPU time with one thread (robust to other work), else wall time."""
    clock = time.process_time if threads == 1 else time.perf_counter
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, run in kernels.items():
            start = clock()
            run(inputs)
            best[name] = min(best.get(name, float("inf")), clock() - start)
    return best
