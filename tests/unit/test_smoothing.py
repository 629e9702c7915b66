"""Calibrated scales (`sobrio/layers/smoothing.py`): folding SmoothQuant's or AWQ's scales into a float
model leaves its output unchanged (Llama's norms and Gemma's 1 + weight ones, up_proj's rows); on inputs
with outlier channels a smoothed W8A8 layer is nearer the float one than an unsmoothed one, and the LM
head's outlier channels kept in float cut its W8A8 error."""

import pytest
import torch

from sobrio.layers import smoothing
from sobrio.layers.quantization import Outliers, QuantizedLinear, int8_mm, quantize_weight
from sobrio.models.gemma3 import GemmaForCausalLM as Gemma3ForCausalLM
from sobrio.models.llama import LlamaForCausalLM

VOCAB, HIDDEN, TOKENS = 256, 64, 48
OUTLIER_CHANNELS = [3, 17, 40]


def tiny_llama():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config, 64)


def tiny_gemma3():
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
                              layer_types=["sliding_attention", "full_attention"])
    return Gemma3ForCausalLM(config, 64)


def randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Random fp32 weights, the norms with a few large channels: the outliers smoothing is for."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * (0.3 if "norm" in name else 0.05))
            if name.endswith("layernorm.weight"):
                param[OUTLIER_CHANNELS] = 8.0
    return model.float().eval().requires_grad_(False)


def through_every_layer(model: torch.nn.Module, ids: list[int], fold_layer=None) -> smoothing.PromptRun:
    """The prompt through the model's layers in order, `fold_layer(model, run, i)` folding each layer's
    scales in as it goes (as `CausalLM.quantize` does), or not."""
    run = smoothing.PromptRun(model, ids)
    for i in range(len(model.model.layers)):
        if fold_layer is None:
            run.layer(i)
        else:
            fold_layer(model, run, i)
    return run


def hidden_states(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return through_every_layer(model, ids).output().clone()


IDS = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(1)).tolist()
FOLDS = {"smoothquant": lambda model: through_every_layer(model, IDS, smoothing.smooth_layer),
         "awq": lambda model: through_every_layer(model, IDS, lambda m, run, i: smoothing.awq_layer(m, run, i, 32))}


@pytest.mark.parametrize("fold", FOLDS)
@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3])
def test_folded_scales_leave_the_float_model_unchanged(build, fold):
    model = randomized(build())
    before = hidden_states(model, IDS)
    norms = [layer.input_layernorm.weight.clone() for layer in model.model.layers]
    FOLDS[fold](model)
    assert not any(torch.equal(n, layer.input_layernorm.weight) for n, layer in zip(norms, model.model.layers))
    after = hidden_states(model, IDS)
    assert ((after - before).norm() / before.norm()).item() < 1e-5


def outlier_inputs(tokens: int = 64, k: int = 256) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, k, generator=gen)
    x[:, [5, 99, 200]] *= 40  # as after an LLM's RMSNorm
    return x


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).norm() / expected.norm()).item()


def test_smoothing_cuts_the_w8a8_error_on_outlier_channels():
    x, weight = outlier_inputs(), torch.randn(128, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    expected = x @ weight.T
    plain = QuantizedLinear.from_float(weight, None, "int8")(x)
    s = smoothing.smooth_scales(x.abs().amax(0), weight)
    smoothed = QuantizedLinear.from_float(weight * s, None, "int8")(x / s)
    assert relative_error(smoothed, expected) < 0.5 * relative_error(plain, expected)  # measured 0.3x


def test_outlier_channels_in_float_cut_the_heads_w8a8_error():
    x, weight = outlier_inputs(), torch.randn(512, 256, generator=torch.Generator().manual_seed(4)) * 0.05
    q, scale = quantize_weight(weight, torch.float32)
    expected = x @ (q.float() * scale[:, None]).T  # the int8 weight itself: only the activations' error left
    outliers = Outliers.of(x.abs().amax(0), q, scale, 8)
    assert set(outliers.index.tolist()) >= {5, 99, 200}
    assert relative_error(int8_mm(x, q, scale, outliers), expected) < 0.3 * relative_error(int8_mm(x, q, scale),
                                                                                          expected)
