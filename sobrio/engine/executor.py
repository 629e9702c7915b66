"""Executor: owns the model runner(s) and runs one scheduled step on them.

In-process, one runner. A tensor-parallel executor (one process per rank) implements the same three
members; the scheduler never learns how many processes run the model.
"""

import torch

from sobrio.config import SobrioConfig
from sobrio.engine.model_runner import ModelRunner
from sobrio.engine.scheduler import SchedulerOutput
from sobrio.loader.load import LoadedModelFiles


class Executor:
    def __init__(self, config: SobrioConfig, files: LoadedModelFiles):
        self.runner = ModelRunner(config, files)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def execute(self, out: SchedulerOutput, prompt_logprobs: dict | None = None) -> torch.Tensor:
        """float32 logits, one row per scheduled request whose last token was computed this step (1 + k for
        one with k drafts); the
        prompt log-probabilities of the requests that want them go into `prompt_logprobs` (by request id)."""
        return self.runner.execute(out, prompt_logprobs)

    def draft_by_early_exit(self, reqs: list, num_tokens: list[int], exit_layer: int) -> list[list[int]]:
        """Self-speculative drafts: `ModelRunner.draft_by_early_exit`."""
        return self.runner.draft_by_early_exit(reqs, num_tokens, exit_layer)

    @property
    def num_layers(self) -> int:
        return self.runner.kv_spec.num_layers

    @property
    def sampled_hidden(self) -> torch.Tensor:
        """The last step's final hidden states at the rows its logits came from, in the same order."""
        return self.runner.sampled_hidden
