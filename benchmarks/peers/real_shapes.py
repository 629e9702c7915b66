"""Random-weight checkpoints of real model shapes, for side-by-side runs at size (issue 43): a Hugging Face
folder (bf16 safetensors, shards of ~2 GB, names and shapes from transformers' own model class) and GGUF
files of the same weights (Q8_0, Q4_0 or BF16, written by the `gguf` package). A forward pass costs the same
whatever the weights' values, so these time a 1B-8B model without downloading one.

The model is never built whole: transformers builds it on the meta device for its names and shapes, and the
tensors are drawn and written one shard at a time, so an 8B checkpoint (16 GB) is written on a 24 GB machine.
The tokenizer is SmolLM2's (shipped in a package; 49,152 tokens), cut to the model's vocabulary where that is
smaller (Phi-3.5-mini's 32,064, Mistral's 32,768: the BPE's first tokens and the merges among them), so no
prompt holds a token the model lacks; the GGUF's token list is padded to the model's vocabulary with unused
tokens, as llama.cpp requires. A mixture of experts' routed experts are written one matrix an expert, under the
names its published checkpoints use (transformers' own model holds them stacked).

    .venv/bin/python benchmarks/peers/real_shapes.py write llama3.2-1b [--out /tmp/sobrio-shapes] [--gguf Q8_0 Q4_0]
    .venv/bin/python benchmarks/peers/real_shapes.py path llama3.2-1b [--gguf Q8_0]   # where it is (for scripts)
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

SHAPES = {  # name -> transformers config fields (the published models' config.json values that set the cost)
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                        tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072,
                        rms_norm_eps=1e-5),
    "qwen2.5-3b": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6),
    "llama3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                        tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=131072,
                        rms_norm_eps=1e-5),
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=40960,
                       rms_norm_eps=1e-6),
    "gemma3-1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                      tie_word_embeddings=True, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                      max_position_embeddings=32768, rms_norm_eps=1e-6, sliding_window=512,
                      query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh"),
    "gemma2-2b": dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                      tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=8192, rms_norm_eps=1e-6,
                      sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh"),
    "phi3.5-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, tie_word_embeddings=False,
                        rope_theta=10000.0, max_position_embeddings=131072, original_max_position_embeddings=4096,
                        rope_scaling=dict(type="longrope", short_factor=[1.0 + 0.005 * i for i in range(48)],
                                          long_factor=[1.0 + 1.25 * i for i in range(48)]),
                        sliding_window=262144, rms_norm_eps=1e-5),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
                       tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=32768,
                       sliding_window=None, rms_norm_eps=1e-5),
    "glm4-9b": dict(model_type="glm4", hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
                    num_attention_heads=32, num_key_value_heads=2, head_dim=128, vocab_size=151552,
                    partial_rotary_factor=0.5, attention_bias=True, tie_word_embeddings=False, rope_theta=10000.0,
                    max_position_embeddings=32768, rms_norm_eps=1.5625e-07),
    "qwen1.5-moe-a2.7b": dict(model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632,
                              moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
                              num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                              num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, qkv_bias=True,
                              vocab_size=151936, tie_word_embeddings=False, rope_theta=1000000.0,
                              max_position_embeddings=8192, rms_norm_eps=1e-6),
}
# transformers' stacked experts -> the per-expert names of published checkpoints (gate, up, down)
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}
SHARD_BYTES = 2 << 30
DEFAULT_OUT = Path("/tmp/sobrio-shapes")


def hf_config(name: str):
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    fields = dict(SHAPES[name])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, torch_dtype="bfloat16")
    config.bos_token_id, config.eos_token_id = 1, 2  # SmolLM2's tokenizer's <|im_start|>, <|im_end|>
    # vLLM picks its model class by this field; without it a Qwen3 or Gemma 3 folder loads as an embedding model
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return config


def parameter_shapes(config) -> dict[str, torch.Size]:
    """The checkpoint's names and shapes, from transformers' model built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {}
    for name, p in model.state_dict().items():
        if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
            shapes.update(expert_shapes(config, name, p.shape))
        else:
            shapes[name] = p.shape
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def expert_shapes(config, name: str, stacked: torch.Size) -> dict[str, torch.Size]:
    """A stack of routed experts' matrices [experts, out, in] (gate and up joined along out) as the checkpoint
    holds them: one [out, in] matrix an expert."""
    gate, up, down = EXPERT_NAMES.get(config.model_type, ("gate_proj", "up_proj", "down_proj"))
    prefix, what = name.rsplit(".", 1)
    experts, out, inputs = stacked
    if what == "down_proj":
        return {f"{prefix}.{e}.{down}.weight": torch.Size((out, inputs)) for e in range(experts)}
    half = torch.Size((out // 2, inputs))
    return {f"{prefix}.{e}.{m}.weight": half for e in range(experts) for m in (gate, up)}


def draw(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """A tensor as an initialised model holds it: norms 1, biases small, matrices N(0, 0.02)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=generator) * (0.01 if name.endswith("bias") else 0.02)).to(torch.bfloat16)


def iter_tensors(config, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    for name, shape in parameter_shapes(config).items():
        yield name, draw(name, shape, generator)


def write_hf(name: str, folder: Path, seed: int = 0) -> Path:
    """The HF folder: config.json, SmolLM2's tokenizer files, bf16 shards and their index."""
    from safetensors.torch import save_file

    if (folder / "model.safetensors.index.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = hf_config(name)
    config.save_pretrained(tmp)
    copy_tokenizer(tmp, config.vocab_size)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    files: list[str] = []

    def flush() -> None:
        files.append(f"model-{len(files) + 1:05d}.safetensors")
        save_file(shard, str(tmp / files[-1]), metadata={"format": "pt"})
        index.update({n: files[-1] for n in shard})
        shard.clear()

    for tensor_name, tensor in iter_tensors(config, seed):
        shard[tensor_name] = tensor
        if sum(t.nbytes for t in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    total = sum((tmp / f).stat().st_size for f in files)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": index}, indent=1))
    tmp.replace(folder)
    return folder


def copy_tokenizer(folder: Path, vocab_size: int) -> None:
    from sobrio.loader.gguf import prepared_folder
    from sobrio.loader.resolve import resolve_model

    source = prepared_folder(resolve_model("smollm2-135m").path)
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / file).is_file():
            shutil.copy(source / file, folder / file)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    if len(tokenizer["model"]["vocab"]) > vocab_size:
        (folder / "tokenizer.json").write_text(json.dumps(cut_bpe(tokenizer, vocab_size), ensure_ascii=False))


def cut_bpe(tokenizer: dict, vocab_size: int) -> dict:
    """A byte-level BPE tokenizer.json keeping its tokens below `vocab_size` and the merges that make one of
    them from two of them (SmolLM2's merges are ranked as their results' ids, so the cut is a prefix)."""
    model = tokenizer["model"]
    vocab = {token: i for token, i in model["vocab"].items() if i < vocab_size}
    merges = []
    for merge in model["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        if left in vocab and right in vocab and left + right in vocab:
            merges.append(merge)
    added = [t for t in tokenizer["added_tokens"] if t["id"] < vocab_size]
    return {**tokenizer, "added_tokens": added, "model": {**model, "vocab": vocab, "merges": merges}}


def gguf_path(out: Path, name: str, qtype: str) -> Path:
    return out / f"{name}-{qtype}.gguf"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["write", "path"])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the checkpoints go (default %(default)s)")
    parser.add_argument("--gguf", nargs="*", default=[], choices=["Q8_0", "Q4_0", "BF16"],
                        help="also (write) or instead (path) the GGUF files of these types")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    folder = args.out / args.shape
    if args.action == "path":
        print(gguf_path(args.out, args.shape, args.gguf[0]) if args.gguf else folder)
        return 0
    write_hf(args.shape, folder, args.seed)
    print(folder)
    for qtype in args.gguf:
        from gguf_writer import write_gguf  # beside this script, which Python puts first on sys.path

        path = gguf_path(args.out, args.shape, qtype)
        if not path.is_file():
            write_gguf(folder, path, qtype)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
