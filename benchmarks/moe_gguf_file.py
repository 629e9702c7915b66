"""A GGUF of a mixture of experts at a published model's widths (a few layers, random weights): the
checkpoint `families_at_width.py` writes, then the same weights in one block type by the `gguf` package, with
llama.cpp's names (`tests/model/tiny_moe.py write_gguf`). For timing and sizing a GGUF load under
`--quantization gguf` without downloading one (docs/memory.md, "A GGUF mixture of experts"):

    .venv/bin/python benchmarks/moe_gguf_file.py [--shape qwen3-30b-a3b] [--layers 2] [--blocks Q4_0]
    .venv/bin/python benchmarks/quantization_start.py PRINTED_PATH --quantization gguf --starts 1 --cache off \\
        --kv-cache-memory 200000000
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from families_at_width import SHAPES, write_checkpoint  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=[s for s, (t, _) in SHAPES.items()
                                                                     if t in ("qwen3_moe", "mixtral")])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--blocks", default="Q4_0", choices=("Q4_0", "Q8_0"), help="the block type (default Q4_0)")
    parser.add_argument("--out", default="/tmp/sobrio-widths", help="where the folder and the file go")
    args = parser.parse_args()
    from tests.model.tiny_moe import write_gguf

    folder = write_checkpoint(Path(args.out) / f"{args.shape}-{args.layers}", args.shape, args.layers)
    path = Path(args.out) / f"{args.shape}-{args.layers}-{args.blocks}.gguf"
    if not path.exists():
        write_gguf(folder, path, args.blocks)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
