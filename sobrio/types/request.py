"""A request as the scheduler sees it: tokens, how many are computed, which KV blocks hold them."""

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from sobrio.types.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed on this request alone; the others went on

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never past the model's context
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    kv_offload: bool = False  # its blocks may go to the KV offload tiers (kv/offload.py) when evicted
    kv_load_deadline: float | None = None  # when it stops waiting for KV blocks from the disk tier (kv/manager.py)
    kv_export: bool = False  # a disaggregated prefill: its prompt's blocks are exported when it finishes
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first schedule
    block_table: list[int] = field(default_factory=list)
    num_freed_blocks: int = 0  # leading blocks of the table given back, behind every layer's sliding window
    block_hashes: list[bytes] = field(default_factory=list)  # of the full, computed blocks
    prompt_block_hashes: list[bytes] = field(default_factory=list)  # of every full block, set on admission
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    energy_j: float = 0.0  # its share of the steps it was in (engine/step_energy.py)
    priority: int = 0  # --scheduling-policy priority: lower first, then earlier arrival
    prompt_logprobs: list | None = None  # prompt_logprobs: entry k is for prompt token k + 1 (core.TokenLogprob)
    prompt_logprobs_sent: bool = False
    # fast-forward: tokens the grammar forced after the last sampled one; the next step computes them with it
    num_forced_tokens: int = 0
    error: str | None = None  # why it failed, when it was its own fault (its grammar): a 400 at the front
    # speculative decoding: drafts to verify in the next step (past num_tokens: not yet output), and its record
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_kv: int = 0  # draft_model, eagle: positions whose KV the draft wrote for this request (its blocks)
    draft_features: Any = None  # eagle: the target's features the head has not read yet (eagle.FeatureTrail)

    def __post_init__(self) -> None:
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = []

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt must be computed here, not taken from the prefix cache: each position's logits count."""
        return self.prompt_logprobs is not None

    @property
    def sort_key(self) -> tuple[int, float]:
        return self.priority, self.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
