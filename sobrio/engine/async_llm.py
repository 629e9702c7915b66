"""asyncio front of one engine: the synchronous loop runs in its own thread, outputs fan out to queues.

Each request gets an asyncio.Queue fed from the engine thread; its consumer iterates `generate()`.
Cancelling that iteration (a client that disconnects) aborts the request, which frees its blocks at the
next step. An exception inside a step fails the requests in flight then (each gets the error); the loop
keeps serving new ones.
"""

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from sobrio.config import EngineConfig
from sobrio.engine.llm_engine import LLMEngine
from sobrio.engine.outputs import RequestOutput
from sobrio.errors import SobrioError
from sobrio.sample.params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStepError(SobrioError):
    """The engine failed while computing this request (HTTP 500); other requests go on."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine, on_output: Callable[[RequestOutput, float], None] | None = None):
        self.engine = engine
        self.on_output = on_output
        self.on_abort: Callable[[str], None] | None = None  # e.g. metrics forgetting a request's timings
        self._lock = threading.Lock()  # guards the engine: the loop's step vs add/abort from other threads
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending_aborts: list[str] = []  # aborts asked from the event loop, applied before the next step
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"engine-{engine.model_name}", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> "AsyncLLM":
        return cls(LLMEngine(config), **kwargs)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    async def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                          queue: asyncio.Queue, prompt_token_ids: list[int] | None = None,
                          cache_salt: str | None = None) -> None:
        """Queue a request whose outputs (or a failure) go to `queue`; raises InvalidRequestError at once."""
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._add, request_id, prompt, params, prompt_token_ids, cache_salt, loop, queue)

    async def generate(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                       prompt_token_ids: list[int] | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield outputs as the engine makes them; leaving early aborts the request."""
        queue: asyncio.Queue = asyncio.Queue()
        await self.add_request(request_id, prompt, params, queue, prompt_token_ids, cache_salt)
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
                    raise EngineStepError("the engine failed while computing this request")
                yield item
        finally:
            for request_id in request_ids:
                if remaining:
                    self.abort_soon(request_id)  # no await: this may run inside a cancelled task
                self.release(request_id)

    def _add(self, request_id, prompt, params, prompt_token_ids, cache_salt, loop, queue) -> None:
        if self._stopping:
            raise SobrioError("the server is shutting down")
        # Tokenizing takes no lock: a long prompt never holds up the step of the requests in flight.
        processed = self.engine.process_input(request_id, prompt, params, cache_salt=cache_salt,
                                              prompt_token_ids=prompt_token_ids)
        with self._lock:
            self.engine.add_processed(processed)
            self._queues[request_id] = (loop, queue)
        self._wake.set()

    def release(self, request_id: str) -> None:
        """The consumer has every output it wants: stop routing this request's outputs."""
        self._queues.pop(request_id, None)

    def abort_soon(self, request_id: str) -> None:
        """Abort without waiting for the engine lock: safe in a cancelled task or a `finally` (a client that
        went away); the engine thread applies it before its next step."""
        self._pending_aborts.append(request_id)
        self._queues.pop(request_id, None)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort_request(request_id)
        self._queues.pop(request_id, None)
        if self.on_abort is not None:
            self.on_abort(request_id)

    def stats(self) -> dict:
        stats = self.engine.stats()
        stats["tables"] = {**stats["tables"], "async_queues": len(self._queues),
                           "async_pending_aborts": len(self._pending_aborts)}
        return stats

    def _apply_pending_aborts(self) -> None:
        while self._pending_aborts:
            self.abort(self._pending_aborts.pop())

    def _loop(self) -> None:
        while not self._stopping:
            self._apply_pending_aborts()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            with self._lock:
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # fail the requests in flight, keep the loop alive
                    logger.exception("engine step failed: %s", type(exc).__name__)
                    self._fail_all(EngineStepError(f"engine step failed: {type(exc).__name__}"))
                    continue
            now = time.monotonic()
            for output in outputs:
                self._deliver(output, now)

    def _deliver(self, output: RequestOutput, now: float) -> None:
        if self.on_output is not None:
            self.on_output(output, now)
        target = self._queues.get(output.request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, output)

    def _fail_all(self, error: Exception) -> None:
        for request_id, (loop, queue) in list(self._queues.items()):
            self.engine.abort_request(request_id)  # the caller holds the lock
            if self.on_abort is not None:
                self.on_abort(request_id)
            loop.call_soon_threadsafe(queue.put_nowait, error)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Abort what is still in flight and stop the loop thread."""
        self._stopping = True
        with self._lock:
            self._fail_all(SobrioError("the server is shutting down"))
        self._wake.set()
        self._thread.join(timeout)
