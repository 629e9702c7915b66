"""Structured output's forced tokens (fast-forward), compile bounds and metrics, on smollm2-135m.

Fast-forward appends the tokens a grammar forces without sampling them and computes them in one forward with
the next step: greedy (and seeded) output must be exactly token-by-token decoding's, in fewer steps, through
preemption, stop strings and max_tokens, with nothing left behind. A grammar that compiles too long or past
llguidance's limits fails its request alone (a 400 through HTTP); the engine goes on serving.
"""

import asyncio
import json
import random
import time

import httpx
import pytest

from sobrio import SamplingParams, StructuredOutputsParams
from sobrio.config import SobrioConfig
from sobrio.engine.scheduler import Scheduler, is_decode
from sobrio.errors import InvalidRequestError
from sobrio.structured.manager import sole_token
from sobrio.types.request import Request
from tests.unit.test_block_accounting import check_invariants

# long fixed keys: most of an object's tokens are forced
KEYS = ["customer_identification_number", "primary_shipping_address_line", "preferred_contact_method_name",
        "account_creation_timestamp_utc"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": KEYS,
          "properties": {k: {"type": "integer", "minimum": 0, "maximum": 99} if i % 2
                         else {"enum": ["alpha_value_one", "beta_value_two"]}
                         for i, k in enumerate(KEYS)}}
CHOICES = ["internationalization_is_long", "internationalization_is_short"]
REGEX = r"ID-[0-9]{3}-constant-suffix-value-[a-z]{2}"


def params(max_tokens: int = 80, **kw) -> SamplingParams:
    so = {k: kw.pop(k) for k in ("json", "choice", "regex", "grammar") if k in kw}
    return SamplingParams(temperature=kw.pop("temperature", 0), max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**so) if so else None, **kw)


BATCH = [  # (prompt, params): constrained, unconstrained, logprobs, stop string, seeded sampling
    ("Customer record as JSON:", params(json=SCHEMA)),
    ("The capital of France is", params(max_tokens=16)),
    ("Pick one:", params(choice=CHOICES)),
    ("Identifier:", params(regex=REGEX)),
    ("Identifier, cut short:", params(regex=REGEX, stop=["suffix"])),
    ("Pick one, with logprobs:", params(choice=CHOICES, logprobs=1)),
    ("One, two, three,", params(max_tokens=16)),
    ("A random record:", params(json=SCHEMA, temperature=1.0, seed=5)),
]


def run(engine, batch, tag: str, fast_forward: bool) -> tuple[list, int]:
    """Every request's final output, in order, and the steps it took."""
    engine.core.fast_forward = fast_forward
    ids = [f"{tag}-{i}" for i in range(len(batch))]
    for request_id, (prompt, p) in zip(ids, batch):
        engine.add_request(request_id, prompt, p)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[i] for i in ids], steps


def assert_idle(engine) -> None:
    assert all(size == 0 for size in engine.table_sizes().values()), engine.table_sizes()
    pool = engine.scheduler.pool
    assert pool.num_free == pool.num_blocks and all(b.ref_count == 0 for b in pool.blocks)


@pytest.fixture
def engine(smollm2):
    engine = smollm2.engine
    yield engine
    engine.core.fast_forward = True
    assert_idle(engine)


def test_fast_forward_gives_token_by_token_output_in_fewer_steps(engine):
    forced_before = engine.core.structured.num_forced_tokens
    slow, slow_steps = run(engine, BATCH, "tbt", fast_forward=False)
    assert engine.core.structured.num_forced_tokens == forced_before
    fast, fast_steps = run(engine, BATCH, "ff", fast_forward=True)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in slow]
    assert [o.outputs[0].text for o in fast] == [o.outputs[0].text for o in slow]
    assert [o.outputs[0].finish_reason for o in fast] == [o.outputs[0].finish_reason for o in slow]
    assert fast_steps < slow_steps * 0.5, (fast_steps, slow_steps)
    assert engine.core.structured.num_forced_tokens - forced_before > 40
    record = json.loads(fast[0].outputs[0].text)
    assert list(record) == KEYS and fast[0].outputs[0].finish_reason == "stop"
    assert fast[2].outputs[0].text in CHOICES
    assert fast[4].outputs[0].text.endswith("-constant-") and fast[4].outputs[0].stop_reason == "suffix"
    with_logprobs = fast[5].outputs[0]  # not fast-forwarded: each token has its logprob
    assert len(with_logprobs.logprobs) == len(with_logprobs.token_ids)


