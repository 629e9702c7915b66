"""The Llama family (Llama, SmolLM2, Mistral, Qwen2): forward over the flattened tokens of a step."""

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sobrio.layers import smoothing
from sobrio.layers.attention import AttentionMetadata, BatchedDecodeAttention, ReferenceAttention
from sobrio.layers.cpu_ops import cpu_ops
from sobrio.layers.linear import (
    BlockedEmbedding,
    BlockedPacker,
    Linear,
    amx_pack_weight,
    blocked_linear,
    linear,
    one_copy_layout,
)
from sobrio.layers.moe import FusedExperts
from sobrio.layers.norm import RMSNorm
from sobrio.layers.quantization import INT4_GROUP_SIZE, int8_head_method, quantized_embedding, quantized_linear
from sobrio.layers.rotary import RotaryEmbedding
from sobrio.memory import release_freed_memory
from sobrio.models.weights import PackedLinear
from sobrio.timing import log_step

logger = logging.getLogger(__name__)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_window(config, layer_idx: int) -> int | None:
    """Layer `layer_idx`'s sliding window as transformers applies it: a config with `layer_types` (Qwen2's
    `use_sliding_window` and `max_window_layers`, Qwen3, Gemma) windows its `sliding_attention` layers; one
    without (Mistral, Phi-3) windows every layer when `sliding_window` is set."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or types is None:
        return window or None
    return window if types[layer_idx] == "sliding_attention" else None


class LlamaAttention(torch.nn.Module):
    """Attention with the family switches: q/k/v and output biases, per-head q/k RMSNorm (Qwen3; Gemma 3's
    norm class through `qk_norm_cls`), logit softcapping (Gemma 2), each layer's sliding window and the
    rotary it is given (partial, interleaved or scaled)."""

    def __init__(self, config, rotary: RotaryEmbedding, sliding_window: int | None = None, scale=None,
                 attn_cls: type[ReferenceAttention] = BatchedDecodeAttention, layer_idx: int = 0,
                 qkv_bias: bool | None = None, o_bias: bool | None = None,
                 qk_norm_cls: type[RMSNorm] | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = PackedLinear(config.hidden_size, [q_size, kv_size, kv_size],
                                     bias=bias if qkv_bias is None else qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=bias if o_bias is None else o_bias)
        self.split = [q_size, kv_size, kv_size]
        self.rotary = rotary
        self.q_norm = self.k_norm = None
        if qk_norm_cls is not None:
            self.q_norm = qk_norm_cls(self.head_dim, config.rms_norm_eps)
            self.k_norm = qk_norm_cls(self.head_dim, config.rms_norm_eps)
        self.attn = attn_cls(self.num_heads, self.num_kv_heads, self.head_dim,
                             scale or self.head_dim ** -0.5, sliding_window, layer_idx, softcap=softcap)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim), meta))


ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # codes of the C++ act_and_mul


class GatedMLP(torch.nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden, [intermediate, intermediate], bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        assert act in ACTIVATIONS, f"unsupported activation {act}"
        self.act_code = ACTIVATIONS[act]
        self.act = F.silu if act == "silu" else lambda x: F.gelu(x, approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = cpu_ops()
        if ops is not None:
            return self.down_proj(ops.act_and_mul(gate_up, self.act_code))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def dense_mlp(config, layer_idx: int) -> torch.nn.Module:
    """The feed-forward block of a dense layer; a mixture-of-experts family passes its own `mlp` factory."""
    return GatedMLP(config.hidden_size, config.intermediate_size,
                    getattr(config, "hidden_activation", None) or config.hidden_act)


MlpFactory = Callable[[object, int], torch.nn.Module]  # (config, layer index) -> the layer's feed-forward block


def qwen3_attention(config) -> dict:
    """LlamaAttention's switches for Qwen3 (and Qwen3-MoE): per-head q/k RMSNorm."""
    return {"qk_norm_cls": RMSNorm}


