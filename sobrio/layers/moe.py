"""Mixture-of-experts feed-forward: a router picks `top_k` of `num_experts` gated FFNs per token, and the
layer's output is their outputs weighted by the router's probabilities.

Routing is the checkpoint's own rule (`route`): softmax over the router's logits in float32, the top k,
then renormalised to sum to 1 where the model says so (Mixtral always; Qwen2/Qwen3-MoE `norm_topk_prob`).

The experts' weights are stacked per layer (`FusedExperts`: gate/up [E, 2I, H], down [E, H, I]). A step's
(token, expert) pairs are sorted by expert id, so each active expert's tokens are one contiguous run of
rows and it computes them in one matmul pair; the Python loop runs over the experts, never the tokens.
Each token's k outputs are then summed in ascending expert id, the order transformers adds them in.

Quantized (`--quantization int8/int4`, `FusedExperts.quantize`), each expert's two matrices become the
same modules a dense Linear becomes (`layers.quantization.quantized_linear`), so the experts run the
dense kernels (VNNI, int8pack, int4pack), one call per active expert; the float stacks are dropped.
"""

import torch

from sobrio.layers.activation import act_and_mul, activation_code
from sobrio.layers.cpu_ops import cpu_ops, invariant_linear_available
from sobrio.layers.linear import invariant_linear, linear

GROUPED_MAX_ROWS = 4  # rows per active expert (on average) up to which the experts share one C++ call


def expert_linear_available() -> bool:
    """Whether the grouped expert matmul was built (the batch-invariant kernel's, AVX-512 or AVX2)."""
    return invariant_linear_available() and hasattr(cpu_ops(), "expert_linear")


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) of each token's k experts, in ascending expert id:
    softmax in float32, top k, and with `normalize` the k weights divided by their sum."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    experts, order = experts.sort(dim=-1)
    return weights.gather(-1, order), experts


class FusedExperts(torch.nn.Module):
    """`num_experts` gated FFNs (act(x Wg) * x Wu) Wd, their weights stacked: `gate_up_proj` [E, 2I, H]
    (gate rows first, as `PackedLinear`'s shards: `shard_offsets`), `down_proj` [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.gate_up_proj = torch.nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = torch.nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.shard_offsets = [(0, intermediate), (intermediate, intermediate)]
        self.act_code = activation_code(act)
        self.batch_invariant = False
        self.quantized_gate_up: torch.nn.ModuleList | None = None  # per expert, set by `quantize`
        self.quantized_down: torch.nn.ModuleList | None = None

    def prepack(self, batch_invariant: bool = False) -> None:
        """Choose the float matmul: the batch-invariant kernel, or `layers.linear.linear` (the C++ GEMV for a
        few rows, aten's matmul past them). No packed copies: they would double the experts' memory, and at
        decode most experts see one to four rows, where the GEMV reads the plain weight."""
        self.batch_invariant = batch_invariant

    def quantize(self, method: str, name: str) -> None:
        """Each expert's matrices in the quantized form of a dense Linear (`quantized_linear`), the float
        stacks dropped."""
        from sobrio.layers.quantization import quantized_linear

        self.quantized_gate_up = torch.nn.ModuleList(
            quantized_linear(w, None, method, f"{name}.{e}.gate_up_proj") for e, w in enumerate(self.gate_up_proj))
        self.quantized_down = torch.nn.ModuleList(
            quantized_linear(w, None, method, f"{name}.{e}.down_proj", grouped_inputs=True)
            for e, w in enumerate(self.down_proj))
        self.gate_up_proj = self.down_proj = None

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e`'s FFN on its rows x [n, H]."""
        if self.quantized_gate_up is not None:
            return self.quantized_down[e](act_and_mul(self.quantized_gate_up[e](x), self.act_code))
        matmul = invariant_linear if self.batch_invariant else linear
        return matmul(act_and_mul(matmul(x, self.gate_up_proj[e]), self.act_code), self.down_proj[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights, experts [T, k] (`route`'s) -> sum over k of weight * expert(x), in x's dtype."""
        tokens, k = experts.shape
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        rows = x.index_select(0, order // k)
        active = counts.nonzero().squeeze(1)
        if self._grouped(rows, len(active)):
            offsets = torch.nn.functional.pad(counts[active].cumsum(0), (1, 0))
            ops = cpu_ops()
            gate_up = ops.expert_linear(rows, self.gate_up_proj, active, offsets)
            out = ops.expert_linear(act_and_mul(gate_up, self.act_code), self.down_proj, active, offsets)
        else:
            out = torch.empty_like(rows)
            start = 0
            for e, n in zip(active.tolist(), counts[active].tolist()):
                out[start:start + n] = self.expert(e, rows[start:start + n])
                start += n
        slots = torch.empty_like(out).index_copy_(0, order, out).view(tokens, k, -1)
        return _weighted_sum(slots, weights.to(x.dtype))

    def _grouped(self, rows: torch.Tensor, active: int) -> bool:
        """Whether every active expert runs in one C++ call (`expert_linear`): float weights, and few rows per
        expert (decode), where one call per expert would cost more in calls than in reading its weights;
        past `GROUPED_MAX_ROWS` an expert's rows take `layers.linear.linear` (oneDNN, aten), whose blocking
        wins on long prompts."""
        return (self.quantized_gate_up is None and rows.dtype in (torch.float32, torch.bfloat16)
                and rows.shape[0] <= GROUPED_MAX_ROWS * active and expert_linear_available())


def _weighted_sum(slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights[:, j] * slots[:, j] ([T, k, H], [T, k] -> [T, H]), each token's sum in slot order."""
    return (slots * weights[..., None]).sum(dim=1)


class SparseMoE(torch.nn.Module):
    """A router (`gate`, kept in float: a quantized router would move tokens to other experts), the routed
    experts, and optionally Qwen2-MoE's shared expert, an always-on FFN scaled by sigmoid(shared_expert_gate)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, normalize: bool, act: str,
                 shared_expert: torch.nn.Module | None = None):
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.gate = torch.nn.Linear(hidden, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden, intermediate, act)
        self.shared_expert = shared_expert
        self.shared_expert_gate = None if shared_expert is None else torch.nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        weights, experts = route(self._linear(rows, self.gate), self.top_k, self.normalize)
        out = self.experts(rows, weights, experts)
        if self.shared_expert is not None:
            out += torch.sigmoid(self._linear(rows, self.shared_expert_gate)) * self.shared_expert(rows)
        return out.view(x.shape)

    def _linear(self, rows: torch.Tensor, gate: torch.nn.Linear) -> torch.Tensor:
        """A float gate's logits; with `--batch-invariant` by the kernel whose rows do not depend on the batch
        (aten's may round a row differently with the batch, and move a token to another expert); else by
        `layers.linear.linear`, whose C++ GEMV takes a decode step's few bf16 rows (Qwen1.5-MoE's router of 60
        x 2,048: 4-6 us a call where aten took 25-45)."""
        return invariant_linear(rows, gate.weight) if self.experts.batch_invariant else linear(rows, gate.weight)
