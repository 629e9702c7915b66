"""Several engine-core processes behind one front, speaking `CoreProcess`'s interface (add, abort, purge,
recv, stats, close), so `AsyncMPClient` drives them as it drives one:

- `DataParallelCores` (`--data-parallel-size N`): N replicas of the model; each request goes to one, chosen
  by the gateway's rule (`balance.choose`: least outstanding, with prefix affinity on its token blocks).
- `DisaggregatedCores` (`--kv-transfer-config`): a prefill core computes each prompt's KV blocks and
  exports them; the decode core imports them and generates (`kv_transfer.py`).

A member that dies fails only the requests it held (`MemberDeadError` names them) and is restarted alone;
the others keep serving.
"""

import dataclasses
import functools
import logging
from concurrent.futures import ThreadPoolExecutor

import zmq

from sobrio.config import SobrioConfig
from sobrio.distributed.balance import Balanced, chained_hashes, choose
from sobrio.engine.core import EngineCoreOutput, EngineCoreRequest
from sobrio.engine.core_process import CoreInfo, CoreProcess, EngineDeadError
from sobrio.engine.model_runner import available_cpus
from sobrio.timing import start_together
from sobrio.types.params import SamplingParams

logger = logging.getLogger(__name__)

MAX_AFFINITY_BLOCKS = 64  # the first 64 blocks of a prompt decide where it goes
BALANCE_SLACK = 4


class MemberDeadError(EngineDeadError):
    """One core of a group died: only `request_ids` (core request ids) failed."""

    def __init__(self, message: str, member: int, request_ids: list[str]):
        super().__init__(message)
        self.member, self.request_ids = member, request_ids


class Member(Balanced):
    """One core of a group, with the requests it holds."""

    def __init__(self, name: str, core: CoreProcess):
        super().__init__()
        self.name, self.core = name, core
        self.requests: set[str] = set()


def merge_stats(stats: list[dict]) -> dict:
    """The group's stats for the front and /metrics: counts summed, KV usage averaged, each member's kept."""
    merged: dict = {"members": stats}
    for key in ("num_requests_running", "num_requests_waiting", "prefix_cache_queries", "prefix_cache_hits",
                "num_preemptions", "num_blocks"):
        merged[key] = sum(s.get(key, 0) for s in stats)
    merged["kv_cache_usage_perc"] = sum(s.get("kv_cache_usage_perc", 0.0) for s in stats) / len(stats)
    tables: dict[str, int] = {}
    for s in stats:
        for name, size in s.get("tables", {}).items():
            tables[name] = tables.get(name, 0) + size
    merged["tables"] = tables
    return merged


