"""Requests to the sampler's per-step metadata: the only place that reads SamplingParams for sampling."""

from sobrio.sample.metadata import SamplingMetadata
from sobrio.types.request import Request


def _banned(req: Request) -> list[int]:
    """EOS and stop tokens are forbidden until the request has its min_tokens."""
    params = req.sampling_params
    if len(req.output_token_ids) >= params.min_tokens:
        return []
    return list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(req.eos_token_ids))


def build_sampling_metadata(reqs: list[Request]) -> SamplingMetadata:
    params = [r.sampling_params for r in reqs]
    return SamplingMetadata(
        temperature=[p.temperature for p in params], top_p=[p.top_p for p in params],
        top_k=[p.top_k for p in params], min_p=[p.min_p for p in params],
        generators={row: r.generator for row, r in enumerate(reqs) if r.generator is not None},
        presence_penalty=[p.presence_penalty for p in params], frequency_penalty=[p.frequency_penalty for p in params],
        repetition_penalty=[p.repetition_penalty for p in params],
        prompt_token_ids=[r.prompt_token_ids for r in reqs], output_token_ids=[r.output_token_ids for r in reqs],
        banned_token_ids=[_banned(r) for r in reqs], num_logprobs=[p.logprobs for p in params],
        logit_bias=[p.logit_bias for p in params] if any(p.logit_bias for p in params) else [])
