"""numpy's large allocations are not advised as transparent huge pages once sobrio is imported (whichever of
the two comes first), and the user's own NUMPY_MADVISE_HUGEPAGE wins (sobrio/huge_pages.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sobrio.memory import THP_SETTING
from tests.conftest import with_thp

PROBE = """
import sys
first = sys.argv[1]
if first == "numpy":
    import numpy
import sobrio  # noqa: F401
import numpy
buffer = numpy.ones(32 << 20, dtype=numpy.uint8)
address, advised = buffer.ctypes.data + (16 << 20), None  # numpy advises from the first whole page on
for line in open("/proc/self/smaps"):
    if "-" in line.split()[0] and not line.startswith("VmFlags"):
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        inside = start <= address < end
    elif line.startswith("VmFlags") and inside:
        advised = "hg" in line.split()
print(advised)
"""
THP = Path(THP_SETTING)


def advised(first: str, **env: str) -> bool:
    environ = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"} | env
    out = subprocess.run([sys.executable, "-c", PROBE, first], capture_output=True, text=True, timeout=120, env=environ)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip() == "True"


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc/self/smaps")
def test_numpy_memory_is_not_advised_as_huge_pages_unless_the_user_asks():
    assert not advised("sobrio") and not advised("numpy")
    if THP.exists() and "[never]" not in THP.read_text():  # numpy advises only where the kernel has THP
        assert advised("sobrio", NUMPY_MADVISE_HUGEPAGE="1")


COLLAPSE_PROBE = """
import ctypes, hashlib, mmap, os
from sobrio.memory import memory_spans, to_huge_pages
size = 16 << 20
region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
region.write(os.urandom(size))
address = ctypes.addressof(ctypes.c_char.from_buffer(region))
before = hashlib.sha256(region).hexdigest()
moved = to_huge_pages(memory_spans([(address + 4096, size - 8192)]))
huge = 0
for line in open("/proc/self/smaps"):
    if "-" in line.split()[0] and not line.startswith("VmFlags"):
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        inside = start <= address < end
    elif line.startswith("AnonHugePages") and inside:
        huge = int(line.split()[1]) << 10
