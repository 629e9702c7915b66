"""The `kv` package without a model: cache sizing and tensors, the eviction hook, purge by cache salt."""

import mmap
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sobrio.kv.cache as kv_cache_module
from sobrio.config import CacheConfig, SobrioConfig
from sobrio.engine.scheduler import Scheduler
from sobrio.errors import InvalidRequestError
from sobrio.kv.block_pool import BlockPool
from sobrio.kv.cache import KVCache, KVCacheSpec, kv_budget
from sobrio.kv.prefix_cache import PrefixCache, hash_block
from sobrio.types.params import SamplingParams
from sobrio.types.request import Request

BLOCK = 8

# ---- sizing and tensors ----


def test_spec_sizes_blocks_like_the_runner_did():
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32, block_size=16)
    assert spec.block_bytes == 2 * 30 * 16 * 3 * 64 * 4
    assert spec.num_blocks_for(24 * spec.block_bytes + spec.block_bytes - 1) == 24
    with pytest.raises(InvalidRequestError, match="holds no block"):
        spec.num_blocks_for(spec.block_bytes - 1)


def test_budget_is_the_flag_or_a_capped_share_of_available_memory(monkeypatch):
    assert kv_cache_module.available_memory() > 0
    monkeypatch.setattr(kv_cache_module, "available_memory", lambda: 100 << 30)
    assert kv_budget(12345, 0.15, 2 << 30) == 12345  # --kv-cache-memory wins
    assert kv_budget(None, 0.15, 1 << 40) == int((100 << 30) * 0.15)
    defaults = CacheConfig()
    assert kv_budget(defaults.kv_cache_memory, defaults.kv_cache_memory_fraction,
                     defaults.kv_cache_memory_cap) == 2 << 30  # the cap, on a large host


def test_the_default_budget_leaves_room_for_the_weights_about_to_load(monkeypatch):
    monkeypatch.setattr(kv_cache_module, "available_memory", lambda: 20 << 30)
    assert kv_budget(None, 0.5, 1 << 40, weights=16 << 30) == 2 << 30  # half of what the weights leave
    assert kv_budget(1 << 30, 0.5, 1 << 40, weights=16 << 30) == 1 << 30
    with pytest.raises(MemoryError, match="weights .*17.18 GB.* KV cache .*5.37 GB"):
        kv_budget(5 << 30, 0.5, 1 << 40, weights=16 << 30)  # both cannot fit: said before loading anything


def test_kv_cache_owns_one_tensor_per_layer_and_slot_views_alias_it():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16, block_size=BLOCK)
    cache = KVCache.allocate(spec, num_blocks=5)
    assert cache.num_layers == 3 and cache.num_blocks == 5 and cache.block_size == BLOCK
    assert all(cache.layer(i).shape == (2, 5, BLOCK, 2, 4) for i in range(3))
    assert cache.nbytes() == 5 * spec.block_bytes
    keys, values = cache.slots(1)
    assert keys.shape == values.shape == (5 * BLOCK, 2, 4)
    keys[3 * BLOCK + 2] = 1.0  # slot = block * block_size + offset
    values[0] = 2.0
    assert (cache.layer(1)[0, 3, 2] == 1).all() and (cache.layer(1)[1, 0, 0] == 2).all()
    assert not cache.layer(0).any() and not cache.layer(2).any()


