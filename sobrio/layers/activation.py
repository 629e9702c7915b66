"""Gated activations (SwiGLU, GeGLU-tanh): act(gate) * up over a [T, 2I] matmul output, by the C++ operator
where it built, else in PyTorch (the reference)."""

import torch
import torch.nn.functional as F

from sobrio.layers.cpu_ops import cpu_ops

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # `hidden_act` -> code of the C++ act_and_mul


def activation_code(name: str) -> int:
    """The code of a checkpoint's `hidden_act`; one sobrio does not compute is a ValueError naming it."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def act_and_mul(gate_up: torch.Tensor, code: int) -> torch.Tensor:
    """act(gate) * up, gate the first half of the last dimension and up the second."""
    ops = cpu_ops()
    if ops is not None:
        return ops.act_and_mul(gate_up.contiguous(), code)
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) if code == 0 else F.gelu(gate, approximate="tanh")) * up
