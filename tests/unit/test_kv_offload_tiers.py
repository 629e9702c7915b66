"""The KV offload tiers without a model: sealing (AES-256-GCM bound to tenant, block, model and layout),
crypto-shredding, the disk tier's index, faults that make misses, and the block codec."""

import errno
import logging
import math
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from sobrio.errors import ConfigError
from sobrio.kv.cache import KVCache, KVCacheSpec
from sobrio.kv.disk_tier import HEADER, DiskTier, Stats
from sobrio.kv.offload import BlockCodec, KVOffload
from sobrio.kv.sealing import MASTER_KEY_ENV, TenantKeys, read_master_key, seal, tenant_digest, unseal

MASTER = bytes(range(32))
MODEL = b"m" * 16


def tier(folder: Path, master: bytes = MASTER, model: bytes = MODEL, budget: int = 1 << 20) -> DiskTier:
    return DiskTier(folder, budget, model, TenantKeys(master, folder / "keyring.json"), Stats())


def block(i: int) -> bytes:
    return bytes((i * 31 + k) % 251 for k in range(4096))


def test_a_sealed_block_opens_only_with_its_tenant_hash_model_and_key():
    keys = TenantKeys(MASTER)
    a, b = keys.cipher(tenant_digest("A"), create=True), keys.cipher(tenant_digest("B"), create=True)
    blob = seal(a, b"kv bytes", b"header-A")
    assert unseal(a, blob, b"header-A") == b"kv bytes"
    assert unseal(a, blob, b"header-B") is None  # moved to another block, tenant or model
    assert unseal(b, blob, b"header-A") is None  # another tenant's key
    assert unseal(TenantKeys(bytes(32)).cipher(tenant_digest("A"), create=True), blob, b"header-A") is None
    flipped = bytearray(blob)
    flipped[20] ^= 1
    assert unseal(a, bytes(flipped), b"header-A") is None
    assert seal(a, b"kv bytes", b"h") != seal(a, b"kv bytes", b"h")  # a fresh nonce per write


def test_the_master_key_comes_from_the_environment_or_a_file_and_a_bad_one_never_shows(tmp_path, monkeypatch):
    monkeypatch.setenv(MASTER_KEY_ENV, "ab" * 32)
    assert read_master_key(None) == bytes.fromhex("ab" * 32)
    (tmp_path / "key").write_text("cd" * 32 + "\n")
    assert read_master_key(str(tmp_path / "key")) == bytes.fromhex("cd" * 32)
    monkeypatch.setenv(MASTER_KEY_ENV, "secretsecret")
    with pytest.raises(ConfigError) as exc:
        read_master_key(None)
    assert "secretsecret" not in str(exc.value) and "64 hex digits" in str(exc.value)
    monkeypatch.delenv(MASTER_KEY_ENV)
    assert read_master_key(None) is None


def test_disk_blocks_survive_a_restart_and_other_models_files_are_ignored(tmp_path):
    disk = tier(tmp_path)
    for i in range(3):
        assert disk.write(bytes([i]) * 16, "tenant", block(i))
    assert tier(tmp_path).read(bytes([1]) * 16, "tenant") == block(1)
    other_model = tier(tmp_path, model=b"o" * 16)
    assert len(other_model.index) == 0 and other_model.read(bytes([1]) * 16, "tenant") is None
    assert len(list(tmp_path.glob("*.kvb"))) == 3  # ignored, not removed


def test_a_flipped_byte_a_truncated_file_a_wrong_key_or_tenant_is_a_miss(tmp_path):
    disk = tier(tmp_path)
    hashes = [bytes([i]) * 16 for i in range(4)]
    for i, h in enumerate(hashes):
        disk.write(h, "A", block(i))
    path = disk.index[hashes[0]][0]
    data = bytearray(path.read_bytes())
    data[HEADER.size + 100] ^= 0x01
    path.write_bytes(bytes(data))
    truncated = disk.index[hashes[1]][0]
    truncated.write_bytes(truncated.read_bytes()[:200])
    restarted = tier(tmp_path)
    assert restarted.read(hashes[0], "A") is None and restarted.read(hashes[1], "A") is None
    assert restarted.stats.auth_failures == 2 and not path.exists()  # a bad file is removed
    assert restarted.read(hashes[2], "B") is None  # another tenant's
    assert restarted.read(hashes[3], "A") == block(3)
    assert tier(tmp_path, master=bytes(32)).read(hashes[3], "A") is None  # a wrong master key: removed too


def test_forgetting_a_tenant_shreds_its_key_and_its_files_go(tmp_path):
    disk = tier(tmp_path)
    disk.write(b"a" * 16, "A", block(1))
    disk.write(b"b" * 16, "B", block(2))
    assert disk.keys.forget(tenant_digest("A"))
    assert tier(tmp_path).read(b"a" * 16, "A") is None  # even with the master key, after a restart
    disk.forget_tenant("A")
    assert len(disk.index) == 1 and len(list(tmp_path.glob("*.kvb"))) == 1
    assert tier(tmp_path).read(b"b" * 16, "B") == block(2)