def llama_attention(config) -> dict:
    """Qwen2 puts a bias on q/k/v (not the output) without saying so in its config, Qwen2-MoE where its
    `qkv_bias` says; Llama, Mistral, Mixtral and Phi-3 follow `attention_bias`."""
    if config.model_type == "qwen2_moe":
        return {"qkv_bias": bool(getattr(config, "qkv_bias", True)), "o_bias": False}
    return {"qkv_bias": True, "o_bias": False} if config.model_type == "qwen2" else {}


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, attn_cls: type[ReferenceAttention], layer_idx: int,
                 mlp: MlpFactory = dense_mlp, attention: dict | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, layer_window(config, layer_idx), attn_cls=attn_cls,
                                        layer_idx=layer_idx, **(attention or {}))
        self.mlp = mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, meta):
        """Returns (this layer's output, the residual stream before it): the next norm adds them."""
        x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class SandwichDecoderLayer(torch.nn.Module):
    """Four norms a layer (Gemma 2 and 3, GLM-4): each block's output is normed again before the residual add.
    `names`: the checkpoint's names of (the attention's input norm, its output norm, the MLP's input norm,
    its output norm)."""

    def __init__(self, attention: LlamaAttention, mlp: torch.nn.Module, norm: Callable[[], RMSNorm],
                 names: tuple[str, str, str, str]):
        super().__init__()
        self.self_attn, self.mlp = attention, mlp
        self.names = names
        for name in names:
            setattr(self, name, norm())

    def forward(self, positions, x, residual, meta):
        """Returns (this layer's output, the residual stream before it): the next norm adds them."""
        attn_in, attn_out, mlp_in, mlp_out = (getattr(self, name) for name in self.names)
        x, residual = attn_in.add_and_norm(x, residual)
        x = attn_out(self.self_attn(positions, x, meta))
        x, residual = mlp_in.add_and_norm(x, residual)
        return mlp_out(self.mlp(x)), residual


def sandwich_layers(config, rotary_of: Callable[[int], RotaryEmbedding], norm_cls: type[RMSNorm],
                    names: tuple[str, str, str, str], **switches) -> list[SandwichDecoderLayer]:
    """Every layer of a four-norm family: layer i with rotary `rotary_of(i)`, its window, the attention
    `switches` (LlamaAttention's keywords) and a dense MLP."""
    norm = lambda: norm_cls(config.hidden_size, config.rms_norm_eps)  # noqa: E731
    return [SandwichDecoderLayer(LlamaAttention(config, rotary_of(i), layer_window(config, i), layer_idx=i,
                                                **switches), dense_mlp(config, i), norm, names)
            for i in range(config.num_hidden_layers)]


class DecoderModel(torch.nn.Module):
    """Embedding, layers, final norm; the `model.` prefix of Hugging Face names."""

    def __init__(self, config, layers: list[torch.nn.Module], norm: torch.nn.Module):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(layers)
        self.norm = norm
        self.embed_scale: float | None = None
        self.fused_decode = None  # models/fused_decode.py: pure decode steps in one C++ call, where it covers them
        # Called after each layer (the engine core's CPU governor: a prompt step of many seconds follows the
        # cores a neighbour leaves free while it runs, not only from the next step on).
        self.between_layers: Callable[[], None] | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embedding (scaled, for Gemma): also what an EAGLE head reads its tokens through."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def forward(self, input_ids, positions, meta, num_layers: int | None = None):
        """The final norm of the residual stream after all layers, or after the first `num_layers` (an early
        exit: the self-speculative draft)."""
        x = self.embed(input_ids)
        if num_layers is None and self.fused_decode is not None and self.fused_decode.applies(x, meta):
            return self.fused_decode(x, positions, meta)
        residual = None
        for layer in self.layers[:num_layers]:
            x, residual = layer(positions, x, residual, meta)
            if self.between_layers is not None:
                self.between_layers()
        return self.norm.add_and_norm(x, residual)[0]


