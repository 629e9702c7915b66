"""The OpenMP thread policy, set when `sobrio` is imported, before anything imports torch.

Unbounded busy-waiting (the ACTIVE policy) makes a decoder layer many times slower on a busy 2-core
machine; never waiting (PASSIVE) pays a thread wake-up at each of the ~300 small parallel regions of a
decode step. GNU OpenMP's spin count bounds the wait: `SPINCOUNT` spins keep a thread awake across the
short gaps of a step but not the long ones (the measurements: docs/benchmarks.md, "The CPU fast path").
The engine-core process of `sobrio serve` spins longer (`ENGINE_CORE_SPINCOUNT`, set for it by
`engine.core_process`). An explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT wins everywhere.
"""

import os

SPINCOUNT = "100000"
# The serving engine's own process (about 13 ms of spinning when it goes idle), for when other processes
# share its cores: 32 streams through HTTP with an httpx client on the same 2 cores 1,070 -> 1,140 tok/s (mean
# of 4 runs each, Intel Xeon with AMX, the batch-32 workload of `benchmarks/peers/serving_workloads.sh`);
# with the lighter aiohttp client 1,169 -> 1,206 (2 runs each), offline steps unchanged. Our reading, not
# measured: a thread that spun out sleeps, then must be woken on a core another process holds.
ENGINE_CORE_SPINCOUNT = "1000000"
OMP_WAIT_SET_BY_USER = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
if not OMP_WAIT_SET_BY_USER:
    os.environ["GOMP_SPINCOUNT"] = SPINCOUNT