def share_cores(config: SobrioConfig, members: int) -> SobrioConfig:
    """Each member's config on one host: the cores split between them (unless --num-threads says otherwise);
    two cores each running as many threads as the machine has cores ran DP=2 at 0.19x of one core."""
    parallel = config.parallel_config
    if parallel.num_threads is not None or parallel.distributed_executor_backend == "ray":  # Ray: 1 CPU each
        return config
    per_member = max(1, available_cpus() // (members * parallel.tensor_parallel_size))
    return dataclasses.replace(config, parallel_config=dataclasses.replace(parallel, num_threads=per_member))


class CoreGroup:
    serves_while_restarting = True  # the other members answer while a dead one restarts (/health stays 200)

    def __init__(self, configs: list[tuple[str, SobrioConfig]], startup_timeout: float):
        self.config = configs[0][1]
        self.startup_timeout = startup_timeout
        self.member_configs = [c for _, c in configs]
        self.core_class = core_class(self.config)
        cores = start_together([functools.partial(self.core_class, c, startup_timeout) for _, c in configs],
                               lambda core: core.close())
        self.members = [Member(name, core) for (name, _), core in zip(configs, cores)]
        self.info = CoreInfo(min(c.info.max_model_len for c in cores), sum(c.info.num_blocks for c in cores),
                             cores[0].info.pid, self.layout())
        self.max_model_len = self.info.max_model_len
        self.owner: dict[str, Member] = {}
        self.poller = zmq.Poller()
        for core in cores:
            self.poller.register(core._outputs, zmq.POLLIN)  # noqa: SLF001 - the group reads its members' sockets

    def layout(self) -> list[str]:
        """A line per member: its name, its core's pid, and its tensor-parallel ranks if any."""
        return [f"{m.name}: {line}" for m in self.members for line in m.core.layout()]

    def _send(self, member: Member, creq: EngineCoreRequest) -> None:
        member.core.add_request(creq)
        member.requests.add(creq.request_id)
        member.in_flight += 1
        self.owner[creq.request_id] = member

    def _done(self, request_id: str) -> None:
        member = self.owner.pop(request_id, None)
        if member is not None and request_id in member.requests:
            member.requests.discard(request_id)
            member.in_flight -= 1

    def abort_requests(self, request_ids: list[str]) -> None:
        by_member: dict[int, list[str]] = {}
        for request_id in request_ids:
            member = self.owner.get(request_id)
            if member is not None:
                by_member.setdefault(id(member), []).append(request_id)
                self._done(request_id)
        for member in self.members:
            if id(member) in by_member:
                member.core.abort_requests(by_member[id(member)])

    def purge_cache_salt(self, salt: str) -> None:
        for member in self.members:
            member.core.purge_cache_salt(salt)

    def recv(self, timeout_ms: int) -> tuple | None:
        """The outputs of every member with some ready, merged; MemberDeadError for a member that died."""
        for member in self.members:
            if not member.core.is_alive():
                raise self._dead(member)
        ready = dict(self.poller.poll(timeout_ms))
        outputs: list[EngineCoreOutput] = []
        for member in self.members:
            if member.core._outputs in ready:  # noqa: SLF001
                try:
                    message = member.core.recv(0)
                except EngineDeadError:
                    raise self._dead(member) from None
                if message is not None and message[0] == "outputs":
                    outputs += self._route(member, message[1])
        return ("outputs", outputs, self.stats()) if ready else None

    def _route(self, member: Member, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """What goes on to the front (all of it, for replicas)."""
        for out in outputs:
            if out.finished:
                self._done(out.request_id)
        return outputs

    def _dead(self, member: Member) -> MemberDeadError:
        failed = sorted(member.requests)
        for request_id in failed:
            self._done(request_id)
        return MemberDeadError(f"{member.name} (pid {member.core.info.pid}) exited "
                               f"(code {member.core.process.exitcode})", self.members.index(member), failed)

    def restarted(self, exc: EngineDeadError) -> "CoreGroup":
        """Restart the member that died (MemberDeadError; otherwise every dead one), in place; the others
        keep serving."""
        dead = [exc.member] if isinstance(exc, MemberDeadError) else \
            [i for i, m in enumerate(self.members) if not m.core.is_alive()]
        for index in dead:
            member = self.members[index]
            self.poller.unregister(member.core._outputs)  # noqa: SLF001
            member.core.close(timeout=1)
            member.core = self.core_class(self.member_configs[index], self.startup_timeout)
            member.seen.clear()
            self.poller.register(member.core._outputs, zmq.POLLIN)  # noqa: SLF001
            logger.info("%s restarted: engine core pid %d", member.name, member.core.info.pid)
        return self

    def stats(self) -> dict:
        merged = merge_stats([m.core.stats() for m in self.members])
        for member, stats in zip(self.members, merged["members"]):
            stats["name"] = member.name
        return merged

    def table_sizes(self) -> dict[str, int]:
        return {**self.stats()["tables"], "group_owner": len(self.owner)}

    def is_alive(self) -> bool:
        return all(m.core.is_alive() for m in self.members)

    def close(self, timeout: float = 10.0) -> None:
        with ThreadPoolExecutor(len(self.members)) as pool:
            list(pool.map(lambda m: m.core.close(timeout), self.members))


class DataParallelCores(CoreGroup):
    def __init__(self, config: SobrioConfig, startup_timeout: float = 600.0):
        size = config.parallel_config.data_parallel_size
        one = dataclasses.replace(config, parallel_config=dataclasses.replace(config.parallel_config,
                                                                              data_parallel_size=1))
        super().__init__([(f"dp{i}", share_cores(one, size)) for i in range(size)], startup_timeout)

    def add_request(self, creq: EngineCoreRequest) -> None:
        sibling = self.owner.get(creq.after_prompt_of or "")
        if sibling is not None:  # n > 1: the siblings share the first one's cached prompt
            return self._send(sibling, creq)
        block = self.config.cache_config.block_size
        hashes = chained_hashes(creq.prompt_token_ids, block, MAX_AFFINITY_BLOCKS, creq.cache_salt)
        healthy = [m for m in self.members if m.core.is_alive()] or self.members
        self._send(choose(healthy, hashes, BALANCE_SLACK), creq)


class DisaggregatedCores(CoreGroup):
    """Member 0 prefills (each request with max_tokens 1, its blocks exported), member 1 decodes (the blocks
    imported into its RAM tier, then restored by its prefix lookup). A request that wants prompt
    log-probabilities, or whose prompt is shorter than a block, goes to the decode core alone."""

    serves_while_restarting = False  # every request needs both

    def __init__(self, config: SobrioConfig, startup_timeout: float = 600.0):
        cache = config.cache_config
        decode = dataclasses.replace(config, cache_config=dataclasses.replace(
            cache, kv_offload_ram=cache.kv_offload_ram or config.kv_transfer_config.get("kv_buffer_size")))
        super().__init__([("prefill", share_cores(config, 2)), ("decode", share_cores(decode, 2))], startup_timeout)
        self.waiting: dict[str, EngineCoreRequest] = {}  # prefilling: the request the decode core gets next

    def add_request(self, creq: EngineCoreRequest) -> None:
        prefill, decode = self.members
        if creq.sampling_params.prompt_logprobs is not None or \
                len(creq.prompt_token_ids) <= self.config.cache_config.block_size:
            return self._send(decode, creq)
        self.waiting[creq.request_id] = creq
        self._send(prefill, dataclasses.replace(
            creq, sampling_params=SamplingParams(max_tokens=1, temperature=0.0), max_tokens=1,
            after_prompt_of=None, kv_transfer={"export": True}))

    def _route(self, member: Member, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        if member is self.members[1]:
            return super()._route(member, outputs)
        for out in outputs:  # the prefill core's: never the front's
            if out.finished:
                self._done(out.request_id)
                creq = self.waiting.pop(out.request_id, None)
                if creq is not None:  # not aborted meanwhile; a failed prefill: the decode core computes it all
                    params = out.kv_transfer_params or {"connector": "none", "hashes": []}
                    try:
                        self._send(self.members[1], dataclasses.replace(creq, kv_transfer=params))
                    except EngineDeadError:
                        raise self._dead(self.members[1]) from None
        return []

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.waiting.pop(request_id, None)
        super().abort_requests(request_ids)

    def _dead(self, member: Member) -> MemberDeadError:
        error = super()._dead(member)
        if member is self.members[0]:
            for request_id in error.request_ids:
                self.waiting.pop(request_id, None)
        return error

    def table_sizes(self) -> dict[str, int]:
        return {**super().table_sizes(), "group_waiting": len(self.waiting)}


def core_class(config: SobrioConfig) -> type[CoreProcess]:
    """Where each core runs: a child process, or a Ray actor (`--distributed-executor-backend ray`)."""
    if config.parallel_config.distributed_executor_backend == "ray":
        from sobrio.engine.ray_cores import RayCoreProcess

        return RayCoreProcess
    return CoreProcess


def open_cores(config: SobrioConfig, startup_timeout: float = 600.0):
    """The engine core(s) one model's front drives: one process, replicas, or a prefill/decode pair."""
    if config.kv_transfer_config.enabled:
        return DisaggregatedCores(config, startup_timeout)
    if config.parallel_config.data_parallel_size > 1:
        return DataParallelCores(config, startup_timeout)
    return core_class(config)(config, startup_timeout)
