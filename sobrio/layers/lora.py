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

import numpy
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


def lora_apply(y: torch.Tensor, x: torch.Tensor, bank: "LoRABank", layer: int, step: LoRAStep) -> None:
    """y[rows] += (x[rows] @ A[slot].T) @ B[slot].T for each group of the step, with layer `layer`'s A and B:
    the C++ operator where it is built, else the reference. Called 120 times a step on a small model: kept
    to a few attribute reads around the call (an import or a cached call here cost a few us each)."""
    operator = bank.operator
    if operator is not None and x.dtype is y.dtype is bank.dtype and y.is_contiguous():
        operator(y, x.contiguous(), bank.a_of[layer], bank.b_of[layer], bank.ranks, bank.scales, bank.widths,
                 step.rows, step.slots, step.offsets)
    else:
        lora_apply_reference(y, x, bank, layer, step)


def lora_apply_reference(y: torch.Tensor, x: torch.Tensor, bank: "LoRABank", layer: int, step: LoRAStep) -> None:
    """One matmul pair a group, in y's dtype: what the C++ operator is tested against."""
    xs = x[step.span] if step.span is not None else x.index_select(0, step.rows)
    delta = y.new_empty(xs.shape[0], y.shape[1])
    bounds = step.offsets.tolist()
    for g, slot in enumerate(step.slots.tolist()):
        a, bt = bank.a_of[layer][slot] * bank.in_use(slot)[:, None], bank.dense_bt(layer, slot)
        delta[bounds[g]:bounds[g + 1]] = (xs[bounds[g]:bounds[g + 1]] @ a.T * bank.scales[slot].item()) @ bt
    y.index_add_(0, step.rows, delta)


@functools.cache
def lora_operator():
    """The C++ `lora_apply`, or None where the operators did not build."""
    from sobrio.layers.cpu_ops import cpu_ops

    return getattr(cpu_ops(), "lora_apply", None)


def lora_apply_available() -> bool:
    return lora_operator() is not None


_SAME_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # an integer dtype of each float's width


def copy_here(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) on the calling thread, by numpy where the dtypes match: torch spreads a large copy over
    its threads, and beside a busy neighbour each such copy waited a time slice for the thread whose core the
    neighbour held (docs/lora.md)."""
    if dst.dtype != src.dtype or dst.dtype.itemsize not in _SAME_WIDTH:
        dst.copy_(src)
        return
    same = _SAME_WIDTH[dst.dtype.itemsize]
    numpy.copyto(dst.view(same).numpy(), src.view(same).numpy())


def tile_view(packed: torch.Tensor, counts: list[int], rank: int, j: int) -> torch.Tensor:
    """Slice j's tiles [..., counts[j], rank, TILE] in packed B [..., P] (a view)."""
    begin = sum(counts[:j]) * rank * TILE
    return packed[..., begin:begin + counts[j] * rank * TILE].unflatten(-1, (counts[j], rank, TILE))


