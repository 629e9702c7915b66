"""LoRA on top of any Linear (bf16, int8, int4, GGUF): the base module's output plus each adapter's (x @ A) @ B.

A step's tokens are grouped by adapter once (`LoRAStep`: one adapter's rows as a slice or index, several
adapters' as a padded [adapters, rows] table), so every wrapped module runs one matmul pair for one adapter
and one batched pair (`torch.bmm`) for several, whatever the number of requests: no Python loop over
requests or adapters in the forward. A packed module (q/k/v, gate/up) holds each adapter's
A matrices stacked and its B matrices block-diagonal, so it too is one pair per adapter. Tokens of the base
model run the base module alone.
"""

import torch


class LoRAStep:
    """The current step's token groups, shared by every wrapped module of one model. With several adapters
    active, their rows are laid out as a padded [adapters, rows] table, so a module computes every adapter's
    product in two batched matmuls (`torch.bmm`) whatever the number of adapters or requests."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor | slice]] = []
        self.ids: tuple[int, ...] = ()  # the active adapters, in the table's order
        self.gather: torch.Tensor | None = None  # [adapters * rows]: the token row of each slot (padding: 0)
        self.valid: torch.Tensor | None = None  # the slots that hold a token (None: all of them)
        self.dest: torch.Tensor | None = None  # the token row of each valid slot

    def set(self, adapter_of_request: list[int | None], lengths: list[int]) -> None:
        """`adapter_of_request[i]`: the id of request i's adapter (None: the base model), `lengths[i]` its
        tokens in the flat batch. A group whose rows are contiguous is a slice (no gather)."""
        rows: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for adapter, n in zip(adapter_of_request, lengths):
            if adapter is not None and n:
                rows.setdefault(adapter, []).append((start, start + n))
            start += n
        self.groups = [(adapter, _rows(spans)) for adapter, spans in rows.items()]
        self.ids = tuple(rows)
        self.gather = self.valid = self.dest = None
        if len(self.groups) > 1:
            self._table([torch.cat([torch.arange(s, e) for s, e in spans]) for spans in rows.values()])

    def _table(self, members: list[torch.Tensor]) -> None:
        width = max(len(m) for m in members)
        table = torch.zeros(len(members), width, dtype=torch.long)
        mask = torch.zeros(len(members), width, dtype=torch.bool)
        for i, m in enumerate(members):
            table[i, :len(m)] = m
            mask[i, :len(m)] = True
        self.gather = table.view(-1)
        self.dest = torch.cat(members)
        self.valid = None if bool(mask.all()) else mask.view(-1).nonzero().squeeze(1)


def _rows(spans: list[tuple[int, int]]) -> torch.Tensor | slice:
    merged = [list(spans[0])]
    for s, e in spans[1:]:
        if s == merged[-1][1]:
            merged[-1][1] = e
        else:
            merged.append([s, e])
    if len(merged) == 1:
        return slice(*merged[0])
    return torch.cat([torch.arange(s, e) for s, e in merged])


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
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (A [R, in], B [out, R])
        self._stack_key: tuple[int, ...] | None = None
        self._stack: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))

    def add_adapter(self, adapter_id: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """`pairs[target] = (A [r, in], B [out, r])` (B scaled); slices the adapter does not target stay zero."""
        present = [(name, width, pairs[name]) for name, width in self.slices if name in pairs]
        if not present:
            return
        a = torch.cat([ab[0] for _, _, ab in present])
        b = torch.zeros(self.out_features, a.shape[0], dtype=a.dtype)
        row, col = 0, 0
        for name, width in self.slices:
            if name in pairs:
                r = pairs[name][0].shape[0]
                b[row:row + width, col:col + r] = pairs[name][1]
                col += r
            row += width
        self.adapters[adapter_id] = (a, b)
        self._stack_key = None

    def remove_adapter(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)
        self._stack_key = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.step
        if len(step.groups) == 1:
            adapter_id, rows = step.groups[0]
            ab = self.adapters.get(adapter_id)
            if ab is not None and isinstance(rows, slice):
                y[rows] += (x[rows] @ ab[0].T) @ ab[1].T
            elif ab is not None:
                y.index_add_(0, rows, (x.index_select(0, rows) @ ab[0].T) @ ab[1].T)
        elif step.groups:
            a_t, b_t = self._stacked(step.ids)  # float32: PyTorch's CPU bmm has no fast bf16 path (20x slower)
            xs = x.index_select(0, step.gather).view(len(step.ids), -1, x.shape[1]).float()
            delta = torch.bmm(torch.bmm(xs, a_t), b_t).view(-1, y.shape[1]).to(y.dtype)
            y.index_add_(0, step.dest, delta if step.valid is None else delta.index_select(0, step.valid))
        return y

    def _stacked(self, ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """A^T [adapters, in, R] and B^T [adapters, R, out] of these adapters (R: their largest rank; an
        adapter without this module, or of a smaller rank, padded with zeros), kept while the set is the same."""
        if self._stack_key == ids:
            return self._stack
        pairs = [self.adapters.get(i) for i in ids]
        rank = max((p[0].shape[0] for p in pairs if p is not None), default=1)
        a_t = torch.zeros(len(ids), self.in_features, rank)
        b_t = torch.zeros(len(ids), rank, self.out_features)
        for j, p in enumerate(pairs):
            if p is not None:
                a_t[j, :, :p[0].shape[0]] = p[0].T
                b_t[j, :p[0].shape[0]] = p[1].T
        self._stack_key, self._stack = ids, (a_t, b_t)
        return self._stack


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
