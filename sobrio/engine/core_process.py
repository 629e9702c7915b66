"""The engine core in a process of its own, and the handle the API process holds on it.

Two ZMQ sockets over IPC (a private 0700 folder): API -> core carries `("add", EngineCoreRequest)`,
`("abort", [ids])`, `("purge", cache_salt)` and `("shutdown", None)`; core -> API carries `("ready", info)`
once, `("failed", why)` if start-up fails, and `("outputs", [EngineCoreOutput], stats)` after each step (or
after inputs that changed something while idle). Messages are pickled: `benchmarks/ipc_overhead.py` measures the cost.

The core process never sees text: the front tokenizes and detokenizes on the API side. This module imports
neither torch nor the engine at its top, so `sobrio serve` starts a core (`CoreProcess(wait=False)`) before
it imports its own heavy modules and reads the tokenizer, and both load at once.
"""

import contextlib
import ctypes
import logging
import multiprocessing
import os
import pickle
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from sobrio import collector, openmp
from sobrio.config import SobrioConfig
from sobrio.engine.cpu_share import INTERVAL_S, open_governor, spin_count_for_start
from sobrio.engine.orphan import exit_with_parent
from sobrio.errors import SobrioError

if TYPE_CHECKING:
    from sobrio.engine.core import EngineCoreRequest

logger = logging.getLogger(__name__)

IDLE_POLL_MS = round(INTERVAL_S * 1000)  # an idle core wakes this often: to notice a parent that died, and to
# keep the governor's looks recent
STALE_FOLDER_AGE_S = 60.0  # a socket folder younger than this may belong to a start under way


class EngineDeadError(SobrioError):
    """The engine-core process is gone; the requests it held failed (HTTP 500)."""