def test_forced_tokens_are_recomputed_after_preemption(engine):
    reference, _ = run(engine, [BATCH[0]], "ref", fast_forward=True)
    engine.add_request("pre", *BATCH[0])
    sched = engine.scheduler
    while not any(r.num_forced_tokens and r.num_computed_tokens > r.num_prompt_tokens for r in sched.running):
        engine.step()
    req = sched.running[0]
    assert is_decode(req) and req.num_tokens - req.num_computed_tokens == 1 + req.num_forced_tokens
    hits = sched.pool.hits
    sched.running.remove(req)
    sched._preempt(req)  # as the scheduler does when blocks run out
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert outputs[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert outputs[0].metrics.num_preemptions == 1
    assert sched.pool.hits > hits  # its full blocks, forced tokens included, came back from the prefix cache


def test_scheduler_feeds_forced_tokens_as_one_decode_and_keeps_blocks_exact():
    """A fake runner whose requests get 0-6 forced tokens after each sample, in a pool tight enough to
    preempt: a decode's forced tokens go in one chunk, outside the prefill slots, and every block is
    accounted for."""
    rng = random.Random(7)
    config = SobrioConfig.from_kwargs(block_size=8, max_num_batched_tokens=48, long_prefill_token_threshold=8,
                                      max_num_partial_prefills=1)
    sched = Scheduler(config, num_blocks=24)
    for i in range(10):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randint(3, 30))]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=40), 40))
    multi = 0
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        before = {r.request_id: (is_decode(r), r.num_tokens - r.num_computed_tokens) for r in sched.running}
        out = sched.schedule()
        check_invariants(sched)
        for req, n in out.scheduled:
            decode, remaining = before.get(req.request_id, (False, 0))
            if decode and n == remaining:
                multi += n > 1
            assert not decode or n <= remaining
        for req in sched.update_after_step(out):
            sched.append_token(req, rng.randrange(1, 50))
            req.num_forced_tokens = 0
            for _ in range(rng.randint(0, 6)):
                if req.status.finished:
                    break
                sched.append_token(req, rng.randrange(1, 50))
                req.num_forced_tokens += 1
    assert not sched.has_unfinished() and sched.num_preemptions > 0 and multi > 10
    assert sched.pool.num_free == sched.pool.num_blocks


def test_sole_token():
    import torch

    row = torch.zeros(4, dtype=torch.int32)
    assert sole_token(row) is None
    row[2] = 1 << 5
    assert sole_token(row) == 69
    row[3] = -(1 << 31)  # bit 31: the sign
    assert sole_token(row) is None
    row[2] = 0
    assert sole_token(row) == 127
    row[3] = 3
    assert sole_token(row) is None


def test_max_tokens_inside_forced_tokens_finishes_with_length(engine):
    """A grammar that cannot finish within max_tokens ends with "length", never a complete claim, whether
    max_tokens falls inside a forced run (here before any forward: the first key is forced) or not."""
    batch = [("Record:", params(json=SCHEMA, max_tokens=3)), ("Record:", params(json=SCHEMA, max_tokens=13)),
             ("Code:", params(regex=r"[a-z]{40}", max_tokens=6))]
    slow, _ = run(engine, batch, "len-tbt", fast_forward=False)
    fast, _ = run(engine, batch, "len-ff", fast_forward=True)
    for a, b, (_, p) in zip(fast, slow, batch):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == "length" and len(a.outputs[0].token_ids) == p.max_tokens
    with pytest.raises(json.JSONDecodeError):
        json.loads(fast[1].outputs[0].text)


