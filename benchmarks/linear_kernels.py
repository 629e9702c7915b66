"""The matmuls of a SmolLM2-135M decode step (30 layers' qkv, o, gate_up and down, then the LM head: 270 MB
of bf16 weights, read from memory as a step reads them) through each kernel at a given row count:
aten (F.linear), oneDNN with its packed weight, the C++ AMX kernel (on its own copy and on oneDNN's, which is
what a bf16 Linear runs up to 64 rows on AMX), the C++ GEMV, the C++ GEMV on oneDNN's packed
copy (`blocked_gemv_bf16`: what a bf16 Linear runs up to 4 rows where it keeps that copy alone) and the C++ lane kernel
(`invariant_linear`: what float32 takes on an AVX2-only CPU), and on AMX-INT8 the W8A8 kernel that
`--quantization int8` takes there (int8 weights per channel, activations rounded per token in the kernel,
each down_proj's per token and group of 64 inputs, as the engine runs them: half the bytes). Prints ms per
step's matmuls, the weight bytes per second (each kernel's own bytes), and aten's time over the fastest other
float kernel's, then the fastest float kernel's over AMX int8's. Run it on a quiet machine; `--threads 1`
times CPU, so it holds up under load.

    .venv/bin/python benchmarks/linear_kernels.py [--rows 1 4 8 32 64 128 512] [--threads 2] [--dtype float32]
"""

import argparse
import time

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sobrio.layers.cpu_ops import (  # noqa: E402
    amx_available,
    amx_int8_available,
    cpu_ops,
    gemv_available,
    invariant_linear_available,
)
from sobrio.layers.linear import AMX_BLOCK, amx_pack_weight, blocked_view, pack_weight  # noqa: E402
from sobrio.layers.quantization import AMX_ACT_GROUP, quantize_weight  # noqa: E402

INT8 = "AMX int8"

# (out, in) of qkv, o, gate_up, down; layers; the LM head's (vocabulary, hidden)
MODELS = {"smollm2-135m": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, (49152, 576)),
          "llama3.2-1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 16, (128256, 2048))}


def weights(dtype: torch.dtype, model: str = "smollm2-135m") -> list[torch.Tensor]:
    shapes, layers, head = MODELS[model]
    return [torch.randn(n, k).to(dtype) for _ in range(layers) for (n, k) in shapes] + [torch.randn(*head).to(dtype)]


def kernels(ws: list[torch.Tensor], rows: int) -> dict:
    """name -> a function running every matmul once with `rows` input rows (the kernels this CPU has)."""
    xs = {k: torch.randn(rows, k).to(ws[0].dtype) for k in {w.shape[1] for w in ws}}
    found = {"aten": lambda: [F.linear(xs[w.shape[1]], w) for w in ws]}
    dnn = [pack_weight(w) for w in ws]
    if all(p is not None for p in dnn):
        found["oneDNN"] = lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                   for w, p in zip(ws, dnn)]
    amx = [amx_pack_weight(w) for w in ws]
    if amx_available() and all(p is not None for p in amx):
        found["AMX"] = lambda: [cpu_ops().amx_linear(xs[w.shape[1]], p, w.shape[0]) for w, p in zip(ws, amx)]
    if gemv_available() and ws[0].dtype == torch.bfloat16 and rows <= 8:
        found["GEMV"] = lambda: [cpu_ops().gemv_bf16(xs[w.shape[1]], w) for w in ws]
    views = [blocked_view(p, w) if p is not None else None for w, p in zip(ws, dnn)]
    if all(v is not None for v in views):  # the few-row kernel on oneDNN's copy (one copy kept): AMX's or the GEMV
        if views[0].shape[2] == AMX_BLOCK:
            found["AMX on oneDNN's"] = lambda: [cpu_ops().amx_linear(xs[w.shape[1]], v, w.shape[0])
                                                for w, v in zip(ws, views)]
        elif rows <= 8:
            found["GEMV on oneDNN's"] = lambda: [cpu_ops().blocked_gemv_bf16(xs[w.shape[1]], v)
                                                 for w, v in zip(ws, views)]
    if invariant_linear_available() and rows <= 64:
        found["C++ lanes"] = lambda: [cpu_ops().invariant_linear(xs[w.shape[1]], w) for w in ws]
    if amx_int8_available():
        int8 = [(cpu_ops().amx_pack_weight_int8(q), s.float()) for q, s in (quantize_weight(w, w.dtype) for w in ws)]
        groups = [AMX_ACT_GROUP if i % 4 == 3 else 0 for i in range(len(ws))]  # each layer's down_proj
        found[INT8] = lambda: [cpu_ops().amx_int8_linear(xs[w.shape[1]], p, s, w.shape[0], group_k=g)
                               for w, (p, s), g in zip(ws, int8, groups)]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32, 64, 128, 512])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS),
                        help="whose layer shapes (default %(default)s; llama3.2-1b: 2.5 GB of bf16 weights)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    ws = weights(getattr(torch, args.dtype), args.model)
    total = sum(w.numel() * w.element_size() for w in ws)
    size = {INT8: sum(w.numel() for w in ws)}  # bytes each kernel reads a step: one a weight in int8
    for rows in args.rows:
        found, best = kernels(ws, rows), {}
        for _ in range(args.repeats):  # interleaved, so a burst of load hits every kernel alike
            for name, run in found.items():
                start = clock()
                run()
                best[name] = min(best.get(name, float("inf")), clock() - start)
        cells = "  ".join(f"{n} {t * 1e3:6.1f} ms ({size.get(n, total) / t / 1e9:4.1f} GB/s)" for n, t in best.items())
        others = {n: t for n, t in best.items() if n not in ("aten", INT8)}
        fastest = min(others, key=others.get) if others else "aten"
        int8 = f", {fastest}/{INT8} {best[fastest] / best[INT8]:.2f}x" if INT8 in best else ""
        print(f"rows {rows:4d}, {args.threads} thread(s), {args.dtype}: {cells}  | aten/{fastest} "
              f"{best['aten'] / best[fastest]:.2f}x{int8}", flush=True)


if __name__ == "__main__":
    main()
