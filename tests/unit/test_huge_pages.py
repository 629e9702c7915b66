"""numpy's large allocations are not advised as transparent huge pages once sobrio is imported (whichever of
the two comes first), and the user's own NUMPY_MADVISE_HUGEPAGE wins (sobrio/huge_pages.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


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
