"""sobrio: a frugal LLM inference engine.

The thread policy is set here, before anything imports torch: with OpenMP's default busy-wait,
two threads on a busy 2-core machine make a decoder layer up to 50x slower.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from sobrio.engine.outputs import CompletionOutput, Logprob, RequestOutput
from sobrio.errors import InvalidRequestError, SobrioError, UnknownModelError
from sobrio.llm import LLM
from sobrio.sample.params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "InvalidRequestError",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "SobrioError",
    "UnknownModelError",
]
__version__ = "0.1.0"
