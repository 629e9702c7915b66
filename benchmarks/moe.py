"""A mixture-of-experts decode step against a dense one with the same active parameters.

The MoE model has Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of
intermediate 768, top 8, `norm_topk_prob`), fewer layers, random bf16 weights; the dense model is the same
network with each sparse FFN replaced by one gated FFN of 8 x 768 = 6144 (Qwen3-MoE's own dense layers,
`mlp_only_layers`): the same attention, the same FLOPs per token, minus the router. Both run the decoder
(no LM head: it is the same in both) over one-token-per-sequence decode steps on a KV cache of
`--context` tokens per sequence, at each `--batch`, their steps alternating so that load from other
processes falls on both alike. Prints each one's median step, their ratio, the FFN's share of each step
(timed by forward hooks) and the distinct experts a step reads per layer: at batch B the router picks up
to 8 B of the 128, and a decode step is bound by reading weights.

    .venv/bin/python benchmarks/moe.py [--layers 2] [--batch 1 16] [--steps 20] [--quantization int8]
"""

import argparse
import contextlib
import statistics
import time

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402

from sobrio.kv.cache import KVCache  # noqa: E402
from sobrio.layers.attention import AttentionMetadata, resolve_backend  # noqa: E402
from sobrio.layers.moe import SparseMoE  # noqa: E402
from sobrio.models.moe import MoeForCausalLM  # noqa: E402

BLOCK = 16
SHAPES = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
              num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, vocab_size=4096,
              rms_norm_eps=1e-6, max_position_embeddings=4096)


def build(layers: int, dense: bool, quantization: str | None) -> MoeForCausalLM:
    """The model in bf16 with random weights (std 1 / sqrt(fan-in); the router's 4x, decisive routing)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3_moe", num_hidden_layers=layers, intermediate_size=8 * 768,
                                  mlp_only_layers=list(range(layers)) if dense else [], **SHAPES)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = MoeForCausalLM(config, SHAPES["max_position_embeddings"], resolve_backend("auto"))
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0, param.shape[-1] ** -0.5 * (4 if name.endswith("mlp.gate.weight") else 1))
    model = model.eval().requires_grad_(False)
    if quantization:
        model.quantize(quantization, calibration_ids=[])
    model.prepack()
    return model


def decode_inputs(model: MoeForCausalLM, batch: int, context: int):
    """One decode step of `batch` sequences with `context` tokens each (the last one new), on a cache of its own."""
    attn = model.attention_layers()
    blocks = -(-context // BLOCK)
    shape = (2, batch * blocks, BLOCK, attn[0].num_kv_heads, attn[0].head_dim)
    cache = KVCache([torch.randn(shape, dtype=torch.bfloat16) for _ in attn])
    tables = torch.arange(batch * blocks).view(batch, blocks)
    slots = tables[:, (context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK
    ids = torch.randint(0, SHAPES["vocab_size"], (batch,))
    positions = torch.full((batch,), context - 1)
    return ids, positions, lambda: AttentionMetadata(slots, list(range(batch + 1)), [context] * batch, tables,
                                                     BLOCK, cache)


class FfnTimer:
    """Seconds spent in the model's FFN modules (sparse or dense), and the distinct experts each sparse one
    ran, while open."""

    def __init__(self, model: MoeForCausalLM):
        self.model = model
        self.seconds, self.experts, self.calls, self._start, self._handles = 0.0, 0, 0, 0.0, []

    def __enter__(self) -> "FfnTimer":
        for layer in self.model.model.layers:
            self._handles += [layer.mlp.register_forward_pre_hook(self._begin),
                              layer.mlp.register_forward_hook(self._end)]
            if isinstance(layer.mlp, SparseMoE):
                self._handles.append(layer.mlp.gate.register_forward_hook(self._counter(layer.mlp.top_k)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def reset(self) -> None:
        self.seconds, self.experts, self.calls = 0.0, 0, 0

    def _begin(self, *_):
        self._start = time.perf_counter()

    def _end(self, *_):
        self.seconds += time.perf_counter() - self._start

    def _counter(self, top_k: int):
        def count(_module, _args, logits):
            self.experts += int(logits.topk(top_k).indices.unique().numel())
            self.calls += 1
        return count


def time_steps(models: dict[str, MoeForCausalLM], batch: int, context: int, steps: int) -> dict[str, tuple]:
    """Per model: (median seconds a step, the FFN's share of the step, distinct experts per sparse layer). The
    models' steps alternate, so that load from other processes falls on both alike."""
    inputs = {kind: decode_inputs(model, batch, context) for kind, model in models.items()}
    times: dict[str, list[float]] = {kind: [] for kind in models}
    with torch.inference_mode(), contextlib.ExitStack() as stack:
        timers = {kind: stack.enter_context(FfnTimer(model)) for kind, model in models.items()}
        for step in range(steps + 3):
            for kind, model in models.items():
                ids, positions, meta = inputs[kind]
                if step == 3:
                    timers[kind].reset()
                start = time.perf_counter()
                model(ids, positions, meta())
                times[kind].append(time.perf_counter() - start)
    result = {}
    for kind, timer in timers.items():
        median = statistics.median(times[kind][3:])
        result[kind] = (median, timer.seconds / sum(times[kind][3:]), timer.experts / max(timer.calls, 1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (Qwen3-30B-A3B has 48)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=256, help="tokens in the KV cache per sequence")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quantization", default=None, help="int8, int8-weight-only or int4 (both models)")
    args = parser.parse_args()
    models = {kind: build(args.layers, kind == "dense", args.quantization) for kind in ("moe", "dense")}
    print(f"{args.layers} layers, context {args.context}, {torch.get_num_threads()} threads, "
          f"weights {args.quantization or 'bf16'}")
    for batch in args.batch:
        result = time_steps(models, batch, args.context, args.steps)
        (moe, moe_share, experts), (dense, dense_share, _) = result["moe"], result["dense"]
        print(f"batch {batch:3d}: MoE step {moe * 1e3:7.2f} ms (experts {moe_share:.0%}, {experts:.0f} of 128 "
              f"experts a layer), dense {dense * 1e3:7.2f} ms (FFN {dense_share:.0%}), MoE / dense {moe / dense:.2f}x")

if __name__ == "__main__":
    main()
