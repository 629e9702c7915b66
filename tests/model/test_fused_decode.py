"""The fused decode (models/fused_decode.py): a pure decode step through the C++ `FusedDecoder` gives the
hidden states and logits of the same step through the modules, bitwise, on SmolLM2's GGUF computed on its
own blocks, on SmolLM2 in bf16 (oneDNN's packed copies) and in int8 on AMX, and on tiny checkpoints of the
Llama-like and Gemma families; and it stands aside for every step and model it does not cover."""

import pytest
import torch

from sobrio import LLM, SamplingParams
from sobrio.layers.cpu_ops import amx_int8_available
from sobrio.layers.linear import AMX_MAX_ROWS, blocked_max_rows, one_copy_layout
from sobrio.layers.vnni import usable
from sobrio.loader.resolve import resolve_model
from sobrio.models import fused_decode
from tests.conftest import engine_kwargs

needs_vnni = pytest.mark.skipif(not usable(32), reason="the fused decode on VNNI codes needs AVX512-VNNI")
needs_blocked = pytest.mark.skipif(not one_copy_layout(), reason="bf16 Linears here keep a plain weight beside "
                                   "oneDNN's copy (no few-row kernel reads its layout): the modules decode")

PROMPTS = [[300 + i for i in range(n)] for n in (5, 37, 130)]  # ragged contexts, one spanning several blocks


class CountingDecoder:
    """Delegates to the C++ decoder, counting the steps it computed."""

    def __init__(self, decoder):
        self.decoder, self.calls = decoder, 0

    def forward(self, *args):
        self.calls += 1
        return self.decoder.forward(*args)


def run_both_ways(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list, int]:
    """Generate greedily; every pure decode step is computed by the fused decode, then again by the modules
    on the same inputs (rewriting the same KV slots with the same values). Returns [(fused hidden, modules'
    hidden, fused logits, modules' logits)] per such step, and how many steps the fused decode computed."""
    runner = llm.engine.runner
    fused = runner.model.model.fused_decode
    assert fused is not None
    counting = fused.decoder = CountingDecoder(fused.decoder)
    run, pairs = runner.run, []

    def run_twice(step, prompt_logprobs=None):
        logits = run(step, prompt_logprobs)
        if len(step.input_ids) == len(step.context_lens):  # one new token per sequence
            hidden = runner.sampled_hidden.clone()
            runner.model.model.fused_decode = None
            try:
                reference = run(step, prompt_logprobs)
            finally:
                runner.model.model.fused_decode = fused
            pairs.append((hidden, runner.sampled_hidden.clone(), logits, reference))
        return logits

    runner.run = run_twice
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    finally:
        runner.run = run
        fused.decoder = counting.decoder
    return pairs, counting.calls


def assert_bitwise_equal(pairs: list) -> None:
    """Each step's fused hidden states and logits equal the modules', bit for bit."""
    for hidden, reference_hidden, logits, reference_logits in pairs:
        assert torch.equal(hidden, reference_hidden)
        assert torch.equal(logits, reference_logits)


@needs_vnni
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_fused_decode_equals_the_modules(kv_cache_dtype: str) -> None:
    path = str(resolve_model("smollm2-135m").path)
    llm = LLM(path, quantization="gguf", **engine_kwargs(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype))
    pairs, calls = run_both_ways(llm, PROMPTS, max_tokens=12)
    assert len(pairs) >= 10 and calls == len(pairs)  # every decode step went through the C++ decoder
    assert any(h.shape[0] == len(PROMPTS) for h, *_ in pairs)  # batched steps among them
    assert_bitwise_equal(pairs)


@needs_vnni
def test_fused_decode_equals_the_modules_past_the_dense_row_count() -> None:
    """A decode batch of `dense_min_rows` sequences or more takes the dense matmul in the fused decode as in
    the modules (both pass the same switch to the operator they call)."""
    from sobrio.layers import vnni

    batch = vnni.dense_min_rows(16) + 2  # gguf's 16-bit activations
    llm = LLM(str(resolve_model("smollm2-135m").path), quantization="gguf",
              **engine_kwargs(dtype="bfloat16", max_num_seqs=batch))
    pairs, calls = run_both_ways(llm, [[300 + i, 7 + i, 900] for i in range(batch)], max_tokens=3)
    assert calls == len(pairs) >= 2 and any(h.shape[0] == batch for h, *_ in pairs)
    assert_bitwise_equal(pairs)


@needs_vnni
def test_fused_decode_stands_aside_where_it_does_not_cover(smollm2, monkeypatch) -> None:
    """A float32 model's projections are neither VNNI codes nor packed bf16: no fused decode. On a covered
    model, a step with a prompt takes the modules; a forward hook (which it would step past) or
    SOBRIO_DISABLE_FUSED_DECODE=1 means none is built."""
    assert smollm2.engine.runner.model.model.fused_decode is None
    llm = LLM(str(resolve_model("smollm2-135m").path), quantization="gguf", **engine_kwargs())
    model = llm.engine.runner.model
    fused = model.model.fused_decode
    counting = fused.decoder = CountingDecoder(fused.decoder)
    llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert counting.calls == 0  # one step: the prompt
    llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert counting.calls == 2  # the prompt (cached but its last token), then two decode steps
    assert fused_decode.build(model) is not None
    monkeypatch.setenv("SOBRIO_DISABLE_FUSED_DECODE", "1")
    assert fused_decode.build(model) is None
    monkeypatch.delenv("SOBRIO_DISABLE_FUSED_DECODE")
    model.model.layers[3].mlp.down_proj.register_forward_hook(lambda *args: None)
    assert fused_decode.build(model) is None


