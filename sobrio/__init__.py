"""sobrio: a frugal LLM inference engine.

The OpenMP thread policy is set first (`sobrio.openmp`), before anything imports torch.
"""

from sobrio import openmp  # noqa: F401  (first: before anything imports torch)
from sobrio.engine.outputs import CompletionOutput, Logprob, RequestOutput
from sobrio.errors import InvalidRequestError, SobrioError, UnknownModelError
from sobrio.llm import LLM
from sobrio.types.params import SamplingParams, StructuredOutputsParams

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