class CausalLM(torch.nn.Module):
    """A decoder plus its LM head; `forward` returns hidden states, `compute_logits` the float32 logits."""

    def __init__(self, config, model: DecoderModel, batch_invariant: bool = False):
        super().__init__()
        self.config = config
        self.model = model
        self.batch_invariant = batch_invariant  # every matmul through the batch-invariant kernel
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.packed_lm_head: torch.Tensor | None = None
        self.amx_lm_head: torch.Tensor | None = None
        self.lm_head_blocks: torch.Tensor | None = None  # tied, one copy: `packed_lm_head` read by the C++ kernel
        self.quantized_lm_head: torch.nn.Module | None = None  # set by `quantize()` or a pre-quantized checkpoint
        self.gather_logits = None  # tensor parallelism: this rank's vocabulary slice -> the whole row

    def prepack(self) -> None:
        """Choose every matmul (oneDNN's packed weights, or the batch-invariant kernel); call once the
        weights are loaded and cast."""
        if self.quantized_lm_head is None and self.lm_head is not None and type(self.lm_head) is torch.nn.Linear:
            self.lm_head = Linear.of(self.lm_head)  # packed as the other Linears, its plain weight then dropped
        packer = BlockedPacker()
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack(self.batch_invariant, packer)
            elif isinstance(module, FusedExperts):
                module.prepack(self.batch_invariant)
        if self.quantized_lm_head is None and self.lm_head is None and not self.batch_invariant:
            # Tied: one copy where the few-row kernel reads oneDNN's layout (the embedding then reads the
            # head's packed copy); else the packed copy beside the embedding's, as the Linears keep two there.
            weight = self.lm_head_weight()
            packed, blocks = packer.pack(weight)
            self.lm_head_blocks = blocks if one_copy_layout() else None
            if self.lm_head_blocks is not None:
                self.model.embed_tokens = BlockedEmbedding(packed, self.lm_head_blocks)
            self.packed_lm_head = packed if self.lm_head_blocks is not None or not one_copy_layout() else None
            self.amx_lm_head = amx_pack_weight(weight) if self.lm_head_blocks is None else None

    def quantize(self, method: str, calibration_ids: list[int] | None = None,
                 fill: Callable[[str], None] | None = None) -> None:
        """Quantized weights (`--quantization`): every Linear replaced by its int8 or int4 form, the
        embedding and the LM head (tied: the embedding's own matrix) by int8 ones, the float weights dropped.
        Modules a checkpoint held quantized are in place already and stay as they are. `int8` and `int4`
        first calibrate on the shipped calibration text (`calibration_ids`: its tokens; by default read
        with the tokenizer in the model's folder): SmoothQuant's or AWQ's scales (layers/smoothing.py), and
        for `int4` GPTQ's input statistics (layers/gptq.py). Call once the weights are loaded and cast,
        before `prepack` (which then packs nothing).
        A decoder layer at a time: calibrated (the calibration prompt through it), quantized, its float
        weights dropped. `fill(prefix)`, where given, reads the float weights of a layer (`model.layers.3.`)
        or of the untied head (`lm_head.`) just before they are quantized (a load that streams them,
        models/registry.py): then only one layer's float weights are ever in memory. An untied embedding and
        head are quantized first (the embedding once the calibration prompts are embedded): the head's float
        copy and its quantized forms together were the peak of an 8B start when they came last."""
        scales_run, gptq_run = self._calibration_runs(method, calibration_ids)
        layers = self.model.layers
        if not self.config.tie_word_embeddings:
            self._quantize_embedding_and_head(method, fill, None)
        with log_step(logger, "quantizing %d layers to %s%s", len(layers), method,
                      ", calibrated, by GPTQ" if gptq_run else ", calibrated" if scales_run else ""):
            for i, layer in enumerate(layers):
                if fill is not None:
                    fill(f"model.layers.{i}.")
                if scales_run and method == "int8":
                    smoothing.smooth_layer(self, scales_run, i)
                elif scales_run:
                    smoothing.awq_layer(self, scales_run, i, INT4_GROUP_SIZE)
                hessians = smoothing.layer_hessians(self, gptq_run, i) if gptq_run else {}
                self._quantize_linears(f"model.layers.{i}.", method, hessians)
                assert not hessians, f"GPTQ statistics for no Linear: {sorted(hessians)[:3]}"
                for name, module in layer.named_modules(prefix=f"model.layers.{i}"):
                    if isinstance(module, FusedExperts):
                        module.quantize(method, name)  # each expert as a dense Linear is (layers/moe.py)
                release_freed_memory()  # the layer's float weights, which the heap would keep otherwise
                logger.info("quantized layer %d of %d", i + 1, len(layers))  # minutes at 8B: never silent
            self._quantize_linears("", method, {})  # any outside the decoder layers
        # tied: the embedding's matrix is the head, whose int8 form rounds apart the channels calibrated largest
        self._quantize_embedding_and_head(method, fill, scales_run if method == "int8" else None)

    def _quantize_embedding_and_head(self, method: str, fill: Callable[[str], None] | None,
                                     run: "smoothing.PromptRun | None") -> None:
        """The embedding and the LM head in their int8 forms, where still float; `run`: the calibration
        prompt through every layer, for the tied head's input channels (`smoothing.head_input_max`)."""
        if isinstance(self.model.embed_tokens, torch.nn.Embedding):
            self.model.embed_tokens = quantized_embedding(self.model.embed_tokens.weight, method)
        if self.quantized_lm_head is None:
            if fill is not None and self.lm_head is not None:
                fill("lm_head.")
            head_input = None if run is None else smoothing.head_input_max(run)
            self.quantized_lm_head = self._quantized_head(method, head_input)
            self.lm_head = None
        release_freed_memory()

    def _quantize_linears(self, prefix: str, method: str, hessians: dict[str, torch.Tensor]) -> None:
        """Replace every float Linear whose name starts with `prefix` by its quantized form (GPTQ with its
        Hessian where `hessians` has one, popped), each float weight freed once quantized."""
        for qualified in [name for name, _ in smoothing.float_linears(self, prefix)]:  # names: no module held
            parent_name, _, name = qualified.rpartition(".")
            parent = self.get_submodule(parent_name)
            child = getattr(parent, name)
            setattr(parent, name, quantized_linear(child.weight, child.bias, method, qualified,
                                                   grouped_inputs=name == "down_proj",
                                                   hessian=hessians.pop(qualified, None)))
            del child

    def _calibration_runs(self, method: str, ids: list[int] | None
                          ) -> tuple[smoothing.PromptRun | None, smoothing.PromptRun | None]:
        """The calibration prompts `quantize` takes through the layers, (scales, GPTQ): the first SmoothQuant's
        (`int8`) or AWQ's (`int4`), the second (the whole text) GPTQ's where its statistics fit
        (`smoothing.gptq_fits`); None where there is none (not `int8` or `int4`, some layer held quantized by
        the checkpoint, or no tokenizer). Never a user's prompt."""
        if method not in ("int8", "int4") or not smoothing.all_float(self):
            return None, None
        if ids is None:  # an empty list: no calibration, on purpose (an EAGLE head has no text of its own)
            ids = smoothing.calibration_ids(self.config, smoothing.GPTQ_TOKENS)
            if not ids:
                logger.warning("--quantization %s: no tokenizer in %r to read the calibration text: quantizing "
                               "without calibration", method, getattr(self.config, "name_or_path", ""))
        if not ids:
            return None, None
        scales = smoothing.PromptRun(self, ids[:smoothing.CALIBRATION_TOKENS])
        return scales, smoothing.PromptRun(self, ids) if method == "int4" and smoothing.gptq_fits(self) else None

    def _quantized_head(self, method: str, head_input: torch.Tensor | None = None) -> torch.nn.Module:
        """int8 in both int8 modes and in int4 (which keeps the int8 embedding as head); tied, the embedding's
        own matrix (W8A8 with its calibrated outlier input channels in float, `head_input`)."""
        head_method = int8_head_method(method)
        if self.lm_head is not None:
            return quantized_linear(self.lm_head.weight, None, head_method, "lm_head")
        assert hasattr(self.model.embed_tokens, "lm_head"), type(self.model.embed_tokens)
        return self.model.embed_tokens.lm_head(head_method, head_input)

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids, positions, meta: AttentionMetadata, num_layers: int | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quantized_lm_head is not None:
            logits = self.quantized_lm_head(hidden).float()
        elif self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        elif self.lm_head_blocks is not None:
            logits = blocked_linear(hidden, self.packed_lm_head, self.lm_head_blocks).float()
        else:
            logits = linear(hidden, self.lm_head_weight(), packed=self.packed_lm_head,
                            batch_invariant=self.batch_invariant, amx_packed=self.amx_lm_head).float()
        if self.gather_logits is not None:
            logits = self.gather_logits(logits)
        if self.final_logit_softcapping:
            logits = self._softcap(logits, self.final_logit_softcapping)
        return logits

    def _softcap(self, logits: torch.Tensor, cap: float) -> torch.Tensor:
        # batch-invariant: row by row (aten's tanh takes a scalar path at each thread's range end); a step that
        # samples no row has no logits to stack
        if self.batch_invariant and len(logits):
            return torch.stack([torch.tanh(row / cap) * cap for row in logits])
        return torch.tanh(logits / cap) * cap

    def attention_layers(self) -> list[ReferenceAttention]:
        """In layer order: the i-th reads layer i of the step's KV cache."""
        return [layer.self_attn.attn for layer in self.model.layers]


class LlamaForCausalLM(CausalLM):
    """Llama, Mistral, Qwen2/2.5, Qwen3 and Phi-3 (whose fused `qkv_proj` and `gate_up_proj` are sobrio's own
    packed modules, loaded as they are). A mixture-of-experts subclass sets `mlp_factory`."""

    mlp_factory: MlpFactory = staticmethod(dense_mlp)

    def __init__(self, config, max_positions: int, attn_cls: type[ReferenceAttention] = BatchedDecodeAttention,
                 batch_invariant: bool = False):
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        attention = qwen3_attention(config) if config.model_type.startswith("qwen3") else llama_attention(config)
        layers = [LlamaDecoderLayer(config, rotary, attn_cls, i, self.mlp_factory, attention)
                  for i in range(config.num_hidden_layers)]
        model = DecoderModel(config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps))
        super().__init__(config, model, batch_invariant)