print(moved, huge, hashlib.sha256(region).hexdigest() == before)
"""


def collapse(**env: str) -> tuple[str, int, bool]:
    environ = {k: v for k, v in os.environ.items() if k != "SOBRIO_DISABLE_HUGE_PAGES"} | env
    out = subprocess.run([sys.executable, "-c", COLLAPSE_PROBE], capture_output=True, text=True, timeout=120,
                         env=environ)
    assert out.returncode == 0, out.stderr[-2000:]
    moved, huge, same = out.stdout.split()
    return moved, int(huge), same == "True"


@with_thp
def test_a_span_moves_to_huge_pages_with_its_contents_and_nothing_around_it():
    """16 MB less a 4 KB page at each end: the 2 MB pages wholly inside it, 12 or 14 MB by its alignment, and
    never the partial ones at its ends (memory beside a model's weights must not become resident)."""
    moved, huge, same = collapse()
    if moved == "None":
        pytest.skip("this kernel does not collapse (MADV_COLLAPSE: Linux 6.1)")
    assert same
    assert int(moved) == huge and huge in (12 << 20, 14 << 20), (moved, huge)
    moved, huge, same = collapse(SOBRIO_DISABLE_HUGE_PAGES="1")
    assert (moved, huge, same) == ("None", 0, True)


def test_regions_merge_into_spans_across_small_gaps_only():
    from sobrio.memory import SPAN_GAP as GAP
    from sobrio.memory import memory_spans

    regions = [(1200 + GAP, 50), (0, 1000), (1251 + 2 * GAP, 10), (900, 300), (10_000_000, 0)]
    assert memory_spans(regions) == [(0, 1250 + GAP), (1251 + 2 * GAP, 1261 + 2 * GAP)]


@with_thp
def test_each_huge_page_waits_for_a_quiet_moment(monkeypatch):
    """The collapse asks before every 2 MB page whether a model step runs, and waits while one does."""
    monkeypatch.delenv("SOBRIO_DISABLE_HUGE_PAGES", raising=False)
    import ctypes
    import mmap

    from sobrio.memory import HUGE_PAGE, memory_spans, to_huge_pages

    region = mmap.mmap(-1, 4 * HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    region.write(b"x" * len(region))
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    answers = iter([False, False, True, False, True, True, True, True])
    asked = []

    def quiet() -> bool:
        asked.append(1)
        return next(answers)

    moved = to_huge_pages(memory_spans([(address, len(region))]), quiet)
    if moved is None:
        pytest.skip("this kernel does not collapse (MADV_COLLAPSE: Linux 6.1)")
    pages = moved // HUGE_PAGE
    assert pages >= 3 and len(asked) == pages + 3  # a look a page; 2 refusals before the first, 1 before the second


def test_a_runner_is_quiet_only_a_while_after_its_last_step(monkeypatch):
    from sobrio.engine import model_runner
    from sobrio.engine.model_runner import StepActivity

    now = [100.0]
    monkeypatch.setattr(model_runner.time, "monotonic", lambda: now[0])
    activity = StepActivity()
    assert activity.quiet()
    with activity:
        now[0] += 5
        assert not activity.quiet()  # a long prompt step
    assert not activity.quiet()
    now[0] += StepActivity.QUIET_S * 1.5
    assert activity.quiet()


def test_pages_refused_for_want_of_memory_are_tried_again_later(monkeypatch, caplog):
    """A page the kernel refuses for want of a free 2 MB block (ENOMEM: memory was short at the start) is tried
    again on later passes, while pages it refuses for other reasons are not; ENOMEM on every page is a short
    host, not a kernel without the call, so the pass goes on through the span."""
    import errno
    import logging
    import threading
    import time

    from sobrio import memory

    page = memory.HUGE_PAGE
    short_twice = {2 * page, 5 * page}  # ENOMEM on the first two tries, then moved
    tries: dict[int, int] = {}

    def collapse_page(libc, address, quiet):
        tries[address] = tries.get(address, 0) + 1
        if address == 7 * page:
            return errno.EINVAL  # not anonymous memory, say: never tried again
        return errno.ENOMEM if address in short_twice and tries[address] <= 2 else 0

    monkeypatch.setattr(memory, "_collapse_page", collapse_page)
    monkeypatch.setattr(memory, "huge_pages_allowed", lambda: True)
    monkeypatch.setattr(memory, "_libc", lambda: object())
    monkeypatch.setattr(memory, "MEMORY_RETRY_S", 0.01)
    others = set(threading.enumerate())  # other tests' models in this process may have later passes of their own

    def later_passes_done() -> bool:
        return not any(t.name == "sobrio-huge-pages-later" and t not in others for t in threading.enumerate())

    with caplog.at_level(logging.INFO, "sobrio.memory"):
        thread = memory.huge_pages_in_background([(page, 8 * page)], "tiny")  # pages 1 to 8
        thread.join(10)  # the first pass (what `ModelRunner.settle` waits for) ends before the later ones
        assert not thread.is_alive()
        for _ in range(500):
            if later_passes_done():
                break
            time.sleep(0.01)
    assert later_passes_done()
    assert tries == {p * page: 3 if p * page in short_twice else 1 for p in range(1, 9)}
    assert "weights of tiny in huge pages: 0.01 of 0.02 GB" in caplog.text  # 5 of 8 pages at first
    assert "2 more huge pages on a later try, 0 still refused" in caplog.text

    tries.clear()  # memory never frees up: MEMORY_RETRIES later passes, then the pages stay as they are
    monkeypatch.setattr(memory, "_collapse_page", lambda libc, address, quiet: (
        tries.__setitem__(address, tries.get(address, 0) + 1), errno.ENOMEM)[1])
    memory.huge_pages_in_background([(page, 2 * page)], "short").join(10)
    for _ in range(500):
        if later_passes_done():
            break
        time.sleep(0.01)
    assert tries == {page: 1 + memory.MEMORY_RETRIES, 2 * page: 1 + memory.MEMORY_RETRIES}
