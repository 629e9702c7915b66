"""The pre-quantized weight seam (`models.weights.PrequantizedWeight`): any record type a weights iterator
yields in place of a float tensor is collected by `load_weights` (a fused module's shards in order) and put
in place by `build_model` (`concat(shards).linear(bias)`, the embedding by `embedding(dtype)`, the tied LM
head by `linear(None)`), float biases kept; a fused module quantized in part is refused."""

from dataclasses import dataclass

import pytest
import torch
from transformers import Qwen2Config

from sobrio.layers.grouped import GroupedLinear
from sobrio.layers.linear import Linear
from sobrio.layers.quantization import QuantizedLinear, grouped_int8_preferred, vnni_int8_preferred
from sobrio.layers.vnni import VnniLinear
from sobrio.models.registry import build_model

CONFIG = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


@dataclass
class DenseRecord:
    """A stand-in record type (not Int4Codes): a float matrix behind the protocol."""

    weight: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @staticmethod
    def concat(parts: list["DenseRecord"]) -> "DenseRecord":
        return DenseRecord(torch.cat([p.weight for p in parts]))

    def linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        layer = torch.nn.Linear(self.in_features, self.out_features, bias=bias is not None)
        layer.weight.data, layer.bias = self.weight, None if bias is None else torch.nn.Parameter(bias)
        return layer

    def embedding(self, dtype: torch.dtype) -> torch.nn.Module:
        return torch.nn.Embedding.from_pretrained(self.weight.to(dtype))


def hf_weights() -> dict[str, torch.Tensor]:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return {name: t.detach().clone() for name, t in Qwen2ForCausalLM(CONFIG).state_dict().items()}


def build(weights: dict, as_record) -> torch.nn.Module:
    items = [(n, DenseRecord(t) if as_record(n) else t) for n, t in weights.items()]
    return build_model(CONFIG, 64, iter(items), torch.float32, "reference")


def test_records_replace_their_modules_and_keep_the_float_biases():
    weights = hf_weights()
    model = build(weights, lambda n: n.endswith("proj.weight") or n == "model.embed_tokens.weight")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert not any(isinstance(m, Linear) for m in model.modules())
    q, k, v = (weights[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]))  # shards in order
    assert torch.equal(attn.qkv_proj.bias, torch.cat([weights[f"model.layers.0.self_attn.{p}_proj.bias"]
                                                      for p in "qkv"]))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([weights["model.layers.0.mlp.gate_proj.weight"],
                                                           weights["model.layers.0.mlp.up_proj.weight"]]))
    assert torch.equal(model.model.embed_tokens.weight, weights["model.embed_tokens.weight"])
    assert torch.equal(model.quantized_lm_head.weight, weights["model.embed_tokens.weight"])  # tied
    assert model.packed_lm_head is None


def test_quantize_then_touches_only_the_float_layers_left():
    model = build(hf_weights(), lambda n: "mlp" in n and n.endswith("proj.weight"))
    model.quantize("int8-weight-only")
    assert isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)  # the record's module, untouched
    o_proj = model.model.layers[0].self_attn.o_proj
    expected = (VnniLinear if vnni_int8_preferred(CONFIG.hidden_size, "int8-weight-only")  # by the CPU
                else GroupedLinear if grouped_int8_preferred(CONFIG.hidden_size, torch.float32) else QuantizedLinear)
    assert type(o_proj) is expected


def test_a_fused_module_quantized_in_part_is_refused():
    with pytest.raises(AssertionError, match="quantized whole or not at all"):
        build(hf_weights(), lambda n: n.endswith("q_proj.weight"))
