"""Each supported family at a published model's widths (a few layers, random bf16 weights written by
transformers): sobrio's greedy tokens against transformers, on the same weights, in the dtype a user serves.

The tests compare every family token for token in float32 at tiny widths; this is the check at real widths,
where the bf16 kernels (AMX tiles, VNNI codes, blocked GEMV) take other paths by shape (head dims of 96, 128
and 256, 2 kv heads, vocabularies past 150,000, 128 experts). In bf16 greedy tokens may differ where two
logits lie within bf16's rounding, so each of sobrio's tokens is scored against transformers in float32,
teacher-forced on sobrio's own sequence: its margin is (best logit - the logit of sobrio's token) in units of
that row's standard deviation. Transformers' own bf16 model, scored the same way on the same sequences, shows
the margin rounding alone gives; a wrong kernel shows as agreement far below it and margins of whole units.

    .venv/bin/python benchmarks/families_at_width.py [--shapes qwen3-4b gemma2-2b ...] [--layers 2]
        [--quantization int8] [--out /tmp/sobrio-widths]
"""

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# family -> (model_type, the published config's fields that set the widths; windows shortened to 128 so the
# prompts cross them)
SHAPES = {
    "llama3.2-3b": ("llama", dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
                                  num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True,
                                  rope_theta=5e5)),
    "qwen3-4b": ("qwen3", dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                               rope_theta=1e6)),
    "gemma2-2b": ("gemma2", dict(hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
                                 num_key_value_heads=4, head_dim=256, vocab_size=256000, sliding_window=128,
                                 query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                                 final_logit_softcapping=30.0)),
    "gemma3-1b": ("gemma3_text", dict(hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
                                      num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=128,
                                      query_pre_attn_scalar=256, tie_word_embeddings=True)),
    "phi3-mini": ("phi3", dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
                               num_key_value_heads=32, vocab_size=32064, sliding_window=2047)),
    "mistral-7b-window": ("mistral", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                          num_key_value_heads=8, vocab_size=32768, sliding_window=128)),
    "glm4-9b": ("glm4", dict(hidden_size=4096, intermediate_size=13696, num_attention_heads=32,
                             num_key_value_heads=2, head_dim=128, vocab_size=151552, partial_rotary_factor=0.5,
                             attention_bias=True)),
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                                        num_experts=128, num_experts_per_tok=8, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128, vocab_size=151936,
                                        norm_topk_prob=True, decoder_sparse_step=1)),
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                     num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8,
                                     vocab_size=32000)),
}
PROMPT_LENGTHS = (300, 37)  # past the shortened windows, and one short prompt in the same batch
NEW_TOKENS = 12


def write_checkpoint(folder: Path, shape: str, layers: int) -> Path:
    """The shape's random bf16 checkpoint (norm weights away from 0 and 1, as the tests' tiny ones) and the
    tests' word-level tokenizer, unless `folder` already holds it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.model.tiny_checkpoints import spread_norms, tokenizer

    if (folder / "config.json").exists():
        return folder
    model_type, fields = SHAPES[shape]
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, num_hidden_layers=layers, max_position_embeddings=4096,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0, **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    spread_norms(model, model_type)
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def sobrio_greedy(folder: Path, prompts: list[list[int]], quantization: str | None) -> list[list[int]]:
    from sobrio import LLM, SamplingParams

    kwargs = dict(max_model_len=1024, kv_cache_memory=200_000_000)
    if quantization:
        kwargs.update(quantization=quantization, quantization_cache="off")
    with LLM(str(folder), **kwargs) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def scores(reference, other, prompts: list[list[int]],
           generated: list[list[int]]) -> tuple[int, int, float, int, float]:
    """(tokens, sobrio's argmax agreements, its worst margin, transformers bf16's agreements, its worst margin)
    against `reference` (float32), all teacher-forced on sobrio's sequences."""
    total = agree = other_agree = 0
    worst = other_worst = 0.0
    with torch.no_grad():
        for prompt, tokens in zip(prompts, generated):
            ids = torch.tensor([prompt + tokens])
            rows = slice(len(prompt) - 1, len(prompt) - 1 + len(tokens))
            ref, low = reference(ids).logits[0, rows], other(ids).logits[0, rows].float()
            for row, low_row, token in zip(ref, low, tokens):
                spread = row.std().item()
                worst = max(worst, (row.max() - row[token]).item() / spread)
                other_token = low_row.argmax().item()
                other_worst = max(other_worst, (row.max() - row[other_token]).item() / spread)
                agree += int(row.argmax().item() == token)
                other_agree += int(row.argmax().item() == other_token)
                total += 1
    return total, agree, worst, other_agree, other_worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES),
                        help="the families' shapes to check (default: all)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers a checkpoint has (default 2)")
    parser.add_argument("--quantization", help="as `sobrio serve --quantization` (default none)")
    parser.add_argument("--out", default="/tmp/sobrio-widths", help="where the checkpoints go")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    for shape in args.shapes:
        start = time.monotonic()
        folder = write_checkpoint(Path(args.out) / f"{shape}-{args.layers}", shape, args.layers)
        generated = sobrio_greedy(folder, prompts, args.quantization)
        gc.collect()
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        total, agree, worst, bf16_agree, bf16_worst = scores(reference, bf16, prompts, generated)
        del reference, bf16
        gc.collect()
        print(f"{shape} ({args.layers} layers, quantization {args.quantization or 'none'}): sobrio's argmax "
              f"agrees {agree}/{total}, worst margin {worst:.4f} sd; transformers bf16 {bf16_agree}/{total}, "
              f"{bf16_worst:.4f} sd ({time.monotonic() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
