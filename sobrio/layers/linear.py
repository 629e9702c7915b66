"""Linear layers whose few-row bf16 matmuls (a decode step at small batch) take the C++ GEMV.

aten's bf16 matmul on a CPU without AMX reads a 1-row activation against the weight at about a third of
memory bandwidth; the GEMV streams each weight row once through AVX512-BF16 dot products. Above
`GEMV_MAX_ROWS` rows aten's blocked GEMM wins (`benchmarks/step_overhead.py --batch 1|4|8`).
"""

import torch
import torch.nn.functional as F

from sobrio.layers.cpu_ops import cpu_ops, gemv_available

GEMV_MAX_ROWS = 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, through the GEMV when x is a few bf16 rows."""
    if x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and gemv_available():
        return cpu_ops().gemv_bf16(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