def test_zeros_on_touch_are_zero_and_cost_no_memory_until_written():
    """The kernel's zero pages, mapped when first written: 96 MB have no page resident, and writing one row
    makes that row's pages resident only. Counted on the tensor's own pages (mincore), not the process's
    resident size, which another thread of a test worker (an earlier engine's background work) can move by
    megabytes meanwhile."""
    from sobrio.memory import zeros_on_touch

    tensor = zeros_on_touch((3, 2048, 8192), torch.bfloat16)
    assert resident_pages(tensor)[0] == 0
    tensor[1, 7].fill_(1)  # 16 KB
    assert 0 < resident_pages(tensor)[0] <= -(-(8192 * 2) // mmap.PAGESIZE) + 1
    assert int(tensor.count_nonzero()) == 8192  # read last: reads map pages too


def test_mapped_bytes_follow_a_map_as_its_pages_are_written():
    """The start's log splits what is resident into weights, the KV cache's pages mapped so far (its maps'
    resident size) and the rest: before, it took the whole cache as resident while a thread was still
    mapping it, and the rest read 0.00 GB."""
    from sobrio.memory import mapped_bytes, zeros_on_touch

    tensor = zeros_on_touch((3, 2048, 8192), torch.bfloat16)  # 96 MiB
    other = zeros_on_touch((2048, 8192), torch.bfloat16)
    other.fill_(1)  # another map's pages are not counted
    assert mapped_bytes([tensor.data_ptr()]) == 0
    tensor[1].fill_(1)  # 32 MiB
    assert 32 << 20 <= mapped_bytes([tensor.data_ptr(), tensor[1].data_ptr()]) <= (32 << 20) + (2 << 20)


def resident_pages(tensor: torch.Tensor) -> tuple[int, int]:
    """(pages of a page-aligned tensor's memory that are resident, its pages), by mincore(2)."""
    import ctypes
    import mmap

    pages = -(-tensor.untyped_storage().nbytes() // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(pages * mmap.PAGESIZE), vec) == 0
    return sum(v & 1 for v in vec), pages


@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
def test_a_new_cache_is_zero_and_resident_once_its_thread_is_done(cache_dtype):
    """`allocate` returns before the cache's pages are mapped (the start goes on) and a thread maps them, so
    the memory it reserves is resident soon after, as `torch.zeros` made it, without changing what was written.
    Residency is the cache's own pages' (mincore): the process's resident size also moved with what the rest
    of the test process freed meanwhile, and once read 74 MB for a 96 MB cache."""
    spec = KVCacheSpec(num_layers=3, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16,
                       cache_dtype=cache_dtype)
    cache = KVCache.allocate(spec, num_blocks=spec.num_blocks_for(96 << 20))
    cache.layer(1)[0, 7].fill_(1)
    cache.populating.join(timeout=30)
    assert not cache.populating.is_alive()
    tensors = [cache.layer(i) for i in range(3)] + [cache.scales(i)[0] for i in range(3) if cache.scales(i) is not None]
    resident, pages = map(sum, zip(*(resident_pages(t) for t in tensors)))
    assert resident * 4096 >= cache.nbytes() * 0.9 and resident == pages
    for i in range(3):
        assert cache.layer(i).data_ptr() % 4096 == 0  # page-aligned
        assert int(cache.layer(i).count_nonzero()) == (16 * 8 * 128 if i == 1 else 0)
        assert cache.scales(i) is None or not cache.scales(i)[0].any()


# ---- the pool's prefix cache: eviction hook and purge ----

def chain(tokens: list[int], salt: str | None) -> list[bytes]:
    hashes, parent = [], None
    for j in range(len(tokens) // BLOCK):
        parent = hash_block(parent, tokens[j * BLOCK:(j + 1) * BLOCK], salt)
        hashes.append(parent)
    return hashes


def cache_blocks(pool: BlockPool, hashes: list[bytes], salt: str | None) -> list[int]:
    """Allocate, compute (register) and release one block per hash, as a finished request would."""
    blocks = [pool.allocate() for _ in hashes]
    for block_id, block_hash in zip(blocks, hashes):
        pool.register(block_id, block_hash, salt)
    pool.release(blocks)
    return blocks


def test_eviction_hook_sees_exactly_the_evicted_blocks_with_their_hashes():
    pool = BlockPool(num_blocks=6, block_size=BLOCK)
    evicted: list[tuple[bytes, int]] = []
    pool.add_eviction_hook(lambda block_hash, block_id: evicted.append((block_hash, block_id)))
    hashes = chain(list(range(4 * BLOCK)), "a")
    assert cache_blocks(pool, hashes, "a") == [0, 1, 2, 3]  # 4 and 5 never used
    assert not evicted
    # LRU: the two never-used blocks, then the chain's tail (released first, so a prefix outlives its extensions)
    taken = [pool.allocate() for _ in range(4)]
    assert taken == [4, 5, 3, 2]
    assert evicted == [(hashes[3], 3), (hashes[2], 2)]
    assert pool.lookup(hashes) == [0, 1]
    pool.release(taken)
    assert len(evicted) == 2  # releasing evicts nothing


def test_eviction_hook_runs_before_the_block_is_reused():
    """The hook sees the block still cached (so an offload tier can copy its content out)."""
    pool = BlockPool(num_blocks=1, block_size=BLOCK)
    [block_hash] = chain(list(range(BLOCK)), None)
    seen = []
    pool.add_eviction_hook(lambda h, b: seen.append((pool.blocks[b].ref_count, pool.lookup([h]))))
    cache_blocks(pool, [block_hash], None)
    pool.allocate()
    assert seen == [(0, [0])]


def test_a_duplicate_block_is_not_cached_and_its_reuse_evicts_nothing():
    pool = BlockPool(num_blocks=2, block_size=BLOCK)
    evicted = []
    pool.add_eviction_hook(lambda h, b: evicted.append(b))
    [block_hash] = chain(list(range(BLOCK)), None)
    first, second = pool.allocate(), pool.allocate()
    pool.register(first, block_hash)
    pool.register(second, block_hash)  # the same content computed twice: first writer wins
    pool.release([second])
    pool.release([first])
    assert pool.lookup([block_hash]) == [first]
    assert pool.allocate() == second and evicted == []  # freed first, reused first: it held nothing findable
    assert pool.allocate() == first and evicted == [first]


def test_purge_forgets_one_salt_only():
    pool = BlockPool(num_blocks=16, block_size=BLOCK)
    tokens = list(range(3 * BLOCK))
    salted = {salt: chain(tokens, salt) for salt in ("a", "b", None)}
    for salt, hashes in salted.items():
        cache_blocks(pool, hashes, salt)
    assert all(len(pool.lookup(h)) == 3 for h in salted.values())
    assert pool.purge("a") == 3
    assert pool.lookup(salted["a"]) == []
    assert len(pool.lookup(salted["b"])) == 3 and len(pool.lookup(salted[None])) == 3
    assert pool.purge("a") == 0 and pool.purge("never-seen") == 0
    assert pool.num_free == 16 and all(b.ref_count == 0 for b in pool.blocks)


def test_purged_blocks_are_reused_first_as_plain_blocks():
    pool = BlockPool(num_blocks=5, block_size=BLOCK)
    evicted = []
    pool.add_eviction_hook(lambda h, b: evicted.append(b))
    kept = cache_blocks(pool, chain(list(range(2 * BLOCK)), "keep"), "keep")  # freed first: LRU's front
    gone = cache_blocks(pool, chain(list(range(3 * BLOCK)), "gone"), "gone")
    pool.purge("gone")
    assert sorted(pool.allocate() for _ in range(3)) == sorted(gone)
    assert evicted == []  # reusing a purged block evicts nothing
    assert sorted(pool.allocate() for _ in range(2)) == sorted(kept) and sorted(evicted) == sorted(kept)


def test_purge_keeps_blocks_in_use_until_released():
    pool = BlockPool(num_blocks=8, block_size=BLOCK)
    hashes = chain(list(range(2 * BLOCK)), "t")
    blocks = [pool.allocate() for _ in hashes]  # a running request holds them
    for block_id, block_hash in zip(blocks, hashes):
        pool.register(block_id, block_hash, "t")
    pool.touch(blocks[0])  # and a second request shares the first
    assert pool.purge("t") == 2
    assert pool.lookup(hashes) == []
    assert [pool.blocks[b].ref_count for b in blocks] == [2, 1]
    assert pool.num_free == 6 and not set(blocks) & set(pool.free)
    pool.release(blocks)
    pool.release(blocks[:1])
    assert pool.num_free == 8 and all(b.ref_count == 0 for b in pool.blocks)


def test_prefix_cache_index_stays_consistent():
    """Random register / evict / purge against a model dict: the two maps stay inverse, the salt index
    names exactly the salted hashes still cached."""
    rng = random.Random(0)
    cache, model = PrefixCache(), {}  # model: hash -> (block, salt)
    salts = ["a", "b", None]
    for _ in range(2000):
        op = rng.choice(["register", "register", "evict", "purge"])
        if op == "register":
            block_id, salt = rng.randrange(40), rng.choice(salts)
            block_hash = hash_block(None, [rng.randrange(30)], salt)
            if block_id not in cache.hash_of:
                won = cache.register(block_id, block_hash, salt)
                assert won == (block_hash not in model)
                model.setdefault(block_hash, (block_id, salt))
        elif op == "evict":
            block_id = rng.randrange(40)
            cache.evict(block_id)
            model = {h: v for h, v in model.items() if v[0] != block_id}
        else:
            salt = rng.choice(["a", "b"])
            forgotten = cache.purge(salt)
            assert sorted(forgotten) == sorted(b for b, s in model.values() if s == salt)
            model = {h: v for h, v in model.items() if v[1] != salt}
        assert cache.block_of == {h: b for h, (b, _) in model.items()}
        assert cache.hash_of == {b: h for h, (b, _) in model.items()}
        for salt in ("a", "b"):
            assert cache.hashes_of_salt.get(salt, set()) == {h for h, (_, s) in model.items() if s == salt}


# ---- through the scheduler ----

def check_ref_counts(sched: Scheduler) -> None:
    """Each block's reference count is the number of block tables holding it; free blocks are exactly ref 0."""
    owners: dict[int, int] = {}
    for req in sched.running + [r for r in sched.waiting if r.block_table]:
        for block_id in req.block_table:
            owners[block_id] = owners.get(block_id, 0) + 1
    for block in sched.pool.blocks:
        assert block.ref_count == owners.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in sched.pool.free)


def step(sched: Scheduler, rng: random.Random) -> None:
    out = sched.schedule()
    check_ref_counts(sched)
    for req in sched.update_after_step(out):
        sched.append_token(req, rng.randrange(50))
    check_ref_counts(sched)


def request(request_id: str, prompt: list[int], salt: str | None, max_tokens: int = 4) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), max_tokens, frozenset(),
                   cache_salt=salt)


