"""LoRA pieces without an engine: PEFT config fields sobrio lacks refused by name, rank over --max-lora-rank,
--lora-modules' two forms, a LoRALinear over a quantized base equal to the base plus (x @ A) @ B on exactly
its adapter's rows, and the step's token groups."""

import json

import pytest
import torch

from sobrio.config.lora import LoRAConfig
from sobrio.errors import ConfigError, InvalidRequestError
from sobrio.layers.cpu_ops import cpu_ops
from sobrio.layers.lora import LoRABank, LoRALinear, LoRAStep, lora_apply_available, lora_apply_reference
from sobrio.layers.quantization import quantized_linear
from sobrio.loader.lora import ReadBuffer, check_adapter, read_adapter, read_adapter_config

BASE_CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
               "bias": "none", "use_dora": False, "modules_to_save": None, "use_rslora": False}


def _folder(tmp_path, **fields):
    (tmp_path / "adapter_config.json").write_text(json.dumps({**BASE_CONFIG, **fields}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    return tmp_path


@pytest.mark.parametrize("fields, named", [
    ({"use_dora": True}, "use_dora"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "lora_only"}, "bias"), ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"), ({"layers_to_transform": [0]}, "layers_to_transform"),
    ({"peft_type": "IA3"}, "IA3"), ({"r": 64}, "--max-lora-rank")])
def test_what_sobrio_does_not_compute_is_refused_by_name(tmp_path, fields, named):
    with pytest.raises(InvalidRequestError, match=named):
        read_adapter_config(_folder(tmp_path, **fields), max_rank=16)


def test_an_adapter_read_in_one_go_holds_its_files_tensors(tmp_path):
    """read_adapter stacks each target's A and B of every layer from the file's bytes (dtypes kept), a second
    read into the memory of the first; a file
    cut short, a header that is not JSON and another model's shapes are refused with InvalidRequestError."""
    from safetensors.torch import save_file

    _folder(tmp_path)
    shapes, layers = {"q_proj": (24, 16), "v_proj": (8, 16)}, 3
    tensors = {f"base_model.model.model.layers.{i}.self_attn.{t}.lora_{m}.weight":
               torch.randn(*((8, shapes[t][1]) if m == "A" else (shapes[t][0], 8))).to(dtype)
               for i in range(layers) for t, dtype in (("q_proj", torch.bfloat16), ("v_proj", torch.float32))
               for m in "AB"}
    file = tmp_path / "adapter_model.safetensors"
    buffer, memories = ReadBuffer(), []
    for _ in range(2):  # the second read into the same buffer: another adapter's values, the same pages
        save_file(tensors, str(file))
        scaling, stacks = read_adapter(tmp_path, 16, layers, shapes, buffer)
        assert scaling == 2.0 and list(stacks) == ["q_proj", "v_proj"]
        for t, (a, b) in stacks.items():
            for i in range(layers):
                prefix = f"base_model.model.model.layers.{i}.self_attn.{t}"
                assert torch.equal(a[i], tensors[f"{prefix}.lora_A.weight"])
                assert torch.equal(b[i], tensors[f"{prefix}.lora_B.weight"])
        memories.append(buffer.memory)
        tensors = {name: torch.randn_like(t.float()).to(t.dtype) for name, t in tensors.items()}
    assert memories[0] is memories[1]
    with pytest.raises(InvalidRequestError, match="another base model"):
        check_adapter(tmp_path, 16, layers, {"q_proj": (24, 16), "v_proj": (9, 16)})
    file.write_bytes(file.read_bytes()[:-4])
    with pytest.raises(InvalidRequestError, match="cut short"):
        read_adapter(tmp_path, 16, layers, shapes)
    file.write_bytes(b"\x10" + b"\0" * 7 + b"not json" * 2)
    with pytest.raises(InvalidRequestError, match="unreadable"):
        check_adapter(tmp_path, 16, layers, shapes)


def test_alpha_and_rslora_scaling(tmp_path):
    assert read_adapter_config(_folder(tmp_path), 16).scaling == 2.0
    assert read_adapter_config(_folder(tmp_path, use_rslora=True), 16).scaling == 16 / 8 ** 0.5


def test_lora_modules_in_both_forms():
    config = LoRAConfig(enable_lora=True, lora_modules=["sql=/a", '{"name": "rev", "path": "/b", '
                                                                  '"base_model_name": "base"}'])
    assert config.modules() == [("sql", "/a", None), ("rev", "/b", "base")]
    with pytest.raises(ConfigError, match="--lora-modules"):
        LoRAConfig(enable_lora=True, lora_modules=["no-path"])
    with pytest.raises(ConfigError, match="--enable-lora"):
        LoRAConfig(lora_modules=["a=/b"])


def test_a_quantized_base_plus_each_adapter_on_its_rows_only():
    torch.manual_seed(0)
    weight = torch.randn(48, 64)
    base = quantized_linear(weight, None, "int8-weight-only", "o_proj")
    step = LoRAStep(slots=3)
    bank = LoRABank([("q_proj", 32), ("k_proj", 16)], 64, layers=1, slots=3, dtype=torch.float32)
    module = LoRALinear(base, bank, 0, step)
    pairs = {1: {"q_proj": (torch.randn(4, 64), torch.randn(32, 4))}, 2: {"k_proj": (torch.randn(2, 64),
                                                                                     torch.randn(16, 2))}}
    for adapter_id, p in pairs.items():
        for target, (a, b) in p.items():
            bank.add(adapter_id, target, a[None], b[None])
    x = torch.randn(10, 64)
    step.set([1, None, 2, 1], [3, 2, 1, 4])  # adapter 1 on rows 0-2 and 6-9, adapter 2 on row 5
    got, plain = module(x), base(x)
    want = plain.clone()
    a, b = pairs[1]["q_proj"]
    rows = [0, 1, 2, 6, 7, 8, 9]
    want[rows, :32] += (x[rows] @ a.T) @ b.T
    a, b = pairs[2]["k_proj"]
    want[5, 32:] += (x[5] @ a.T) @ b.T
    torch.testing.assert_close(got, want)
    assert step.rows.tolist() == [0, 1, 2, 6, 7, 8, 9, 5] and step.offsets.tolist() == [0, 7, 8]
    step.set([2, 2, None], [1, 3, 2])  # contiguous rows: a slice, no gather
    assert step.span == slice(0, 4) and step.slots.tolist() == [2]
    bank.remove(1)  # an emptied slot adds nothing
    step.set([1], [10])
    torch.testing.assert_close(module(x), base(x))


@pytest.mark.skipif(not lora_apply_available(), reason="the C++ operators did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lora_operator_equals_its_reference(dtype):
    """Slices of widths off the 64-column tiles, adapters of three ranks (the slots repacked as the rank
    grows), one skipping two projections; rows of several groups, one group of many rows, and one or two
    threads (a lone group's tiles split between them)."""
    torch.manual_seed(0)
    step = LoRAStep(slots=5)
    slices = [("q_proj", 100), ("k_proj", 70), ("v_proj", 130)]
    bank = LoRABank(slices, 72, layers=2, slots=5, dtype=dtype)
    reference = LoRABank(slices, 72, layers=2, slots=5, dtype=torch.float64)  # the same adapters, in float64
    for slot, rank, targets in [(3, 4, ["q_proj", "v_proj"]), (0, 8, ["k_proj"]), (4, 6, bank.targets)]:
        for target in targets:
            width = bank.widths[bank.targets.index(target)]
            a = torch.randn(2, rank, 72, dtype=dtype)
            b = torch.randn(2, width, rank).to(dtype).float()  # float32 into bf16: converted as placed
            bank.add(slot, target, a, b, scaling=0.5)
            reference.add(slot, target, a, b, scaling=0.5)
    tolerance = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    threads = torch.get_num_threads()
    try:
        for slots, lengths in [([3, None, 0, 4, 3], [1, 2, 1, 5, 1]), ([4], [40]), ([0, 3], [1, 1])]:
            step.set(slots, lengths)
            x, y = torch.randn(sum(lengths), 72, dtype=dtype), torch.randn(sum(lengths), 300, dtype=dtype)
            want = y.double()
            lora_apply_reference(want, x.double(), reference, 1, step)
            for count in (1, 2):
                torch.set_num_threads(count)
                got = y.clone()
                cpu_ops().lora_apply(got, x, bank.a_of[1], bank.b_of[1], bank.ranks, bank.scales, bank.widths,
                                     step.rows, step.slots, step.offsets)
                torch.testing.assert_close(got, want.to(dtype), **tolerance)
    finally:
        torch.set_num_threads(threads)
