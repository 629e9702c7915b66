"""Embedding models: a second kind of engine client, for `/v1/embeddings`.

An encoder step has no KV cache, no sampling and no decode loop, so it needs none of the engine core: a
request's inputs are tokenized, queued as rows, and a worker thread runs batches of rows (inputs of
several requests together, padded to the longest with an attention mask, at most `--max-num-seqs` rows
and `--max-num-batched-tokens` padded tokens a forward) and hands each request its vectors when its last
row is done. The event loop only awaits a future: it never runs the model. PyTorch releases the GIL in
its operators, so the HTTP process keeps answering while a batch runs; the model (22M parameters for
all-MiniLM-L6-v2) is small enough that a process of its own would cost more in copies than it saves.

`EmbeddingClient` (engine/client.py) is the protocol the server uses; `EmbeddingEngine` the in-process
implementation. A client is told from a generative `EngineClient` by `task == "embed"`.
"""

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from sobrio.config import SobrioConfig
from sobrio.engine.engine_stats import EmbeddingRequestStats, EngineStats
from sobrio.engine.guard import CallbackGuard, where
from sobrio.engine.input import InputProcessor, check_text
from sobrio.errors import (
    ConfigError,
    EngineOverloadedError,
    EngineStepError,
    EngineUnavailableError,
    InvalidRequestError,
)

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    rows: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    arrival_time: float
    vectors: np.ndarray | None = None
    remaining: int = 0
    first_scheduled_time: float | None = None
    failed: bool = False
    order: list[int] = field(default_factory=list)

    def done(self) -> bool:
        return self.failed or self.future.done()  # done: cancelled by a client that went away, or answered


