"""Start-up steps logged with their timings, so a slow step shows what it is doing and a hang shows where."""

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


@contextmanager
def log_step(logger: logging.Logger, what: str, *args: object) -> Iterator[None]:
    """`what...` when the step starts, `what: done in 1.2s` when it ends (nothing more if it raises: the
    caller reports the error)."""
    logger.info(what + "...", *args)
    start = time.monotonic()
    yield
    logger.info(what + ": done in %.1fs", *args, time.monotonic() - start)


def start_together(starters: list[Callable[[], T]], stop: Callable[[T], None]) -> list[T]:
    """Run slow starts at once (engine cores, each loading its weights), in their order; if any fails, `stop`
    those that started, then raise the first error: a failed start leaves nothing running."""
    with ThreadPoolExecutor(len(starters)) as pool:
        futures = [pool.submit(starter) for starter in starters]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for future in futures:
            if future.exception() is None:
                stop(future.result())
        raise errors[0]
    return [f.result() for f in futures]
