"""When to speculate, what to propose, and what was accepted: the engine core's one speculative-decoding seam.

After each step the core asks for the next step's drafts of every running decode (`propose`); the scheduler
gives a request with drafts 1 + k query tokens, the runner returns k + 1 rows of logits, and the sampler's
`rejection.verify` keeps the accepted drafts; `record` counts them (vLLM's spec_decode metrics).

Not every request speculates:
- a step with more than `disable_by_batch_size` requests running is bound by matrix throughput, not by
  reading the weights: k more tokens per request cost about k times more there, so nobody drafts;
- a request whose drafts are rarely accepted (below `min_acceptance_rate` after `PROBATION` drafts) stops;
- penalties depend on the tokens before each position, structured output advances a grammar token by
  token, and min_tokens bans EOS by position: such requests decode one token at a time (same output).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sobrio.config.speculative import OPTION, SpeculativeConfig
from sobrio.errors import ConfigError
from sobrio.speculative.eagle import EagleProposer
from sobrio.speculative.medusa import DraftHeadProposer, DraftHeads
from sobrio.speculative.model_draft import Drafter, ModelDraftProposer, Reserve
from sobrio.speculative.ngram import NgramProposer
from sobrio.types.request import Request

PROBATION = 32  # draft tokens a request is judged on before `min_acceptance_rate` can stop it


@dataclass(frozen=True)
class ModelAccess:
    """What a proposer that runs a model needs of the engine: the served model's size, greedy drafts (its
    early exit, or the draft model; the EAGLE head's), and KV slots ahead of the scheduler."""

    vocab_size: int
    num_layers: int
    draft: Drafter
    reserve: Reserve
    draft_eagle: Callable  # Executor.draft_eagle


def make_proposer(config: SpeculativeConfig, model: ModelAccess):
    """The method's proposer; draft heads trained for another vocabulary (another tokenizer) are refused."""
    k, vocab_size = config.get("num_speculative_tokens"), model.vocab_size
    if config.get("method") == "ngram":
        return NgramProposer(config.get("prompt_lookup_min"), config.get("prompt_lookup_max"), k)
    if config.get("method") == "layer_skip":
        exit_layer = config.get("exit_layer") or model.num_layers // 2
        if exit_layer >= model.num_layers:
            raise ConfigError(f"{OPTION}: exit_layer {exit_layer} must be below the model's {model.num_layers} "
                              "layers: the draft is the model cut short", OPTION)
        return ModelDraftProposer(model.draft, model.reserve, exit_layer, k)
    if config.get("method") == "draft_model":  # the executor loaded it and checked its tokenizer
        return ModelDraftProposer(model.draft, model.reserve, None, k)
    if config.get("method") == "eagle":  # the runner loaded the head (and checked its vocabulary)
        return EagleProposer(model.draft_eagle, model.reserve, k, config.get("min_draft_confidence"))
    heads = DraftHeads.load(config.get("model"))
    if heads.config.vocab_size != vocab_size:
        raise ConfigError(f"{OPTION}: the draft heads in {config.get('model')} were trained for a vocabulary of "
                          f"{heads.config.vocab_size} tokens ({heads.config.base_model}), this model has "
                          f"{vocab_size}: another tokenizer", OPTION)
    if k > heads.config.num_heads:
        raise ConfigError(f"{OPTION}: num_speculative_tokens {k} > the {heads.config.num_heads} draft heads in "
                          f"{config.get('model')}", OPTION)
    return DraftHeadProposer(heads, k)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, model: ModelAccess):
        self.k = config.get("num_speculative_tokens")
        self.proposer = make_proposer(config, model)
        self.disable_by_batch_size = config.get("disable_by_batch_size")
        self.min_acceptance_rate = config.get("min_acceptance_rate")
        self.max_model_len = max_model_len
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.k

    @property
    def needs_hidden(self) -> bool:
        """Whether `propose` reads the hidden states the requests' last tokens came from."""
        return self.proposer.needs_hidden

    @property
    def needs_step_features(self) -> bool:
        """Whether `propose` reads every hidden state of the last step (EAGLE: `Executor.step_features`)."""
        return getattr(self.proposer, "needs_step_features", False)

    def propose(self, running: list[Request], hidden: dict[str, torch.Tensor]) -> None:
        """Set each running request's drafts for the next step (none for a step above the batch size)."""
        off = self.disable_by_batch_size is not None and len(running) > self.disable_by_batch_size
        if self.needs_step_features and not off:  # a busy step keeps none: nobody drafts from it
            self.proposer.observe(running, hidden)
        todo = [] if off else [(req, self._limit(req)) for req in running if self._eligible(req)]
        drafts = self.proposer.propose_batch([(req, limit) for req, limit in todo if limit > 0], hidden)
        for req in running:
            req.spec_token_ids = drafts.get(req.request_id, [])

    def _limit(self, req: Request) -> int:
        """Drafts that fit: the last accepted one still leaves room for the token after it, in max_tokens and
        in the model's context."""
        return min(req.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - req.num_tokens - 1)

    def _eligible(self, req: Request) -> bool:
        params = req.sampling_params
        judged = req.num_draft_tokens >= PROBATION
        return (bool(req.output_token_ids) and req.num_tokens - req.num_computed_tokens == 1
                and not req.num_forced_tokens and params.structured_outputs is None
                and len(req.output_token_ids) >= params.min_tokens
                and not (params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)
                and not (judged and req.num_accepted_tokens < self.min_acceptance_rate * req.num_draft_tokens))

    def record(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_drafts <= self.k
        req.num_draft_tokens += num_drafts
        req.num_accepted_tokens += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def stats(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position)}
