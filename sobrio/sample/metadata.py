"""What the sampler needs for one step, one row per sampling request: plain values, no engine objects.

The engine builds it from its requests (`sobrio.engine.sampling.build_sampling_metadata`); the sampler
knows nothing of requests, schedulers or processes. Structured output fills `allowed_tokens`;
other per-step logit rewrites hang in `logits_processors`.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

LogitsProcessor = Callable[[torch.Tensor], torch.Tensor]  # [B, V] float32 logits in, same shape out


@dataclass
class TokenBitmask:
    """The tokens structured output allows in some rows of a step, as llguidance packs them: bit t % 32 of
    `bits[i, t // 32]` allows token t in row `rows[i]`. Tokens past the last word are not allowed there."""

    rows: torch.Tensor  # int64 [R]
    bits: torch.Tensor  # int32 [R, ceil(vocab / 32)]


@dataclass
class SamplingMetadata:
    temperature: list[float]  # 0 (below 1e-5): greedy
    top_p: list[float]
    top_k: list[int]  # 0: off
    min_p: list[float]
    generators: dict[int, torch.Generator]  # row -> the request's own seeded generator
    presence_penalty: list[float]
    frequency_penalty: list[float]
    repetition_penalty: list[float]
    prompt_token_ids: list[list[int]]  # read only where a penalty is set
    output_token_ids: list[list[int]]
    banned_token_ids: list[list[int]]  # forbidden this step (EOS and stop tokens before min_tokens)
    num_logprobs: list[int | None]  # top-n log-probabilities to return; None: none
    allowed_tokens: "TokenBitmask | None" = None  # structured output's rows: what their grammar allows
    logit_bias: list[dict[int, float] | None] = field(default_factory=list)  # per row (or empty: none at all)
    logits_processors: list[LogitsProcessor] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert len(self.temperature) == len(self.top_p) == len(self.top_k) == len(self.num_logprobs)

    @property
    def num_rows(self) -> int:
        return len(self.temperature)

    def is_greedy(self, row: int) -> bool:
        return self.temperature[row] < 1e-5

    def has_penalties(self, row: int) -> bool:
        return bool(self.presence_penalty[row] or self.frequency_penalty[row] or self.repetition_penalty[row] != 1.0)

    def edits_logits(self) -> bool:
        """Whether any row's logits change before its token is drawn (bias, penalties, bans, a grammar's mask,
        a processor)."""
        return bool(any(self.logit_bias) or any(self.banned_token_ids) or self.allowed_tokens is not None
                    or self.logits_processors or any(self.has_penalties(i) for i in range(self.num_rows)))

    def rewrites_logits(self) -> bool:
        """Whether sampling this step is more than each row's argmax of its logits as they are: an edit
        (`edits_logits`) or a temperature."""
        return self.edits_logits() or not all(self.is_greedy(i) for i in range(self.num_rows))
