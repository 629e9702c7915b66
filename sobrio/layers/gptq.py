"""GPTQ's error compensation for `--quantization int4` (Frantar et al. 2023): the columns of a Linear weight
[N, K] are rounded one at a time, and each one's rounding error is spread over the columns not yet rounded,
in proportion to how the layer's inputs correlate (the Hessian H = 2 X^T X / T of the layer's squared output
error, from the calibration text), so the layer's outputs move less than with each weight on its nearest
code. The grids are sobrio's own int4 groups (layers/int4.py `fit_grids`); the result is the codes,
scales and zeros of `Int4Codes`, for any kernel. What it gained (Gemma 3 270M int4 from +16.76% to +7.68%
perplexity), what was tried and found no better (act-order, more tokens, more damping) and its load-time
cost: docs/quantization.md.
"""

import logging

import torch

from sobrio.layers.int4 import SCALE_DTYPE, check_int4_shape, fit_grids, quantize_int4_codes

logger = logging.getLogger(__name__)

DAMPING = 0.01  # of H's mean diagonal, added to its diagonal: a few thousand tokens leave H near singular
TRIANGULAR_LEAF = 256  # `_lower_inverse` solves blocks up to this size directly
BLOCK = 128  # columns rounded between two updates of the rest of the matrix; their groups' grids are fitted at once


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor,
                  group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int32 [N, K], scales_and_zeros bf16 [K / g, N, 2]) of `weight` [N, K] under the input Hessian
    `hessian` [K, K]. A block's errors reach the later columns in one matmul when it is done; the grids of
    its groups are fitted when it starts, with every earlier block's errors in (as GPTQ's own code does). An
    input channel the calibration never used (a zero diagonal) is rounded without compensating anything."""
    n, k = weight.shape
    check_int4_shape(n, k, group_size)
    assert hessian.shape == (k, k) and BLOCK % group_size == 0, (tuple(hessian.shape), k, group_size)
    u = _inverse_hessian_factor(hessian.float())
    if u is None:
        logger.warning("int4: GPTQ's statistics of a %dx%d weight are not usable (not finite, or singular "
                       "after damping): its weights are rounded to their nearest codes", n, k)
        plain = quantize_int4_codes(weight.detach(), group_size)
        return plain.codes, plain.scales_and_zeros.to(SCALE_DTYPE)
    w = weight.detach().float().clone()
    codes = torch.empty(n, k)
    grids = torch.empty(k // group_size, n, 2)
    for first in range(0, k, BLOCK):
        last = min(first + BLOCK, k)
        errors = _quantize_block(w[:, first:last], u[first:last, first:last], codes[:, first:last],
                                 grids[first // group_size:last // group_size], group_size)
        w[:, last:] -= errors @ u[first:last, last:]
    return codes.to(torch.int32), grids.to(SCALE_DTYPE)


def _inverse_hessian_factor(hessian: torch.Tensor) -> torch.Tensor | None:
    """The upper Cholesky factor U of H^-1 (damped): row j of U carries column j's error to the later ones.
    None where H is not finite, or stays singular with 1000x the damping."""
    if not torch.isfinite(hessian).all():
        return None
    h = hessian.clone()
    unused = h.diagonal() == 0
    h[unused, unused] = 1.0
    mean_diagonal = h.diagonal().mean()
    for damping in (DAMPING, DAMPING * 10, DAMPING * 100, DAMPING * 1000):
        # With J the order-reversing permutation, J H J = M M^T (M lower) gives H = R R^T with R = J M J upper,
        # so H^-1 = R^-T R^-1 and U = R^-1 = J M^-1 J: one Cholesky and one triangular inverse, where
        # inverting H and factoring the inverse took three factorizations (docs/quantization.md has the times).
        factor, info = torch.linalg.cholesky_ex((h + damping * mean_diagonal * torch.eye(len(h))).flip(0, 1))
        if info == 0:
            return _lower_inverse(factor).flip(0, 1)
    return None


def _lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """The inverse of a lower-triangular matrix, by halves: [[A, 0], [B, C]]^-1 = [[A^-1, 0], [-C^-1 B A^-1,
    C^-1]], so most of the work is two matrix products (LAPACK's trtri, which torch does not expose, in
    matmuls; `solve_triangular` against the identity does three times the arithmetic)."""
    n = len(lower)
    if n <= TRIANGULAR_LEAF:
        return torch.linalg.solve_triangular(lower, torch.eye(n), upper=False)
    half = n // 2
    inverse = torch.zeros_like(lower)
    inverse[:half, :half] = first = _lower_inverse(lower[:half, :half])
    inverse[half:, half:] = second = _lower_inverse(lower[half:, half:])
    inverse[half:, :half] = -(second @ (lower[half:, :half] @ first))
    return inverse


def _quantize_block(w: torch.Tensor, u: torch.Tensor, codes: torch.Tensor, grids: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """Round a block's columns `w` [N, B] in order, their codes into `codes` [N, B] and their groups'
    (step, zero) into `grids` [B / g, N, 2]; returns the scaled errors [N, B] for the columns after it.
    Works on the block transposed, a column a contiguous row."""
    n, width = w.shape
    step, zero = fit_grids(w.reshape(n, width // group_size, group_size))  # [N, B / g, 1] each
    grids[..., 0], grids[..., 1] = step[..., 0].T, zero[..., 0].T
    steps = step.expand(-1, -1, group_size).reshape(n, width).T  # [B, N]: column j's step per channel
    first_codes = (zero - 8 * step).expand(-1, -1, group_size).reshape(n, width).T  # the value of code 0
    columns = w.T.contiguous()
    column_codes, errors = torch.empty_like(columns), torch.empty_like(columns)
    for j in range(width):
        code = torch.div(columns[j] - first_codes[j], steps[j], out=column_codes[j]).round_().clamp_(0, 15)
        torch.mul(columns[j] - torch.addcmul(first_codes[j], code, steps[j]), 1 / u[j, j].item(), out=errors[j])
        columns[j + 1:].addr_(u[j, j + 1:], errors[j], alpha=-1)
    codes.copy_(column_codes.T)
    return errors.T
