"""RMSNorm variants, computed in float32 as transformers does; the C++ operator fuses the residual add."""

import torch

from sobrio.layers.cpu_ops import cpu_ops


class RMSNorm(torch.nn.Module):
    """Llama: weight * normalize(x), the product in x's dtype."""

    offset = 0.0  # Gemma scales by (1 + weight)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((dim,), 1.0 - self.offset))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_ops()
        if ops is not None and x.dtype == self.weight.dtype:
            return ops.rms_norm(x.contiguous(), None, self.weight, self.eps, self.offset != 0.0)
        return self.reference(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the sum kept as the next residual; without one, (norm(x), x).
        The C++ path adds into `residual` in place: callers hand over the residual they got from here."""
        if residual is None:
            return self.forward(x), x
        ops = cpu_ops()
        if ops is not None and x.dtype == self.weight.dtype and residual.is_contiguous():
            return ops.rms_norm(x.contiguous(), residual, self.weight, self.eps, self.offset != 0.0), residual
        residual = x + residual
        return self.reference(residual), residual

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma: normalize(x) * (1 + weight), all in float32."""

    offset = 1.0

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)
