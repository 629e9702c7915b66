"""Decode and prompt steps of a bf16 model with one copy of each weight (oneDNN's packed copy, read by the C++
few-row kernel too: today's default where the CPU allows) against two copies (the plain weight beside it, read
by the plain GEMV up to 4 rows, and the tied LM head's packed copy: the layout before issue 43), alternating
in one process on the same loaded model. Prints each mode's step time, the ratio, and the resident bytes.
`--threads 1` (the default) times CPU seconds, so it holds up on a shared machine.

    .venv/bin/python benchmarks/one_copy.py /tmp/sobrio-shapes/llama3.2-1b [--batch 1 4 16] [--prompt 512]
"""

import argparse
import time

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

import torch  # noqa: E402

from sobrio import LLM, SamplingParams  # noqa: E402
from sobrio.layers.linear import BlockedEmbedding, Linear, pack_weight, unblocked  # noqa: E402
from sobrio.models.weights import resident_bytes  # noqa: E402


def two_copies(model) -> None:
    """The layout before issue 43: each Linear's plain weight back beside oneDNN's copy, the tied head packed."""
    for m in model.modules():
        if isinstance(m, Linear) and m.blocks is not None:
            m.saved_blocks, m.blocks = m.blocks, None
            m.weight = torch.nn.Parameter(unblocked(m.saved_blocks), requires_grad=False)
    if isinstance(model.model.embed_tokens, BlockedEmbedding):  # tied: the plain embedding beside the packed head
        model.saved_embedding, model.model.embed_tokens = model.model.embed_tokens, model.model.embed_tokens.plain()
        model.lm_head_blocks = None
    elif model.lm_head is None and model.packed_lm_head is None:
        model.packed_lm_head = pack_weight(model.lm_head_weight())


def one_copy(model) -> None:
    for m in model.modules():
        if isinstance(m, Linear) and getattr(m, "saved_blocks", None) is not None:
            del m.weight
            m.blocks, m.saved_blocks = m.saved_blocks, None
    if getattr(model, "saved_embedding", None) is not None:
        model.model.embed_tokens, model.saved_embedding = model.saved_embedding, None
        model.lm_head_blocks = model.model.embed_tokens.blocks


def step_time(llm, batch: int, prompt: int, steps: int, clock) -> tuple[float, float]:
    """(seconds of the step that computes the prompts, mean seconds of a decode step) at this batch."""
    engine = llm.engine
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", None, SamplingParams(max_tokens=steps + 8, ignore_eos=True),
                           prompt_token_ids=[100 + (i * 7 + j) % 20000 for j in range(prompt)])
    start = clock()
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    prefill = clock() - start
    engine.step()
    start = clock()
    for _ in range(steps):
        engine.step()
    decode = (clock() - start) / steps
    for i in range(batch):
        engine.abort_request(f"b{batch}-{i}")
    return prefill, decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens of each request")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    llm = LLM(args.model, dtype="bfloat16", max_num_batched_tokens=args.prompt, kv_cache_memory=1 << 30,
              enable_prefix_caching=False)
    model = llm.engine.runner.model
    modes = {"one copy": one_copy, "two copies": two_copies}
    for batch in args.batch:
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.repeats):  # alternating, so a burst of load hits both alike
            for name, switch in modes.items():
                switch(model)
                prefill, decode = step_time(llm, batch, args.prompt, args.steps, clock)
                old = best.get(name, (float("inf"), float("inf")))
                best[name] = (min(old[0], prefill), min(old[1], decode))
        (p1, d1), (p2, d2) = best["one copy"], best["two copies"]
        print(f"batch {batch:3}: prompts ({batch} x {args.prompt} tokens) {p1:.2f} s one copy, {p2:.2f} s two "
              f"({p2 / p1:.2f}x) | decode step {d1 * 1e3:.1f} ms one copy, {d2 * 1e3:.1f} ms two ({d2 / d1:.2f}x)",
              flush=True)
    one_copy(model)
    one = resident_bytes(model)
    two_copies(model)
    print(f"resident weights: {one / 1e9:.2f} GB one copy, {resident_bytes(model) / 1e9:.2f} GB two")


if __name__ == "__main__":
    main()
