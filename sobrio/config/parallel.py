"""How the work is spread: CPU threads, tensor parallelism (ranks of one model), data parallelism (engine
replicas), and where the ranks run (child processes, or Ray actors)."""

from dataclasses import dataclass

from sobrio.config.fields import Checked, flag
from sobrio.errors import ConfigError

EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig(Checked):
    """How the work is spread. vLLM's flags and meanings; pipeline parallelism takes only 1 until it is built."""

    tensor_parallel_size: int = flag(1, "ranks one model's layers are split across (heads, MLP channels, "
                                        "vocabulary), one process each")
    pipeline_parallel_size: int = flag(1, "pipeline stages one model is split into (only 1 for now)")
    data_parallel_size: int = flag(1, "engine-core replicas of the model behind this server, balanced by "
                                      "outstanding requests with prefix affinity")
    distributed_executor_backend: str | None = flag(None, "where ranks and replicas run: mp (child processes of "
                                                          "this host, the default) or ray (actors placed by the "
                                                          "Ray cluster of RAY_ADDRESS, or a local one)")
    num_threads: int | None = None  # torch intra-op threads; None: torch's default (tensor parallel: cores / ranks)

    def __post_init__(self) -> None:
        self._at_least(1, "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
        self._at_least(1, "num_threads", optional=True)
        if self.pipeline_parallel_size != 1:
            raise ConfigError(f"sobrio does not support --pipeline-parallel-size={self.pipeline_parallel_size} yet "
                              f"(only 1)", "--pipeline-parallel-size")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ConfigError(f"--distributed-executor-backend must be one of {', '.join(EXECUTOR_BACKENDS)}, got "
                              f"{backend!r}", "--distributed-executor-backend")
