"""Shared fixtures: real models loaded once per session, and their transformers references."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs a worker per core: one thread each (no contention)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


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
