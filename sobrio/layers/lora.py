"""LoRA on top of any Linear (bf16, int8, int4, GGUF): the base module's output plus each adapter's (x @ A) @ B.

Each resident adapter has a slot (`RunnerAdapters` assigns it), the same in every wrapped module, which holds
every slot's A and B in the model's dtype. A step's tokens are grouped by slot once (`LoRAStep.set`: their
rows in slot order, and each group's slot and bounds), and every module then adds all its adapters' products
in one C++ call, whatever the number of requests or adapters (`lora_apply`, csrc/lora.cpp): the shrink
h = x @ A.T and the expand y[rows] += h @ B.T, h kept in float32 inside. A packed module (q/k/v, gate/up) has
one slice a projection; each slice holds up to R ranks (the largest rank held), A's rows stacked slice after
slice and B packed in tiles of 64 output columns (`TILE`), so the expand reads each tile's ranks in one run
and keeps its sums in registers. Only the ranks an adapter has in a slice are read (`ranks`). Tokens of the
base model run the base module alone. Where the C++ operator did not build, a loop over the step's adapters
(one matmul pair each) computes the same: the reference the operator is tested against.
"""

import functools

import torch


class LoRAStep:
    """The current step's token groups, shared by every wrapped module of one model: `rows` (the token rows
    that have an adapter, grouped by slot), `slots` [G] and `offsets` [G + 1] (group g is
    rows[offsets[g]:offsets[g + 1]], of slot slots[g]); `rows` None: no adapter. `span`: `rows` as a slice
    where they are contiguous (the gather is then a view), else None."""

    def __init__(self, slots: int) -> None:
        self.capacity = slots  # the slots every wrapped module holds (the adapters resident at once)
        self.rows: torch.Tensor | None = None
        self.span: slice | None = None
        self.slots = torch.zeros(0, dtype=torch.long)
        self.offsets = torch.zeros(1, dtype=torch.long)

    def set(self, slot_of_request: list[int | None], lengths: list[int]) -> None:
        """`slot_of_request[i]`: the slot of request i's adapter (None: the base model), `lengths[i]` its
        tokens in the flat batch."""
        spans: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for slot, n in zip(slot_of_request, lengths):
            if slot is not None and n:
                spans.setdefault(slot, []).append((start, start + n))
            start += n
        if not spans:
            self.rows = None
            return
        ordered = [span for group in spans.values() for span in group]
        sizes = [sum(e - s for s, e in group) for group in spans.values()]
        self.slots = torch.tensor(list(spans), dtype=torch.long)
        self.offsets = torch.tensor([0] + sizes, dtype=torch.long).cumsum(0)
        self.rows = torch.cat([torch.arange(s, e) for s, e in ordered])
        contiguous = all(s == e for (_, e), (s, _) in zip(ordered, ordered[1:]))
        self.span = slice(ordered[0][0], ordered[-1][1]) if contiguous else None


TILE = 64  # output columns of a tile of packed B (csrc/lora.cpp's kTile)


def lora_apply(y: torch.Tensor, x: torch.Tensor, module: "LoRALinear", step: LoRAStep) -> None:
    """y[rows] += (x[rows] @ A[slot].T) @ B[slot].T for each group of the step: the C++ operator where it is
    built, else the reference."""
    if (lora_apply_available() and y.dtype in (torch.float32, torch.bfloat16) and x.dtype == y.dtype == module.a.dtype
            and y.is_contiguous()):
        from sobrio.layers.cpu_ops import cpu_ops

        cpu_ops().lora_apply(y, x.contiguous(), module.a, module.b, module.ranks, module.widths, step.rows,
                             step.slots, step.offsets)
    else:
        lora_apply_reference(y, x, module, step)


def lora_apply_reference(y: torch.Tensor, x: torch.Tensor, module: "LoRALinear", step: LoRAStep) -> None:
    """One matmul pair a group, in y's dtype: what the C++ operator is tested against."""
    xs = x[step.span] if step.span is not None else x.index_select(0, step.rows)
    delta = y.new_empty(xs.shape[0], y.shape[1])
    bounds = step.offsets.tolist()
    for g, slot in enumerate(step.slots.tolist()):
        delta[bounds[g]:bounds[g + 1]] = (xs[bounds[g]:bounds[g + 1]] @ module.a[slot].T) @ module.dense_bt(slot)
    y.index_add_(0, step.rows, delta)


@functools.cache
def lora_apply_available() -> bool:
    from sobrio.layers.cpu_ops import cpu_ops

    return hasattr(cpu_ops(), "lora_apply")


