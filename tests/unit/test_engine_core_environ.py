"""The OpenMP spin count a spawned engine-core process starts with, and the API process's left as it was."""

import multiprocessing
import os

from sobrio import openmp
from sobrio.engine.core_process import engine_core_environ


def _report_spincount(queue) -> None:
    queue.put(os.environ.get("GOMP_SPINCOUNT"))


def spawned_spincount() -> str | None:
    """GOMP_SPINCOUNT as a process spawned under `engine_core_environ` sees it."""
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    with engine_core_environ():
        child = spawn.Process(target=_report_spincount, args=(queue,))
        child.start()
    try:
        return queue.get(timeout=60)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()


def test_a_spawned_core_spins_longer_and_this_process_keeps_its_own(monkeypatch):
    monkeypatch.setattr(openmp, "OMP_WAIT_SET_BY_USER", False)
    monkeypatch.setenv("GOMP_SPINCOUNT", openmp.SPINCOUNT)
    assert spawned_spincount() == openmp.ENGINE_CORE_SPINCOUNT != openmp.SPINCOUNT
    assert os.environ["GOMP_SPINCOUNT"] == openmp.SPINCOUNT


def test_a_policy_the_user_set_reaches_the_core_unchanged(monkeypatch):
    monkeypatch.setattr(openmp, "OMP_WAIT_SET_BY_USER", True)
    monkeypatch.setenv("GOMP_SPINCOUNT", "1234")
    assert spawned_spincount() == "1234"
    assert os.environ["GOMP_SPINCOUNT"] == "1234"
