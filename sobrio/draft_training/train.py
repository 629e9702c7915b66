"""`sobrio train-draft`: draft heads (speculative/medusa.py) for a served model, trained on the CPU in minutes.

1. The target answers the shipped prompts (`sobrio/data/draft_prompts.txt`) greedily through sobrio's own
   engine: the heads learn what this model says, not what a dataset says (Medusa-2's self-distillation).
2. transformers computes the target's last hidden states over prompt + answer, once.
3. The draft vocabulary is the answers' most frequent tokens; each head is trained with cross-entropy to
   guess, from each position's hidden state and the token it produced, the token k places after that,
   with the head and embedding rows frozen.
A tenth of the answers is held out: their top-1 accuracy per head is what the drafts' acceptance will be
near. The folder gets the heads, `config.json`, `training.json` (figures) and `loss.png`.
"""

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from sobrio.data import DRAFT_PROMPTS, read_text
from sobrio.speculative.medusa import DraftHeads, DraftHeadsConfig

logger = logging.getLogger(__name__)
IGNORE = -100  # no label: past the sequence's end
OUTSIDE = -1  # a label outside the draft vocabulary: a miss for the accuracy, no loss


@dataclass
class Answers:
    sequences: list[list[int]]  # prompt + answer token ids
    starts: list[int]  # where each answer begins


def generate_answers(model: str, prompts: list[str], max_tokens: int, dtype: str) -> tuple[Answers, int]:
    """The target's greedy answers through sobrio (chat template applied), and its vocabulary size."""
    from sobrio.llm import LLM
    from sobrio.types.params import SamplingParams

    llm = LLM(model, dtype=dtype, max_model_len=1024)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                       SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=True)
    answers = Answers([o.prompt_token_ids + o.outputs[0].token_ids for o in outputs],
                      [len(o.prompt_token_ids) for o in outputs])
    return answers, llm.engine.runner.hf_config.vocab_size