def test_a_write_queued_before_its_tenant_was_forgotten_writes_nothing(tmp_path):
    """The engine queues disk writes when idle; a tenant deleted while some wait must not get its blocks
    written after its files were removed, nor key material made anew for it."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16, block_size=8)
    offload = KVOffload(BlockCodec([KVCache.allocate(spec, 2)]), 1 << 20, 1 << 20, tmp_path,
                        TenantKeys(MASTER, tmp_path / "keyring.json"), "model")
    data = offload.codec.gather(0)
    try:
        offload.forget_tenant("A")
        offload.run_job("write", (b"a" * 16, "A", data))  # as the writer thread would, after the forget
        offload.run_job("write", (b"b" * 16, "B", data))
        assert not (tmp_path / "keyring.json").read_text().count(tenant_digest("A").hex())
        assert offload.disk.read(b"a" * 16, "A") is None and offload.disk.read(b"b" * 16, "B") is not None
        assert len(list(tmp_path.glob("*.kvb"))) == 1
    finally:
        offload.close()


def test_the_byte_budget_drops_the_least_recently_used(tmp_path):
    disk = tier(tmp_path, budget=3 * (len(block(0)) + 200))
    for i in range(5):
        disk.write(bytes([i]) * 16, "A", block(i))
        if i == 2:
            disk.read(bytes([0]) * 16, "A")  # used: stays
    assert set(disk.index) == {bytes([0]) * 16, bytes([3]) * 16, bytes([4]) * 16}
    assert len(list(tmp_path.glob("*.kvb"))) == 3 and disk.nbytes <= disk.budget


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_is_a_miss_logged_once_without_content(tmp_path, monkeypatch, caplog, code):
    disk = tier(tmp_path)
    real_open = open

    def failing_open(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(code, os.strerror(code))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", failing_open)
    with caplog.at_level(logging.WARNING, logger="sobrio.kv.offload"):
        assert not disk.write(b"a" * 16, "A", block(1)) and not disk.write(b"b" * 16, "A", block(2))
    # a full disk loses each block it refuses; a read-only one turns the tier off after the first refusal
    assert disk.stats.disk_errors == (2 if code == errno.ENOSPC else 1) and disk.read(b"a" * 16, "A") is None
    assert (disk.off is None) == (code == errno.ENOSPC)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and os.strerror(code) in warnings[0]


def test_an_unreadable_block_leaves_the_index_and_a_vanished_directory_turns_the_tier_off_until_back(
        tmp_path, caplog):
    disk = tier(tmp_path / "kv")
    disk.probe_interval_s = 3600.0
    hashes = [bytes([i]) * 16 for i in range(3)]
    for i, h in enumerate(hashes):
        assert disk.write(h, "A", block(i))
    disk.index[hashes[0]][0].unlink()  # one file deleted behind its back: a miss, asked for once
    assert disk.read(hashes[0], "A") is None and hashes[0] not in disk and disk.off is None
    shutil.rmtree(tmp_path / "kv")  # the whole directory (the key ring is in memory already)
    with caplog.at_level(logging.WARNING, logger="sobrio.kv.offload"):
        assert disk.read(hashes[1], "A") is None
        assert disk.off is not None and not disk.index and disk.nbytes == 0
        assert not disk.write(hashes[1], "A", block(1))  # off: not even tried, not logged again
        assert len([r for r in caplog.records if "is off" in r.getMessage()]) == 1
        disk.next_probe = 0.0  # the next probe is due: the directory can be made and written again
        assert disk.write(hashes[1], "A", block(1)) and disk.off is None
    assert disk.read(hashes[1], "A") == block(1)
    assert any("back on" in r.getMessage() for r in caplog.records)


def test_a_read_only_directory_keeps_a_good_read_and_turns_the_tier_off(tmp_path, monkeypatch):
    disk = tier(tmp_path)
    assert disk.write(b"a" * 16, "A", block(1))

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr("sobrio.kv.disk_tier.os.utime", read_only)
    assert disk.read(b"a" * 16, "A") == block(1)
    assert disk.off is not None and b"a" * 16 not in disk and disk.read(b"a" * 16, "A") is None


def test_a_directory_that_cannot_be_made_leaves_an_empty_tier(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    disk = tier(tmp_path / "file" / "kv")
    assert disk.stats.disk_errors == 1 and not disk.write(b"a" * 16, "A", block(1))


def test_sealed_files_look_random_and_hold_no_plaintext_window(tmp_path):
    disk = tier(tmp_path)
    plain = b"".join(f"token {i:05d} kv row ".encode() for i in range(400))  # low-entropy, easy to spot
    disk.write(b"p" * 16, "A", plain)
    body = next(tmp_path.glob("*.kvb")).read_bytes()[HEADER.size:]
    assert all(plain[i:i + 16] not in body for i in range(0, len(plain) - 16, 64))
    counts = Counter(body)
    entropy = -sum(c / len(body) * math.log2(c / len(body)) for c in counts.values())
    assert entropy > 7.9, entropy


@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
def test_the_codec_moves_a_block_whole_between_slots(cache_dtype):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=8,
                       cache_dtype=cache_dtype)
    cache = KVCache.allocate(spec, 4)
    for t in cache.layers + (cache.scale_layers or []):
        t.view(torch.uint8).copy_(torch.randint(0, 255, t.view(torch.uint8).shape, dtype=torch.uint8))
    codec = BlockCodec([cache])
    data = codec.gather(1)
    assert data.size == codec.block_nbytes == spec.block_bytes
    codec.scatter(3, data)
    for t in cache.layers + (cache.scale_layers or []):
        assert torch.equal(t[:, 3].view(torch.uint8), t[:, 1].view(torch.uint8))
