"""sobrio: a frugal LLM inference engine.

The OpenMP thread policy is set here, before anything imports torch. Unbounded busy-waiting (the
ACTIVE policy) makes a decoder layer up to 50x slower on a busy 2-core machine; never waiting
(PASSIVE) pays a thread wake-up at each of the ~300 small parallel regions of a decode step. GNU
OpenMP's spin count bounds the wait at about a millisecond: batch-32 step 71 -> 46 ms, batch-1
19.8 -> 15 ms (`benchmarks/step_overhead.py`). An explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
"""

import os

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")

from sobrio.engine.outputs import CompletionOutput, Logprob, RequestOutput
from sobrio.errors import InvalidRequestError, SobrioError, UnknownModelError
from sobrio.llm import LLM
from sobrio.sample.params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "InvalidRequestError",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "SobrioError",
    "StructuredOutputsParams",
    "UnknownModelError",
]
__version__ = "0.1.0"
