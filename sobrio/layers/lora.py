"""LoRA on top of any Linear (bf16, int8, int4, GGUF): the base module's output plus each adapter's (x @ A) @ B.

Each resident adapter has a slot (`RunnerAdapters` assigns it), the same in every wrapped module, which holds
every slot's A and B stacked in the model's dtype. A step's tokens are grouped by slot once (`LoRAStep.set`:
their rows in slot order), and every module then computes all its adapters' products in two C++ calls,
whatever the number of requests or adapters: the shrink h = x @ A.T (`expert_linear`, the segment matmul the
mixture-of-experts MLP uses: rows grouped by matrix, each group against its own) and the expand
y[rows] += h @ B.T (`lora_expand`, summed along the output columns and added into y in place). A packed
module (q/k/v, gate/up) holds each adapter's A matrices stacked and its B matrices block-diagonal, so it too
is one pair; the expand reads only B's non-zero blocks. Tokens of the base model run the base module alone.
Where the C++ operators did not build, a loop over the step's adapters (one matmul pair each) computes the
same: the reference the operators are tested against.
"""

import torch

from sobrio.layers.moe import expert_linear_available


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


def segment_matmul(x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows grouped by slot, each group @ w[its slot].T: x [rows, K], w [slots, N, K] -> [rows, N]. The C++
    operator where it is built, else one matmul a group (the reference)."""
    if expert_linear_available() and x.dtype in (torch.float32, torch.bfloat16):
        from sobrio.layers.cpu_ops import cpu_ops

        return cpu_ops().expert_linear(x.contiguous(), w, slots, offsets)
    return segment_matmul_reference(x, w, slots, offsets)


def segment_matmul_reference(x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor
                             ) -> torch.Tensor:
    out = x.new_empty(x.shape[0], w.shape[1])
    bounds = offsets.tolist()
    for g, slot in enumerate(slots.tolist()):
        out[bounds[g]:bounds[g + 1]] = x[bounds[g]:bounds[g + 1]] @ w[slot].T
    return out


def lora_expand(y: torch.Tensor, h: torch.Tensor, bt: torch.Tensor, spans: torch.Tensor, step: LoRAStep) -> None:
    """y[rows] += h @ bt[slot] for each group of the step (bt [slots, R, out]; spans [slots, R, 2] the output
    columns each rank writes, zeros elsewhere in bt). The C++ operator where it is built, else the reference."""
    if expand_available() and y.dtype in (torch.float32, torch.bfloat16) and y.is_contiguous():
        from sobrio.layers.cpu_ops import cpu_ops

        cpu_ops().lora_expand(y, h.contiguous(), bt, spans, step.rows, step.slots, step.offsets)
    else:
        lora_expand_reference(y, h, bt, step)


def lora_expand_reference(y: torch.Tensor, h: torch.Tensor, bt: torch.Tensor, step: LoRAStep) -> None:
    delta = y.new_empty(h.shape[0], y.shape[1])
    bounds = step.offsets.tolist()
    for g, slot in enumerate(step.slots.tolist()):
        delta[bounds[g]:bounds[g + 1]] = h[bounds[g]:bounds[g + 1]] @ bt[slot]
    y.index_add_(0, step.rows, delta)


def expand_available() -> bool:
    from sobrio.layers.cpu_ops import cpu_ops

    return hasattr(cpu_ops(), "lora_expand")


class LoRALinear(torch.nn.Module):
    """`base` (any module computing x -> y) plus the LoRA products of the step's adapters. `slices`: the
    PEFT target names of its output slices in order (["q_proj", "k_proj", "v_proj"] for a packed module)
    and their widths."""

    def __init__(self, base: torch.nn.Module, slices: list[tuple[str, int]], in_features: int, step: LoRAStep):
        super().__init__()
        self.base = base
        self.slices = slices
        self.in_features = in_features
        self.out_features = sum(width for _, width in slices)
        self.step = step
        # Every slot's A [slots, R, in] and B.T [slots, R, out] (R: the largest stacked rank held; a smaller
        # adapter, an empty slot or one whose adapter skips this module is zero there), and the output
        # columns [begin, end) each rank writes (spans [slots, R, 2], int32). None: no adapter yet.
        self.a: torch.Tensor | None = None
        self.bt: torch.Tensor | None = None
        self.spans: torch.Tensor | None = None

    def add_adapter(self, slot: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """`pairs[target] = (A [r, in], B [out, r])` (B scaled) into `slot`; slices the adapter does not target
        stay zero."""
        present = [(name, pairs[name]) for name, _ in self.slices if name in pairs]
        if not present:
            self.remove_adapter(slot)
            return
        self._reserve(sum(ab[0].shape[0] for _, ab in present), present[0][1][0].dtype)
        self.remove_adapter(slot)
        row, col = 0, 0
        for name, width in self.slices:
            if name in pairs:
                a, b = pairs[name]
                self.a[slot, col:col + a.shape[0]] = a
                self.bt[slot, col:col + a.shape[0], row:row + width] = b.T
                self.spans[slot, col:col + a.shape[0]] = torch.tensor([row, row + width], dtype=torch.int32)
                col += a.shape[0]
            row += width

    def remove_adapter(self, slot: int) -> None:
        if self.a is not None:
            self.a[slot].zero_()
            self.bt[slot].zero_()
            self.spans[slot].zero_()

    def _reserve(self, rank: int, dtype: torch.dtype) -> None:
        """Every slot with room for a stacked rank `rank` at least (grown rarely: the first adapter, or a
        larger rank than any before)."""
        if self.a is not None and self.a.shape[1] >= rank:
            return
        old = (self.a, self.bt, self.spans)
        rank = rank if old[0] is None else max(rank, old[0].shape[1])
        self.a = torch.zeros(self.step.capacity, rank, self.in_features, dtype=dtype)
        self.bt = torch.zeros(self.step.capacity, rank, self.out_features, dtype=dtype)
        self.spans = torch.zeros(self.step.capacity, rank, 2, dtype=torch.int32)
        if old[0] is not None:
            for new, held in zip((self.a, self.bt, self.spans), old):
                new[:, :held.shape[1]] = held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.step
        if step.rows is None or self.a is None:
            return y
        xs = x[step.span] if step.span is not None else x.index_select(0, step.rows)
        lora_expand(y, segment_matmul(xs, self.a, step.slots, step.offsets), self.bt, self.spans, step)
        return y


def attach_lora(layers: torch.nn.ModuleList, shapes: dict[str, tuple[int, int]], step: LoRAStep
                ) -> list[dict[str, LoRALinear]]:
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
            module = LoRALinear(getattr(block, attr), slices, shapes[names[0]][1], step)
            setattr(block, attr, module)
            targets |= {name: module for name in names}
        wrapped.append(targets)
    return wrapped
