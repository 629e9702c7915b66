"""sobrio: a frugal LLM inference engine.

The thread policy is set here, before anything imports torch: with OpenMP's default busy-wait,
two threads on a busy 2-core machine make a decoder layer up to 50x slower.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from sobrio.engine.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from sobrio.errors import InvalidRequestError, SobrioError, UnknownModelError  # noqa: E402
from sobrio.llm import LLM  # noqa: E402
from sobrio.sample.params import SamplingParams  # noqa: E402

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "SobrioError",
    "InvalidRequestError",
    "UnknownModelError",
]
__version__ = "0.1.0"
