"""asyncio clients of one engine: the front (tokenize, detokenize) plus a core, in-process or in its own process.

Both implement the `EngineClient` protocol (`sobrio/engine/client.py`); `engine/launch.py` builds them. A
background thread produces the engine's outputs and routes them to one asyncio queue per HTTP request:
- `AsyncLLM`: the thread steps an in-process core (the offline-style engine; tests).
- `AsyncMPClient`: the core runs in its own process (`core_process.py`); the thread receives each
  step's outputs and runs the front on them. The default of `sobrio serve`: the event loop and the
  model no longer share one interpreter.

Cancelling an output iteration (a client that disconnects) aborts the request. A step that fails for
one request fails that request alone (the core isolates it); a core process that dies fails the
requests in flight, and the client starts a new core (a bounded number of times, then gives up).
The thread itself is supervised the same way: the server's callbacks on it (metrics, logs) cannot raise
into it (`guard.CallbackGuard`), and if it dies anyway its requests fail at once, `healthy` turns False
(/health: 503) and the engine restarts; a thread that is not running is never reported healthy.
"""

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from sobrio.config import ServerConfig, SobrioConfig
from sobrio.engine.client import EngineClient
from sobrio.engine.core_groups import open_cores
from sobrio.engine.core_process import CoreProcess, EngineDeadError
from sobrio.engine.engine_stats import EngineStats
from sobrio.engine.guard import CallbackGuard, where
from sobrio.engine.llm_engine import LLMEngine
from sobrio.engine.outputs import RequestOutput
from sobrio.errors import EngineStepError, EngineUnavailableError, InvalidRequestError, SobrioError
from sobrio.loader.load import LoadedModelFiles, load_model_files
from sobrio.loader.lora import LoRARequest
from sobrio.loader.resolve import core_may_start_first
from sobrio.types.params import SamplingParams

logger = logging.getLogger(__name__)


