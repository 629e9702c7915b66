"""Python's cyclic garbage collector paused while a `sobrio serve` process starts (its survivors then frozen)
or an offline `LLM` loads.

Importing torch and transformers and building a model leave millions of long-lived objects, none of them
garbage, and each full collection during the start walks all of them (docs/memory.md has what that cost).
Frozen (`gc.freeze`) once the process has started, later collections skip them too, as vLLM's engine does
after its start.
"""

import contextlib
import gc


@contextlib.contextmanager
def paused(freeze: bool = True):
    """No collection inside; afterwards what exists is frozen (`freeze`: a process of sobrio's own, not a
    user's program that builds an `LLM`) and collection is on again (where it was on)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()