class LoRABank:
    """The adapters of one kind of module (q/k/v, o, gate/up or down) in every layer, so that an adapter is
    placed in a few operations a kind whatever the number of layers. `slices`: the PEFT target names of the
    module's output slices in order (["q_proj", "k_proj", "v_proj"] for a packed module) and their widths.

    A [layers, slots, S * R, in] (slice j's ranks at rows j * R ..), B packed [layers, slots, P] (slice after
    slice, each [tiles, R, TILE]), each slot's rank in each slice (`ranks` [slots, S], int32; the same in every
    layer, as PEFT's rank_pattern and layers_to_transform are refused; 0 where the adapter skips the projection
    or the slot is empty) and its scaling (`scales` [slots], float32: applied to x @ A.T, as PEFT applies it to
    the product, so B is placed as stored). R: the largest rank held. None until the first adapter."""

    def __init__(self, slices: list[tuple[str, int]], in_features: int, layers: int, slots: int,
                 dtype: torch.dtype):
        self.targets = [name for name, _ in slices]
        self.widths = [width for _, width in slices]
        self.counts = [-(-width // TILE) for width in self.widths]  # tiles of each slice
        self.in_features, self.out_features = in_features, sum(self.widths)
        self.layers, self.slots, self.dtype = layers, slots, dtype
        self.rank = 0
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.ranks: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.a_of: list[torch.Tensor] = []  # each layer's A and B (views): what a module's forward reads
        self.b_of: list[torch.Tensor] = []
        self.operator = lora_operator() if dtype in (torch.float32, torch.bfloat16) else None  # the C++ one

    def add(self, slot: int, target: str, a: torch.Tensor, b: torch.Tensor, scaling: float = 1.0) -> None:
        """One projection's A [layers, r, in] and B [layers, out, r] of every layer into an empty `slot`, in the
        model's dtype: A as it is, B transposed into its tiles (`copy_here`); the product is scaled by
        `scaling`."""
        j = self.targets.index(target)
        r, width, count = a.shape[1], self.widths[j], self.counts[j]
        self._reserve(r)
        copy_here(self.a[:, slot].narrow(1, j * self.rank, r), a)
        if width % TILE:
            b = torch.nn.functional.pad(b, (0, 0, 0, count * TILE - width))
        tiles = tile_view(self.b[:, slot], self.counts, self.rank, j)[:, :, :r]  # [layers, tiles, r, TILE]
        copy_here(tiles, b.reshape(self.layers, count, TILE, r).transpose(2, 3))
        self.rank_table[slot, j] = r  # `ranks` itself, through numpy: a tensor's element write costs ~10 us
        self.scale_table[slot] = scaling

    def remove(self, slot: int) -> None:
        """Empty `slot`: its ranks 0, so nothing of it is read (its A and B stay until overwritten)."""
        if self.ranks is not None:
            self.ranks[slot].zero_()

    def in_use(self, slot: int) -> torch.Tensor:
        """Which of the S * R rows of `slot`'s A (and of its B.T) hold its adapter's ranks, [S * R] bool."""
        return (torch.arange(self.rank)[None, :] < self.ranks[slot, :, None]).reshape(-1)

    def dense_bt(self, layer: int, slot: int) -> torch.Tensor:
        """B.T of `slot` in `layer` unpacked, [S * R, out] (block-diagonal for a packed module): the reference's."""
        bt = self.b.new_zeros(len(self.widths) * self.rank, self.out_features)
        column = 0
        for j, width in enumerate(self.widths):
            rows = tile_view(self.b[layer, slot], self.counts, self.rank, j).transpose(0, 1).reshape(self.rank, -1)
            bt[j * self.rank:(j + 1) * self.rank, column:column + width] = rows[:, :width]
            column += width
        return bt

    def _reserve(self, rank: int) -> None:
        """Room for rank `rank` in each slice (grown rarely: the first adapter, or a larger rank than any
        before; the slots held are repacked)."""
        if self.rank >= rank:
            return
        held, old_a, old_b = self.rank, self.a, self.b
        self.rank, count = rank, len(self.widths)
        self.a = torch.zeros(self.layers, self.slots, count * rank, self.in_features, dtype=self.dtype)
        self.b = torch.zeros(self.layers, self.slots, sum(self.counts) * rank * TILE, dtype=self.dtype)
        if old_a is None:
            self.ranks = torch.zeros(self.slots, count, dtype=torch.int32)
            self.scales = torch.zeros(self.slots, dtype=torch.float32)
            self.rank_table, self.scale_table = self.ranks.numpy(), self.scales.numpy()
        else:
            for j in range(count):
                self.a[:, :, j * rank:j * rank + held] = old_a[:, :, j * held:(j + 1) * held]
                tile_view(self.b, self.counts, rank, j)[..., :held, :] = tile_view(old_b, self.counts, held, j)
        self.a_of, self.b_of = list(self.a.unbind(0)), list(self.b.unbind(0))


class LoRALinear(torch.nn.Module):
    """`base` (any module computing x -> y) plus the LoRA products of the step's adapters, from layer
    `layer`'s share of `bank`."""

    def __init__(self, base: torch.nn.Module, bank: LoRABank, layer: int, step: LoRAStep):
        super().__init__()
        self.base, self.bank, self.layer, self.step = base, bank, layer, step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.step.rows is None or self.bank.a is None:
            return y
        lora_apply(y, x, self.bank, self.layer, self.step)
        return y


def attach_lora(layers: torch.nn.ModuleList, shapes: dict[str, tuple[int, int]], step: LoRAStep,
                dtype: torch.dtype) -> dict[str, LoRABank]:
    """Wrap each layer's q/k/v/o and gate/up/down modules named in `shapes` (target -> (out, in) features;
    a mixture-of-experts MLP has no dense gate/up/down there and keeps its own). Returns the bank of each
    PEFT target (q/k/v share one, gate/up another)."""
    plan = [("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("self_attn", "o_proj", ("o_proj",)),
            ("mlp", "gate_up_proj", ("gate_proj", "up_proj")), ("mlp", "down_proj", ("down_proj",))]
    banks: dict[str, LoRABank] = {}
    for block_name, attr, names in plan:
        if not all(name in shapes for name in names):
            continue
        bank = LoRABank([(name, shapes[name][0]) for name in names], shapes[names[0]][1], len(layers),
                        step.capacity, dtype)
        for i, layer in enumerate(layers):
            block = getattr(layer, block_name)
            setattr(block, attr, LoRALinear(getattr(block, attr), bank, i, step))
        banks |= {name: bank for name in names}
    return banks
