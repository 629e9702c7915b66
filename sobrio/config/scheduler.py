"""What one engine step may hold: sequences, tokens, the waiting queue, and prompt work beside decodes."""

from dataclasses import dataclass

from sobrio.config.fields import Checked, flag
from sobrio.errors import ConfigError


@dataclass(frozen=True)
class SchedulerConfig(Checked):
    """What one step may hold; prompt work beside decodes is vLLM's policy (engine/scheduler.py PrefillSlots)."""

    max_num_seqs: int = flag(64, "requests running at once")
    max_num_batched_tokens: int = flag(2048, "tokens one step computes")
    max_num_waiting: int = flag(4096, "admission bound: past it a request is refused (HTTP 429)")
    long_prefill_token_threshold: int = flag(512, "in a step with decodes, a prompt gets at most this many tokens "
                                                  "(0: no cap)")
    max_num_partial_prefills: int = flag(8, "in a step with decodes, at most this many prompts get tokens")
    max_long_partial_prefills: int = flag(1, "of those, at most this many have more than the threshold left")
    max_prompt_tokens_with_decodes: int = flag(512, "in a step with decodes, the prompts together get at most this "
                                                    "many tokens (Sarathi-Serve's token budget; 0: no cap)")
    scheduling_policy: str = flag("fcfs", "order of the waiting queue: fcfs (arrival), or priority (a request's "
                                          "`priority`, lower first, then arrival; lowest is preempted first)",
                                  choices=("fcfs", "priority"))

    enable_chunked_prefill: bool = flag(True, "accepted for vLLM's scripts: prompts are always computed in chunks "
                                              "that fit a step's token budget (--no-enable-chunked-prefill is "
                                              "refused)")

    def __post_init__(self) -> None:
        if not self.enable_chunked_prefill:
            raise ConfigError("sobrio does not support --no-enable-chunked-prefill: prefill is always chunked",
                              "--enable-chunked-prefill")
        self._at_least(1, "max_num_seqs", "max_num_batched_tokens", "max_num_waiting", "max_num_partial_prefills")
        for name in ("long_prefill_token_threshold", "max_prompt_tokens_with_decodes"):
            self._require(name, getattr(self, name) >= 0, ">= 0 (0: no cap)")
        self._require("max_long_partial_prefills",
                      1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills,
                      f"in [1, --max-num-partial-prefills={self.max_num_partial_prefills}]")
        self._require("scheduling_policy", self.scheduling_policy in ("fcfs", "priority"), "fcfs or priority")
