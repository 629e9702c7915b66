"""Build OpenAI response bodies and stream chunks from engine outputs."""

from collections.abc import Callable
from dataclasses import dataclass, field

from sobrio.engine.outputs import Logprob, RequestOutput
from sobrio.server import tool_calls
from sobrio.server.protocol import UsageInfo, now


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    role_sent: bool = False
    echo_sent: bool = False
    tool_parser: tool_calls.ToolCallParser | None = None  # a stream's, when the answer may hold tool calls
    energy_j: float = 0.0  # the sequence's so far (engine/step_energy.py)


class ChoiceState:
    """The choices of one HTTP request: prompt i's sequence j is choice i * n + j."""

    def __init__(self, request_ids: list[str], n: int, top_n: int | None, echo: list[str] | None = None,
                 prompt_top_n: int | None = None, decode: Callable[[list[int]], str] | None = None):
        self.request_ids = request_ids
        self.prompt_index = {rid: i for i, rid in enumerate(request_ids)}
        self.n = n
        self.top_n = top_n
        self.echo = echo  # completions' echo: each prompt's text, put before its choices' text
        self.prompt_top_n = prompt_top_n  # prompt_logprobs asked for (or implied by echo with logprobs)
        self.decode = decode  # token ids to text: the echoed prompt's first token has no logprob entry
        self.choices: dict[int, Choice] = {}
        self.prompt_tokens: dict[str, int] = {}
        self.cached_tokens: dict[str, int] = {}
        self.prompt_token_ids: dict[str, list[int]] = {}
        self.prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] = {}
        self.tool_calls = False  # chat with tools: the answers are parsed for tool calls (server/tool_calls.py)
        self.forced_tool_calls = False  # tool_choice "required" or named: the answers are calls only
        self.energy_source: str | None = None

    def add(self, output: RequestOutput) -> Choice:
        completion = output.outputs[0]
        index = self.prompt_index[output.request_id] * self.n + completion.index
        choice = self.choices.setdefault(index, Choice(index))
        choice.text, choice.token_ids = completion.text, completion.token_ids
        choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason
        choice.logprobs = completion.logprobs
        choice.energy_j = output.metrics.energy_j
        self.energy_source = output.metrics.energy_source or self.energy_source
        self.prompt_tokens[output.request_id] = len(output.prompt_token_ids)
        self.cached_tokens[output.request_id] = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            self.prompt_token_ids[output.request_id] = output.prompt_token_ids
            self.prompt_logprobs[output.request_id] = output.prompt_logprobs
        return choice

    def echo_of(self, choice: Choice) -> str:
        return self.echo[choice.index // self.n] if self.echo else ""

    def request_of(self, choice: Choice) -> str:
        return self.request_ids[choice.index // self.n]

    def sorted(self) -> list[Choice]:
        return [self.choices[i] for i in sorted(self.choices)]


def usage_of(state: ChoiceState) -> UsageInfo:
    prompt = sum(state.prompt_tokens.values())
    completion = sum(len(c.token_ids) for c in state.choices.values())
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details={"cached_tokens": sum(state.cached_tokens.values())})


def note_usage(entry, state: ChoiceState) -> None:
    """The request's token counts and energy into its ledger row (`LedgerEntry`; None: no ledger)."""
    if entry is not None:
        usage = usage_of(state)
        entry.prompt_tokens, entry.completion_tokens = usage.prompt_tokens, usage.completion_tokens
        entry.cached_tokens = usage.prompt_tokens_details["cached_tokens"]
        entry.energy_j = sum(c.energy_j for c in state.choices.values())
        entry.energy_source = state.energy_source


def _top(entry: dict[int, Logprob], top_n: int) -> list[Logprob]:
    return sorted(entry.values(), key=lambda lp: lp.logprob, reverse=True)[:top_n]


def chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], top_n: int) -> dict:
    def item(lp: Logprob) -> dict:
        token = lp.decoded_token or ""
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

    content = [{**item(entry[tid]), "top_logprobs": [item(lp) for lp in _top(entry, top_n)]}
               for entry, tid in zip(entries, token_ids)]
    return {"content": content}


