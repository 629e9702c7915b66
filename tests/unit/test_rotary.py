"""RoPE tables of every scaled type build on the meta device as on the CPU: `sobrio bench roofline` counts a
model's weights on a copy built there, and transformers makes scaled frequencies on the CPU whatever the
default device (a Llama 3.x or Phi-3.5 checkpoint failed that count)."""

import pytest
import torch
from transformers import AutoConfig

from sobrio.layers.rotary import RotaryEmbedding
from tests.model.tiny_checkpoints import BASE, EXHAUSTIVE_FAMILIES, FAMILIES

SCALED = {name: family for name, family in {**FAMILIES, **EXHAUSTIVE_FAMILIES}.items()
          if "rope_parameters" in family[1]}


def test_the_scaled_types_are_all_here():
    types = {fields["rope_parameters"]["rope_type"] for _, fields in SCALED.values()}
    assert types == {"llama3", "yarn", "longrope", "linear", "dynamic"}


@pytest.mark.parametrize("name", sorted(SCALED))
def test_scaled_rope_builds_on_the_meta_device(name):
    model_type, fields = SCALED[name]
    config = AutoConfig.for_model(model_type, **{**BASE, **fields})
    on_cpu = RotaryEmbedding(config, BASE["head_dim"], 300)
    with torch.device("meta"):
        on_meta = RotaryEmbedding(config, BASE["head_dim"], 300)
    assert on_meta.cos.is_meta and on_meta.sin.is_meta
    assert on_meta.cos.shape == on_cpu.cos.shape and on_meta.rotary_dim == on_cpu.rotary_dim
    assert not on_cpu.cos.is_meta and torch.isfinite(on_cpu.cos).all()
