"""How far the prompt-size matmuls sit from Intel AMX's own limits on this machine, in one run: the tile
products' rate with their operands already in tiles (the compute peak), then with the four tiles of each
2x2 step loaded from a buffer that fits L1, L2 or only L3 (how fast the caches feed the tiles), against
oneDNN's bf16 GEMM (what a bf16 Linear runs past 64 rows), sobrio's AMX-INT8 kernel (`--quantization
int8`) and `torch._int_mm` at Llama-3.2-1B's four matmuls with 2,048 rows (a prompt chunk).

Prints TFLOP/s (TOPS for int8) and each GEMM's share of the tile peak of its type (the faster of the
products in tiles and fed from L1). The tile loops are a small
inline extension built at the first run (about 30 s). Needs AMX (an Intel Xeon from Sapphire Rapids on).

    .venv/bin/python benchmarks/amx_tile_peak.py [--rows 2048] [--repeats 5]
"""

import argparse
import pathlib

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402
from kernel_timing import best_times  # noqa: E402  (benchmarks/ is on the path when a script here runs)
from torch.utils.cpp_extension import load_inline  # noqa: E402

import sobrio.csrc  # noqa: E402
from sobrio.layers.cpu_ops import amx_available, amx_int8_available, cpu_ops  # noqa: E402
from sobrio.layers.quantization import AMX_ACT_GROUP, quantize_weight  # noqa: E402
from sobrio.memory import reuse_step_buffers  # noqa: E402

SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # (out, in): qkv, o, gate_up, down

TILE_LOOPS = r"""
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <vector>
#include "amx.h"

// `iters` 2x2 steps (4 tile products into tiles 0-3) on each thread; `bytes` 0: no loads (operands stay in
// tiles 4-7), else the four operand tiles of each step loaded from the next 4 KB of a buffer that size.
void tile_steps(int64_t iters, bool int8, int64_t bytes, int64_t threads) {
  sobrio_amx::request_amx();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<char> storage(bytes + 8192);
    char* buf = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(storage.data()) + 4095) & ~uintptr_t(4095));
    for (int64_t i = 0; i < bytes + 4096; i += 64) buf[i] = 0;
    sobrio_amx::configure_tiles();
    _tile_loadd(4, buf, 64); _tile_loadd(5, buf, 64); _tile_loadd(6, buf, 64); _tile_loadd(7, buf, 64);
    sobrio_amx::zero_tiles();
    int64_t off = 0;
    for (int64_t i = 0; i < iters; ++i) {
      if (bytes) {
        _tile_loadd(4, buf + off, 64);
        _tile_loadd(5, buf + off + 1024, 64);
        _tile_loadd(6, buf + off + 2048, 64);
        _tile_loadd(7, buf + off + 3072, 64);
        off = off + 4096 >= bytes ? 0 : off + 4096;
      }
      if (int8) {
        _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
      } else {
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, buf, 64);
    _tile_release();
  });
}
"""


def tile_loops():
    include = str(pathlib.Path(sobrio.csrc.__file__).parent)  # amx.h
    return load_inline("sobrio_amx_tile_peak", cpp_sources=[TILE_LOOPS], functions=["tile_steps"],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                       extra_include_paths=[include])


def tile_rate(ext, int8: bool, bytes_: int, threads: int, iters: int = 400_000) -> float:
    """Tile products a second times their operations (2 x 16 x 16 x 32 bf16 or x 64 int8 each), best of 5
    (a host's hiccup shows as one slow pass)."""
    ext.tile_steps(1000, int8, bytes_, threads)
    steps = {"steps": lambda _: ext.tile_steps(iters, int8, bytes_, threads)}
    best = best_times(steps, None, repeats=5, threads=threads)["steps"]
    return threads * iters * 4 * 2 * 16 * 16 * (64 if int8 else 32) / best


def gemm_rates(rows: int, repeats: int) -> dict[str, float]:
    """oneDNN bf16 (weight packed for `rows`), the AMX-INT8 kernel and torch._int_mm over the four matmuls,
    operations a second, each the best of `repeats` passes, the kernels interleaved."""
    calls: dict[str, list] = {"oneDNN bf16": [], "AMX int8": [], "torch._int_mm": []}
    for i, (n, k) in enumerate(SHAPES):
        w = torch.randn(n, k, dtype=torch.bfloat16)
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        q, scale = quantize_weight(w, w.dtype)
        tiles, scale = cpu_ops().amx_pack_weight_int8(q), scale.float()
        group = AMX_ACT_GROUP if i == len(SHAPES) - 1 else 0  # the down_proj's inputs per group, as the engine's
        xq, qt = torch.randint(-127, 127, (rows, k), dtype=torch.int8), q.t()
        calls["oneDNN bf16"].append(lambda x=x, p=packed:
                                    torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
        calls["AMX int8"].append(lambda x=x, t=tiles, s=scale, n=n, g=group:
                                 cpu_ops().amx_int8_linear(x, t, s, n, group_k=g))
        calls["torch._int_mm"].append(lambda a=xq, b=qt: torch._int_mm(a, b))
    ops = 2 * rows * sum(n * k for n, k in SHAPES)
    kernels = {name: lambda _, fns=fns: [fn() for fn in fns] for name, fns in calls.items()}
    best = best_times(kernels, None, repeats, torch.get_num_threads())
    return {name: ops / t for name, t in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2048,
                        help="rows of x a GEMM takes, a prompt chunk's (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="passes over the GEMMs, the best one kept (default: %(default)s)")
    args = parser.parse_args()
    if not (amx_available() and amx_int8_available()):
        raise SystemExit("this benchmark needs AMX-BF16 and AMX-INT8 (an Intel Xeon from Sapphire Rapids on)")
    reuse_step_buffers()  # as the engine: a GEMM's large output reuses freed heap pages, no fresh page faults
    ext = tile_loops()
    threads = torch.get_num_threads()
    peak = {}
    for int8 in (False, True):
        kind = "int8" if int8 else "bf16"
        rates = {"in tiles": tile_rate(ext, int8, 0, threads)}
        for name, size in (("L1 (32 KB)", 32 << 10), ("L2 (1 MB)", 1 << 20), ("L3 (16 MB)", 16 << 20)):
            rates[f"loaded from {name}"] = tile_rate(ext, int8, size, threads)
        peak[kind] = max(rates.values())  # in tiles or from L1: both the compute's rate
        one = tile_rate(ext, int8, 0, 1)
        print(f"{kind} tile products, {threads} threads: " + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in rates.items())
              + f" T/s (1 thread, in tiles: {one / 1e12:.2f})")
    for name, rate in gemm_rates(args.rows, args.repeats).items():
        kind = "bf16" if "bf16" in name else "int8"
        print(f"{name:>14} at {args.rows} rows, Llama-3.2-1B's 4 matmuls: {rate / 1e12:.2f} T/s = "
              f"{rate / peak[kind]:.0%} of the {kind} tile peak")


if __name__ == "__main__":
    main()
