"""Activation-aware scales for quantized weights, from one calibration pass: SmoothQuant's for `int8` (W8A8)
and AWQ's search for `int4`.

A few input channels of a Linear carry activations tens of times larger than the rest (after an RMSNorm
above all). Per-token int8 activations spend their 255 steps on those few, and the others round to a
handful of steps; group-wise int4 weights do the reverse harm, rounding the weights those large inputs
multiply as coarsely as any other. Both are cured by a per-input-channel scale s: the Linear computes
(x / s) @ (W * s).T, equal in float, with 1 / s folded into what produces x, so nothing is computed at
run time:

- qkv_proj and gate_up_proj: into the RMSNorm before them (Llama: weight / s; Gemma, which scales by
  1 + weight: 1 + weight' = (1 + weight) / s);
- down_proj: into up_proj's rows (act(gate) * up is linear in up).

o_proj's input (attention's output) would take its 1 / s in v_proj's rows, which grouped-query attention
shares between heads; it is left alone (W8A8 there cost nothing measurable). The LM head's input comes from
the final norm, but the head is the tied embedding on these models: a scale would change the embedding too.

Calibration: the float model runs once over the first `CALIBRATION_TOKENS` tokens of the shipped
calibration text (`sobrio/data`, never the held-out text, never a user's prompt), forward pre-hooks on
the Linears recording each input's per-channel max |x| (SmoothQuant) or keeping the inputs (AWQ). It runs a
layer at a time (`PromptRun`), each layer's scales folded in once the prompt has gone through it, so that a
quantizing load can read, calibrate and quantize one layer's float weights at a time (`CausalLM.quantize`).

SmoothQuant (Xiao et al. 2023): s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), alpha `SMOOTH_ALPHA` (0.5, the
paper's default, measured best among 0.35-0.8). AWQ (Lin et al. 2024): `layers.int4.awq_search_scales`, per
Linear, on its recorded inputs. Then GPTQ (layers/gptq.py) rounds each int4 Linear under its inputs'
Hessian (`layer_hessians`, the whole text). What W8A8 loses per layer kind and what smoothing gives back, by
alpha: docs/quantization.md.
"""

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from sobrio import data
from sobrio.layers.attention import AttentionMetadata
from sobrio.layers.int4 import awq_search_scales
from sobrio.layers.linear import Linear
from sobrio.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512  # a few hundred tokens settle the statistics; one prompt, no sliding window past it
GPTQ_TOKENS = 4096  # the whole calibration text (~2,000 tokens): GPTQ's Hessians want more rows than K
# GPTQ runs where every Linear's Hessians together stay under this (SmolLM2 0.4 GB, Llama-3.2-1B 4.8): they were
# all held until quantized; a layer's alone are now, but GPTQ's time grows with them (~1 min a layer at 7B
# widths), so from about 1B up int4 stays AWQ's scales on least-squares grids as before
GPTQ_MAX_BYTES = 4 << 30
SMOOTH_ALPHA = 0.5  # SmoothQuant's migration strength: the best of the grid above, on SmolLM2
MIN_SCALE = 1e-5  # a channel no calibration token used keeps a usable scale
CALIBRATION_BLOCK = 16

Fold = Callable[[torch.Tensor], None]  # divides the producer's output channels by s


def calibration_ids(config, num_tokens: int = CALIBRATION_TOKENS) -> list[int] | None:
    """The calibration text's first tokens, by the tokenizer in the model's folder (`config.name_or_path`:
    a GGUF's prepared folder too); None where that folder has no tokenizer."""
    from transformers import AutoTokenizer

    folder = getattr(config, "name_or_path", "")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder) if folder else None
    except (OSError, ValueError):
        tokenizer = None
    if tokenizer is None:
        return None
    prefix = tokenizer("", add_special_tokens=True).input_ids
    return (prefix + tokenizer(data.read_text(data.CALIBRATION), add_special_tokens=False).input_ids)[:num_tokens]


class _PromptCache:
    """A float KV cache for one calibration prompt, as attention reads it (`PagedKVCache`, unquantized):
    layers get their cache through the metadata, so calibration brings its own instead of kv/'s."""

    def __init__(self, layers: list[torch.Tensor]):
        self._slots = [(t[0].flatten(0, 1), t[1].flatten(0, 1)) for t in layers]
        self.layers = layers

    def slots(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._slots[i]

    def scales(self, i: int) -> None:
        return None

    def write_quantized(self, i, slots, k, v) -> None:
        raise AssertionError("the calibration cache is float")

    read_quantized = write_quantized


class PromptRun:
    """One calibration prompt through a model's decoder a layer at a time, on a KV cache of its own in the
    model's float dtype (the final norm's: a quantized embedding's weight is codes): the model's forward
    split, so that a layer's float weights need only be in memory while it runs and is quantized
    (`CausalLM.quantize` on a streamed load). A model built for fewer positions than `ids` runs their first
    ones only: the rotary tables end there (past them the C++ rotary refuses the position)."""

    def __init__(self, model: torch.nn.Module, ids: list[int]):
        ids = ids[:min(m.cos.shape[0] for m in model.modules() if isinstance(m, RotaryEmbedding))]
        attn = model.attention_layers()
        dtype = model.model.norm.weight.dtype
        blocks = -(-len(ids) // CALIBRATION_BLOCK)
        shape = (2, blocks, CALIBRATION_BLOCK, attn[0].num_kv_heads, attn[0].head_dim)
        cache = _PromptCache([torch.zeros(shape, dtype=dtype) for _ in attn])
        self.meta = AttentionMetadata(torch.arange(len(ids)), [0, len(ids)], [len(ids)], torch.arange(blocks)[None],
                                      CALIBRATION_BLOCK, cache)
        self.model, self.positions = model, torch.arange(len(ids))
        with torch.inference_mode():
            self.x, self.residual = model.model.embed(torch.tensor(ids)), None

    def layer(self, i: int) -> None:
        """The prompt through decoder layer i (the layers in order, each once)."""
        with torch.inference_mode():
            self.x, self.residual = self.model.model.layers[i](self.positions, self.x, self.residual, self.meta)

    def output(self) -> torch.Tensor:
        """The final norm of the residual stream, after the last layer: the LM head's input."""
        with torch.inference_mode():
            return self.model.model.norm.add_and_norm(self.x, self.residual)[0]


@contextmanager
def recorded_inputs(linears: dict[str, Linear],
                    summary: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """While open, `summary` of each Linear's inputs (fp32 [T, K] in) by name: their per-channel max |x|
    (SmoothQuant), the inputs themselves (AWQ's search), X^T X (GPTQ)."""
    found: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(_module, args):
            found[name] = summary(args[0].detach().reshape(-1, args[0].shape[-1]).float())
        return record

    handles = [linear.register_forward_pre_hook(hook(name)) for name, linear in linears.items()]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def smooth_scales(max_abs_x: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """SmoothQuant's s [K] (fp32): moves part of the activations' range per channel into the weights',
    so that neither has a channel far above the rest."""
    max_abs_w = weight.detach().abs().amax(0).float().clamp_min(MIN_SCALE)  # exact in the weight's dtype
    s = max_abs_x.clamp_min(MIN_SCALE).pow(alpha) / max_abs_w.pow(1 - alpha)
    return s.clamp_min(MIN_SCALE)


def fold_into_norm(norm: torch.nn.Module) -> Fold:
    """1 / s into an RMSNorm's weight (Gemma's scales by 1 + weight: `offset` 1)."""
    def fold(s: torch.Tensor) -> None:
        w = norm.weight.data
        w.copy_(((w.float() + norm.offset) / s - norm.offset).to(w.dtype))
    return fold


def fold_into_rows(linear: Linear, first: int) -> Fold:
    """1 / s into a Linear's output rows first .. first + len(s) (up_proj's, inside gate_up_proj)."""
    def fold(s: torch.Tensor) -> None:
        rows = linear.weight.data[first:first + len(s)]
        rows.copy_(rows.to(torch.float32, copy=True).div_(s[:, None]))  # one float32 copy at a time
        if linear.bias is not None:
            bias = linear.bias.data[first:first + len(s)]
            bias.copy_((bias.float() / s).to(bias.dtype))
    return fold


def scale_inputs(linear: Linear, s: torch.Tensor) -> None:
    """W * s along the input channels: the Linear's side of the fold."""
    w = linear.weight.data
    w.copy_(w.to(torch.float32, copy=True).mul_(s))  # one float32 copy at a time (a layer's peak at load)


def smoothable(model: torch.nn.Module) -> Iterator[tuple[str, Linear, Fold]]:
    """(name, Linear, the fold into its input's producer) for qkv_proj, gate_up_proj and down_proj of every
    decoder layer; of a mixture-of-experts layer qkv_proj only (its experts are quantized unsmoothed). The
    norm before the MLP is Gemma 3's `pre_feedforward_layernorm` (its `post_attention_layernorm` normalizes
    attention's output), Llama's `post_attention_layernorm`."""
    for i in range(len(model.model.layers)):
        yield from smoothable_in_layer(model, i)


def smoothable_in_layer(model: torch.nn.Module, i: int) -> Iterator[tuple[str, Linear, Fold]]:
    """`smoothable`'s entries of decoder layer i."""
    layer = model.model.layers[i]
    mlp_norm = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm
    yield f"layers.{i}.qkv_proj", layer.self_attn.qkv_proj, fold_into_norm(layer.input_layernorm)
    if not hasattr(layer.mlp, "gate_up_proj"):  # a sparse FFN (layers/moe.py): its norm feeds the router too
        return
    gate_up = layer.mlp.gate_up_proj
    yield f"layers.{i}.gate_up_proj", gate_up, fold_into_norm(mlp_norm)
    yield f"layers.{i}.down_proj", layer.mlp.down_proj, fold_into_rows(gate_up, gate_up.shard_offsets[1][0])


def all_float(model: torch.nn.Module) -> bool:
    """Whether every smoothable layer is still a float Linear (a checkpoint's quantized ones are final)."""
    return all(isinstance(linear, Linear) for _, linear, _ in smoothable(model))


def _fold(linears: list[tuple[str, Linear, Fold]], scales_of: Callable[[str, Linear], torch.Tensor]) -> None:
    """Fold each Linear's scales (`scales_of(name, linear)`) into it and its input's producer."""
    for name, linear, fold in linears:
        s = scales_of(name, linear)
        fold(s)
        scale_inputs(linear, s)


def smooth_layer(model: torch.nn.Module, run: PromptRun, i: int, alpha: float = SMOOTH_ALPHA) -> None:
    """SmoothQuant on decoder layer i before its W8A8 quantization: `run` (through the float layers before
    i, unsmoothed) goes through layer i recording its inputs' max |x| per channel, then the scales are folded
    in (the layer's outputs unchanged up to rounding)."""
    linears = list(smoothable_in_layer(model, i))
    with recorded_inputs({name: linear for name, linear, _ in linears}, lambda x: x.abs().amax(0)) as max_abs:
        run.layer(i)
    _fold(linears, lambda name, linear: smooth_scales(max_abs[name], linear.weight, alpha))


def awq_layer(model: torch.nn.Module, run: PromptRun, i: int, group_size: int) -> None:
    """AWQ's scales for decoder layer i before its int4 quantization, searched per Linear on the inputs
    `run` brings it (through the float layers before i, without their scales)."""
    linears = list(smoothable_in_layer(model, i))
    with recorded_inputs({name: linear for name, linear, _ in linears}, lambda x: x.clone()) as inputs:
        run.layer(i)
    with one_thread():
        _fold(linears, lambda name, linear: awq_search_scales(linear.weight, inputs.pop(name), group_size))


def head_input_max(run: PromptRun) -> torch.Tensor:
    """The LM head's calibrated input max |x| per channel, once `run` is through every layer: smoothing leaves
    the head's input as it was, and a tied head rounds its largest channels apart (layers/quantization.py
    `Outliers`)."""
    return run.output().float().abs().amax(0)


@contextmanager
def one_thread() -> Iterator[None]:
    """PyTorch on one thread while open: the search's ops are small (128 rows of a weight), and split over
    threads on a busy host they wait for each other (SmolLM2's search: 4 s on one thread, 29 s on two with
    the other core taken)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def gptq_fits(model: torch.nn.Module) -> bool:
    """Whether every decoder Linear's Hessian fits in `GPTQ_MAX_BYTES` together (their sum: a model is
    quantized by GPTQ whole or not at all, whatever order its layers are quantized in); logs why not."""
    needed = sum(linear.weight.shape[1] ** 2 * 4 for _, linear in float_linears(model, "model.layers."))
    if needed > GPTQ_MAX_BYTES:
        logger.warning("int4: GPTQ's statistics would take %.1f GB (more than %.1f): rounding each weight to "
                       "its nearest code instead", needed / 2**30, GPTQ_MAX_BYTES / 2**30)
    return needed <= GPTQ_MAX_BYTES


def float_linears(model: torch.nn.Module, prefix: str) -> list[tuple[str, Linear]]:
    """(name in `model.named_modules()`, Linear) of every float Linear whose name starts with `prefix`
    (`model.layers.3.`: decoder layer 3's)."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, Linear) and name.startswith(prefix)]


def layer_hessians(model: torch.nn.Module, run: PromptRun, i: int) -> dict[str, torch.Tensor]:
    """GPTQ's input Hessian 2 X^T X / T (fp32 [K, K]) of each of decoder layer i's Linears, by name, as `run`
    (through the layers before i as they stood before quantizing, AWQ's scales folded in) goes through it."""
    linears = dict(float_linears(model, f"model.layers.{i}."))
    with recorded_inputs(linears, lambda x: 2 * x.T @ x / x.shape[0]) as found:
        run.layer(i)
    return found