def hf_model(model: str):
    """transformers' model of the same files (a GGUF is read through its gguf support), fp32."""
    from transformers import AutoModelForCausalLM

    from sobrio.loader.resolve import resolve_model

    path = resolve_model(model).path
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def last_hidden_states(hf, answers: Answers, batch_size: int = 16) -> list[torch.Tensor]:
    """Each sequence's final-norm hidden states [len, d] (what the target's head reads), `batch_size`
    sequences a forward, padded on the right (causal: the padding changes no earlier position)."""
    hidden, sequences = [], answers.sequences
    for i in tqdm(range(0, len(sequences), batch_size), desc="hidden states"):
        batch = sequences[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([seq + [0] * (width - len(seq)) for seq in batch])
        mask = torch.tensor([[1] * len(seq) + [0] * (width - len(seq)) for seq in batch])
        states = hf(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1].float()
        hidden += [states[j, :len(seq)] for j, seq in enumerate(batch)]
    return hidden


def draft_vocabulary(answers: Answers, size: int) -> torch.Tensor:
    counts = Counter(t for seq, start in zip(answers.sequences, answers.starts) for t in seq[start:])
    return torch.tensor(sorted(t for t, _ in counts.most_common(size)), dtype=torch.long)


def training_pairs(answers: Answers, hidden: list[torch.Tensor], num_heads: int, vocab_ids: torch.Tensor,
                   vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [N, d], the token each produced [N], labels [N, heads] in the draft vocabulary: IGNORE past
    the end, OUTSIDE for a token not in it), one row per position from the last prompt token to the one
    before the answer's end."""
    index = torch.full((vocab_size,), OUTSIDE, dtype=torch.long)
    index[vocab_ids] = torch.arange(len(vocab_ids))
    xs, ts, ys = [], [], []
    for seq, start, h in zip(answers.sequences, answers.starts, hidden):
        ids = torch.tensor(seq + [IGNORE] * (num_heads + 1))
        positions = torch.arange(start - 1, len(seq) - 1)
        ahead = torch.stack([ids[positions + 1 + k] for k in range(1, num_heads + 1)], dim=1)
        ys.append(torch.where(ahead >= 0, index[ahead.clamp(min=0)], IGNORE))
        xs.append(h[positions])
        ts.append(ids[positions + 1])
    return torch.cat(xs), torch.cat(ts), torch.cat(ys)


def head_loss(heads: DraftHeads, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the draft vocabulary; positions past the end or outside it (OUTSIDE) do not count."""
    labels = torch.where(y == OUTSIDE, IGNORE, y).flatten()
    return torch.nn.functional.cross_entropy(heads.logits(x, t).flatten(0, 1), labels, ignore_index=IGNORE)


@torch.no_grad()
def top1_accuracy(heads: DraftHeads, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Per head, the share of positions whose guess is right (a token outside the draft vocabulary: a miss)."""
    guess, valid = heads.logits(x, t).argmax(-1), y != IGNORE
    return [float(((guess[:, k] == y[:, k]) & valid[:, k]).sum() / valid[:, k].sum().clamp(min=1))
            for k in range(y.shape[1])]


def train(heads: DraftHeads, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, epochs: int, lr: float,
          batch_size: int = 512) -> list[float]:
    """AdamW over shuffled batches; the loss of every step."""
    return one_cycle(heads, lambda generator: torch.randperm(len(x), generator=generator).split(batch_size),
                     epochs * -(-len(x) // batch_size), epochs, lr,
                     lambda batch: head_loss(heads, x[batch], t[batch], y[batch]), "training draft heads")


def one_cycle(module: torch.nn.Module, epoch_batches, steps: int, epochs: int, lr: float, loss_of, desc: str,
              clip: float | None = None) -> list[float]:
    """AdamW with a one-cycle schedule over `epochs` passes of `epoch_batches(generator)` (shuffled by a
    generator seeded 0), `steps` batches in all; the loss of every step (`loss_of(batch)`), a progress bar."""
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    losses, generator = [], torch.Generator().manual_seed(0)
    module.train()
    with tqdm(total=steps, desc=desc) as bar:
        for _ in range(epochs):
            for batch in epoch_batches(generator):
                loss = loss_of(batch)
                optimizer.zero_grad()
                loss.backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(params, clip)
                optimizer.step()
                schedule.step()
                losses.append(loss.item())
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
                bar.update()
    module.eval()
    return losses


def plot_losses(losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (all heads)")
    ax.set_title("draft heads: training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train_draft(model: str, out: Path, num_heads: int = 3, draft_vocab_size: int = 4096, max_tokens: int = 192,
                epochs: int = 4, lr: float = 3e-3, num_prompts: int | None = None, dtype: str = "auto") -> dict:
    """The whole recipe; returns the figures written to training.json."""
    started = time.monotonic()
    prompts = [p for p in read_text(DRAFT_PROMPTS).splitlines() if p.strip()][:num_prompts]
    answers, vocab_size = generate_answers(model, prompts, max_tokens, dtype)
    hf = hf_model(model)
    hidden = last_hidden_states(hf, answers)
    held = max(1, len(prompts) // 10)
    train_part = Answers(answers.sequences[held:], answers.starts[held:])
    vocab_ids = draft_vocabulary(train_part, draft_vocab_size)
    head = hf.get_output_embeddings().weight.detach().float()
    embed = hf.get_input_embeddings().weight.detach().float()
    config = DraftHeadsConfig(num_heads, head.shape[1], vocab_size, len(vocab_ids), model)
    heads = DraftHeads(config, vocab_ids, head[vocab_ids], embed[vocab_ids])
    x, t, y = training_pairs(train_part, hidden[held:], num_heads, vocab_ids, vocab_size)
    held_out = training_pairs(Answers(answers.sequences[:held], answers.starts[:held]), hidden[:held],
                              num_heads, vocab_ids, vocab_size)
    before = top1_accuracy(heads, *held_out)
    losses = train(heads, x, t, y, epochs, lr)
    heads.save(out)
    plot_losses(losses, out / "loss.png")
    figures = {"model": model, "prompts": len(prompts), "held_out_prompts": held, "positions": len(x),
               "draft_vocab_size": len(vocab_ids), "num_heads": num_heads, "epochs": epochs,
               "final_loss": sum(losses[-20:]) / len(losses[-20:]),
               "held_out_top1_before": before, "held_out_top1": top1_accuracy(heads, *held_out),
               "seconds": time.monotonic() - started,
               "bytes": (out / "draft_heads.safetensors").stat().st_size}
    (out / "training.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures
