"""Pack each bf16 Linear as soon as the checkpoint has filled its weight, from a reused staging buffer.

Where the few-row kernel reads oneDNN's packed copy (`layers.linear.one_copy_layout`), a Linear's plain
weight is dropped once packed. Read into its own fresh memory first, every weight was written into fresh pages
twice (the read, then the packed copy): on a 2-core Zen 4 a page fault costs about as much as copying the page,
and the read into fresh memory took 1.0 s of a 1B model's 3 s of loading against 0.2 s into reused memory.
Here the checkpoint is read into a staging tensor taken from a pool (one per shape: the next layer's same
matrix reuses it), the module is packed as soon as all its shards are in, and the staging tensor goes back to
the pool. Only where nothing changes the weights between the load and `prepack` (no quantizing at load, not
batch-invariant, bf16): `models.registry.build_model` decides.
"""

import torch

from sobrio.layers.linear import Linear


class PackOnLoad:
    """`load_weights`' hooks: `before_fill` points a Linear's weight at staging memory before its first shard
    is read, `after_fill` packs the module once every shard is in."""

    def __init__(self, model: torch.nn.Module):
        self.modules = {f"{name}.weight": module for name, module in model.named_modules()
                        if isinstance(module, Linear) and module.weight.dtype == torch.bfloat16}
        self.pending: dict[str, set[int | None]] = {}  # target -> the shards read so far
        self.done: set[str] = set()
        self.free: dict[torch.Size, list[torch.Tensor]] = {}

    def before_fill(self, target: str, param: torch.nn.Parameter) -> None:
        if target in self.modules and target not in self.pending and target not in self.done:
            self.pending[target] = set()
            pool = self.free.get(param.shape)
            param.data = pool.pop() if pool else torch.empty(param.shape, dtype=param.dtype)

    def after_fill(self, target: str, shard: int | None, param: torch.nn.Parameter) -> None:
        shards = self.pending.get(target)
        if shards is None:
            return
        shards.add(shard)
        module = self.modules[target]
        if len(shards) < len(getattr(module, "shard_offsets", [None])):
            return
        staging = param.data
        module.prepack()
        module.packed_at_load = True  # `Linear.prepack` leaves it as it is once
        # The plain weight stays where the few-row kernel cannot read the packed copy: then in its own memory.
        param.data = staging.clone() if "weight" in module._parameters else staging.new_empty(0)
        self.free.setdefault(staging.shape, []).append(staging)
        del self.pending[target]
        self.done.add(target)
