"""Start-up steps logged with their timings, so a slow step shows what it is doing and a hang shows where."""

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def log_step(logger: logging.Logger, what: str, *args: object) -> Iterator[None]:
    """`what...` when the step starts, `what: done in 1.2s` when it ends (nothing more if it raises: the
    caller reports the error)."""
    logger.info(what + "...", *args)
    start = time.monotonic()
    yield
    logger.info(what + ": done in %.1fs", *args, time.monotonic() - start)
