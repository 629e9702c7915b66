"""Callbacks on the engine's delivery path (metrics, request logs) must never stop the engine.

The engine thread hands every output to the server's callbacks before routing it to its request. One of
them raising (a metric library refusing a value, a bug in a log line) once killed that thread: every
request of the model hung from then on while /health said 200. `CallbackGuard` runs such a callback,
logs the first error of each type with where it happened (never its message, which could carry request
text), counts every one, and lets the request go on.
"""

import logging
from collections import Counter
from collections.abc import Callable

from sobrio.errors import where

logger = logging.getLogger(__name__)


class CallbackGuard:
    """Runs callbacks whose failure must not reach the caller; `errors` counts them by exception type."""

    def __init__(self, what: str):
        self.what = what
        self.errors: Counter[str] = Counter()

    def __call__(self, callback: Callable[..., object], *args) -> None:
        try:
            callback(*args)
        except Exception as exc:
            self.record(exc)

    def record(self, exc: BaseException) -> None:
        name = type(exc).__name__
        if name not in self.errors:
            logger.error("%s raised %s at %s; logged once, counted, the request goes on", self.what, name,
                         where(exc))
        self.errors[name] += 1

    @property
    def total(self) -> int:
        return sum(self.errors.values())
