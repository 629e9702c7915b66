"""The OpenMP spin count a spawned engine-core process starts with, and the API process's left as it was."""

import itertools
import multiprocessing
import os
import threading
import time

from sobrio import openmp
from sobrio.engine import core_process, cpu_share
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
    monkeypatch.setattr(core_process, "spin_count_for_start", lambda long, short: long)  # a free host
    monkeypatch.setenv("GOMP_SPINCOUNT", openmp.SPINCOUNT)
    assert spawned_spincount() == openmp.ENGINE_CORE_SPINCOUNT != openmp.SPINCOUNT
    assert os.environ["GOMP_SPINCOUNT"] == openmp.SPINCOUNT


def test_a_policy_the_user_set_reaches_the_core_unchanged(monkeypatch):
    monkeypatch.setattr(openmp, "OMP_WAIT_SET_BY_USER", True)
    monkeypatch.setenv("GOMP_SPINCOUNT", "1234")
    assert spawned_spincount() == "1234"
    assert os.environ["GOMP_SPINCOUNT"] == "1234"


def test_a_core_on_a_shared_host_spins_short_and_bounds_its_allocator_and_caches(monkeypatch):
    """What a core spawned inside the block inherits (the test above shows a spawn sees the environment)."""
    monkeypatch.setattr(openmp, "OMP_WAIT_SET_BY_USER", False)
    monkeypatch.setattr(cpu_share, "cpu_quota", lambda: 0.5)  # a container allowed half a core
    for name in core_process.CORE_ENV:
        monkeypatch.delenv(name, raising=False)
    with engine_core_environ():
        assert os.environ["GOMP_SPINCOUNT"] == openmp.SPINCOUNT and os.environ["MALLOC_ARENA_MAX"] == "2"
        assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == os.environ["LRU_CACHE_CAPACITY"] == "128"
    assert not set(core_process.CORE_ENV) & set(os.environ)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "1024")
    with engine_core_environ():
        assert os.environ["MALLOC_ARENA_MAX"] == "8" and os.environ["LRU_CACHE_CAPACITY"] == "1024"  # the user's
        assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "128"


def test_cores_started_together_each_get_the_whole_environment_and_leave_it_as_it_was(monkeypatch):
    """`start_together` spawns cores from threads at once: each block must see all its settings while it spawns,
    and the API process's environment must be as before when all are done (interleaved blocks restored each
    other's variables: the first to leave removed what the second's core still needed)."""
    monkeypatch.setattr(openmp, "OMP_WAIT_SET_BY_USER", False)
    monkeypatch.setattr(core_process, "spin_count_for_start", lambda long, short: long)
    monkeypatch.setenv("GOMP_SPINCOUNT", openmp.SPINCOUNT)
    for name in core_process.CORE_ENV:
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    together = threading.Barrier(4)
    entered = itertools.count()
    seen: list[bool] = []

    def start() -> None:
        together.wait()
        with engine_core_environ():
            time.sleep(0.05 * (next(entered) + 1))  # a spawn takes a while; the first in leaves first
            seen.append(all(os.environ.get(k) == v for k, v in core_process.CORE_ENV.items()) and
                        os.environ["GOMP_SPINCOUNT"] == openmp.ENGINE_CORE_SPINCOUNT)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert seen == [True] * 4
    assert dict(os.environ) == before
