"""A decode step's layer matmuls on int8 VNNI codes, by batch: wall ms of a real model's layer matmuls (by
default Llama-3.2-1B's: 16 layers of qkv 2048->3072, o 2048->2048, gate_up 2048->16384, down 8192->2048; `--shape`
takes any of `peers/real_shapes.py`'s), each matrix distinct so that it comes from memory as in a step, with
`--quantization int8`'s activation groups (`quantization.VNNI_INPUT_GROUPS`: 256 inputs, a down_proj's 64). Wall
time, best and median of 7: from a few rows on, a step is both memory-bound (the first pass over each tile of
weights) and compute-bound (the later passes), so time is what counts.

    .venv/bin/python benchmarks/vnni_decode_rows.py [--rows 1,4,8,16,32] [--shape qwen2.5-3b]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from quantization_start import avx512_flags, cpu_name  # noqa: E402
from real_shapes import SHAPES as MODELS  # noqa: E402
from real_shapes import hf_config, parameter_shapes  # noqa: E402
from vnni_prompt_rows import codes  # noqa: E402

from sobrio.layers import vnni  # noqa: E402
from sobrio.layers.cpu_ops import cpu_ops  # noqa: E402
from sobrio.layers.quantization import VNNI_INPUT_GROUPS  # noqa: E402


def layer_shapes(model: str) -> tuple[int, list[tuple[int, int]]]:
    """The model's layer count and a layer's (out, in) matmuls as sobrio fuses them: qkv, o, gate_up, down
    (the shapes of transformers' own model of `peers/real_shapes.py`'s config)."""
    config = hf_config(model)
    shapes = {name.removeprefix("model.layers.0.").removesuffix("_proj.weight"): shape
              for name, shape in parameter_shapes(config).items() if name.startswith("model.layers.0.")}
    q, k, v, o = (shapes[f"self_attn.{p}"] for p in "qkvo")
    gate, up, down = (shapes[f"mlp.{p}"] for p in ("gate", "up", "down"))
    return config.num_hidden_layers, [(q[0] + k[0] + v[0], q[1]), tuple(o), (gate[0] + up[0], gate[1]), tuple(down)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,8,16,32", help="batch sizes, comma-separated (default: %(default)s)")
    parser.add_argument("--shape", default="llama3.2-1b", choices=sorted(MODELS), help="default: %(default)s")
    args = parser.parse_args()
    ops = cpu_ops()
    count, shapes = layer_shapes(args.shape)
    groups = [VNNI_INPUT_GROUPS["down_proj"] if k > n else VNNI_INPUT_GROUPS["int8"] for n, k in shapes]
    layers = [[codes(n, k, 8, g, channel=True) for (n, k), g in zip(shapes, groups)] for _ in range(count)]
    megabytes = sum(w.weight.numel() for layer in layers for w in layer) / 1e6
    print(f"{cpu_name()} ({avx512_flags()}), {torch.get_num_threads()} threads; {args.shape}: {megabytes:.0f} MB of "
          "int8 codes")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, k).bfloat16() for _, k in shapes]

        def step(xs=xs) -> None:
            for layer in layers:
                for x, w in zip(xs, layer):
                    ops.vnni_linear(x, w.weight, w.scales, w.offsets, w.out_features, w.bits, w.group_size,
                                    w.code_zero, 8, None, vnni.NO_DENSE_ROWS)

        step()
        times = []
        for _ in range(7):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1000)
        print(f"rows {rows:>3}: {min(times):6.1f} ms best, {statistics.median(times):6.1f} ms median")


if __name__ == "__main__":
    main()
