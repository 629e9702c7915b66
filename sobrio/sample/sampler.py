"""Turn a step's logits into tokens: penalties, min_tokens, greedy or temperature / top-k / top-p / min-p.

Random rows sample by inverse CDF, drawing their uniform from the request's own generator when it has a
seed, so its tokens do not depend on what else is in the batch.
"""

from dataclasses import dataclass

import torch

from sobrio.engine.request import Request


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # raw model log-probability of the chosen token
    rank: int | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Repetition (prompt and output), frequency and presence (output) penalties, in place."""
    vocab = logits.shape[-1]
    for row, req in enumerate(reqs):
        params = req.sampling_params
        if not params.has_penalties:
            continue
        out_ids = torch.tensor(req.output_token_ids, dtype=torch.long)
        counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(logits.dtype)
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(req.prompt_token_ids, dtype=torch.long)] = True
            x = logits[row]
            penalized = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
            logits[row] = torch.where(seen, penalized, x)
        logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def mask_stop_tokens(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Forbid EOS and stop tokens until a request has its min_tokens."""
    for row, req in enumerate(reqs):
        params = req.sampling_params
        if len(req.output_token_ids) < params.min_tokens:
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(req.eos_token_ids))
            if banned:
                logits[row, banned] = float("-inf")


def filter_top_k_top_p_min_p(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                             min_p: list[float]) -> torch.Tensor:
    """Set the logits outside each row's top-k, top-p nucleus and min-p floor to -inf."""
    if any(top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        keep = torch.ones_like(sorted_logits, dtype=torch.bool)
        k = torch.tensor([kk if kk > 0 else logits.shape[-1] for kk in top_k]).unsqueeze(1)
        keep &= torch.arange(logits.shape[-1]).unsqueeze(0) < k
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
        keep &= before < torch.tensor(top_p, dtype=probs.dtype).unsqueeze(1)
        keep[:, 0] = True
        kept = sorted_logits.masked_fill(~keep, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, kept)
    if any(min_p):
        probs = logits.softmax(dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, dtype=probs.dtype).unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def sample_random(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform per row, from the request's own generator when it is seeded.
    Overwrites `logits`.

    On this CPU, one exponential or multinomial draw over a 49k vocabulary costs ~1 ms per row;
    cumsum + searchsorted costs ~25 us per row. The work is in place: at 64 rows each fresh [64, 49k]
    float32 tensor cost ~4 ms of page faults, and five of them were 20% of a decode step.
    """
    params = [r.sampling_params for r in reqs]
    logits.div_(torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1))
    logits = filter_top_k_top_p_min_p(logits, [p.top_k for p in params], [p.top_p for p in params],
                                      [p.min_p for p in params])
    cdf = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_().cumsum_(dim=-1)  # unnormalized
    uniform = torch.rand(len(reqs), 1)
    for row, req in enumerate(reqs):
        if req.generator is not None:
            uniform[row] = torch.rand(1, generator=req.generator)
    tokens = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
    return tokens.clamp_(max=logits.shape[-1] - 1)


class Sampler:
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[SampledToken]:
        """logits: [B, V] float32, one row per request in `reqs` (left unchanged: the work is on one copy)."""
        assert logits.shape[0] == len(reqs)
        want_logprobs = [r.sampling_params.logprobs is not None for r in reqs]
        raw_logprobs = logits.log_softmax(dim=-1) if any(want_logprobs) else None
        logits = logits.clone()
        apply_penalties(logits, reqs)
        mask_stop_tokens(logits, reqs)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
        if len(random_rows) == len(reqs):
            tokens = sample_random(logits, reqs)
        elif random_rows:
            rows = torch.tensor(random_rows)
            tokens[rows] = sample_random(logits[rows], [reqs[i] for i in random_rows])
        token_list = tokens.tolist()
        return [self._with_logprobs(token_list[i], raw_logprobs, i, reqs[i]) for i in range(len(reqs))]

    @staticmethod
    def _with_logprobs(token: int, raw_logprobs, row: int, req: Request) -> SampledToken:
        n = req.sampling_params.logprobs
        if n is None:
            return SampledToken(token)
        row_lp = raw_logprobs[row]
        chosen = row_lp[token].item()
        rank = int((row_lp > chosen).sum().item()) + 1
        top = []
        if n > 0:
            values, ids = row_lp.topk(n)
            top = list(zip(ids.tolist(), values.tolist()))
        return SampledToken(token, chosen, rank, top)
