"""Executor: owns the model runner(s) and runs one scheduled step on them.

In-process, one runner (`Executor`). The tensor-parallel executor (`engine/tp_executor.py`, one
process per rank) implements the same members; the scheduler never learns how many processes run the model.
`EngineCore` picks one by `--tensor-parallel-size`.
"""

import torch

from sobrio.config import SobrioConfig
from sobrio.engine.model_runner import ModelRunner
from sobrio.errors import SobrioError
from sobrio.loader.load import LoadedModelFiles
from sobrio.speculative.model_draft import load_draft_model
from sobrio.types.scheduler_output import SchedulerOutput


class ExecutorDeadError(SobrioError):
    """A rank of the model is gone: no step can run until the group is restarted (not a request's fault)."""


class Executor:
    def __init__(self, config: SobrioConfig, files: LoadedModelFiles):
        spec, draft = config.speculative_config, None
        if spec.enabled and spec.get("method") == "draft_model":
            draft = load_draft_model(spec.get("model"), spec.get("quantization"), files)
        self.runner = ModelRunner(config, files, draft)

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

    def draft(self, reqs: list, num_tokens: list[int], exit_layer: int | None) -> list[list[int]]:
        """Greedy drafts of the model cut after `exit_layer` layers, or of the draft model: `ModelRunner.draft`."""
        return self.runner.draft(reqs, num_tokens, exit_layer)

    def draft_eagle(self, reqs: list, num_tokens: list[int], starts: list[int], features: list,
                    min_confidence: float) -> list[list[int]]:
        """Greedy drafts of the EAGLE head from the target's features: `ModelRunner.draft_eagle`."""
        return self.runner.draft_eagle(reqs, num_tokens, starts, features, min_confidence)

    @property
    def step_features(self) -> dict:
        """The last step's final hidden states by request: (its first position, its rows); EAGLE only."""
        return self.runner.step_features

    def check_alive(self) -> None:
        """Raise ExecutorDeadError if a rank is gone (one process: never)."""

    def layout(self) -> list[str]:
        """Where the model runs, a line per process (what `sobrio serve` prints at start)."""
        return []

    def stats(self) -> dict | None:
        """Tensor parallelism's collectives so far (calls, bytes, seconds by kind); None with one rank."""
        return None

    def close(self) -> None:
        """Stop the other ranks (one process: nothing)."""

    @property
    def num_layers(self) -> int:
        return self.runner.kv_spec.num_layers

    @property
    def sampled_hidden(self) -> torch.Tensor:
        """The last step's final hidden states at the rows its logits came from, in the same order."""
        return self.runner.sampled_hidden
