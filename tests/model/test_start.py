"""What a start does before the first token (issue 43), asserted without timing on a tiny bf16 Llama: `sobrio
serve` spawns the engine core before it imports torch, transformers, FastAPI or the tokenizers (so both
processes load at once); the engine core imports none of the front (text, tokenizer, detokenizing) nor the
server; it reads each tensor of the checkpoint once, straight into its parameter (no staging copy), or points
the parameter at the file's pages until it is packed; it runs one warm-up step. One fresh interpreter does it
all (docs/memory.md, "Start time", has the figures)."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.model.tiny_checkpoints import VOCAB, tokenizer

SCRIPT = textwrap.dedent("""
    import json, shutil, socket, sys
    HEAVY = ("torch", "transformers", "tokenizers", "fastapi")
    result = {}

    from sobrio.engine import core_process

    class Spawned(Exception):
        pass

    def spawn(self, input_addr, output_addr):  # in place of the real spawn: what this process imported by then
        result["imported_at_spawn"] = [m for m in HEAVY if m in sys.modules]
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._folder, ignore_errors=True)
        raise Spawned

    core_process.CoreProcess._start = spawn
    from sobrio.cli import main
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    try:
        main(["serve", sys.argv[1], "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"])
    except Spawned:
        pass

    # the engine core's own start, as its process runs it: what it reads, how many steps, what it imports
    from sobrio.config import SobrioConfig
    from sobrio.engine.model_runner import ModelRunner
    from sobrio.loader import hf
    reads, copies, steps = [], [], []
    execute = ModelRunner.execute
    if hasattr(hf, "StoredTensor"):  # none: no tensor is read in place
        read_into, read, mapped = hf.StoredTensor.read_into, hf.StoredTensor.read, hf.StoredTensor.mapped
        hf.StoredTensor.read_into = lambda self, dest: reads.append(self.name) or read_into(self, dest)
        hf.StoredTensor.read = lambda self: copies.append(self.name) or read(self)
        hf.StoredTensor.mapped = lambda self: reads.append(self.name) or mapped(self)  # the file's pages, not read
    ModelRunner.execute = lambda self, *a, **k: steps.append(1) or execute(self, *a, **k)
    config = SobrioConfig.from_kwargs(model=sys.argv[1], dtype="bfloat16", kv_cache_memory=1 << 22)
    core = core_process._start_core(config)
    result.update(reads=reads, copies=copies, steps=len(steps), modules=sorted(sys.modules))
    print(json.dumps(result))
""")

FRONT_AND_SERVER = ("sobrio.llm", "sobrio.engine.llm_engine", "sobrio.engine.input", "sobrio.engine.detokenize",
                    "sobrio.structured.edge", "sobrio.engine.async_llm", "sobrio.server.app", "fastapi")


def write_checkpoint(folder):
    """A random 2-layer Llama in bf16 (its tensors written directly: no transformers model built)."""
    from transformers import AutoConfig

    from sobrio.loader.hf import write_safetensors

    hidden, inter, kv = 64, 128, 32
    AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                         tie_word_embeddings=False).save_pretrained(folder)
    shapes = {"model.embed_tokens.weight": (VOCAB, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (VOCAB, hidden)}
    for i in range(2):
        layer = f"model.layers.{i}."
        shapes |= {layer + "input_layernorm.weight": (hidden,), layer + "post_attention_layernorm.weight": (hidden,),
                   layer + "self_attn.q_proj.weight": (hidden, hidden), layer + "self_attn.k_proj.weight": (kv, hidden),
                   layer + "self_attn.v_proj.weight": (kv, hidden), layer + "self_attn.o_proj.weight": (hidden, hidden),
                   layer + "mlp.gate_proj.weight": (inter, hidden), layer + "mlp.up_proj.weight": (inter, hidden),
                   layer + "mlp.down_proj.weight": (hidden, inter)}
    generator = torch.Generator().manual_seed(0)
    write_safetensors(folder / "model.safetensors", {name: (torch.randn(shape, generator=generator) * 0.05).bfloat16()
                                                    for name, shape in shapes.items()}, {"format": "pt"})
    tokenizer().save_pretrained(folder)  # the server reads it (today after the core's spawn)
    return folder


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("start"))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder, json.loads(done.stdout.strip().splitlines()[-1])


def test_serve_spawns_the_engine_core_before_importing_torch_or_the_app(start):
    _, result = start
    assert result["imported_at_spawn"] == []


def test_the_engine_core_imports_neither_the_front_nor_the_server(start):
    _, result = start
    assert [m for m in FRONT_AND_SERVER if m in result["modules"]] == []


def test_each_weight_is_read_once_straight_into_its_parameter_and_one_warm_up_step_runs(start):
    from sobrio.loader.hf import safetensors_files, safetensors_names

    folder, result = start
    names = [n for f in safetensors_files(folder) for n in safetensors_names(f)]
    assert sorted(result["reads"]) == sorted(names)  # each once
    assert result["copies"] == []  # none through a tensor of its own (bf16 into bf16 parameters)
    assert result["steps"] == 1
