"""The safetensors reader's two ways to a tensor's bytes (loader/hf.py): read into a tensor, or a view of the
file's mapping (`StoredTensor.mapped`) that `release` unmaps; a file cut short is a ValueError naming the tensor
either way, never a crash on a page past the file's end."""

import os

import pytest
import torch

from sobrio.loader.hf import stored_safetensors, write_safetensors


@pytest.fixture
def checkpoint(tmp_path):
    tensors = {"a": torch.arange(6000, dtype=torch.float32).view(60, 100),
               "b": torch.randn(3, 4097, generator=torch.Generator().manual_seed(0)).bfloat16()}
    file = tmp_path / "model.safetensors"
    write_safetensors(file, tensors, {"format": "pt"})
    return file, tensors


def test_a_read_and_a_mapped_view_hold_the_files_bytes(checkpoint):
    file, tensors = checkpoint
    for name, stored in stored_safetensors(file):
        view = stored.mapped()
        assert view is not None and torch.equal(view, tensors[name])
        into = torch.empty(stored.shape, dtype=stored.dtype)
        stored.read_into(into)
        stored.release()
        assert torch.equal(into, tensors[name]) and torch.equal(view, tensors[name])  # read back after release
    del view, stored  # the mapping goes with its last view
    assert str(file) not in open("/proc/self/maps").read()


def test_a_file_cut_short_is_an_error_naming_the_tensor(checkpoint):
    file, _ = checkpoint
    os.truncate(file, file.stat().st_size - 100)
    with pytest.raises(ValueError, match="ends inside tensor b"):
        for name, stored in stored_safetensors(file):
            assert stored.mapped() is None or name == "a"
            stored.read()
