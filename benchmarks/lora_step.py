"""What LoRA adds to one decode step and what placing a new adapter costs, without an engine: the wrapped
q/k/v, o, gate/up and down modules of a model's architecture (random bf16 weights) at `--rows` rows spread
over `--adapters` adapters of rank `--rank` on all seven targets, against the same modules without adapters;
and a new adapter's load into its slot (the engine core's `RunnerAdapters`) against reading it from disk.
One thread, thread CPU time, the best of `--repeats`: on a shared host other jobs' load counts less than in
`benchmarks/lora.py`, which times the whole engine.

    .venv/bin/python benchmarks/lora_step.py [--model smollm2-135m] [--rows 16] [--adapters 8] [--rank 16]
"""

import argparse
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from sobrio.engine.lora import RunnerAdapters  # noqa: E402
from sobrio.layers.linear import Linear  # noqa: E402
from sobrio.loader.load import load_model_files  # noqa: E402
from sobrio.loader.lora import (  # noqa: E402
    ATTENTION_TARGETS,
    LoRARequest,
    check_adapter,
    target_shapes,
)
from sobrio.models.weights import PackedLinear  # noqa: E402


def layers_of(shapes: dict[str, tuple[int, int]], count: int) -> torch.nn.ModuleList:
    """`count` layers holding only the four projection modules, random bf16 weights packed as the engine's."""
    layers = torch.nn.ModuleList()
    hidden, inter = shapes["q_proj"][1], shapes["down_proj"][1]
    for _ in range(count):
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
        modules = {"qkv_proj": PackedLinear(hidden, [shapes[t][0] for t in ("q_proj", "k_proj", "v_proj")], False),
                   "o_proj": Linear(shapes["o_proj"][1], hidden, bias=False),
                   "gate_up_proj": PackedLinear(hidden, [inter, inter], False),
                   "down_proj": Linear(inter, hidden, bias=False)}
        for name, module in modules.items():
            torch.nn.init.normal_(module.weight, std=0.02)
            module.to(torch.bfloat16).prepack()
            setattr(layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp, name, module)
        layers.append(layer)
    return layers


def write_adapter(folder: Path, shapes: dict[str, tuple[int, int]], layers: int, rank: int, seed: int) -> Path:
    """A PEFT folder (as `save_pretrained` writes it) with random bf16 A and B on all seven targets."""
    torch.manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for target, (out_f, in_f) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{'self_attn' if target in ATTENTION_TARGETS else 'mlp'}"
            tensors[f"{prefix}.{target}.lora_A.weight"] = (torch.randn(rank, in_f) * 0.05).bfloat16()
            tensors[f"{prefix}.{target}.lora_B.weight"] = (torch.randn(out_f, rank) * 0.01).bfloat16()
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(shapes), "bias": "none"}))
    return folder


def read_from_disk(path: str, rank: int, layers: int, shapes: dict[str, tuple[int, int]]) -> None:
    """The adapter checked and every tensor read into memory of its own, with safetensors (as a model's weights
    are commonly read; it maps the file, so every tensor is copied out: untouched pages are never read)."""
    check_adapter(path, rank, layers, shapes)
    with safe_open(str(Path(path) / "adapter_model.safetensors"), framework="pt") as f:
        for name in f.keys():
            f.get_tensor(name).clone()


def best(fn, repeats: int) -> float:
    """Seconds of thread CPU time of the fastest of `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hf_config = load_model_files(args.model).config
    shapes, count = target_shapes(hf_config), hf_config.num_hidden_layers
    layers = layers_of(shapes, count)
    runner = RunnerAdapters(SimpleNamespace(model=SimpleNamespace(layers=layers, fused_decode=None)), hf_config,
                            torch.bfloat16, args.rank, args.adapters + 1)
    inputs = {"qkv_proj": shapes["q_proj"][1], "o_proj": shapes["o_proj"][1], "gate_up_proj": shapes["q_proj"][1],
              "down_proj": shapes["down_proj"][1]}
    x = {name: torch.randn(args.rows, width).bfloat16() for name, width in inputs.items()}

    @torch.inference_mode()
    def step() -> None:
        for layer in layers:
            for block in (layer.self_attn, layer.mlp):
                for name, module in block.named_children():
                    module(x[name])

    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", shapes, count, args.rank, i)))
                 for i in range(args.adapters + 1)]
        loads = []
        for lora in loras[:args.adapters]:
            start = time.thread_time()
            runner.prepare([lora], [1])
            loads.append(time.thread_time() - start)
        runner.prepare([None] * args.rows, [1] * args.rows)
        base = best(step, args.repeats)
        runner.prepare([loras[i % args.adapters] for i in range(args.rows)], [1] * args.rows)
        lora = best(step, args.repeats)
        fresh = loras[-1]
        check = best(lambda: check_adapter(fresh.lora_path, args.rank, count, shapes), 5)
        read = best(lambda: read_from_disk(fresh.lora_path, args.rank, count, shapes), 5)
        start = time.thread_time()
        runner.prepare([fresh], [1])
        load = time.thread_time() - start
    print(f"{args.model}'s shapes, {count} layers, {args.rows} rows over {args.adapters} adapters of rank {args.rank} "
          "on all 7 targets, bf16, one thread, thread CPU time")
    print(f"the wrapped modules' step: base alone {base * 1e3:.2f} ms, with the adapters {lora * 1e3:.2f} ms "
          f"(+{(lora - base) * 1e3:.2f} ms, {base / lora:.2f}x)")
    print(f"a new adapter: read from disk (checked, every tensor copied) {read * 1e3:.1f} ms; the front's check "
          f"{check * 1e3:.1f} ms; the engine core's load into its slot {load * 1e3:.1f} ms (the first {args.adapters}: "
          f"{', '.join(f'{t * 1e3:.0f}' for t in loads)} ms)")


if __name__ == "__main__":
    main()
