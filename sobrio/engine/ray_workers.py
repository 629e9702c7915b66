"""Tensor-parallel ranks 1..N-1 and data-parallel engine cores as Ray actors
(`--distributed-executor-backend ray`), as vLLM places its workers: on the machines of the Ray cluster this
process joins (`RAY_ADDRESS`, or a cluster started with `ray start --head` on this host), or on a local one it
starts when there is none. A rank's actor takes one CPU and a bundle of a placement group (PACK: on as few
machines as fit), joins rank 0's store over TCP, and runs the same loop as a worker process. A replica's
engine core runs in an actor too, its two ZMQ sockets over TCP at this node's address instead of a private
Unix folder: the Ray cluster's network must be private (as for vLLM's). Actors die with the process that made
them (Ray's fate sharing). `ray` is an optional extra: only this path imports it.
"""

import logging
import os

from sobrio.config import SobrioConfig
from sobrio.engine.tp_worker import WorkerArgs, run_worker
from sobrio.errors import ConfigError

logger = logging.getLogger(__name__)


def connect_ray():
    """This process's Ray session: the one already open, the cluster of RAY_ADDRESS or on this host, or a new
    local one."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--distributed-executor-backend ray needs Ray: pip install 'sobrio[ray]'",
                          "--distributed-executor-backend") from None
    if not ray.is_initialized():
        try:
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True)
        except ConnectionError:
            logger.info("no Ray cluster found: starting a local one")
            ray.init(log_to_driver=True)
    return ray


class _RankActor:
    def run(self, args: WorkerArgs) -> None:
        logging.basicConfig(level=args.log_level,
                            format=f"%(asctime)s %(levelname)s %(name)s[tp{args.rank}]: %(message)s")
        run_worker(args)

    def node(self) -> str:
        import ray

        return ray.util.get_node_ip_address()


class RayWorkers:
    """Same members as `tp_executor.LocalWorkers`: alive, describe, stop."""

    def __init__(self, config: SobrioConfig, size: int, host: str, port: int):
        ray = connect_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray = ray
        self.group = placement_group([{"CPU": 1}] * (size - 1), strategy="PACK")
        ray.get(self.group.ready(), timeout=120)
        level = logging.getLogger().getEffectiveLevel()
        actor = ray.remote(num_cpus=1)(_RankActor)
        self.actors = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=i)).remote() for i in range(size - 1)]
        self.nodes = ray.get([a.node.remote() for a in self.actors], timeout=120)
        self.runs = [a.run.remote(WorkerArgs(config, rank, size, host, port, level))
                     for rank, a in enumerate(self.actors, start=1)]

    def alive(self) -> bool:
        """A rank's `run` only returns when it stops (or its actor dies)."""
        done, _ = self.ray.wait(self.runs, num_returns=1, timeout=0)
        return not done

    def describe(self) -> list[str]:
        return [f"tensor-parallel rank {i}: Ray actor on {node}" for i, node in enumerate(self.nodes, start=1)]

    def stop(self, timeout: float = 10.0) -> None:
        self.ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)
        for actor in self.actors:
            self.ray.kill(actor)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)
