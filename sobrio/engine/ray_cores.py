"""Data-parallel engine cores in Ray actors (`--distributed-executor-backend ray`): `RayCoreProcess` is a
`CoreProcess` whose core runs in an actor wherever the cluster has a free CPU, its two ZMQ sockets over TCP
at this node's address (the cluster's network must be private, as for vLLM's). The actor dies with the
server that made it (Ray's fate sharing), so the core does not watch a parent process."""

import logging

from sobrio.config import SobrioConfig
from sobrio.engine.core_process import CoreProcess, run_engine_core
from sobrio.engine.ray_workers import connect_ray


class _CoreActor:
    def run(self, config: SobrioConfig, input_addr: str, output_addr: str, log_level: int) -> None:
        run_engine_core(config, input_addr, output_addr, log_level, watch_parent=False)


class ActorProcess:
    """A Ray actor seen as a process: alive until its `run` returns or it dies."""

    def __init__(self, ray, actor, run):
        self.ray, self.actor, self.run = ray, actor, run
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        done, _ = self.ray.wait([self.run], timeout=0)
        if done and self.exitcode is None:
            try:
                self.ray.get(self.run)
                self.exitcode = 0
            except Exception:  # the actor died (killed, or its process exited)
                self.exitcode = 1
        return not done

    def join(self, timeout: float | None = None) -> None:
        self.ray.wait([self.run], timeout=timeout)

    def kill(self) -> None:
        self.ray.kill(self.actor)


class RayCoreProcess(CoreProcess):
    """An engine core in a Ray actor, wherever the cluster has a free CPU."""

    def _bind(self) -> tuple[str, str]:
        ip = connect_ray().util.get_node_ip_address()
        in_port = self._inputs.bind_to_random_port(f"tcp://{ip}")
        out_port = self._outputs.bind_to_random_port(f"tcp://{ip}")
        return f"tcp://{ip}:{in_port}", f"tcp://{ip}:{out_port}"

    def _start(self, input_addr: str, output_addr: str) -> ActorProcess:
        ray = connect_ray()
        actor = ray.remote(num_cpus=1)(_CoreActor).remote()
        run = actor.run.remote(self.config, input_addr, output_addr, logging.getLogger().getEffectiveLevel())
        return ActorProcess(ray, actor, run)

    place = "engine core in a Ray actor (pid {pid})"