class EmbeddingEngine:
    """The encoder in this process, run by one worker thread in batches across requests."""

    task = "embed"

    def __init__(self, model_name: str, model: torch.nn.Module, tokenizer, hf_config, pooling_modes: tuple[str, ...],
                 normalize: bool, max_model_len: int, config: SobrioConfig, dtype: torch.dtype = torch.float32):
        from sobrio.models.bert import pool

        self.model_name = model_name
        self.config = config
        self.model = model
        self.dtype = dtype
        self._pool = lambda hidden, mask: pool(hidden, mask, pooling_modes, normalize)
        self._max_model_len = max_model_len
        self._dimensions = hf_config.hidden_size * len(pooling_modes)
        self._input_processor = InputProcessor(tokenizer, max_model_len, hf_config.vocab_size)
        self.pad_token_id = hf_config.pad_token_id or 0
        self.max_batch_rows = config.scheduler_config.max_num_seqs
        self.max_batch_tokens = max(config.scheduler_config.max_num_batched_tokens, max_model_len)
        self.healthy = True
        self._on_finished: list[Callable[[EmbeddingRequestStats], None]] = []  # metrics, from the worker thread
        self.callbacks = CallbackGuard(f"a callback of embedding model {model_name}")
        self._pending: deque[tuple[_Job, int]] = deque()
        self._running = 0
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"embed-{model_name}", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: SobrioConfig) -> "EmbeddingEngine":
        """Load a sentence-transformers BERT folder (or alias): weights, tokenizer, pooling, then one warm-up."""
        from transformers import AutoConfig, AutoTokenizer

        from sobrio.loader.hf import iter_safetensors_weights
        from sobrio.loader.resolve import resolve_model
        from sobrio.loader.st import read_sentence_transformer_config
        from sobrio.models.bert import BertModel
        from sobrio.models.sizing import resolve_dtype

        start = time.monotonic()
        mc = config.model_config
        source = resolve_model(mc.model)
        folder = source.path
        hf_config = AutoConfig.from_pretrained(folder)
        if hf_config.model_type != "bert":
            raise ConfigError(f"embedding model {mc.model!r} is a {hf_config.model_type!r}; sobrio's encoder is "
                              f"BERT's", "--model")
        if mc.quantization is not None:
            raise ConfigError(f"sobrio does not support --quantization for embedding models yet ({mc.model!r})",
                              "--quantization")
        st = read_sentence_transformer_config(folder)
        limit = min(st.max_seq_length or hf_config.max_position_embeddings, hf_config.max_position_embeddings)
        if mc.max_model_len is not None:
            limit = min(limit, mc.max_model_len)
        # auto: float32. The model is small (a batch of 64 short inputs takes tens of ms), and bf16 moves the
        # vectors by ~1e-3 cosine from the reference; --dtype bfloat16 is there for those who want it.
        dtype = torch.float32 if mc.dtype == "auto" else resolve_dtype(mc.dtype)
        with torch.device("cpu"):
            model = BertModel(hf_config)
        model.load_weights(iter_safetensors_weights(folder))
        model = model.to(dtype).eval().requires_grad_(False)
        model.prepack()
        engine = cls(source.name, model, AutoTokenizer.from_pretrained(folder), hf_config, st.pooling_modes,
                     st.normalize, limit, config, dtype)
        engine._forward([[engine.pad_token_id] * 8])  # warm-up: oneDNN picks its kernels on the first call
        logger.info("embedding model %s ready in %.1fs (%d dimensions, %d tokens per input, pooling %s%s, %s)",
                    source.name, time.monotonic() - start, engine.dimensions, limit, "+".join(st.pooling_modes),
                    ", normalized" if st.normalize else "", str(dtype).removeprefix("torch."))
        return engine

    # ---- the protocol ----
    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def dimensions(self) -> int:
        return self._dimensions

    @property
    def max_num_waiting(self) -> int:
        return self.config.scheduler_config.max_num_waiting

    @property
    def input_processor(self) -> InputProcessor:
        return self._input_processor

    async def embed(self, rows: list[list[int]], arrival_time: float | None = None) -> np.ndarray:
        """The vectors of token-id rows (from `tokenize_inputs`), batched with other requests' rows."""
        loop = asyncio.get_running_loop()
        job = _Job(rows, loop, loop.create_future(), arrival_time or time.monotonic())
        self._submit(job)
        try:
            return await job.future
        except asyncio.CancelledError:  # the client went away: its rows still queued are skipped
            job.future.cancel()
            raise

    def tokenize_inputs(self, inputs: list[str | list[int]], truncate_prompt_tokens: int | None = None,
                        add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids per input, checked against the vocabulary and the model's length (vLLM's rules: a longer
        input is refused unless `truncate_prompt_tokens` asks to cut it; -1 cuts at the model's length)."""
        if not inputs:
            raise InvalidRequestError("input is empty", param="input")
        limit = self._truncation(truncate_prompt_tokens)
        tokenizer = self._input_processor.tokenizer
        rows = []
        for i, item in enumerate(inputs):
            param = "input" if len(inputs) == 1 else f"input[{i}]"
            if isinstance(item, str):
                if not item:
                    raise InvalidRequestError(f"{param} is empty", param="input")
                if limit is None:
                    ids = self._input_processor.encode(item, add_special_tokens, param="input")
                else:
                    check_text(item, "input")
                    ids = tokenizer(item, add_special_tokens=add_special_tokens, truncation=True,
                                    max_length=limit).input_ids
            else:
                ids = list(item)
                if not ids:
                    raise InvalidRequestError(f"{param} is empty", param="input")
                self._input_processor.check_token_ids(ids, "input")
                if limit is not None:
                    ids = ids[:limit]  # the tokenizer's side (right) for BERT
            if len(ids) > self._max_model_len:
                raise InvalidRequestError(
                    f"{param} has {len(ids)} tokens, more than this model's {self._max_model_len}; shorten it or "
                    f"set truncate_prompt_tokens", param="input")
            rows.append(ids)
        return rows

    def _truncation(self, truncate_prompt_tokens: int | None) -> int | None:
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens == -1:
            return self._max_model_len
        if not 1 <= truncate_prompt_tokens <= self._max_model_len:
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or in [1, {self._max_model_len}]",
                                      param="truncate_prompt_tokens")
        return truncate_prompt_tokens

    def subscribe(self, on_finished: Callable[[EmbeddingRequestStats], None] | None = None) -> None:
        if on_finished is not None:
            self._on_finished.append(on_finished)

    def stats(self) -> EngineStats:
        with self._cond:
            waiting, running = len(self._pending), self._running
        return EngineStats(num_requests_running=running, num_requests_waiting=waiting,
                           tables={"embedding_pending_rows": waiting})

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            pending, self._pending = list(self._pending), deque()
            self._cond.notify_all()
        for job in {job for job, _ in pending}:
            self._fail(job, EngineUnavailableError("the server is shutting down"))
        self._thread.join(timeout)

    # ---- the worker ----
    def _submit(self, job: _Job) -> None:
        # Shortest rows first within a request: a request's batch pads less.
        job.order = sorted(range(len(job.rows)), key=lambda i: len(job.rows[i]))
        job.remaining = len(job.rows)
        with self._cond:
            if self._stopping or not self.healthy:
                raise EngineUnavailableError("the embedding engine is not running")
            if len(self._pending) + len(job.rows) > self.max_num_waiting:
                raise EngineOverloadedError("the embedding queue is full; retry later")
            self._pending.extend((job, i) for i in job.order)
            self._cond.notify()

    def _take_batch(self) -> list[tuple[_Job, int]]:
        """Rows in arrival order while the batch fits: rows <= max_batch_rows, padded tokens <= the token
        budget (always at least one row). Rows of requests already answered or cancelled are dropped."""
        batch: list[tuple[_Job, int]] = []
        longest = 0
        while self._pending and len(batch) < self.max_batch_rows:
            job, i = self._pending[0]
            if job.done():
                self._pending.popleft()
                continue
            length = max(longest, len(job.rows[i]))
            if batch and length * (len(batch) + 1) > self.max_batch_tokens:
                break
            self._pending.popleft()
            batch.append((job, i))
            longest = length
        return batch

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._pending and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                    batch = self._take_batch()
                    self._running = len(batch)
                vectors = self._compute(batch) if batch else None
                with self._cond:
                    self._running = 0  # before answering: a client that reads /metrics next sees it idle
                if batch:
                    self._deliver(batch, vectors)
        except BaseException as exc:  # noqa: BLE001 - a bug in the loop itself: say so, and stop taking requests
            logger.error("embedding worker for %s died: %s at %s", self.model_name, type(exc).__name__, where(exc))
            with self._cond:
                self.healthy = False
                pending, self._pending = list(self._pending), deque()
            for job in {job for job, _ in pending}:
                self._fail(job, EngineUnavailableError("the embedding engine failed"))

    def _compute(self, batch: list[tuple[_Job, int]]) -> np.ndarray | None:
        """The batch's vectors, or None if the forward failed (its requests fail: 500; the rest go on)."""
        now = time.monotonic()
        for job, _ in batch:
            if job.first_scheduled_time is None:
                job.first_scheduled_time = now
        try:
            return self._forward([job.rows[i] for job, i in batch])
        except Exception as exc:  # noqa: BLE001
            logger.warning("embedding batch of %d rows failed (%s)", len(batch), type(exc).__name__)
            return None

    def _deliver(self, batch: list[tuple[_Job, int]], vectors: np.ndarray | None) -> None:
        if vectors is None:
            for job in {job for job, _ in batch}:
                self._fail(job, EngineStepError("the embedding model failed while computing this request"))
            return
        for (job, i), vector in zip(batch, vectors):
            if job.done():
                continue
            if job.vectors is None:
                job.vectors = np.empty((len(job.rows), vectors.shape[1]), dtype=np.float32)
            job.vectors[i] = vector
            job.remaining -= 1
            if job.remaining == 0:
                self._finish(job)

    def _forward(self, rows: list[list[int]]) -> np.ndarray:
        longest = max(len(r) for r in rows)
        ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[b, :len(row)] = 1
        with torch.inference_mode():
            hidden = self.model(ids, mask)
            return self._pool(hidden, mask).float().numpy()

    def _finish(self, job: _Job) -> None:
        finished = time.monotonic()
        job.loop.call_soon_threadsafe(_resolve, job.future, job.vectors, None)
        for on_finished in self._on_finished:  # a metric that raises must not stop the worker
            self.callbacks(on_finished, EmbeddingRequestStats([len(r) for r in job.rows], job.arrival_time,
                                                   job.first_scheduled_time or finished, finished))

    @staticmethod
    def _fail(job: _Job, error: Exception) -> None:
        job.failed = True
        job.loop.call_soon_threadsafe(_resolve, job.future, None, error)


def _resolve(future: asyncio.Future, value, error: Exception | None) -> None:
    if future.done():  # cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