def _slow_compiles(monkeypatch, engine, marker: str, seconds: float, timeout: float) -> None:
    """Grammars containing `marker` take `seconds` to compile; the core gives up after `timeout`."""
    compiler = engine.core.structured.compiler
    build = compiler._build

    def slow(tokenizer, p):
        if marker in str(p.spec[1]):
            time.sleep(seconds)
        return build(tokenizer, p)

    monkeypatch.setattr(compiler, "_build", slow)
    monkeypatch.setattr(engine.core.structured, "compile_timeout", timeout)


def test_compile_timeout_and_limits_fail_the_request_alone(engine, monkeypatch):
    run(engine, [("Pick one:", params(choice=CHOICES))], "warm", fast_forward=True)  # the tokenizer is built
    # a timeout that leaves the lexer-limit compile below time to fail on its own, with the other core busy
    _slow_compiles(monkeypatch, engine, "slowpoke", seconds=5.0, timeout=1.5)
    lark = "start: " + " | ".join(f"T{i}" for i in range(3000)) + "\n" + "\n".join(
        f"T{i}: /[a-z]{{{i % 50 + 1},{i % 97 + 60}}}x{i}[0-9]+/" for i in range(3000))
    with pytest.raises(InvalidRequestError, match="too many expressions"):  # the front compiles it now (issue 40)
        engine.add_request("bound-lark", "Word:", params(grammar=lark))
    batch = [("Code:", params(regex="slowpoke[0-9]+")), ("The capital of France is", params(max_tokens=8))]
    start = time.monotonic()
    outs, _ = run(engine, batch, "bound", fast_forward=True)
    assert outs[0].metrics.finished_time - start < 4.0  # failed at the timeout, not once the compile ended
    assert outs[0].outputs[0].finish_reason == "error" and "longer than 1.5 s" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "length" and outs[1].error is None
    after, _ = run(engine, [("Pick one:", params(choice=CHOICES))], "after", fast_forward=True)  # a fresh worker
    assert after[0].outputs[0].text in CHOICES


def test_schema_bomb_is_refused_in_milliseconds(smollm2):
    """allOf of anyOfs: 2^20 alternatives once distributed; llguidance's size limit stops it."""
    bomb = {"allOf": [{"anyOf": [{"type": "object", "required": [f"a{i}"]}, {"type": "object", "required": [f"b{i}"]}]}
                      for i in range(20)]}
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match="too large"):
        smollm2.generate("x", params(json=bomb), use_tqdm=False)
    assert time.monotonic() - start < 2


def test_http_400_on_compile_timeout_and_metrics(smollm2, monkeypatch):
    from sobrio.engine.async_llm import AsyncLLM
    from sobrio.server.app import create_app

    _slow_compiles(monkeypatch, smollm2.engine, "slowpoke", seconds=1.0, timeout=0.2)
    client = AsyncLLM(smollm2.engine)
    model = client.model_name
    app = create_app({model: client})

    async def calls() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            body = {"model": model, "prompt": "Code:", "max_tokens": 8, "structured_outputs": {"regex": "slowpoke1"}}
            plain = await http.post("/v1/completions", json=body)
            streamed = await http.post("/v1/completions", json={**body, "stream": True,
                                                                  "structured_outputs": {"regex": "slowpoke2"}})
            body = {**body, "max_tokens": 16, "structured_outputs": {"choice": CHOICES}}
            ok = [await http.post("/v1/completions", json=body) for _ in range(2)]  # a miss, then a cache hit
            return [plain, streamed, ok[1], await http.get("/metrics")]

    try:
        plain, streamed, ok, metrics = asyncio.run(calls())
    finally:
        client.shutdown()
    assert plain.status_code == 400, plain.text
    error = plain.json()["error"]
    assert error["type"] == "invalid_request_error" and "longer than 0.2 s" in error["message"]
    assert streamed.status_code == 200 and '"invalid_request_error"' in streamed.text
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in CHOICES
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.text.splitlines()
              if line.startswith("sobrio:structured_output") and f'model_name="{model}"' in line}
    for name in ("requests_total", "forced_tokens_total", "grammar_cache_hits_total", "grammar_cache_misses_total",
                 "grammar_compile_seconds_count"):
        assert values[f"sobrio:structured_output_{name}"] > 0, name
    assert "sobrio:structured_output_grammar_compile_seconds_bucket" in values
