"""Offline throughput at a fixed number in flight, and where its time goes by kind of step: the issue-43
workload (48 requests of 128 random prompt tokens and 64 output, EOS ignored, 16 at a time) through `LLM`, each
model step timed (`ModelRunner.run`) and grouped into pure decode steps and steps with prompt rows, with each
group's rate in GOP/s of the decoder layers (2 x a dense layer's weights a row, `StepFlops`; the LM head and
attention left out, so it reads low; wrong for mixtures of experts) and the first steps' minor page faults
(docs/memory.md, "A step's buffers"). The run starts once the KV cache's pages are mapped and the weights are in
huge pages (the start's lowest-priority threads, `ModelRunner.settle`), as a served benchmark's does after its
quiet gap; `--no-kv-wait` times from the start, with those threads' work taken from the run (docs/memory.md).

    .venv/bin/python benchmarks/offline_steps.py MODEL [--quantization int8] [--num-prompts 48]
        [--input-len 128] [--output-len 64] [--max-num-seqs 16] [--no-kv-wait]
"""

import argparse
import collections
import random
import resource
import time

# isort: off
import sobrio  # noqa: F401  (first: it sets the OpenMP thread policy before torch loads)
# isort: on

from sobrio import LLM, SamplingParams  # noqa: E402
from sobrio.engine import model_runner  # noqa: E402
from sobrio.engine.step_energy import StepFlops  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="alias, HF model folder or .gguf file")
    parser.add_argument("--quantization", default=None, help="as `sobrio serve --quantization` (default: none)")
    parser.add_argument("--num-prompts", type=int, default=48, help="requests (default: %(default)s)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens a request (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens a request (default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="requests in flight (default: %(default)s)")
    parser.add_argument("--kv-cache-memory", type=int, default=2 * 10**9, help="KV cache bytes (default: %(default)s)")
    parser.add_argument("--no-kv-wait", action="store_true", help="time from the start")
    args = parser.parse_args()
    llm = LLM(args.model, quantization=args.quantization, max_num_seqs=args.max_num_seqs,
              kv_cache_memory=args.kv_cache_memory)
    rng = random.Random(0)
    prompts = [[rng.randrange(200, 20000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    if not args.no_kv_wait:
        waited = time.perf_counter()
        state = "done" if llm.engine.core.executor.runner.settle(timeout=300) else "not done, timing anyway"
        print(f"waited {time.perf_counter() - waited:.1f} s for the KV cache's pages and the weights' huge pages "
              f"({state})")

    steps: list[tuple[int, int, float, int]] = []  # (rows, sampled rows, seconds, minor page faults)
    run = model_runner.ModelRunner.run

    def timed(self, step, *rest, **kwargs):
        start, faults = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = run(self, step, *rest, **kwargs)
        steps.append((len(step.input_ids), len(step.sample_rows), time.perf_counter() - start,
                      resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
        return out

    model_runner.ModelRunner.run = timed
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    model_runner.ModelRunner.run = run

    config = llm.engine.hf_config
    layer_gop = (StepFlops(config).per_token - 2.0 * config.vocab_size * config.hidden_size) / 1e9  # dense shapes
    print(f"{args.model} quantization={args.quantization}: {args.num_prompts * args.output_len / elapsed:.1f} output "
          f"tok/s, {elapsed:.1f} s, {len(steps)} steps ({sum(s[2] for s in steps):.1f} s in the model)")
    groups = collections.defaultdict(lambda: [0, 0.0, 0, []])
    for rows, sampled, seconds, faults in steps:
        group = groups["decode" if rows == sampled else "with prompt rows"]
        group[0] += 1
        group[1] += seconds
        group[2] += rows
        group[3].append(faults)
    for kind, (count, seconds, rows, faults) in groups.items():
        print(f"  {kind}: {count} steps, {seconds:.2f} s, {seconds / count * 1e3:.0f} ms a step, "
              f"{rows / count:.0f} rows a step, {layer_gop * rows / seconds:.0f} GOP/s in the layers, "
              f"minor page faults a step: {' '.join(map(str, faults[:6]))}{' ...' if len(faults) > 6 else ''}")


if __name__ == "__main__":
    main()
