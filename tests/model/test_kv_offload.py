"""KV offload tiers on real models, offline: a pool too small to keep a long prompt, so its blocks leave for
RAM and disk. Greedy output is the same with the tiers on and off; a prefix comes back from RAM, and from
disk after a restart; a tampered file, a wrong master key or a deleted tenant give misses, never a wrong
token; no tenant reads another's blocks; no block file holds the pool's plaintext bytes."""

import errno
import math
import os
from collections import Counter

import pytest

from sobrio import LLM, SamplingParams
from sobrio.kv.disk_tier import HEADER
from sobrio.kv.sealing import MASTER_KEY_ENV
from tests.conftest import free_memory

GREEDY = SamplingParams(temperature=0, max_tokens=8)
WORDS = "amber birch cedar dune ember fjord grove heath inlet juniper kelp lagoon marsh nettle oak".split()


def text(seed: int, words: int = 120) -> str:
    return " ".join(f"{WORDS[(i * 7 + seed) % len(WORDS)]}{(i * seed) % 97}" for i in range(words))


LONG, OTHERS = text(1), [text(k) for k in range(2, 7)]  # ~400 tokens each: 5 others push LONG out of the pool


def engine(model: str, folder=None, **kwargs) -> LLM:
    """A pool of about 34 blocks (12 MB); tiers of 64 MB RAM and, with `folder`, 512 MB of disk."""
    tiers = {"kv_offload_ram": 64 << 20}
    if folder is not None:
        tiers |= {"kv_offload_disk": 512 << 20, "kv_offload_dir": str(folder)}
    return LLM(model, kv_cache_memory=12 << 20, max_model_len=512, **tiers, **kwargs)


