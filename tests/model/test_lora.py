"""LoRA adapters (PEFT folders made at test time) over tiny random checkpoints: greedy output equals
transformers + PEFT with the adapter merged, for attention and MLP targets, on Llama and Qwen3; a batch
mixing two adapters and the base model equals each run alone (chunked prefill on); two adapters never share
prefix-cache blocks; PEFT features sobrio lacks are refused by name."""

import json
import shutil

import pytest

from sobrio import LLM, SamplingParams
from sobrio.cli import main
from sobrio.errors import ConfigError
from sobrio.loader.load import load_model_files
from sobrio.loader.lora import LoRARequest
from sobrio.lora_train import tokenize_example
from tests.conftest import engine_kwargs
from tests.model.lora_adapters import ATTENTION, CHAT_TEMPLATE, MLP, merged_greedy, write_adapter
from tests.model.tiny_checkpoints import hf_greedy, prompt, write_checkpoint

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [prompt(37, seed=1), prompt(9, seed=2)]


def _engine(folder, **kw):
    return LLM(str(folder), **engine_kwargs(max_num_batched_tokens=16, block_size=16, enable_prefix_caching=True,
                                            max_model_len=256, enable_lora=True, max_loras=3, **kw))


def _family(root, model_type: str, fields: dict):
    base = write_checkpoint(root / "base", model_type, fields)
    adapters = {"attn": write_adapter(base, root / "attn", ATTENTION, seed=1),
                "mlp": write_adapter(base, root / "mlp", MLP, seed=2, rank=4, rslora=True)}
    return base, adapters, _engine(base)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """Llama: every test. Qwen3 (q/k norms): the equality with transformers + PEFT."""
    built = _family(tmp_path_factory.mktemp("llama"), "llama", {})
    yield built
    built[2].engine.core.close()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    built = _family(tmp_path_factory.mktemp("qwen3"), "qwen3", {})
    yield built
    built[2].engine.core.close()


@pytest.mark.parametrize("name", ["family", "qwen3"], ids=["llama", "qwen3"])
def test_greedy_equals_transformers_with_the_adapter_merged(name, request):
    base, adapters, llm = request.getfixturevalue(name)
    for i, (target, path) in enumerate(adapters.items()):
        lora = LoRARequest(target, i + 1, str(path))
        for p in PROMPTS:
            got = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False, lora_request=lora)[0]
            assert got.outputs[0].token_ids == merged_greedy(base, path, p, MAX_TOKENS), f"{target}, {len(p)} tokens"


def test_a_batch_of_two_adapters_and_the_base_equals_each_alone(family):
    base, adapters, llm = family
    loras = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())] + [None]
    alone = [llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False, lora_request=lora)[0]
             for lora in loras]
    assert alone[2].outputs[0].token_ids == hf_greedy(base, PROMPTS[0], MAX_TOKENS, ignore_eos=True)
    assert len({tuple(o.outputs[0].token_ids) for o in alone}) == 3, "the adapters change nothing"
    mixed = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 3, GREEDY, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]


def test_two_adapters_never_share_prefix_cache_blocks(family):
    _, adapters, llm = family
    p = prompt(40, seed=7)  # two full blocks of 16
    a, b = (LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items()))
    cached = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False, lora_request=lora)[0].num_cached_tokens
              for lora in (a, b, None, a, b)]
    assert cached == [0, 0, 0, 32, 32]


def test_ngram_speculation_keeps_the_adapters_output_and_model_drafts_are_refused(family):
    base, adapters, llm = family
    lora = LoRARequest("attn", 1, str(adapters["attn"]))
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    spec = _engine(base, speculative_config=ngram)
    repetitive = PROMPTS[1] * 4
    for engine in (llm, spec):
        engine.outs = engine.generate({"prompt_token_ids": repetitive}, GREEDY, use_tqdm=False, lora_request=lora)
    assert spec.outs[0].outputs[0].token_ids == llm.outs[0].outputs[0].token_ids
    spec.engine.core.close()
    with pytest.raises(ConfigError, match="layer_skip"):
        _engine(base, speculative_config={"method": "layer_skip", "num_speculative_tokens": 2})


def test_train_lora_writes_an_adapter_sobrio_serves_as_peft_merged(family, tmp_path):
    """`sobrio train-lora` on the tiny base (a chat template added): the loss counts assistant tokens only, and
    the trained adapter's greedy output in sobrio equals transformers + PEFT with it merged."""
    base, _, llm = family
    chat_base = tmp_path / "chat-base"
    shutil.copytree(base, chat_base)
    (chat_base / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    rows = [{"messages": [{"role": "user", "content": f"w{10 + i} w{11 + i}"},
                          {"role": "assistant", "content": f"w{200 + i} w{300 + i} w{400 + i}"}]} for i in range(6)]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    ids, labels = tokenize_example(load_model_files(str(chat_base)).tokenizer, rows[0]["messages"], 64)
    assert [t for t, lab in zip(ids, labels) if lab != -100] == [200, 300, 400, 5]  # the answer and its end
    out = tmp_path / "adapter"
    assert main(["train-lora", str(chat_base), str(tmp_path / "data.jsonl"), str(out), "--epochs", "1", "--lr",
                 "0.05", "--batch-size", "2", "--rank", "4"]) == 0
    lora = LoRARequest("trained", 9, str(out))
    got = llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY, use_tqdm=False, lora_request=lora)[0]
    assert got.outputs[0].token_ids == merged_greedy(base, out, PROMPTS[1], MAX_TOKENS)
    assert got.outputs[0].token_ids != hf_greedy(base, PROMPTS[1], MAX_TOKENS, ignore_eos=True), "training did nothing"