def _put_all(deliveries: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, output in deliveries:
        queue.put_nowait(output)


class _ClientBase:
    """Request routing shared by both clients: queues, streaming, aborts, failing what is in flight."""

    task = "generate"

    def __init__(self, engine: LLMEngine, on_output: Callable[[RequestOutput, float], None] | None = None):
        self.engine = engine
        self.config: SobrioConfig = engine.config  # the engine's configuration (/metrics: cache_config_info)
        self._on_output = [on_output] if on_output is not None else []
        self._on_abort: list[Callable[[str], None]] = []  # e.g. metrics forgetting a request's timings
        self._lock = threading.Lock()  # guards the front (and an in-process core) between threads
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._healthy = True
        self.callbacks = CallbackGuard(f"a callback of engine {engine.model_name}")  # errors by type
        self.thread_deaths = 0
        self._thread = threading.Thread(target=self._supervise, name=f"engine-{engine.model_name}", daemon=True)

    @property
    def healthy(self) -> bool:
        """False while the engine restarts, and whenever its thread is not running: nothing would answer."""
        return self._healthy and self._thread.is_alive()

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self._healthy = value

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def input_processor(self):
        return self.engine.input_processor

    @property
    def chat_template(self) -> str | None:
        return getattr(self.engine.input_processor.tokenizer, "chat_template", None)

    @property
    def default_sampling(self) -> dict:
        """--generation-config: SamplingParams keywords for the fields a request leaves unset."""
        return self.engine.default_sampling

    @property
    def adapters(self):
        return self.engine.adapters

    def with_adapter(self, lora: LoRARequest) -> EngineClient:
        return AdapterClient(self, lora)

    def subscribe(self, on_output: Callable[[RequestOutput, float], None] | None = None,
                  on_abort: Callable[[str], None] | None = None) -> None:
        """Observers of the delivery path, called on the engine thread (errors counted, never raised)."""
        if on_output is not None:
            self._on_output.append(on_output)
        if on_abort is not None:
            self._on_abort.append(on_abort)

    @property
    def max_num_waiting(self) -> int:
        return self.engine.config.scheduler_config.max_num_waiting

    async def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                          queue: asyncio.Queue, prompt_token_ids: list[int] | None = None,
                          cache_salt: str | None = None, priority: int = 0, kv_offload: bool | None = None) -> None:
        """Queue a request whose outputs (or a failure) go to `queue`; raises InvalidRequestError at once."""
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._add, request_id, prompt, params, prompt_token_ids, cache_salt, loop, queue,
                                priority, kv_offload)

    async def generate(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                       prompt_token_ids: list[int] | None = None, cache_salt: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield outputs as the engine makes them; leaving early aborts the request."""
        queue: asyncio.Queue = asyncio.Queue()
        await self.add_request(request_id, prompt, params, queue, prompt_token_ids, cache_salt, priority)
        async for output in self.stream_outputs([request_id], params.n, queue):
            yield output

    async def stream_outputs(self, request_ids: list[str], n: int,
                             queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yield every output of these requests (n sequences each) from their shared queue; leaving early
        (a client that disconnects) aborts whatever is unfinished."""
        remaining = len(request_ids) * n
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                remaining -= item.finished
                if item.outputs[0].finish_reason == "error":
                    if item.error is not None:  # its grammar: the request's fault
                        raise InvalidRequestError(item.error, param="structured_outputs")
                    raise EngineStepError("the engine failed while computing this request")
                yield item
        finally:
            for request_id in request_ids:
                if remaining:
                    self.abort_soon(request_id)  # no await: this may run inside a cancelled task
                self.release(request_id)

    def _add(self, request_id, prompt, params, prompt_token_ids, cache_salt, loop, queue, priority=0,
             kv_offload=None) -> None:
        if self._stopping:
            raise EngineUnavailableError("the server is shutting down")
        if not self.healthy:
            raise EngineUnavailableError("the engine is restarting; retry shortly")
        # Tokenizing takes no lock: a long prompt never holds up the step of the requests in flight.
        processed = self.engine.process_input(request_id, prompt, params, cache_salt=cache_salt,
                                              prompt_token_ids=prompt_token_ids, priority=priority,
                                              kv_offload=kv_offload)
        with self._lock:
            self.engine.add_processed(processed)
            self._queues[request_id] = (loop, queue)
        self._wake()

    def release(self, request_id: str) -> None:
        """The consumer has every output it wants: stop routing this request's outputs."""
        self._queues.pop(request_id, None)

    def abort_soon(self, request_id: str) -> None:
        """Abort without awaiting: safe in a cancelled task or a `finally` (a client that went away)."""
        self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort_request(request_id)
        self._queues.pop(request_id, None)
        self._aborted(request_id)

    def _aborted(self, request_id: str) -> None:
        for on_abort in self._on_abort:
            self.callbacks(on_abort, request_id)

    def stats(self) -> EngineStats:
        with self._lock:
            stats = self.engine.stats()
        stats["tables"] = {**stats["tables"], **self._client_tables()}
        return EngineStats.from_dict(stats, callback_errors=dict(self.callbacks.errors),
                                     engine_thread_deaths=self.thread_deaths)

    def _client_tables(self) -> dict[str, int]:
        """The client's own per-request tables (a request that left one behind shows in /metrics)."""
        return {"client_queues": len(self._queues)}

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """One wake-up of each event loop per step, not one per request: each `call_soon_threadsafe` writes
        to the loop's self-pipe, and 32 of them a step cost the API process (and the core's cores) more."""
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            for on_output in self._on_output:
                self.callbacks(on_output, output, now)
            target = self._queues.get(output.request_id)
            if target is not None:
                loop, queue = target
                by_loop.setdefault(loop, []).append((queue, output))
        for loop, deliveries in by_loop.items():
            loop.call_soon_threadsafe(_put_all, deliveries)

    def _fail_all(self, error: Exception, abort_in_core: bool = True) -> None:
        """Every request in flight gets `error`; the front forgets them (the caller holds the lock)."""
        for request_id in list(self._queues) if abort_in_core else ():
            self.engine.abort_request(request_id)
        self._fail(list(self._queues), error)

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        """These requests (front ids) get `error` and leave the routing table (the caller holds the lock;
        the engine has been told, or is gone)."""
        for request_id in request_ids:
            target = self._queues.pop(request_id, None)
            self._aborted(request_id)
            if target is not None:
                target[0].call_soon_threadsafe(target[1].put_nowait, error)

    def purge_cache_salt(self, salt: str) -> None:
        """Forget the cached blocks of a salt (a deleted tenant) and shred its offloaded ones."""
        with self._lock:
            self.engine.purge_cache_salt(salt)
        self._wake()

    def _wake(self) -> None:
        """Tell the thread there is new work (an in-process core waits for it)."""

    def _supervise(self) -> None:
        """The thread: the client's loop, restarted (with the engine) if it ever dies of an exception."""
        while not self._stopping:
            try:
                self._run()
            except Exception as exc:
                self.thread_deaths += 1
                self.healthy = False
                logger.error("engine thread of %s died (%s at %s); failing its requests and restarting",
                             self.model_name, type(exc).__name__, where(exc))
                try:
                    self._recover(exc)
                except Exception as again:
                    logger.error("engine %s could not recover (%s); it stops", self.model_name, type(again).__name__)
                    self._stopping = True

    def _run(self) -> None:
        raise NotImplementedError

    def _recover(self, exc: Exception) -> None:
        """After the thread died of `exc`: fail what was in flight, put the engine back in order."""
        raise NotImplementedError

    def shutdown(self, timeout: float = 5.0) -> None:
        """Fail what is still in flight and stop the thread."""
        self._stopping = True
        if self._lock.acquire(timeout=timeout):  # bounded: a stop must never hang on a wedged engine
            try:
                self._fail_all(EngineUnavailableError("the server is shutting down"))
            finally:
                self._lock.release()
        else:
            logger.error("engine %s did not release its lock in %.0fs; stopping anyway", self.model_name, timeout)
        self._wake()
        self._thread.join(timeout)


class AsyncLLM(_ClientBase):
    """The core in this process: the thread steps it whenever there is work."""

    def __init__(self, engine: LLMEngine, on_output: Callable[[RequestOutput, float], None] | None = None):
        super().__init__(engine, on_output)
        self._work = threading.Event()
        self._pending_aborts: list[str] = []  # asked from the event loop, applied before the next step
        self._thread.start()

    @classmethod
    def from_config(cls, config: SobrioConfig, **kwargs) -> "AsyncLLM":
        return cls(LLMEngine(config), **kwargs)

    def abort_soon(self, request_id: str) -> None:
        """The step holds the lock for tens of ms: queue the abort for the thread instead of waiting."""
        self._pending_aborts.append(request_id)
        self._queues.pop(request_id, None)
        self._wake()

    def _client_tables(self) -> dict[str, int]:
        return {**super()._client_tables(), "client_pending_aborts": len(self._pending_aborts)}

    def _wake(self) -> None:
        self._work.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        super().shutdown(timeout)
        close = getattr(self.engine.core, "close", None)
        if close is not None:  # an in-process EngineCore: its KV offload tier's disk writes
            close()

    def _recover(self, exc: Exception) -> None:
        """An in-process core: its requests fail and are aborted; a thread that keeps dying gives up."""
        with self._lock:
            self._fail_all(EngineStepError(f"the engine thread failed ({type(exc).__name__})"))
        if self.thread_deaths > ServerConfig.engine_restarts:
            raise EngineUnavailableError(f"engine thread died {self.thread_deaths} times")
        self.healthy = True

    def _run(self) -> None:
        while not self._stopping:
            while self._pending_aborts:
                self.abort(self._pending_aborts.pop())
            if not self.engine.has_unfinished_requests():
                with self._lock:
                    more = self.engine.core.on_idle()  # the KV offload tier's disk writes
                self._work.wait(0 if more else 0.5)
                self._work.clear()
                continue
            with self._lock:
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # the core isolates one request's failure; this is anything else
                    # type and place only: an exception's message (and a traceback's) may quote request data
                    logger.error("engine step failed: %s at %s", type(exc).__name__, where(exc))
                    self._fail_all(EngineStepError(f"engine step failed: {type(exc).__name__}"))
                    continue
            self._deliver_all(outputs)


def _files_and_cores(config: SobrioConfig, startup_timeout: float,
                     started: CoreProcess | None = None) -> tuple[LoadedModelFiles, object]:
    """The front's tokenizer and config, read here while the core(s) start (one process, data-parallel replicas,
    or prefill + decode; `started`: one process started already, `launch.start_cores`) and load the weights:
    the core's start is the longer, so it goes first. A GGUF not prepared yet is prepared here first (the
    core reads what that writes). A failure on either side stops what the other started."""
    if started is not None:
        try:
            files = load_model_files(config.model_config)
        except BaseException:
            started.close(timeout=1)
            raise
        return files, started.ready()
    if not core_may_start_first(config.model_config.model, config.model_config.quantization):
        files = load_model_files(config.model_config)
        return files, open_cores(config, startup_timeout)
    with ThreadPoolExecutor(1, thread_name_prefix="core-start") as pool:
        cores = pool.submit(open_cores, config, startup_timeout)  # waits on a socket: this thread runs
        try:
            files = load_model_files(config.model_config)
        except BaseException:
            with contextlib.suppress(Exception):
                cores.result().close()
            raise
        return files, cores.result()


class AsyncMPClient(_ClientBase):
    """The core in its own process: the thread receives each step's outputs and runs the front on them."""

    def __init__(self, config: SobrioConfig, max_restarts: int = ServerConfig.engine_restarts,
                 startup_timeout: float = 600.0, on_output: Callable[[RequestOutput, float], None] | None = None,
                 on_fatal: Callable[[], None] | None = None, started: CoreProcess | None = None):
        """`started`: its core process, started already (`launch.start_cores`), which this client owns."""
        self.config, self.max_restarts, self.startup_timeout = config, max_restarts, startup_timeout
        self.on_fatal = on_fatal  # called when the core died more than max_restarts times
        self.restarts = 0
        files, core = _files_and_cores(config, startup_timeout, started)
        logger.info("engine layout of %s: %s", config.model_config.model, " | ".join(core.layout()))
        super().__init__(LLMEngine(config, core=core, files=files), on_output)
        self._thread.start()

    @property
    def core(self) -> CoreProcess:
        return self.engine.core

    def _run(self) -> None:
        while not self._stopping:
            try:
                message = self.core.recv(200)
            except EngineDeadError as exc:
                if not self._stopping:
                    self._restart(exc)
                continue
            if message is None or message[0] != "outputs":
                continue
            with self._lock:
                outputs = self.engine.process_outputs(message[1])
            self._deliver_all(outputs)

    def _recover(self, exc: Exception) -> None:
        """The thread died (not the core): fail and abort what was in flight, then restart the core as if it
        had died, so the front and the core start again from nothing in flight."""
        with self._lock:
            self._fail_all(EngineStepError(f"the engine thread failed ({type(exc).__name__})"))
            self.engine.forget_all()
        self._restart(EngineDeadError(f"engine thread of {self.model_name} failed ({type(exc).__name__})"))

    def _restart(self, exc: EngineDeadError) -> None:
        """Fail the requests the dead core held at once (all of them, or one replica's), then start a new
        one (503 meanwhile, unless other replicas still serve)."""
        logger.error("%s; failing the requests it held", exc)
        partial = getattr(exc, "request_ids", None)  # a group's member: only its requests
        self.healthy = partial is not None and getattr(self.core, "serves_while_restarting", False)
        error = EngineStepError("the engine process died while computing this request")
        with self._lock:
            if partial is None:
                self._fail_all(error, abort_in_core=False)
                self.engine.forget_all()
            else:
                self._fail(self.engine.forget(partial), error)
        if self.restarts >= self.max_restarts:
            self.core.close(timeout=1)
            return self._give_up(f"engine core died {self.restarts + 1} times; giving up")
        self.restarts += 1
        logger.info("restarting the engine core (%d of %d)", self.restarts, self.max_restarts)
        try:
            self.engine.core = self.core.restarted(exc)
        except SobrioError as start_error:
            return self._give_up(f"engine core restart failed: {start_error}")
        self.healthy = True

    def _give_up(self, why: str) -> None:
        """Stop serving this model and tell the server (which exits 1 for its supervisor)."""
        logger.error("%s", why)
        self._stopping = True
        if self.on_fatal is not None:
            self.on_fatal()

    def shutdown(self, timeout: float = 5.0) -> None:
        super().shutdown(timeout)
        self.core.close()


class AdapterClient:
    """A served model's client, every request through it run with one LoRA adapter: what the server uses for
    a request that names the adapter, so it submits as for any model. Everything else is the base's."""

    def __init__(self, base: _ClientBase, lora: LoRARequest):
        self._base, self.lora_request = base, lora

    def __getattr__(self, name):
        return getattr(self._base, name)

    async def add_request(self, request_id, prompt, params, *args, **kwargs) -> None:
        params = dataclasses.replace(params, lora_request=self.lora_request)
        await self._base.add_request(request_id, prompt, params, *args, **kwargs)

    def generate(self, request_id, prompt, params, *args, **kwargs):
        params = dataclasses.replace(params, lora_request=self.lora_request)
        return self._base.generate(request_id, prompt, params, *args, **kwargs)
