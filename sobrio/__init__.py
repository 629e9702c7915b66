"""sobrio: a frugal LLM inference engine.

The OpenMP thread policy (`sobrio.openmp`) and numpy's huge pages (`sobrio.huge_pages`) are set first,
before anything imports numpy or torch. The public names load on first use (PEP 562), so a process that needs
only part of sobrio (the server before it starts its engine core, the engine core itself) does not import
the offline engine with them.
"""

import importlib

from sobrio import huge_pages, openmp  # noqa: F401  (first: before anything imports numpy or torch)

_EXPORTS = {
    "LLM": "sobrio.llm",
    "CompletionOutput": "sobrio.engine.outputs",
    "Logprob": "sobrio.engine.outputs",
    "RequestOutput": "sobrio.engine.outputs",
    "InvalidRequestError": "sobrio.errors",
    "SobrioError": "sobrio.errors",
    "UnknownModelError": "sobrio.errors",
    "SamplingParams": "sobrio.types.params",
    "StructuredOutputsParams": "sobrio.types.params",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sobrio' has no attribute {name!r}")