def tile_view(packed: torch.Tensor, widths: list[int], rank: int, j: int) -> torch.Tensor:
    """Slice j's tiles [tiles, rank, TILE] in one slot's packed B [P] (a view)."""
    counts = [-(-width // TILE) for width in widths]
    begin = sum(counts[:j]) * rank * TILE
    return packed[begin:begin + counts[j] * rank * TILE].view(counts[j], rank, TILE)


class LoRALinear(torch.nn.Module):
    """`base` (any module computing x -> y) plus the LoRA products of the step's adapters. `slices`: the
    PEFT target names of its output slices in order (["q_proj", "k_proj", "v_proj"] for a packed module)
    and their widths."""

    def __init__(self, base: torch.nn.Module, slices: list[tuple[str, int]], in_features: int, step: LoRAStep,
                 dtype: torch.dtype):
        super().__init__()
        self.base = base
        self.slices = slices
        self.targets = [name for name, _ in slices]
        self.widths = [width for _, width in slices]
        self.dtype = dtype
        self.in_features = in_features
        self.out_features = sum(self.widths)
        self.step = step
        # Every slot's A [slots, S * R, in] (slice j's ranks at rows j * R ..), B packed [slots, P] (slice after
        # slice, each [tiles, R, TILE]: `tiles`) and its rank in each slice (`ranks` [slots, S], int32; 0 where
        # the adapter skips the projection or the slot is empty). R: the largest rank held. None: no adapter yet.
        self.rank = 0
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.ranks: torch.Tensor | None = None

    def tiles(self, slot: int, j: int) -> torch.Tensor:
        """Slice j's packed B of `slot`, [tiles, R, TILE] (a view)."""
        return tile_view(self.b[slot], self.widths, self.rank, j)

    def dense_bt(self, slot: int) -> torch.Tensor:
        """B.T of `slot` unpacked, [S * R, out] (block-diagonal for a packed module): the reference's."""
        bt = self.b.new_zeros(len(self.widths) * self.rank, self.out_features)
        column = 0
        for j, width in enumerate(self.widths):
            rows = self.tiles(slot, j).transpose(0, 1).reshape(self.rank, -1)  # [R, tiles * TILE]
            bt[j * self.rank:(j + 1) * self.rank, column:column + width] = rows[:, :width]
            column += width
        return bt

    def add(self, slot: int, target: str, a: torch.Tensor, b: torch.Tensor, scaling: float = 1.0) -> None:
        """One projection's A [r, in] and B [out, r] into an empty `slot`, straight into the packed layout: in
        the model's dtype, B times `scaling` (rounded once)."""
        j = self.targets.index(target)
        r, width = a.shape[0], self.widths[j]
        self._reserve(r)
        self.a[slot].narrow(0, j * self.rank, r).copy_(a)
        tiles = self.tiles(slot, j)[:, :r]
        if b.dtype != self.dtype:
            b, scaling = b.float() * scaling, 1.0
        if width % TILE:
            b = torch.nn.functional.pad(b, (0, 0, 0, tiles.shape[0] * TILE - width))
        tiles.copy_(b.contiguous().view(tiles.shape[0], TILE, r).transpose(1, 2))
        if scaling != 1.0:
            tiles.mul_(scaling)
        self.rank_table[slot, j] = r  # `ranks` itself, through numpy: a tensor's element write costs ~10 us

    def remove_adapter(self, slot: int) -> None:
        if self.a is not None:
            self.a[slot].zero_()
            self.b[slot].zero_()
            self.ranks[slot].zero_()

    def _reserve(self, rank: int) -> None:
        """Every slot with room for rank `rank` in each slice (grown rarely: the first adapter, or a larger
        rank than any before; the slots held are repacked)."""
        if self.rank >= rank:
            return
        held, old_a, old_b = self.rank, self.a, self.b
        slots, count, tiles = self.step.capacity, len(self.widths), sum(-(-w // TILE) for w in self.widths)
        self.rank = rank
        self.a = torch.zeros(slots, count * rank, self.in_features, dtype=self.dtype)
        self.b = torch.zeros(slots, tiles * rank * TILE, dtype=self.dtype)
        if self.ranks is None:
            self.ranks = torch.zeros(slots, count, dtype=torch.int32)
            self.rank_table = self.ranks.numpy()
            return
        for slot in range(slots):
            for j in range(count):
                self.a[slot, j * rank:j * rank + held] = old_a[slot, j * held:(j + 1) * held]
                self.tiles(slot, j)[:, :held] = tile_view(old_b[slot], self.widths, held, j)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.step
        if step.rows is None or self.a is None:
            return y
        lora_apply(y, x, self, step)
        return y


def attach_lora(layers: torch.nn.ModuleList, shapes: dict[str, tuple[int, int]], step: LoRAStep,
                dtype: torch.dtype) -> list[dict[str, LoRALinear]]:
    """Wrap each layer's q/k/v/o and gate/up/down modules named in `shapes` (target -> (out, in) features;
    a mixture-of-experts MLP has no dense gate/up/down there and keeps its own). Returns each layer's wrapped
    modules by PEFT target."""
    plan = [("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("self_attn", "o_proj", ("o_proj",)),
            ("mlp", "gate_up_proj", ("gate_proj", "up_proj")), ("mlp", "down_proj", ("down_proj",))]
    wrapped = []
    for layer in layers:
        targets: dict[str, LoRALinear] = {}
        for block_name, attr, names in plan:
            if not all(name in shapes for name in names):
                continue
            block = getattr(layer, block_name)
            slices = [(name, shapes[name][0]) for name in names]
            module = LoRALinear(getattr(block, attr), slices, shapes[names[0]][1], step, dtype)
            setattr(block, attr, module)
            targets |= {name: module for name in names}
        wrapped.append(targets)
    return wrapped
