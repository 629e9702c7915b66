"""`sobrio bench roofline`: this machine's peak matmul rates (bf16, fp32, int8) and memory bandwidth, and the
share of each an engine decode step reaches: bandwidth at small batches (weights + KV read per step),
compute at large ones.

Weights are counted two ways. "Resident" is every distinct tensor the model holds (`resident_bytes`): in
bf16 that is oneDNN's packed copy alone where the few-row kernel reads it (AVX512-BF16 without AMX), else the
plain weights plus oneDNN's and AMX's packed copies. "Read per step" is what a decode step streams: each
matrix once, in the form its kernel reads (a bf16 weight's packed copies hold the same bytes as the plain
one, so the parameters or the one packed copy count; a quantized layer's int8 or
int4 buffers, or oneDNN's packed int8 copy, which is its only one), without the rotary tables and an
untied embedding, of which a step reads a row per token. The bandwidth floor uses the latter.

A mixture of experts' routed experts are the exception: a step reads only the experts its tokens are routed
to (4 of 60 at one sequence for Qwen1.5-MoE, most of them at 16). "Read per step" leaves them out, and each
timed step adds the bytes of the experts it did compute, counted as it runs (`ExpertReads`); its matmul
weights are the dense ones plus `top_k` experts a token.
"""

import time
from collections.abc import Callable, Iterable

import torch

from sobrio.layers import quantization
from sobrio.layers.cpu_ops import amx_int8_available, cpu_ops
from sobrio.layers.linear import BlockedEmbedding, Linear
from sobrio.layers.moe import FusedExperts, SparseMoE
from sobrio.layers.quantization import QuantizedLinear
from sobrio.layers.rotary import RotaryEmbedding
from sobrio.memory import memory_spans, to_huge_pages
from sobrio.models.weights import tensor_memory

INT8_ZERO_POINT = torch.zeros((), dtype=torch.long)
BLOCK_SIZE = 16  # CacheConfig's default: KV blocks; also the meta model's (unused) positions