def completion_logprobs(entries: list[dict[int, Logprob] | None], token_ids: list[int], top_n: int,
                        offset: int = 0, decode: Callable[[list[int]], str] | None = None) -> dict:
    """OpenAI's completion logprobs. An entry of None (an echoed prompt's first token) has no logprob."""
    tokens = [entry[tid].decoded_token or "" if entry is not None else (decode([tid]) if decode else "")
              for entry, tid in zip(entries, token_ids)]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens,
            "token_logprobs": [entry[tid].logprob if entry is not None else None
                               for entry, tid in zip(entries, token_ids)],
            "top_logprobs": [{lp.decoded_token or "": lp.logprob for lp in _top(entry, top_n)} if entry is not None
                             else None for entry in entries],
            "text_offset": offsets}


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id: Logprob}."""
    if entries is None:
        return None
    return [None if entry is None else
            {str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in entry.items()} for entry in entries]


def _delta_logprobs(choice: Choice, output: RequestOutput, top_n: int, chat: bool):
    if choice.logprobs is None or not output.delta_token_ids:
        return None
    k = len(output.delta_token_ids)
    entries, ids = choice.logprobs[-k:], choice.token_ids[-k:]
    return chat_logprobs(entries, ids, top_n) if chat else completion_logprobs(entries, ids, top_n)


def chat_chunk(state: ChoiceState, choice: Choice, output: RequestOutput, base_id: str, model: str,
               created: int) -> dict:
    finish_reason = choice.finish_reason
    if state.tool_calls:
        choice.tool_parser = choice.tool_parser or tool_calls.ToolCallParser(state.forced_tool_calls)
        delta = tool_calls.stream_delta(choice.tool_parser, output.delta_text, finish_reason is not None)
        finish_reason = tool_calls.finish_reason(finish_reason, choice.tool_parser.all_complete)
    else:
        delta = {"content": output.delta_text}
    if not choice.role_sent:
        delta["role"] = "assistant"
        choice.role_sent = True
    body = {"index": choice.index, "delta": delta, "finish_reason": finish_reason,
            "logprobs": _delta_logprobs(choice, output, state.top_n or 0, chat=True)}
    return {"id": base_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [body]}


def completion_chunk(state: ChoiceState, choice: Choice, output: RequestOutput, base_id: str, model: str,
                     created: int) -> dict:
    text = output.delta_text
    if state.echo and not choice.echo_sent:
        text, choice.echo_sent = state.echo_of(choice) + text, True
    body = {"index": choice.index, "text": text, "finish_reason": choice.finish_reason,
            "logprobs": _delta_logprobs(choice, output, state.top_n or 0, chat=False)}
    return {"id": base_id, "object": "text_completion", "created": created, "model": model, "choices": [body]}


def final_response(state: ChoiceState, base_id: str, model: str, kind: str) -> dict:
    top_n = state.top_n or 0
    choices = []
    for c in state.sorted():
        if kind == "chat":
            logprobs = chat_logprobs(c.logprobs, c.token_ids, top_n) if c.logprobs is not None else None
            message, complete = {"role": "assistant", "content": c.text}, False
            if state.tool_calls:
                message, complete = tool_calls.message(c.text, state.forced_tool_calls)
            choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                            "finish_reason": tool_calls.finish_reason(c.finish_reason, complete),
                            "stop_reason": c.stop_reason})
        else:
            choices.append(_completion_choice(state, c, top_n))
    obj = "chat.completion" if kind == "chat" else "text_completion"
    body = {"id": base_id, "object": obj, "created": now(), "model": model, "choices": choices,
            "usage": usage_of(state).model_dump()}
    if kind == "chat" and state.prompt_top_n is not None:  # vLLM puts a chat's at the top
        body["prompt_logprobs"] = prompt_logprobs_json(state.prompt_logprobs.get(state.request_ids[0]))
    return body


def _completion_choice(state: ChoiceState, c: Choice, top_n: int) -> dict:
    rid = state.request_of(c)
    prompt_lps = state.prompt_logprobs.get(rid)
    logprobs = None
    if c.logprobs is not None and state.echo and prompt_lps is not None:  # vLLM: the prompt's, then the output's
        logprobs = completion_logprobs(prompt_lps + c.logprobs, state.prompt_token_ids[rid] + c.token_ids, top_n,
                                       decode=state.decode)
    elif c.logprobs is not None:
        logprobs = completion_logprobs(c.logprobs, c.token_ids, top_n, offset=len(state.echo_of(c)))
    choice = {"index": c.index, "text": state.echo_of(c) + c.text, "logprobs": logprobs,
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if state.prompt_top_n is not None:
        choice["prompt_logprobs"] = prompt_logprobs_json(prompt_lps)
    return choice
