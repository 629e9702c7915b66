"""How the work is spread: CPU threads today; tensor, pipeline and data parallelism are named now, built later."""

from dataclasses import dataclass

from sobrio.config.fields import Checked, flag
from sobrio.errors import ConfigError


@dataclass(frozen=True)
class ParallelConfig(Checked):
    """How the work is spread. Tensor, pipeline and data parallelism take vLLM's flags now and only 1 until they
    are built."""

    tensor_parallel_size: int = flag(1, "devices one model's layers are split across (only 1 for now)")
    pipeline_parallel_size: int = flag(1, "pipeline stages one model is split into (only 1 for now)")
    data_parallel_size: int = flag(1, "engine replicas of one model (only 1 for now)")
    num_threads: int | None = None  # torch intra-op threads; None: torch's default

    def __post_init__(self) -> None:
        self._at_least(1, "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
        self._at_least(1, "num_threads", optional=True)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            self._not_yet(name)

    def _not_yet(self, name: str) -> None:
        """Flags named now so scripts can pass vLLM's; a size above 1 is refused, not silently ignored."""
        value = getattr(self, name)
        if value != 1:
            option = "--" + name.replace("_", "-")
            raise ConfigError(f"sobrio does not support {option}={value} yet (only 1)", option)
