"""The offline API, shaped like vLLM's: LLM(model=...).generate(prompts, params) / .chat(messages)."""

import dataclasses
import itertools
from collections.abc import Sequence

from sobrio import collector
from sobrio.config import ModelConfig, SobrioConfig
from sobrio.engine.llm_engine import LLMEngine
from sobrio.engine.outputs import RequestOutput
from sobrio.errors import InvalidRequestError
from sobrio.types.params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    def __init__(self, model: str = ModelConfig.model, **engine_args):
        """`engine_args`: any engine config field, flat (`max_num_seqs=8, block_size=16`), as vLLM's EngineArgs;
        an unknown one raises ConfigError."""
        with collector.paused(freeze=False):  # the load's objects are not garbage (sobrio/collector.py)
            self.engine = LLMEngine(SobrioConfig.from_kwargs(model=model, **engine_args))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop what the engine started (tensor-parallel ranks, the KV offload tier's writes); idempotent."""
        self.engine.core.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given none: the model's recommended defaults (`generation_config`), as vLLM."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order.

        A prompt is text, token ids, or a dict with "prompt" or "prompt_token_ids" and optionally "cache_salt".
        `lora_request`: a `LoRARequest` (vLLM's) for every prompt, or a list of one (or None) per prompt.
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params or self.get_default_sampling_params(), len(prompts))
        adapters = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(adapters) != len(prompts):
            raise InvalidRequestError(f"{len(adapters)} LoRA requests for {len(prompts)} prompts")
        params = [p if a is None else dataclasses.replace(p, lora_request=a) for p, a in zip(params, adapters)]
        request_ids: dict[str, int] = {}  # request id -> number of sequences it returns
        for prompt, p in zip(prompts, params):
            request_id = str(next(self._ids))
            if isinstance(prompt, dict):
                self.engine.add_request(request_id, prompt.get("prompt"), p, cache_salt=prompt.get("cache_salt"),
                                        prompt_token_ids=prompt.get("prompt_token_ids"))
            else:
                self.engine.add_request(request_id, prompt, p)
            request_ids[request_id] = p.n
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        processor = self.engine.input_processor
        prompts = [{"prompt_token_ids": processor.chat_prompt_ids(c, chat_template=chat_template)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(request_ids), use_tqdm)
        try:
            while pending:
                for output in self.engine.step():
                    if output.request_id in pending and output.finished:
                        _merge(results, output)
                        if len(results[output.request_id].outputs) == request_ids[output.request_id]:
                            pending.discard(output.request_id)
                            bar.update(1) if bar else None
        except BaseException:
            for request_id in pending:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close() if bar else None
        while self.engine.core.on_idle():  # idle now: the KV offload tier's disk writes, if any
            pass
        for output in results.values():
            output.outputs.sort(key=lambda c: c.index)
        return [results[r] for r in request_ids]


def _merge(results: dict[str, RequestOutput], output: RequestOutput) -> None:
    if output.request_id in results:
        results[output.request_id].outputs.extend(output.outputs)
    else:
        results[output.request_id] = output


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt of token ids
    return prompts


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    assert len(params) == count, f"{len(params)} sampling params for {count} prompts"
    return params


def _progress(total: int, enabled: bool):
    if not enabled or total < 2:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req")
