"""Multi-LoRA serving cost, in bf16: decode throughput of 16 requests in flight spread over 8 adapters (rank 16
on q/k/v/o and gate/up/down) against 16 requests to the base model alone (an engine without --enable-lora),
in the same run; and the first request of a newly registered adapter (each of `--fresh`) against the same
request with a resident adapter just before it, and against reading another such adapter from disk.

    .venv/bin/python benchmarks/lora.py [--model smollm2-135m] [--requests 16] [--adapters 8] [--max-tokens 32]\
        [--repeats 3] [--fresh 3]

The adapters are made here with PEFT (random non-zero lora_B) over the model's own folder; nothing is
downloaded.
"""

import argparse
import tempfile
import time
from pathlib import Path

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402
from lora_step import read_from_disk  # noqa: E402  (benchmarks/ is the script's folder)

from sobrio import LLM, SamplingParams  # noqa: E402
from sobrio.loader.load import load_model_files  # noqa: E402
from sobrio.loader.lora import LoRARequest, target_shapes  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SENTENCES = ["The cat sat on the warm mat by the window.", "Rivers carry water and sand down to the sea.",
             "In 1905 Einstein published four papers that changed physics.", "A good recipe needs fresh ingredients.",
             "She opened the old wooden door and saw", "Mountains form when tectonic plates collide."]


def bf16_checkpoint(model: str, out: Path) -> Path:
    """A random-weight bf16 checkpoint of `model`'s architecture and tokenizer (the shipped models are GGUF):
    the speed of a bf16 base does not depend on the weights' values."""
    from transformers import AutoModelForCausalLM

    files = load_model_files(model)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(files.config, dtype=torch.bfloat16).save_pretrained(out)
    files.tokenizer.save_pretrained(out)
    return out


def make_adapters(base: Path, out: Path, count: int, rank: int) -> list[Path]:
    """`count` PEFT adapters over `base`, one PEFT model with its LoRA weights drawn again for each."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    lora = [(name, param) for name, param in peft.named_parameters() if "lora_" in name]
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        with torch.no_grad():
            for name, param in lora:
                param.normal_(0.0, 0.01 if "lora_B" in name else 0.05)
        peft.save_pretrained(out / f"a{i}")
        paths.append(out / f"a{i}")
    return paths


def throughput(llm: LLM, prompts: list[str], params: SamplingParams, loras: list | None, repeats: int) -> float:
    """Generated tokens/s of the fastest of `repeats` generate calls over all prompts (on a shared host the
    best one is the least disturbed), after a short warm-up call (which also reads the adapters from disk)."""
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False, lora_request=loras)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    print(f"  {'base' if loras is None else 'adapters'}: {', '.join(f'{r:.1f}' for r in rates)} tok/s", flush=True)
    return max(rates)


def first_request(llm: LLM, fresh: list[LoRARequest], resident: LoRARequest, unread: list[LoRARequest],
                  hf_config) -> tuple[list[float], list[float], list[float]]:
    """Seconds of a 1-token request with each never-seen adapter of `fresh`, of the same request with a
    resident adapter just before each, and of reading an adapter of `unread` from disk alone just after each
    (its config checked, every tensor read into memory with safetensors): `unread` were written with `fresh`
    and never read since, so the page cache holds both alike."""
    params = SamplingParams(temperature=0, max_tokens=1)

    def once(lora: LoRARequest) -> float:
        start = time.perf_counter()
        llm.generate(SENTENCES[0], params, use_tqdm=False, lora_request=lora)
        return time.perf_counter() - start

    once(resident)  # the kernels' first call at this shape
    warm, new, disk = [], [], []
    for lora, other in zip(fresh, unread):
        warm.append(once(resident))
        new.append(once(lora))
        start = time.perf_counter()
        read_from_disk(other.lora_path, 64, hf_config.num_hidden_layers, target_shapes(hf_config))
        disk.append(time.perf_counter() - start)
    return new, warm, disk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each kind; the fastest counts")
    parser.add_argument("--fresh", type=int, default=3, help="never-seen adapters whose first request is timed")
    args = parser.parse_args()
    prompts = [" ".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(1 + i % 3)) for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    common = dict(dtype="bfloat16", kv_cache_memory=512 << 20, max_model_len=1024)
    with tempfile.TemporaryDirectory() as tmp:
        folder = bf16_checkpoint(args.model, Path(tmp) / "base")
        paths = make_adapters(folder, Path(tmp), args.adapters + 2 * args.fresh, args.rank)
        loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        base = LLM(str(folder), **common)
        base_rate = throughput(base, prompts, params, None, args.repeats)
        base.engine.core.close()
        llm = LLM(str(folder), enable_lora=True, max_loras=args.adapters, max_cpu_loras=args.adapters + args.fresh,
                  max_lora_rank=args.rank, **common)
        mixed = [loras[i % args.adapters] for i in range(args.requests)]
        lora_rate = throughput(llm, prompts, params, mixed, args.repeats)
        base_in_lora = throughput(llm, prompts, params, None, args.repeats)
        fresh, warm, disk = first_request(llm, loras[args.adapters:args.adapters + args.fresh], loras[0],
                                          loras[args.adapters + args.fresh:], llm.engine.hf_config)
    print(f"model {args.model}'s architecture, random bf16 weights, {args.requests} requests x {args.max_tokens} "
          f"tokens, torch threads "
          f"{torch.get_num_threads()}")
    print(f"base model alone (no --enable-lora):      {base_rate:8.1f} tok/s")
    print(f"{args.adapters} adapters (rank {args.rank}, 7 targets):     {lora_rate:8.1f} tok/s  "
          f"ratio {lora_rate / base_rate:.2f}x")
    print(f"base requests on the --enable-lora engine: {base_in_lora:8.1f} tok/s  "
          f"ratio {base_in_lora / base_rate:.2f}x")
    added = sorted(f - w for f, w in zip(fresh, warm))
    print(f"first request of a new adapter {_ms(fresh)}, with a resident one just before {_ms(warm)}: "
          f"+{added[len(added) // 2] * 1e3:.1f} ms (median; each +{', +'.join(f'{a * 1e3:.1f}' for a in added)}); "
          f"reading it from disk alone {_ms(disk)}")


def _ms(seconds: list[float]) -> str:
    """Median, and each, in milliseconds."""
    ordered = sorted(seconds)
    return f"{ordered[len(ordered) // 2] * 1e3:.1f} ms ({', '.join(f'{s * 1e3:.1f}' for s in seconds)})"


if __name__ == "__main__":
    main()