@needs_vnni
def test_a_float16_model_on_vnni_codes_decodes_through_the_modules() -> None:
    """The C++ decoder's operators take float32 and bf16: a float16 model keeps the modules (built anyway,
    each of its decode steps failed, and so every request)."""
    llm = LLM(str(resolve_model("smollm2-135m").path), quantization="gguf", **engine_kwargs(dtype="float16"))
    assert llm.engine.runner.model.model.fused_decode is None
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 6 for o in out)


@needs_vnni
def test_fused_decode_honours_the_sliding_window(tmp_path) -> None:
    """A windowed Mistral (int4, so on VNNI codes) decoding past its window: the fused decode's steps equal
    the modules', whose windowed attention equals transformers (tests/model/test_families.py)."""
    from tests.model.tiny_checkpoints import FAMILIES, WINDOW, prompt, write_checkpoint

    folder = write_checkpoint(tmp_path, *FAMILIES["mistral-window"])
    llm = LLM(str(folder), quantization="int4", **engine_kwargs(dtype="bfloat16", max_model_len=256))
    assert [a.sliding_window for a in llm.engine.runner.model.attention_layers()] == [WINDOW, WINDOW]
    pairs, calls = run_both_ways(llm, [prompt(3 * WINDOW), prompt(5, seed=2)], max_tokens=2 * WINDOW)
    assert calls == len(pairs) >= 2 * WINDOW - 1
    assert_bitwise_equal(pairs)


@needs_blocked
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_bf16_fused_decode_equals_the_modules(kv_cache_dtype: str) -> None:
    """bf16, sobrio's default where the CPU has AVX512-BF16 or AMX: each projection on oneDNN's packed copy
    (`blocked_linear`), the same C++ call from the modules and from the fused decode."""
    llm = LLM(str(resolve_model("smollm2-135m").path), **engine_kwargs(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype))
    pairs, calls = run_both_ways(llm, PROMPTS, max_tokens=12)
    assert len(pairs) >= 10 and calls == len(pairs)
    assert any(h.shape[0] == len(PROMPTS) for h, *_ in pairs)
    assert_bitwise_equal(pairs)


@needs_blocked
def test_bf16_fused_decode_past_the_few_row_kernel() -> None:
    """A decode batch larger than the few-row kernel takes (4 rows on the GEMV, 64 on AMX) goes to oneDNN's GEMM
    in the fused decode as in the modules."""
    batch = AMX_MAX_ROWS + 2
    llm = LLM(str(resolve_model("smollm2-135m").path), **engine_kwargs(dtype="bfloat16", max_num_seqs=batch))
    assert blocked_max_rows(llm.engine.runner.model.model.layers[0].mlp.down_proj.blocks) < batch
    pairs, calls = run_both_ways(llm, [[300 + i, 7 + i, 900] for i in range(batch)], max_tokens=3)
    assert calls == len(pairs) >= 2 and any(h.shape[0] == batch for h, *_ in pairs)
    assert_bitwise_equal(pairs)


@pytest.mark.parametrize("family, quantization", [
    pytest.param("llama-llama3-rope", None, marks=needs_blocked),
    pytest.param("qwen2-window-bias", None, marks=needs_blocked),
    pytest.param("mistral-window", None, marks=needs_blocked),
    pytest.param("qwen3-qk-norm", None, marks=needs_blocked),
    pytest.param("qwen3-qk-norm", "int4", marks=needs_vnni),
    pytest.param("gemma2-softcap", None, marks=needs_blocked),
    pytest.param("gemma3-window", None, marks=needs_blocked),
    pytest.param("gemma3-window", "int4", marks=needs_vnni),
])
def test_fused_decode_equals_the_modules_across_families(tmp_path, family: str, quantization: str | None) -> None:
    """q/k/v biases (Qwen2), a sliding window on some layers or all (Qwen2, Mistral, Gemma), llama3's and yarn's
    rope scaling, per-head q/k norms (Qwen3, Gemma 3), four norms a layer and Gemma's (1 + weight) (Gemma 2
    and 3), a rotary base per layer type (Gemma 3), an attention softcap (Gemma 2): decoding past the window,
    the fused decode's steps equal the modules' (bf16 on oneDNN's packed copies, and on VNNI codes)."""
    from tests.model.tiny_checkpoints import EXHAUSTIVE_FAMILIES, FAMILIES, WINDOW, prompt, write_checkpoint

    model_type, fields = {**FAMILIES, **EXHAUSTIVE_FAMILIES}[family]
    if model_type == "gemma3_text":  # a local layer and a global one: a rotary base each
        fields = {**fields, "layer_types": ["sliding_attention", "full_attention"]}
    folder = write_checkpoint(tmp_path, model_type, fields)
    llm = LLM(str(folder), quantization=quantization, **engine_kwargs(dtype="bfloat16", max_model_len=256))
    pairs, calls = run_both_ways(llm, [prompt(3 * WINDOW), prompt(5, seed=2)], max_tokens=2 * WINDOW)
    assert calls == len(pairs) >= 2 * WINDOW - 1
    assert_bitwise_equal(pairs)


@pytest.mark.skipif(not amx_int8_available(), reason="int8's layers take the AMX-INT8 kernel only where it runs")
def test_int8_fused_decode_on_amx_equals_the_modules() -> None:
    """`--quantization int8` on AMX-INT8: each projection W8A8 on the tiles (a down_proj's activations rounded per
    group), the same C++ call from the modules and from the fused decode."""
    llm = LLM(str(resolve_model("smollm2-135m").path), quantization="int8", **engine_kwargs(dtype="bfloat16"))
    pairs, calls = run_both_ways(llm, PROMPTS, max_tokens=12)
    assert len(pairs) >= 10 and calls == len(pairs)
    assert_bitwise_equal(pairs)
