"""Shared fixtures: real models loaded once per session, and their transformers references."""

import atexit
import functools
import os
import pathlib
import re
import shutil
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs a worker per core: one thread each (no contention)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Servers started by tests keep their tenants and usage ledger in a folder of this test process, removed at
# its end, never in the user's own ~/.local/share/sobrio/gateway.db.
_GATEWAY_DIR = tempfile.mkdtemp(prefix="sobrio-test-gateway-")
atexit.register(shutil.rmtree, _GATEWAY_DIR, ignore_errors=True)
os.environ["SOBRIO_DB"] = os.path.join(_GATEWAY_DIR, "gateway.db")
# Quantized models are quantized by each test (the code under test), not read from an earlier run's cache;
# tests/model/test_quantization_cache.py gives the cache a folder of its own.
os.environ["SOBRIO_QUANTIZATION_CACHE"] = "off"

import pytest  # noqa: E402 - after the environment it reads

# The files that take minutes (slowest first): with two workers (`make test`) both start on them, and the
# small files fill in at the end, instead of one worker finishing a long file alone while the other idles.
SLOW_FILES_FIRST = ("test_speculative.py", "test_hf_equality.py", "test_scale_out_server.py",
                    "test_structured_properties.py", "test_engine_process.py", "test_batch_invariant.py",
                    "test_cli_serve.py", "test_hostile.py", "test_awq_gptq_model.py", "test_tools.py",
                    "test_quantized_model.py", "test_sampling_engine.py", "test_tensor_parallel.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order stays


def pytest_xdist_make_scheduler(config, log):
    """Each file runs whole on one worker (its module fixtures start once, as `--dist loadfile`), and the files
    that take the session's `server` (two models, 30-70 s to start) share one worker, so it starts once.
    (xdist's own `xdist_group` marks do nothing under pytest 9: they rename a node id pytest 9 no longer keeps.)"""
    from xdist.scheduler import LoadFileScheduling

    class SessionServerOnOneWorker(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "session-server" if _takes_session_server(path) else path

    return SessionServerOnOneWorker(config, log)


@functools.cache
def _takes_session_server(path: str) -> bool:
    """Whether a test file's functions or fixtures take the `server` fixture (the controller sees node ids only)."""
    source = (pathlib.Path(__file__).parent.parent / path).read_text()
    own = re.search(r"^def server\(", source, re.MULTILINE) is not None  # a module fixture of that name
    return not own and re.search(r"def \w+\([^)]*\bserver\b", source) is not None


def _thp_setting() -> str:
    from sobrio.memory import THP_SETTING

    path = pathlib.Path(THP_SETTING)
    return path.read_text() if path.exists() else "[never]"


# Tests of transparent huge pages: skipped where the kernel has none or the administrator turned them off.
with_thp = pytest.mark.skipif("[never]" in _thp_setting(), reason="a kernel with transparent huge pages")


def engine_kwargs(**overrides) -> dict:
    """Small KV cache and fp32: fast to allocate, exact against the reference."""
    kwargs = dict(dtype="float32", kv_cache_memory=256 << 20, max_model_len=1024)
    kwargs.update(overrides)
    return kwargs


@pytest.fixture(scope="session")
def smollm2():
    from sobrio import LLM

    return LLM("smollm2-135m", **engine_kwargs())


@pytest.fixture(scope="session")
def gemma3():
    from sobrio import LLM

    return LLM("gemma3-270m", **engine_kwargs())



@pytest.fixture(autouse=True)
def seeded_random(request):
    """Every test starts from a seed of its own name: a test's unseeded draws no longer depend on which
    tests ran before it in its worker (xdist hands files out as workers free up), so a failure reproduces.
    CI once failed on an unseeded tolerance that a few draws in a hundred exceeded."""
    import zlib

    import torch

    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture(scope="module", autouse=True)
def return_freed_memory():
    """After each test file, hand the memory its engines freed back to the system. glibc keeps a freed
    model's weights in its heap (its mmap threshold grows past their size), so a worker that loaded a dozen
    engines held 8 GB and, beside the other worker's servers, met the OOM killer on a 24 GB host."""
    yield
    free_memory()


def free_memory() -> None:
    """Collect what is unreachable, then give glibc's free heap back to the system."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
