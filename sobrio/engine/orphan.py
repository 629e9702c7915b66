"""A child process must not outlive the process that started it.

An engine-core process still loading its weights once sat orphaned for 1.5 h: its step loop checks for its
parent, but loading (seconds to minutes) never did, and a child spawned from a thread cannot rely on
PR_SET_PDEATHSIG (Linux sends it when the *thread* that forked the child exits, which would kill a core
started from a short-lived thread). `exit_with_parent` starts a daemon thread that looks at the parent pid
twice a second from the child's first line on, whatever the main thread is doing, and exits the process
(after `cleanup`) once the parent is gone.
"""

import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

POLL_S = 0.5


def exit_with_parent(parent: int, cleanup: Callable[[], None] | None = None,
                     poll_s: float = POLL_S) -> threading.Thread:
    """Watch `parent` (this process's parent pid when it started) on a daemon thread; exit when it is gone."""
    def watch() -> None:
        while os.getppid() == parent:
            stop.wait(poll_s)
        logger.warning("the process that started this one (pid %d) is gone; exiting", parent)
        try:
            if cleanup is not None:
                cleanup()
        finally:
            os._exit(1)

    stop = threading.Event()  # never set: a sleep that is not a busy loop
    thread = threading.Thread(target=watch, name="sobrio-parent-watch", daemon=True)
    thread.start()
    return thread