def run(llm: LLM, prompt: str, salt: str | None = None) -> tuple[list[int], int]:
    out = llm.generate([{"prompt": prompt, "cache_salt": salt} if salt else prompt], GREEDY, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def push_out(llm: LLM, salt: str | None = None) -> None:
    for other in OTHERS:
        run(llm, other, salt)


def byte_entropy(data: bytes) -> float:
    counts = Counter(data)
    return -sum(c / len(data) * math.log2(c / len(data)) for c in counts.values())


def offload_stats(llm: LLM) -> dict:
    return llm.engine.core.offload.snapshot()


@pytest.fixture(autouse=True)
def one_engine_at_a_time():
    """Each test here loads several engines: return their memory before the next test (see conftest)."""
    yield
    free_memory()


def close(llm: LLM) -> None:
    """Finish its disk writes, and let its memory go before the next engine loads."""
    llm.engine.core.close()
    free_memory()


@pytest.fixture
def master_key(monkeypatch):
    monkeypatch.setenv(MASTER_KEY_ENV, "5a" * 32)


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_same_output_with_the_tiers_and_a_prefix_back_from_ram(model):
    """A prefix back from RAM gives what the same prefix kept in the pool gives: the same blocks, the same
    rows left to compute. (In bf16 a prompt's last rows after a cached prefix go through the decode kernel,
    the whole prompt through the prompt kernel: their roundings differ, so a cache hit is compared with a hit.)"""
    plain = LLM(model, kv_cache_memory=12 << 20, max_model_len=512, enable_prefix_caching=True)
    reference = run(plain, LONG)[0]
    from_pool = run(plain, LONG)  # the prefix still in the pool
    assert from_pool[1] >= 16 * 16
    push_out(plain)
    assert run(plain, LONG) == (reference, 0)  # without tiers the pool lost it
    del plain
    free_memory()
    llm = engine(model)
    assert run(llm, LONG) == (reference, 0)
    push_out(llm)
    assert run(llm, LONG) == from_pool
    assert offload_stats(llm)["hits_ram"] >= 16


def test_disk_after_a_restart_tampering_wrong_key_and_no_plaintext(tmp_path, master_key, monkeypatch):
    first = engine("smollm2-135m", tmp_path)
    reference, _ = run(first, LONG)
    from_pool = run(first, LONG)  # what a hit gives (its last rows by the decode kernel: see the test above)
    pool = first.engine.core.scheduler.pool
    some_block = pool.prefix_cache.block_of[next(iter(pool.prefix_cache.block_of))]
    plaintext = first.engine.core.offload.codec.gather(some_block).tobytes()
    del pool
    close(first)  # its disk writes done
    del first
    files = sorted(tmp_path.glob("*.kvb"))
    assert len(files) >= 20
    windows = [plaintext[i:i + 32] for i in range(0, len(plaintext) - 32, 4096) if len(set(plaintext[i:i + 32])) > 4]
    assert windows and not any(w in f.read_bytes() for f in files for w in windows)
    assert all(byte_entropy(f.read_bytes()[HEADER.size:]) > 7.99 for f in files[:5])

    restarted = engine("smollm2-135m", tmp_path)
    assert run(restarted, LONG) == from_pool and from_pool[1] >= 16 * 16
    assert offload_stats(restarted)["hits_disk"] >= 16
    close(restarted)
    del restarted

    for f in sorted(tmp_path.glob("*.kvb"))[:3]:  # one flipped byte in three files
        data = bytearray(f.read_bytes())
        data[HEADER.size + 50] ^= 0x10
        f.write_bytes(bytes(data))
    tampered = engine("smollm2-135m", tmp_path)
    assert run(tampered, LONG)[0] == reference  # from the first bad block on: over 16 rows, the prompt kernel's
    assert offload_stats(tampered)["auth_failures"] >= 1
    close(tampered)
    del tampered

    monkeypatch.setenv(MASTER_KEY_ENV, "a5" * 32)
    wrong_key = engine("smollm2-135m", tmp_path)
    assert run(wrong_key, LONG) == (reference, 0)
    assert offload_stats(wrong_key)["hits_disk"] == 0 and offload_stats(wrong_key)["auth_failures"] >= 1


def test_tenants_never_share_blocks_and_a_deleted_tenant_is_shredded(tmp_path, master_key):
    llm = engine("smollm2-135m", tmp_path)
    reference, _ = run(llm, LONG, "tenant-a")
    push_out(llm, "tenant-a")
    assert run(llm, LONG, "tenant-b") == (reference, 0)  # same prompt, another tenant: nothing of A's
    llm.engine.purge_cache_salt("tenant-a")  # the server calls this when a tenant is deleted
    close(llm)
    del llm
    restarted = engine("smollm2-135m", tmp_path)
    assert run(restarted, LONG, "tenant-a") == (reference, 0)  # its key material is gone
    assert run(restarted, LONG, "tenant-b")[1] > 0  # B's blocks are still there


def test_a_disk_that_cannot_be_written_or_made_keeps_the_engine_serving(tmp_path, master_key, monkeypatch):
    plain = LLM("smollm2-135m", kv_cache_memory=12 << 20, max_model_len=512, enable_prefix_caching=True)
    reference, from_pool = run(plain, LONG)[0], run(plain, LONG)
    del plain
    (tmp_path / "a-file").write_text("not a directory")
    unmakeable = engine("smollm2-135m", tmp_path / "a-file" / "kv")
    assert run(unmakeable, LONG)[0] == reference
    close(unmakeable)
    assert offload_stats(unmakeable)["disk_errors"] >= 1
    del unmakeable
    full = engine("smollm2-135m", tmp_path / "kv")
    real_open = open

    def no_space(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_space)
    assert run(full, LONG)[0] == reference
    push_out(full)
    assert run(full, LONG) == from_pool  # back from RAM: the disk's failures cost nothing else
    full.engine.core.close()
    stats = offload_stats(full)
    assert stats["disk_errors"] >= 1 and stats["stored_disk"] == 0 and stats["hits_ram"] >= 16
    assert not list((tmp_path / "kv").glob("*.kvb"))
