"""What one engine step computes, as the scheduler decided it: the plain type the executor, the model
runner and the TP ranks read (none of them imports the scheduler)."""

from dataclasses import dataclass, field

from sobrio.types.request import Request


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens this step)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def is_empty(self) -> bool:
        return not self.scheduled
