"""Pack each bf16 Linear as soon as the checkpoint has filled its weight, from a reused staging buffer.

Where the few-row kernel reads oneDNN's packed copy (`layers.linear.one_copy_layout`), a Linear's plain
weight is dropped once packed. Read into its own fresh memory first, every weight was written into fresh pages
twice (the read, then the packed copy): on a 2-core Zen 4 a page fault costs about as much as copying the page,
and the read into fresh memory took 1.0 s of a 1B model's 3 s of loading against 0.2 s into reused memory.
Here the checkpoint is read into a staging tensor taken from a pool (one per shape: the next layer's same
matrix reuses it), the module is packed as soon as all its shards are in, and the staging tensor goes back to
the pool. Only where nothing changes the weights between the load and `prepack` (no quantizing at load, not
batch-invariant, bf16): `models.registry.build_model` decides.

A weight the checkpoint holds whole in the parameter's dtype (o_proj, down_proj, a tied embedding: not the
q/k/v or gate/up shards, which are joined) is not read at all: the parameter points at the file's page cache
(`loader.hf.StoredTensor.mapped`) until it is packed, and its pages are unmapped after: half of a Llama's bytes
are never copied (docs/memory.md has the start times).
"""

import torch

from sobrio.layers.linear import BlockedPacker, Linear

TIED_EMBEDDING = "model.embed_tokens.weight"


class PackOnLoad:
    """`load_weights`' hooks: `before_fill` points a Linear's weight at staging memory before its first shard
    is read (or at the file's bytes, where they are the whole weight as it is), `after_fill` packs the module
    once every shard is in; `settle` gives whatever still points at a file memory of its own."""

    def __init__(self, model: torch.nn.Module):
        self.modules = {f"{name}.weight": module for name, module in model.named_modules()
                        if isinstance(module, Linear) and module.weight.dtype == torch.bfloat16}
        self.pending: dict[str, set[int | None]] = {}  # target -> the shards read so far
        self.done: set[str] = set()
        self.free: dict[torch.Size, list[torch.Tensor]] = {}
        # A tied embedding is packed by the model's `prepack` as its LM head, which then drops the plain matrix
        self.tied_embedding = getattr(model, "lm_head", False) is None
        # target -> (param, its stored tensor, the address of the file's bytes it points at)
        self.mapped: dict[str, tuple[torch.nn.Parameter, object, int]] = {}
        self.packer = BlockedPacker()  # the first packed copy of each shape: the later ones copy its layout

    def before_fill(self, target: str, param: torch.nn.Parameter, tensor=None) -> bool:
        """Prepare `param` for the checkpoint's `tensor`; True where it now holds the tensor's bytes already
        (a view of the file: nothing to read)."""
        if target in self.done or target in self.pending:
            return False
        whole = target in self.modules and getattr(self.modules[target], "shard_offsets", None) is None
        if (whole or (target == TIED_EMBEDDING and self.tied_embedding)) and self._map(target, param, tensor):
            if whole:
                self.pending[target] = set()
            return True
        if target in self.modules:
            self.pending[target] = set()
            pool = self.free.get(param.shape)
            param.data = pool.pop() if pool else torch.empty(param.shape, dtype=param.dtype)
        return False

    def _map(self, target: str, param: torch.nn.Parameter, tensor) -> bool:
        if getattr(tensor, "dtype", None) != param.dtype or getattr(tensor, "shape", None) != param.shape:
            return False
        view = tensor.mapped() if hasattr(tensor, "mapped") else None
        if view is None:
            return False
        param.data = view
        self.mapped[target] = (param, tensor, view.data_ptr())
        return True

    def after_fill(self, target: str, shard: int | None, param: torch.nn.Parameter) -> None:
        shards = self.pending.get(target)
        if shards is None:
            return
        shards.add(shard)
        module = self.modules[target]
        if len(shards) < len(getattr(module, "shard_offsets", [None])):
            return
        staging = param.data
        module.prepack(packer=self.packer)
        module.packed_at_load = True  # `Linear.prepack` leaves it as it is once
        # The plain weight stays where the few-row kernel cannot read the packed copy: then in its own memory.
        param.data = staging.clone() if "weight" in module._parameters else staging.new_empty(0)
        if (mapped := self.mapped.pop(target, None)) is not None:
            mapped[1].release()
        else:
            self.free.setdefault(staging.shape, []).append(staging)
        del self.pending[target]
        self.done.add(target)

    def settle(self, model: torch.nn.Module) -> None:
        """After the model's `prepack`: a parameter of the model still on the file's bytes (a tied embedding
        that was not packed) gets memory of its own, and every mapped page is unmapped."""
        kept = {id(p) for p in model.parameters()}
        for param, tensor, address in self.mapped.values():
            if id(param) in kept and param.data.numel() and param.data.data_ptr() == address:
                param.data = param.data.clone()
            tensor.release()
        self.mapped.clear()
        self.free.clear()
        self.packer = BlockedPacker()
