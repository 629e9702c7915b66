"""KV offload tiers under faults, on a tiny random-weight Llama (fp32): files deleted behind the tier's back,
a read-only directory, a RAM tier smaller than the prompt, a slow disk. Each request completes within a
bound with the tokens of a run without tiers: a block the disk cannot give is recomputed, never asked for
again, and a request waits for the disk once, up to one deadline."""

import errno
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from sobrio import LLM, SamplingParams
from sobrio.kv.disk_tier import DiskTier
from sobrio.kv.sealing import MASTER_KEY_ENV
from tests.conftest import free_memory

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [(i * 37) % 900 + 50 for i in range(16 * 12 + 5)]  # 12 full blocks of 16
SALT = "tenant"
BOUND_S = 30.0  # far past what a run takes here; a request that loops never gets there


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from sobrio.loader.gguf import gguf_tokenizer
    from sobrio.loader.resolve import resolve_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = gguf_tokenizer(resolve_model("smollm2-135m").path)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def master_key(monkeypatch):
    monkeypatch.setenv(MASTER_KEY_ENV, "7e" * 32)
    yield
    free_memory()


def engine(model: Path, folder: Path | None = None, ram_blocks: int = 64) -> LLM:
    """A pool of 16 blocks; a RAM tier of `ram_blocks` blocks (8 KiB each) and, with `folder`, a disk tier."""
    tiers = {"kv_offload_ram": ram_blocks * 8192} if folder is not None else {}
    if folder is not None:
        tiers |= {"kv_offload_disk": 64 << 20, "kv_offload_dir": str(folder)}
    return LLM(str(model), dtype="float32", kv_cache_memory=16 * 8192, max_model_len=512,
               enable_prefix_caching=True, **tiers)


def run(llm: LLM) -> tuple[list[int], float]:
    """The prompt's greedy tokens and the seconds they took; a run past BOUND_S fails (it would have hung)."""
    start, result = time.monotonic(), []
    worker = threading.Thread(target=lambda: result.extend(llm.generate(
        [{"prompt_token_ids": PROMPT, "cache_salt": SALT}], GREEDY, use_tqdm=False)), daemon=True)
    worker.start()
    worker.join(BOUND_S)
    if worker.is_alive():  # a daemon: a hung engine cannot keep the test run from ending
        pytest.fail(f"the request did not complete in {BOUND_S:g} s")
    llm.last_cached_tokens = result[0].num_cached_tokens
    return list(result[0].outputs[0].token_ids), time.monotonic() - start


@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory) -> tuple[list[int], Path]:
    """The tokens without tiers, and a disk tier holding the prompt's blocks (an engine closed cleanly)."""
    os.environ[MASTER_KEY_ENV] = "7e" * 32
    reference = run(engine(tiny))[0]
    folder = tmp_path_factory.mktemp("kv")
    llm = engine(tiny, folder)
    assert run(llm)[0] == reference
    llm.engine.core.close()
    assert len(list(folder.glob("*.kvb"))) >= 12
    return reference, folder


def fresh(tiny, written, tmp_path, ram_blocks: int = 64) -> tuple[LLM, Path]:
    """An engine started on a copy of the written disk tier (its index holds the prompt's blocks)."""
    folder = tmp_path / "kv"
    shutil.copytree(written[1], folder)
    llm = engine(tiny, folder, ram_blocks)
    assert len(llm.engine.core.offload.disk.index) >= 12
    return llm, folder


def stats(llm: LLM) -> dict:
    return llm.engine.core.offload.snapshot()


def test_files_deleted_behind_the_tiers_back_are_recomputed(tiny, written, tmp_path):
    llm, folder = fresh(tiny, written, tmp_path)
    for path in folder.glob("*.kvb"):
        path.unlink()
    assert run(llm)[0] == written[0]
    assert stats(llm)["hits_disk"] == 0 and stats(llm)["disk_errors"] >= 1
    llm.engine.core.scheduler.pool.purge(SALT)  # out of the pool: the next run asks the tiers again
    assert run(llm)[0] == written[0]
    # each block's read failed at most once, then left the index: never asked for again
    assert stats(llm)["disk_errors"] <= 12 and llm.engine.core.offload.disk.off is None


def test_a_read_only_directory_turns_the_disk_tier_off(tiny, written, tmp_path, monkeypatch):
    llm, folder = fresh(tiny, written, tmp_path)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr("sobrio.kv.disk_tier.os.utime", read_only)
    assert run(llm)[0] == written[0]
    disk = llm.engine.core.offload.disk
    assert disk.off is not None and stats(llm)["disk_errors"] <= 4  # one per reader thread at most


def test_a_ram_tier_smaller_than_the_prompt_still_lets_it_through(tiny, written, tmp_path):
    llm, _ = fresh(tiny, written, tmp_path, ram_blocks=2)
    assert llm.engine.core.offload.ram_capacity == 2
    tokens, _ = run(llm)
    assert tokens == written[0] and stats(llm)["hits_disk"] >= 2


def test_a_slow_disk_is_waited_for_once_up_to_the_deadline(tiny, written, tmp_path, monkeypatch):
    deadline = 0.5
    monkeypatch.setattr("sobrio.kv.manager.PREFETCH_DEADLINE_S", deadline, raising=False)  # main had none
    monkeypatch.setattr("sobrio.kv.offload.PREFETCH_DEADLINE_S", deadline)
    llm, _ = fresh(tiny, written, tmp_path)
    real_read = DiskTier.read

    def slow_read(self, block_hash, tenant):
        time.sleep(2 * deadline)  # 12 blocks, 4 reader threads: six deadlines' worth in all
        return real_read(self, block_hash, tenant)

    monkeypatch.setattr(DiskTier, "read", slow_read)
    tokens, seconds = run(llm)
    # one wait, then the prompt is computed: it did not wait for the last reads (main waited for all 12)
    assert tokens == written[0] and llm.last_cached_tokens < 12 * 16 and seconds < BOUND_S
    llm.engine.core.offload.flush()
