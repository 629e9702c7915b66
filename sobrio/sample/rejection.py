"""Verify one request's draft tokens against the target model's distributions at their positions.

The step computed the request's last token and its k drafts in one forward, so it has k + 1 rows of logits:
row i is the target's distribution for the token after draft i - 1. Each row goes through the request's
own sampling rules (logit bias, banned tokens, temperature, top-k, top-p, min-p), as the sampler applies
them to a single row.

- Greedy: drafts are accepted while each equals the argmax of its row; the first that differs is replaced
  by that argmax, and with all k accepted the last row's argmax follows: the tokens one-at-a-time greedy
  decoding gives.
- Random (Leviathan et al. 2023; Chen et al. 2023): draft d at row i is accepted with probability
  min(1, p(d) / q(d)); a rejected one is replaced by a draw from max(0, p - q), renormalized, and the
  remaining drafts are dropped; with all accepted a bonus token is drawn from the last row. The tokens
  then follow the target's distribution p exactly. Prompt lookup proposes deterministically, so q is a
  point mass on d: accepted with probability p(d), else a draw from p with d removed.
"""

import torch

from sobrio.sample.metadata import SamplingMetadata
from sobrio.sample.sampler import (
    SampledToken,
    apply_logit_bias,
    apply_masks,
    cpp_logits,
    filter_top_k_top_p_min_p,
    greedy_tokens,
    row_rules,
    with_logprobs,
)


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[R, V] probabilities the sampler would draw from, for rows that all share one request's rules: the C++
    `top_k_top_p_probs` where it reads them (the PyTorch filter sorts whole rows for a wide nucleus, a cost
    at a 128k vocabulary for each request a step verifies: docs/benchmarks.md), else that filter."""
    if (cpp := cpp_logits(logits)) is not None:
        ops, rows_read = cpp
        return ops.top_k_top_p_probs(rows_read, *row_rules(meta, list(range(meta.num_rows))))
    x = logits / meta.temperature[0]
    x = filter_top_k_top_p_min_p(x, meta.top_k, meta.top_p, meta.min_p)
    return x.softmax(dim=-1)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Inverse CDF on an unnormalized distribution, one uniform from the request's generator (if seeded)."""
    cdf = probs.cumsum(dim=0)
    uniform = torch.rand(1, generator=generator) * cdf[-1]
    return int(torch.searchsorted(cdf, uniform, right=True).clamp_(max=len(probs) - 1))


def accept_random(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    """Rejection sampling against point-mass drafts: the accepted drafts, then one token from the target."""
    for i, draft in enumerate(drafts):
        if torch.rand(1, generator=generator).item() < probs[i, draft].item():
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0
        return drafts[:i] + [_draw(residual, generator)]
    return drafts + [_draw(probs[len(drafts)], generator)]


def accept_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    target = greedy_tokens(logits).tolist()  # the sampler's first-maximum rule
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return drafts[:accepted] + [target[accepted]]


def verify(logits: torch.Tensor, meta: SamplingMetadata, drafts: list[int]) -> list[SampledToken]:
    """logits [k + 1, V] float32 of one request, `meta` its rules repeated for each row (no penalties: they
    depend on the tokens before each row, and a request with them does not speculate). The accepted
    drafts and one more token, each with its logprobs when asked."""
    assert logits.shape[0] == meta.num_rows == len(drafts) + 1 and drafts
    assert not any(meta.has_penalties(row) for row in range(meta.num_rows)), "penalties: no drafts"
    raw = logits.log_softmax(dim=-1) if meta.num_logprobs[0] is not None else None
    x = logits.clone()
    apply_logit_bias(x, meta)
    x = apply_masks(x, meta)
    if meta.is_greedy(0):
        tokens = accept_greedy(x, drafts)
    else:
        tokens = accept_random(target_probs(x, meta), drafts, meta.generators.get(0))
    return [with_logprobs(token, raw, row, meta.num_logprobs[0]) for row, token in enumerate(tokens)]