def _best_time(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


PROBE_SECONDS = 0.2  # a peak probe grows its matrices until one product takes this long


def sized_rate(matmul_of_size: Callable[[int], Callable[[], object]], n_max: int) -> float:
    """Multiply-adds x 2 per second of an n x n by n x n product, n doubling from 128 until one takes
    PROBE_SECONDS or reaches n_max: a slow kernel (bf16 without hardware support, int8 without VNNI, where
    a 2048 product takes seconds) is timed small, and the report comes in seconds, not minutes."""
    n = min(128, n_max)
    while True:
        seconds = _best_time(matmul_of_size(n), repeats=5 if n >= n_max else 2)
        if seconds >= PROBE_SECONDS or n >= n_max:
            return 2 * n ** 3 / seconds
        n = min(2 * n, n_max)


def peak_matmul_flops(dtype: torch.dtype, n: int = 2048) -> float:
    def matmul(size: int) -> Callable[[], torch.Tensor]:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        return lambda: torch.mm(a, b)
    return sized_rate(matmul, n)


def int8_matmul_kernels(n: int) -> dict[str, Callable[[], torch.Tensor]]:
    """n x n int8 x int8 matmuls by each kernel here (oneDNN's on a prepacked weight where oneDNN is built in;
    sobrio's AMX-INT8 kernel where the CPU has it, on bf16 activations it rounds itself, as the `int8` layers
    run it), on the same operands. n: a multiple of 64."""
    a = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    a[:, 0] = 127  # every row reaches 127: the AMX kernel's per-token rounding leaves its integers as they are
    b = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    kernels = {"torch._int_mm": lambda: torch._int_mm(a, b.t())}
    if not quantization.int8_dot_products():  # as `int8_mm` runs there: the integers summed in fp32
        kernels["fp32 sums"] = lambda: a.float() @ b.float().t()
    packed = quantization.onednn_pack(b)
    if packed is not None:
        scale = torch.ones(n)
        zero_point = 0 if quantization.onednn_signed_activations() else quantization.ONEDNN_U8_ZERO_POINT
        x = (a.to(torch.int16) + zero_point).to(torch.uint8) if zero_point else a  # as the layers run it
        kernels["onednn qlinear"] = lambda: torch.ops.onednn.qlinear_pointwise(
            x, 1.0, zero_point, packed, scale, INT8_ZERO_POINT, None, 1.0, 0, torch.bfloat16, "none", [], "")
    if amx_int8_available() and n % 64 == 0:
        tiles, activations, ones = cpu_ops().amx_pack_weight_int8(b), a.to(torch.bfloat16), torch.ones(n)
        kernels["sobrio amx int8"] = lambda: cpu_ops().amx_int8_linear(activations, tiles, ones, n, None, None,
                                                                       None, True)
    return kernels


def peak_int8_ops(n: int = 2048) -> tuple[float, str]:
    """(int8 ops/s, kernel) of the fastest int8 matmul kernel: the ceiling of W8A8 at large batches."""
    rates = {name: sized_rate(lambda size, name=name: int8_matmul_kernels(size)[name], n)
             for name in int8_matmul_kernels(64)}
    best = max(rates, key=rates.get)
    return rates[best], best


def memory_bandwidth(gib: float = 1.0) -> float:
    """Reads of a buffer in huge pages where the kernel allows them, as the engine's weights are once it
    serves (`memory.huge_pages_in_background`): in 4 KB pages each page costs a page-table walk too."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    to_huge_pages(memory_spans([tensor_memory(x)]))
    return x.numel() * 4 / _best_time(lambda: x.sum())


def _tensors_read(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of this module (not its children) a decode step reads whole."""
    if isinstance(module, RotaryEmbedding):
        return []  # cos/sin tables: a row per token
    if isinstance(module, Linear) and module.blocks is not None:  # oneDNN's packed copy alone
        return [t for t in (module.packed, module.bias) if t is not None]
    if isinstance(module, BlockedEmbedding):  # the tied head's packed copy, which the embedding reads too
        return [module.packed]
    if isinstance(module, QuantizedLinear) and (module.packed is not None or module.amx_packed is not None):
        packed = module.packed if module.packed is not None else module.amx_packed
        return [t for t in (packed, module.scale_fp32, module.bias, module.outliers and module.outliers.weight)
                if t is not None]
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def _distinct_bytes(modules: Iterable[torch.nn.Module]) -> int:
    """Bytes of the distinct tensors these modules read whole (`_tensors_read`), each memory counted once."""
    memory: dict[int, int] = {}
    for module in modules:
        for t in _tensors_read(module):
            address, nbytes = tensor_memory(t)
            memory.setdefault(address, nbytes)
    return sum(memory.values())


def expert_bytes(experts: FusedExperts) -> int:
    """Bytes one routed expert's two matrices take as its kernel reads them (the experts are equal in size)."""
    if experts.quantized_gate_up is not None:
        return _distinct_bytes([*experts.quantized_gate_up[0].modules(), *experts.quantized_down[0].modules()])
    return experts.gate_up_proj[0].nbytes + experts.down_proj[0].nbytes


class ExpertReads:
    """Bytes of the routed experts the model's steps compute, summed while it is open: a hook on each
    `FusedExperts` counts the distinct experts of its tokens (what a step reads of that layer's experts)."""

    def __init__(self, model: torch.nn.Module):
        self.bytes = 0
        self._hooks = []
        for module in model.modules():
            if isinstance(module, FusedExperts):
                self._hooks.append(module.register_forward_pre_hook(self._counter(expert_bytes(module))))

    def _counter(self, nbytes: int):
        def count(module, args) -> None:
            self.bytes += nbytes * int(args[2].unique().numel())  # forward(x, weights, experts)
        return count

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def step_read_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads, each matrix once (see the module docstring), without the
    routed experts, whose bytes depend on the tokens' routes (`ExpertReads`)."""
    skipped = set() if model.config.tie_word_embeddings else set(model.model.embed_tokens.modules())
    skipped |= {m for experts in model.modules() if isinstance(experts, FusedExperts) for m in experts.modules()}
    return _distinct_bytes(m for m in model.modules() if m not in skipped)


def matmul_weights(model: torch.nn.Module) -> int:
    """Weights a token multiplies by (2 ops each), whatever form they are stored in: counted on the float
    model of the same config, built on the meta device (no memory), so every quantized layer kind counts."""
    attn_cls = type(model.attention_layers()[0])
    with torch.device("meta"):
        plain = type(model)(model.config, BLOCK_SIZE, attn_cls)
    linears = sum(m.weight.numel() for m in plain.modules() if isinstance(m, torch.nn.Linear))
    routed = sum(moe.top_k * (moe.experts.gate_up_proj[0].numel() + moe.experts.down_proj[0].numel())
                 for moe in plain.modules() if isinstance(moe, SparseMoE))  # a token's top_k experts
    return linears + routed + (plain.model.embed_tokens.weight.numel() if plain.lm_head is None else 0)  # tied head


class IdleStepError(RuntimeError):
    """A timed step advanced fewer sequences than the batch: its time is not a decode step's."""


def decode_step_time(llm, batch: int, prompt_len: int, steps: int = 8) -> tuple[float, int, int]:
    """Mean time of a pure decode step at this batch size, the KV tokens it reads, and the mean bytes of
    routed experts it reads (0 for a dense model). Raises `IdleStepError` when a timed step did not advance
    every sequence by one token."""
    from sobrio import SamplingParams

    engine = llm.engine
    for i in range(batch):
        engine.add_request(f"roofline-{batch}-{i}", None, SamplingParams(max_tokens=steps + 64, ignore_eos=True),
                           prompt_token_ids=[100 + (i + j) % 1000 for j in range(prompt_len)])
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    engine.step()
    experts = ExpertReads(llm.engine.runner.model)
    try:
        start = time.perf_counter()
        advanced = [len(engine.step()) for _ in range(steps)]
        elapsed = (time.perf_counter() - start) / steps
    finally:
        experts.close()
    kv_tokens = sum(r.num_computed_tokens for r in engine.scheduler.running)
    for i in range(batch):
        engine.abort_request(f"roofline-{batch}-{i}")
    if advanced != [batch] * steps:
        raise IdleStepError(f"timed steps at batch {batch} advanced {advanced} sequences")
    return elapsed, kv_tokens, experts.bytes // steps


def add_roofline_args(parser) -> None:
    from sobrio.config.cache import KV_CACHE_DTYPES
    from sobrio.config.model import QUANTIZATION_METHODS

    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                        help="quantize the weights at load (unset: the model's dtype)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="KV cache storage: auto (the model's dtype) or one byte a value with a scale per row")
    parser.add_argument("--batch", default="1,32", help="decode batch sizes to place on the roofline")
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens of each request's prompt")


def machine_peaks() -> dict[str, float]:
    """This machine's peak rates (per second; the floors divide by them), printed on one line with the
    int8 kernel that set int8's."""
    print("measuring this machine's matmul peaks and memory bandwidth (about half a minute) ...", flush=True)
    int8, kernel = peak_int8_ops()
    peaks = {"bf16": peak_matmul_flops(torch.bfloat16), "fp32": peak_matmul_flops(torch.float32),
             "int8": int8, "bandwidth": memory_bandwidth()}
    print(f"machine: bf16 matmul {peaks['bf16'] / 1e12:.2f} TFLOP/s, fp32 matmul {peaks['fp32'] / 1e12:.2f} "
          f"TFLOP/s, int8 matmul {int8 / 1e12:.2f} TOPS ({kernel}), memory read {peaks['bandwidth'] / 1e9:.1f} "
          f"GB/s, {torch.get_num_threads()} threads", flush=True)
    return peaks


def compute_peak(quantization: str | None, dtype: torch.dtype) -> str:
    """The peak a step's matmuls can reach: int8's for W8A8; the activations' dtype's for the others
    (weight-only int8 and int4 dequantize to it, or multiply in fp32 registers at few rows)."""
    if quantization == "int8":
        return "int8"
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def _engine_kwargs(args) -> dict:
    kwargs = {"dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype}
    return kwargs | ({"quantization": args.quantization} if args.quantization else {})


def describe_model(args, runner) -> None:
    """One line: the mode, the matmul weights, and both counts of their bytes (module docstring)."""
    from sobrio.models.weights import resident_bytes

    model, dtype = runner.model, str(runner.dtype).removeprefix("torch.")
    print(f"model {args.model} ({dtype}, quantization {args.quantization or 'none'}, kv {args.kv_cache_dtype}): "
          f"{matmul_weights(model) / 1e6:.0f} M matmul weights, {resident_bytes(model) / 1e6:.1f} MB resident "
          f"(every tensor held, packed copies too), {step_read_bytes(model) / 1e6:.1f} MB read per step (each "
          f"weight once, as its kernel reads it{_routed_note(model)}), {runner.kv_spec.token_bytes} B of KV per "
          f"token")


def _routed_note(model: torch.nn.Module) -> str:
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers:
        return ""
    moe = layers[0]
    return (f"; plus the routed experts a step computes, {expert_bytes(moe.experts) / 1e6:.1f} MB each, "
            f"{moe.top_k} of {moe.experts.num_experts} a token in each of {len(layers)} layers")


def roofline_line(batch: int, step: float, moved: int, ops: int, peaks: dict[str, float], peak_name: str,
                  bandwidth_after: float | None = None) -> str:
    """A step's time against its floor (the slower of streaming `moved` bytes at peak bandwidth and `ops`
    at the mode's peak), and its share of each peak; with `bandwidth_after`, also its share of the read loop
    measured again right after its steps (a shared host's bandwidth moves within minutes, and the start's
    figure alone moved a share with it: docs/benchmarks.md)."""
    bandwidth, peak = peaks["bandwidth"], peaks[peak_name]
    floor = max(moved / bandwidth, ops / peak)
    unit = "TOP/s" if peak_name == "int8" else "TFLOP/s"
    after = ("" if bandwidth_after is None else
             f" (read loop right after {bandwidth_after / 1e9:.1f} GB/s: {moved / step / bandwidth_after:5.1%})")
    return (f"batch {batch:3}: step {step * 1000:7.1f} ms (floor {floor * 1000:6.1f} ms) {batch / step:7.1f} tok/s "
            f"| bandwidth {moved / step / 1e9:5.1f} GB/s = {moved / step / bandwidth:5.1%} of peak{after} "
            f"| compute {ops / step / 1e12:5.3f} {unit} = {ops / step / peak:5.1%} of {peak_name} peak")


def cmd_bench_roofline(args) -> int:
    from sobrio import LLM

    peaks = machine_peaks()
    llm = LLM(args.model, **_engine_kwargs(args))
    runner = llm.engine.runner
    if not runner.settle(timeout=300):  # the KV cache's pages and the weights' huge pages, as a server's
        print("the start's background work is not done after 300 s: timing anyway", flush=True)
    describe_model(args, runner)
    read, weights = step_read_bytes(runner.model), matmul_weights(runner.model)
    peak_name = compute_peak(args.quantization, runner.dtype)
    for batch in [int(b) for b in args.batch.split(",")]:
        step, kv_tokens, experts = decode_step_time(llm, batch, args.prompt_len)
        moved = read + experts + kv_tokens * runner.kv_spec.token_bytes
        print(roofline_line(batch, step, moved, 2 * weights * batch, peaks, peak_name, memory_bandwidth()),
              flush=True)
    return 0


# ---- `sobrio models --memory`: weight and KV-cache bytes per mode ----

MEMORY_MODES = (None, "int8", "int8-weight-only", "int4")  # --quantization; None: the model's dtype
MEMORY_KV_DTYPES = ("auto", "int8", "fp8")


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Rows of cells as aligned columns, the first left-aligned, a rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def kv_table(hf_config, dtype: torch.dtype, budget: int) -> str:
    """Bytes per token, blocks and tokens of each KV-cache dtype in `budget` bytes: no model needed."""
    from sobrio.kv.cache import KV_CACHE_DTYPES
    from sobrio.models.sizing import kv_cache_spec

    rows = [("kv-cache-dtype", "bytes/token", "blocks", "tokens")]
    for name in MEMORY_KV_DTYPES:
        spec = kv_cache_spec(hf_config, dtype, BLOCK_SIZE, KV_CACHE_DTYPES[name])
        blocks = budget // spec.block_bytes
        rows.append((name, str(spec.token_bytes), str(blocks), str(blocks * BLOCK_SIZE)))
    return format_table(rows)


def mode_weight_bytes(files, weights: list, dtype: torch.dtype, max_positions: int,
                      quantization: str | None) -> tuple[int, int]:
    """(resident, read per step) bytes of the model built in this mode as the engine builds it: measured,
    not estimated, so packed copies and kept scales count."""
    from sobrio.models.registry import build_model
    from sobrio.models.weights import resident_bytes

    model = build_model(files.config, max_positions, iter(weights), dtype, "auto", quantization=quantization)
    return resident_bytes(model), step_read_bytes(model)


def weights_table(files, dtype: torch.dtype, max_positions: int) -> str:
    """Resident and read-per-step weight MB of each --quantization mode (a mode the model's shapes do not
    take: its error, shortened)."""
    from sobrio.errors import SobrioError

    weights = list(files.iter_weights())  # read once, built into each mode
    rows = [("quantization", "resident MB", "read per step MB")]
    for mode in MEMORY_MODES:
        try:
            resident, read = mode_weight_bytes(files, weights, dtype, max_positions, mode)
            rows.append((mode or "none", f"{resident / 1e6:.1f}", f"{read / 1e6:.1f}"))
        except SobrioError as exc:
            rows.append((mode or "none", "n/a", str(exc)[:60]))
    return format_table(rows)


def _routed_rows(config) -> str:
    """For a mixture of experts, what its "read per step" leaves out (as `step_read_bytes`); else nothing."""
    if not getattr(config, "num_experts_per_tok", None):
        return ""
    from sobrio.models.moe import num_experts

    return (f"read per step leaves out the routed experts: a step reads those its tokens are routed to, "
            f"{config.num_experts_per_tok} of {num_experts(config)} a token in each layer\n")


def memory_report(model: str, kv_memory: int) -> str:
    """Both tables of one model, its weights built once per mode (seconds each), the rotary tables sized
    for the context this KV memory holds, as the engine sizes them."""
    from sobrio.loader.load import load_model_files
    from sobrio.models.sizing import kv_cache_spec, resolve_dtype

    files = load_model_files(model, tokenizer=False)
    dtype = resolve_dtype("auto")
    tokens = kv_memory // kv_cache_spec(files.config, dtype, BLOCK_SIZE).block_bytes * BLOCK_SIZE
    max_positions = max(BLOCK_SIZE, min(getattr(files.config, "max_position_embeddings", 2048), tokens))
    return (f"{model} ({str(dtype).removeprefix('torch.')}): weights per --quantization\n"
            f"{weights_table(files, dtype, max_positions)}\n{_routed_rows(files.config)}"
            f"KV cache in --kv-cache-memory {kv_memory / (1 << 20):.0f} MiB (blocks of {BLOCK_SIZE} tokens)\n"
            f"{kv_table(files.config, dtype, kv_memory)}")
