"""The tensor-parallel executor: rank 0 in this process (beside the scheduler), ranks 1..N-1 in worker
processes (`worker.py`) or Ray actors (`ray_workers.py`). Each step rank 0 flattens the schedule into plain
`StepInputs`, broadcasts them, and every rank runs the same forward; rank 0's logits are the whole model's.

A rank that dies breaks the group: the step raises `ExecutorDeadError`, which the core does not retry
request by request; the engine-core process exits and its client restarts the whole group (the requests in
flight fail, promptly: gloo notices a closed connection at once).
"""

import atexit
import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import time

import torch

from sobrio.config import SobrioConfig
from sobrio.distributed.group import TPGroup, serve_store
from sobrio.distributed.sharding import TPRank, plan_shards, refuse_experts
from sobrio.engine.executor import Executor, ExecutorDeadError
from sobrio.engine.model_runner import ModelRunner
from sobrio.engine.tp_worker import WorkerArgs
from sobrio.errors import ConfigError
from sobrio.loader.load import LoadedModelFiles
from sobrio.models.registry import family_of
from sobrio.timing import log_step
from sobrio.types.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

OPTION = "--tensor-parallel-size"
# not `-m sobrio.engine.tp_worker`: importing the package first imports that module, and runpy warns
WORKER_MAIN = "from sobrio.engine.tp_worker import main; main()"


def check_supported(config: SobrioConfig, files: LoadedModelFiles) -> None:
    """What tensor parallelism does not take yet: a ConfigError naming it."""
    model, spec = config.model_config, config.speculative_config
    if model.quantization is not None or files.quantization is not None:
        raise ConfigError("tensor parallelism takes float weights; --quantization (or a quantized checkpoint) "
                          "cannot be split yet", OPTION)
    if spec.enabled and spec.get("method") != "ngram":
        raise ConfigError("with tensor parallelism only ngram speculation is supported (drafts of the model or "
                          "of heads would need every rank)", OPTION)
    refuse_experts(files.config)  # before the family's reason below, which is about fused projections
    family = family_of(files.config)
    if not family.tensor_parallel:
        raise ConfigError(f"tensor parallelism does not split {family.name} yet (its checkpoints store q/k/v and "
                          f"gate/up fused)", OPTION)
    if config.cache_config.kv_offload_ram:
        raise ConfigError("--kv-offload-ram with tensor parallelism is not supported yet (each rank holds part of "
                          "each KV block)", OPTION)


class LocalWorkers:
    """Ranks 1..N-1 as child processes of this one (each SIGKILLed if this one dies)."""

    def __init__(self, config: SobrioConfig, size: int, host: str, port: int):
        level = logging.getLogger().getEffectiveLevel()
        self.processes = []
        for rank in range(1, size):
            process = subprocess.Popen([sys.executable, "-c", WORKER_MAIN], stdin=subprocess.PIPE)
            process.stdin.write(pickle.dumps(WorkerArgs(config, rank, size, host, port, level)))
            process.stdin.close()
            self.processes.append(process)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.processes)

    def describe(self) -> list[str]:
        return [f"tensor-parallel rank {i + 1}: pid {p.pid}" for i, p in enumerate(self.processes)]

    def stop(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def start_workers(config: SobrioConfig, size: int, host: str, port: int):
    if config.parallel_config.distributed_executor_backend == "ray":
        from sobrio.engine.ray_workers import RayWorkers

        return RayWorkers(config, size, host, port)
    return LocalWorkers(config, size, host, port)


class TensorParallelExecutor(Executor):
    def __init__(self, config: SobrioConfig, files: LoadedModelFiles):
        check_supported(config, files)
        size = config.parallel_config.tensor_parallel_size
        shards = plan_shards(files.config, size)
        host = _node_ip() if config.parallel_config.distributed_executor_backend == "ray" else "127.0.0.1"
        store = serve_store(host, size)
        with log_step(logger, "starting %d tensor-parallel ranks", size - 1):
            self.workers = start_workers(config, size, host, store.port)
        try:
            local = isinstance(self.workers, LocalWorkers)
            self.group = TPGroup(0, size, store, alive=self.workers.alive, same_host=local)
            self.runner = ModelRunner(config, files, tp=TPRank(shards[0], shards, self.group))
        except BaseException:
            self.workers.stop(timeout=0)
            raise
        atexit.register(self.close)  # an offline LLM never closed: its ranks still stop cleanly

    def execute(self, out: SchedulerOutput, prompt_logprobs: dict | None = None) -> torch.Tensor:
        self.check_alive()
        step = self.runner.prepare_inputs(out)
        try:
            self.group.broadcast(step)
            return self.runner.run(step, prompt_logprobs)
        except RuntimeError as exc:  # gloo: a peer closed its connection, or a collective failed
            raise ExecutorDeadError(f"tensor-parallel group broken: {exc}") from exc

    def check_alive(self) -> None:
        if not self.workers.alive():
            raise ExecutorDeadError("a tensor-parallel rank exited")

    def draft(self, reqs: list, num_tokens: list[int], exit_layer: int | None) -> list[list[int]]:
        raise AssertionError("check_supported refuses drafting methods with tensor parallelism")

    def layout(self) -> list[str]:
        return [f"tensor-parallel rank 0: this process (pid {os.getpid()})"] + self.workers.describe()

    def stats(self) -> dict:
        return {"size": self.group.size, **{kind: dataclasses.asdict(s) for kind, s in self.group.stats.items()}}

    def close(self) -> None:
        atexit.unregister(self.close)
        try:
            if self.workers.alive():
                self.group.broadcast(None)
        except RuntimeError:
            pass
        self.workers.stop()
        self.group.close()


def _node_ip() -> str:
    """The address the other machines of the Ray cluster reach this one at (rank 0's store and gloo)."""
    from sobrio.engine.ray_workers import connect_ray

    return connect_ray().util.get_node_ip_address()