def drain(sched: Scheduler, rng: random.Random) -> None:
    for _ in range(2000):
        if not sched.has_unfinished():
            return
        step(sched, rng)
    raise AssertionError("requests never finished")


def test_purge_through_the_scheduler_with_a_request_running():
    sched = Scheduler(SobrioConfig.from_kwargs(block_size=BLOCK, max_num_batched_tokens=256), num_blocks=32)
    rng, prompt = random.Random(0), list(range(1, 30))
    for req in (request("a1", prompt, "a"), request("b1", prompt, "b")):
        sched.add_request(req)
    drain(sched, rng)
    running = request("a2", prompt, "a")
    sched.add_request(running)
    step(sched, rng)  # admitted on its prefix hits; still decoding, holding those blocks
    assert running.num_cached_tokens == 24 and running in sched.running
    held = list(running.block_table[:3])
    assert sched.kv.purge("a") == 4  # a1's full blocks: 29 prompt + 3 computed output tokens
    check_ref_counts(sched)
    assert all(sched.pool.blocks[b].ref_count == 1 for b in held)  # still in use: nothing was freed
    late, other = request("a3", prompt, "a"), request("b2", prompt, "b")
    sched.add_request(late)
    sched.add_request(other)
    drain(sched, rng)
    assert late.num_cached_tokens == 0  # the salt misses after the purge
    assert other.num_cached_tokens == 24  # another salt keeps its blocks
    assert sched.pool.num_free == 32 and all(b.ref_count == 0 for b in sched.pool.blocks)


