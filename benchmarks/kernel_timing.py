"""Shared by the kernel benchmarks (`quant_kernels.py`, `int4_kernels.py`, `vnni_prompt_rows.py`,
`prompt_chunk_attention.py`): the best time of each kernel over the same inputs, the kernels interleaved so
that a burst of load on a shared machine hits every kernel alike; or one call's best CPU time."""

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


def best_cpu_ms(fn: Callable[[], object], repeats: int = 3) -> float:
    """Milliseconds of `fn`'s best call in CPU time (all of the process's threads), after one call not timed:
    a neighbour's load on the host stretches wall time, not the CPU time the call itself takes."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times) * 1e3
