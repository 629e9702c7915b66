"""Load Hugging Face-named tensors into sobrio modules, packing q/k/v and gate/up into one matrix each."""

from collections.abc import Iterable

import torch

from sobrio.layers.linear import Linear

# HF sub-module name -> (packed module name, shard index)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy every tensor into its parameter; assert that every parameter was filled."""
    params = dict(model.named_parameters())
    filled: set[str] = set()
    for name, tensor in weights:
        if name == "lm_head.weight" and "lm_head.weight" not in params:
            continue  # tied embeddings: the file may still carry a copy
        target, shard = _packed_target(name)
        param = params.get(target)
        if param is None:
            continue  # e.g. rotary inv_freq buffers saved by old checkpoints
        with torch.no_grad():
            if shard is None:
                assert param.shape == tensor.shape, f"{name}: {tuple(tensor.shape)} vs {tuple(param.shape)}"
                param.copy_(tensor)
            else:
                module = model.get_submodule(target.rsplit(".", 1)[0])
                start, size = module.shard_offsets[shard]
                assert tensor.shape[0] == size, f"{name}: {tensor.shape[0]} rows, expected {size}"
                param[start:start + size].copy_(tensor)
        filled.add(f"{target}#{shard}")
    missing = [n for n in params if not any(f.startswith(n + "#") for f in filled)]
    assert not missing, f"weights missing from the checkpoint: {missing[:5]}"


def _packed_target(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in PACKED_MODULES:
        packed, shard = PACKED_MODULES[parts[-2]]
        return ".".join(parts[:-2] + [packed, parts[-1]]), shard
    return name, None


class PackedLinear(Linear):
    """One matrix for several projections of the same input (q/k/v or gate/up): one matmul instead of 3."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(out_sizes), bias=bias)
        starts = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.shard_offsets = list(zip(starts, out_sizes))


def resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct tensors a module and its children hold, as parameters, buffers or attributes
    (oneDNN's opaque packed weights counted by their elements)."""
    seen: set[int] = set()
    total = 0
    for sub in module.modules():
        tensors = [*sub.parameters(recurse=False), *sub.buffers(recurse=False),
                   *(v for v in vars(sub).values() if isinstance(v, torch.Tensor))]
        for t in tensors:
            key = id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size() if t.is_mkldnn else t.untyped_storage().nbytes()
    return total