ops = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "abort", "purge"]), st.integers(0, 10_000)),
               min_size=1, max_size=60)


@settings(max_examples=40, deadline=None)
@given(ops=ops, num_blocks=st.integers(8, 40), budget=st.integers(4, 64))
def test_random_add_step_abort_purge_keeps_ref_counts(ops, num_blocks, budget):
    """Purges at any point (requests of that salt waiting, prefilling or decoding) free nothing in use,
    leave every ref count equal to its block tables, and everything drains back to the free list."""
    sched = Scheduler(SobrioConfig.from_kwargs(block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=budget),
                      num_blocks)
    rng = random.Random(0)
    shared = [rng.randrange(50) for _ in range(20)]
    salts = ["t0", "t1", None]
    ids = 0
    for op, arg in ops:
        if op == "add":
            prompt = shared[: arg % 21] + [rng.randrange(50) for _ in range(1 + arg % 13)]
            max_tokens = max(1, min(1 + arg % 17, num_blocks * BLOCK - len(prompt)))
            sched.add_request(request(str(ids), prompt, salts[arg % 3], max_tokens))
            ids += 1
        elif op == "abort" and ids:
            sched.abort(str(arg % ids))
        elif op == "purge":
            salt = salts[arg % 2]
            sched.kv.purge(salt)
            assert salt not in sched.pool.prefix_cache.hashes_of_salt
        else:
            step(sched, rng)
        check_ref_counts(sched)
    drain(sched, rng)
    assert sched.pool.num_free == num_blocks and all(b.ref_count == 0 for b in sched.pool.blocks)


def test_a_failing_eviction_hook_loses_no_block():
    pool = BlockPool(num_blocks=2, block_size=BLOCK)
    cache_blocks(pool, chain(list(range(2 * BLOCK)), None), None)

    def broken(block_hash: bytes, block_id: int) -> None:
        raise RuntimeError("offload tier down")

    pool.add_eviction_hook(broken)
    with pytest.raises(RuntimeError):
        pool.allocate()
    assert pool.num_free == 2 and len(pool.prefix_cache) == 2