def encode(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(frame: bytes):
    return pickle.loads(frame)  # only ever frames of our own processes, on a private socket


# ---- the child process ----

def run_engine_core(config: SobrioConfig, input_addr: str, output_addr: str, log_level: int,
                    watch_parent: bool = True, parent_pid: int | None = None) -> None:
    """Entry point of the engine-core process: load, report ready, then step while there is work.
    `watch_parent`: exit when the process that started this one (`parent_pid`, given by that process: one
    that died while this one imported is no longer its parent) is gone (a Ray actor: Ray does that)."""
    from sobrio.engine.executor import ExecutorDeadError

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    parent = (parent_pid or os.getppid()) if watch_parent else None
    if parent is not None:  # also while loading: a core must not outlive its API process
        exit_with_parent(parent, cleanup=lambda: _remove_socket_folder(input_addr))
    ctx = zmq.Context()
    inputs, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inputs.connect(input_addr)
    outputs.connect(output_addr)
    try:
        with collector.paused():
            core = _start_core(config)
    except Exception as exc:  # a start-up error: say what it was, then exit
        if isinstance(exc, SobrioError):  # a flag or model the user named: its message says it all (no traceback)
            logger.error("engine core failed to start: %s", exc)
        else:
            logger.exception("engine core failed to start")
        outputs.send(encode(("failed", f"{type(exc).__name__}: {exc}")))
        return
    outputs.send(encode(("ready", {"max_model_len": core.max_model_len, "num_blocks": core.scheduler.pool.num_blocks,
                                   "pid": os.getpid(), "layout": core.executor.layout()})))
    try:
        _serve(core, inputs, outputs, parent, open_governor(config.parallel_config.num_threads))
    except ExecutorDeadError as exc:  # a tensor-parallel rank died: exit, the client restarts the group
        logger.error("%s; engine core exits for a restart", exc)
        raise SystemExit(1) from None
    finally:
        core.close()
    ctx.destroy(linger=0)
    _remove_socket_folder(input_addr)


def _remove_socket_folder(input_addr: str) -> None:
    """An API process killed outright cannot remove its socket folder; the core that outlives it does."""
    if input_addr.startswith("ipc://"):
        shutil.rmtree(os.path.dirname(input_addr.removeprefix("ipc://")), ignore_errors=True)


def _start_core(config: SobrioConfig):
    from sobrio.engine.core import EngineCore
    from sobrio.loader.load import load_model_files

    logger.info("loading %s (weights, KV cache, operators)", config.model_config.model)
    start = time.monotonic()
    core = EngineCore(config, load_model_files(config.model_config, tokenizer=False))
    logger.info("engine core ready in %.1fs", time.monotonic() - start)
    return core


@contextlib.contextmanager
def engine_core_environ():
    """The environment a spawned engine-core process starts with: OpenMP threads that spin longer before
    they sleep (`openmp.ENGINE_CORE_SPINCOUNT`) on a host that looks free (no CPU quota below its cores, no
    other process busy: `cpu_share`), the short spin otherwise, unless the user set the policy; and `CORE_ENV`'s
    bounds on its allocator and caches, each unless the user set it. This process's own environment is back as
    it was afterwards.

    One thread at a time (`_ENVIRON_LOCK`): cores start together from threads (`start_together`), and two
    blocks interleaved restored each other's variables, and a spawn could exec while another thread rewrote
    the environment (a likely cause, not reproduced, of a core that once exited 255 at start without a word:
    how multiprocessing's spawn ends when its exec fails)."""
    with _ENVIRON_LOCK:
        settings = {name: value for name, value in CORE_ENV.items() if name not in os.environ}  # the user's win
        if not openmp.OMP_WAIT_SET_BY_USER:  # sobrio's own GOMP_SPINCOUNT (openmp.py) is replaced for the core
            settings["GOMP_SPINCOUNT"] = spin_count_for_start(openmp.ENGINE_CORE_SPINCOUNT, openmp.SPINCOUNT)
        before = {name: os.environ.get(name) for name in settings}
        try:
            os.environ.update(settings)
            yield
        finally:
            for name, value in before.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value


_ENVIRON_LOCK = threading.Lock()


# What the core's memory settles at under a steady mixed load (docs/sharing-and-soak.md). glibc gives each
# thread that allocates (OpenMP's, llguidance's mask threads, ZMQ's) an arena of its own, and freed memory stays
# in them: two arenas, and `malloc_trim` every 30 s (`MemoryTrimmer`). oneDNN builds a primitive for each row
# count a bf16 matmul meets (almost every step that mixes a prompt chunk with decodes has a new one) and keeps
# it in two caches, its own and ideep's, 1024 entries each by default: they filled for over ten minutes
# (+13.9% RSS after the first minute); 128 entries each fill within the first minute or two.
CORE_ENV = {"MALLOC_ARENA_MAX": "2", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "128"}
TRIM_EVERY_S = 30.0


class MemoryTrimmer:
    """Returns the heap's free pages to the system (glibc's malloc_trim, a few ms) every TRIM_EVERY_S."""

    def __init__(self):
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            self._trim = None
        self._next = time.monotonic() + TRIM_EVERY_S

    def poll(self) -> None:
        now = time.monotonic()
        if self._trim is not None and now >= self._next:
            self._next = now + TRIM_EVERY_S
            self._trim(0)


def _parent_lives(parent: int | None) -> bool:
    return parent is None or os.getppid() == parent


def _serve(core, inputs: zmq.Socket, outputs: zmq.Socket, parent: int | None, governor=None) -> None:
    """Step while there is work; `governor` (cpu_share.ThreadGovernor) sizes the threads to the free cores."""
    trimmer = MemoryTrimmer()
    if governor is not None:
        core.executor.runner.poll_between_layers(governor.poll)
    while _parent_lives(parent):
        if governor is not None:
            governor.poll()
        trimmer.poll()
        busy = core.has_unfinished_requests() or core.on_idle()
        inputs.poll(0 if busy else IDLE_POLL_MS)
        changed, stop = _apply_inputs(core, inputs)
        if stop:
            return
        if core.has_unfinished_requests():
            if not busy and governor is not None:
                governor.work_arrived()
            message = ("outputs", core.step(), core.stats())
        elif changed:
            message = ("outputs", [], core.stats())
        else:
            continue
        if not _send_while_parent_lives(outputs, encode(message), parent):
            break
    logger.warning("API process is gone; engine core exits")


def _send_while_parent_lives(socket: zmq.Socket, frame: bytes, parent: int | None) -> bool:
    """A PUSH socket waits while its reader is busy; it must not wait for a reader that died."""
    while True:
        try:
            socket.send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:
            if not _parent_lives(parent):
                return False
            time.sleep(0.001)


def _apply_inputs(core, inputs: zmq.Socket) -> tuple[bool, bool]:
    """Apply every message waiting; (anything applied, shutdown asked)."""
    changed = False
    while True:
        try:
            kind, payload = decode(inputs.recv(zmq.NOBLOCK))
        except zmq.Again:
            return changed, False
        if kind == "shutdown":
            return changed, True
        changed = True
        if kind == "add":
            core.add_request(payload)
        elif kind == "abort":
            core.abort_requests(payload)
        elif kind == "purge":
            core.purge_cache_salt(payload)


# ---- the handle in the API process ----

@dataclass
class CoreInfo:
    max_model_len: int
    num_blocks: int
    pid: int
    layout: list[str] = field(default_factory=list)  # where its model runs: a line per tensor-parallel rank


def sweep_stale_socket_folders(root: str | None = None) -> int:
    """Remove the `sobrio-core-*` socket folders nothing listens on any more: an API process and its core
    both killed outright (SIGKILL, the OOM killer) leave theirs behind. Returns how many went."""
    removed = 0
    for folder in Path(root or tempfile.gettempdir()).glob("sobrio-core-*"):
        try:
            young = time.time() - folder.stat().st_mtime < STALE_FOLDER_AGE_S
        except OSError:
            continue
        if not young and not _listening(folder / "in"):
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    return removed


def _listening(path: Path) -> bool:
    """Whether a process accepts on this Unix socket; when unsure (another user's folder), say yes."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except OSError:
            return True
    return True


class CoreProcess:
    """Starts the engine-core process and speaks to it; the front calls it like an in-process core."""

    def __init__(self, config: SobrioConfig, startup_timeout: float = 600.0, wait: bool = True):
        """Start the core's process; with `wait`, wait until it is ready (else call `ready()` before use)."""
        self.config, self.startup_timeout = config, startup_timeout
        if removed := sweep_stale_socket_folders():
            logger.info("removed %d socket folder(s) left by killed sobrio processes", removed)
        self._folder = tempfile.mkdtemp(prefix="sobrio-core-")  # 0700: only this user reaches the sockets
        self._ctx = zmq.Context()
        self._inputs = self._ctx.socket(zmq.PUSH)
        self._outputs = self._ctx.socket(zmq.PULL)
        input_addr, output_addr = self._bind()
        self.last_stats: dict = {}
        self._closed, self._close_lock = False, threading.Lock()
        logger.info("starting the engine-core process of %s (it loads the weights)", config.model_config.model)
        self.process = self._start(input_addr, output_addr)
        self._started = time.monotonic()
        self.info: CoreInfo | None = None
        if wait:
            self.ready()

    def ready(self) -> "CoreProcess":
        """Wait, within the start-up timeout counted from the start, until the core has loaded; raise
        SobrioError (the process stopped) if it failed or timed out."""
        if self.info is None:
            self.info = self._wait_ready(self.startup_timeout)
            self.max_model_len = self.info.max_model_len
        return self

    def _bind(self) -> tuple[str, str]:
        """Bind the two sockets; the addresses the core connects to."""
        self._inputs.bind(f"ipc://{self._folder}/in")
        self._outputs.bind(f"ipc://{self._folder}/out")
        return f"ipc://{self._folder}/in", f"ipc://{self._folder}/out"

    def _start(self, input_addr: str, output_addr: str):
        """The core's process (a child of this one); anything with is_alive, exitcode, join and kill."""
        spawn = multiprocessing.get_context("spawn")
        process = spawn.Process(target=run_engine_core, name=f"sobrio-core-{self.config.model_config.model}",
                                daemon=True, args=(self.config, input_addr, output_addr,
                                                   logging.getLogger().getEffectiveLevel(), True, os.getpid()))
        with engine_core_environ():
            process.start()
        return process

    def _wait_ready(self, timeout: float) -> CoreInfo:
        deadline = self._started + timeout
        while time.monotonic() < deadline:
            if self._outputs.poll(500):
                kind, payload, *_ = decode(self._outputs.recv())
                if kind == "ready":
                    return CoreInfo(**payload)
                self.close()
                raise SobrioError(f"engine core for {self.config.model_config.model} failed to start: {payload}")
            if not self.process.is_alive():
                self.close()
                raise SobrioError(f"engine core for {self.config.model_config.model} exited during start-up "
                                  f"(exit code {self.process.exitcode})")
        self.close()
        raise SobrioError(f"engine core for {self.config.model_config.model} not ready after {timeout:.0f}s")

    # the in-process core's interface, as the front uses it
    def add_request(self, creq: "EngineCoreRequest") -> None:
        self._send(("add", creq))

    def abort_requests(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        try:
            self._send(("abort", list(request_ids)))
        except EngineDeadError:
            pass  # nothing left to abort

    def purge_cache_salt(self, salt: str) -> None:
        self._send(("purge", salt))

    def _send(self, message, timeout_ms: int = 5000) -> None:
        """Never blocks for good: a PUSH socket with no live peer would wait forever."""
        frame = encode(message)
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            try:
                return self._inputs.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                if not self.process.is_alive() or time.monotonic() > deadline:
                    raise EngineDeadError("engine core process is not taking requests") from None
                time.sleep(0.001)

    def stats(self) -> dict:
        return self.last_stats or {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0,
                                   "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0,
                                   "tables": {}, "num_blocks": self.info.num_blocks}

    def table_sizes(self) -> dict[str, int]:
        return dict(self.stats().get("tables", {}))

    def recv(self, timeout_ms: int) -> tuple | None:
        """The next message from the core, or None after timeout_ms; EngineDeadError if the process died."""
        if self._outputs.poll(timeout_ms):
            message = decode(self._outputs.recv())
            if message[0] == "outputs":
                self.last_stats = message[2]
            return message
        if not self.process.is_alive():
            raise EngineDeadError(f"engine core process exited (code {self.process.exitcode})")
        return None

    def is_alive(self) -> bool:
        return self.process.is_alive()

    place = "engine core pid {pid}"  # how `layout` names where the core runs

    def layout(self) -> list[str]:
        """One line: where the core runs, then its tensor-parallel ranks."""
        return [self.place.format(pid=self.info.pid) + "".join(f"; {line}" for line in self.info.layout)]

    def restarted(self, exc: EngineDeadError) -> "CoreProcess":
        """A new core in place of this dead one (its tensor-parallel ranks with it)."""
        self.close(timeout=1)
        return type(self)(self.config, self.startup_timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait a bounded time, then kill it; remove the socket folder. Once only:
        a deadline and the server's own shutdown may both ask, and a second zmq term would wait forever."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self.process.is_alive():
            try:
                self._inputs.send(encode(("shutdown", None)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        for zmq_socket in (self._inputs, self._outputs):
            zmq_socket.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._folder, ignore_errors=True)
