"""Shared fixtures: real models loaded once per session, and their transformers references."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs a worker per core: one thread each (no contention)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

# The files that take minutes (slowest first): with two workers (`make test`) both start on them, and the
# small files fill in at the end, instead of one worker finishing a long file alone while the other idles.
SLOW_FILES_FIRST = ("test_speculative.py", "test_hf_equality.py", "test_structured_properties.py",
                    "test_engine_process.py", "test_batch_invariant.py", "test_cli_serve.py", "test_hostile.py",
                    "test_awq_gptq_model.py", "test_tools.py", "test_quantized_model.py", "test_sampling_engine.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order stays


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
