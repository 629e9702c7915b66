"""`sobrio train-draft --method eagle`: an EAGLE head (speculative/eagle.py) for a served model, trained on the CPU.

The data: the target's own answers (greedy, and sampled ones for more of them) to the shipped prompts and to
requests it wrote itself (draft_training/self_prompts.py: far more varied than the shipped ones), and its final hidden
states over prompt + answer, both from sobrio's engine (the features it will serve with).
At each position j of a sequence the head reads the target's feature f_j and the embedding of x_{j+1};
through a causal decoder layer over the whole sequence (teacher forcing: every earlier position's true
feature) it must give f_{j+1} (smooth L1, EAGLE's regression loss) whose
draft-vocabulary logits name x_{j+2} (cross-entropy). Noise on the input features (EAGLE's) makes it
tolerate its own guesses, which it reads from its second draft on. Losses count on answer positions only.
"""

import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from sobrio.draft_training.train import Answers, one_cycle
from sobrio.speculative.eagle import CONFIG, WEIGHTS, layer_config

IGNORE = -100
FEATURE_NOISE = 0.2  # uniform noise on the input features, times their mean absolute value (EAGLE: U(-0.1, 0.1))


class EagleTrainee(torch.nn.Module):
    """The head in transformers' layers (the serving form, speculative/eagle.EagleDraft, loads the same names)."""

    def __init__(self, config, embed: torch.Tensor, embed_scale: float | None, head_rows: torch.Tensor):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        config._attn_implementation = "sdpa"
        d = config.hidden_size
        self.fc = torch.nn.Linear(2 * d, d)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("embed", embed * (embed_scale or 1.0), persistent=False)  # frozen, the target's
        self.register_buffer("head_rows", head_rows, persistent=False)  # frozen: the draft vocabulary's

    def forward(self, next_tokens: torch.Tensor, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, L] tokens x_{j+1}, [B, L, d] features f_j, each row's length -> the guesses of f_{j+1}."""
        batch, width = next_tokens.shape
        x = self.fc(torch.cat([self.embed[next_tokens], features], dim=-1))
        positions = torch.arange(width)[None].expand(batch, -1)
        valid = torch.arange(width)[None] < lengths[:, None]
        mask = torch.ones(width, width, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
        h = self.layer(x, attention_mask=mask, position_ids=positions,
                       position_embeddings=self.rotary(x, positions))
        return self.norm(h[0] if isinstance(h, tuple) else h)

    def save(self, folder: Path, config, vocab_ids: torch.Tensor, base_model: str, vocab_size: int) -> None:
        """The weights in the names EagleDraft loads, and config.json (the layer's config, what it was for)."""
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG).write_text(json.dumps({"method": "eagle", "base_model": base_model,
                                                 "vocab_size": vocab_size, "layer": _layer_keys(config)},
                                                indent=2) + "\n")
        tensors = {"fc.weight": self.fc.weight, "fc.bias": self.fc.bias, "vocab_ids": vocab_ids,
                   "model.norm.weight": self.norm.weight, "model.embed_tokens.weight": self.head_rows}
        tensors |= {f"model.layers.0.{k}": v for k, v in self.layer.state_dict().items()}
        save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(folder / WEIGHTS))


def batches(sequences: list[list[int]], starts: list[int], hidden: list[torch.Tensor], index: torch.Tensor,
            batch_size: int, generator: torch.Generator | None):
    """Padded batches: next tokens [B, L], features [B, L, d], lengths [B], target features [B, L, d],
    labels [B, L] (the draft-vocabulary index of x_{j+2}; IGNORE on prompt positions, past the end and
    outside the draft vocabulary). A sequence of n tokens gives n - 1 inputs (j = 0..n-2)."""
    order = torch.randperm(len(sequences), generator=generator) if generator is not None else \
        torch.arange(len(sequences))
    for chunk in order.split(batch_size):
        width = max(len(sequences[i]) - 1 for i in chunk)
        d = hidden[0].shape[1]
        tokens = torch.zeros(len(chunk), width, dtype=torch.long)
        feats, goal = torch.zeros(len(chunk), width, d), torch.zeros(len(chunk), width, d)
        labels = torch.full((len(chunk), width), IGNORE, dtype=torch.long)
        lengths = torch.tensor([len(sequences[i]) - 1 for i in chunk])
        for row, i in enumerate(chunk.tolist()):
            seq, h, n = torch.tensor(sequences[i]), hidden[i], len(sequences[i]) - 1
            tokens[row, :n], feats[row, :n], goal[row, :n] = seq[1:], h[:-1], h[1:]
            ahead = index[seq[2:]]  # x_{j+2} for j = 0..n-2
            first = max(0, starts[i] - 1)  # the last prompt position predicts the answer's second token
            labels[row, first:n - 1] = torch.where(ahead[first:] >= 0, ahead[first:], IGNORE)
        yield tokens, feats, lengths, goal, labels


def step_loss(head: EagleTrainee, batch, noise: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, correct top-1 count, counted positions)."""
    tokens, feats, lengths, goal, labels = batch
    if noise:
        feats = feats + (torch.rand_like(feats) * 2 - 1) * noise * feats.abs().mean()
    out = head(tokens, feats, lengths)
    counted = labels != IGNORE
    logits = out[counted] @ head.head_rows.T
    ce = torch.nn.functional.cross_entropy(logits, labels[counted])
    regression = torch.nn.functional.smooth_l1_loss(out[counted], goal[counted])
    correct = (logits.argmax(-1) == labels[counted]).sum()
    return ce + regression, correct, counted.sum()


def answer_prompts(llm, prompts: list[str], max_tokens: int, samples: int) -> Answers:
    """Each prompt's greedy answer (what greedy serving verifies drafts against), then `samples` sampled ones
    (temperature 0.8: more of the target's own phrasing from the same prompts), grouped by prompt."""
    from sobrio.types.params import SamplingParams

    chats = [[{"role": "user", "content": p}] for p in prompts]
    greedy = llm.chat(chats, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=True)
    sampled = llm.chat(chats, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, n=samples,
                                             seed=0), use_tqdm=True) if samples else [None] * len(chats)
    answers = Answers([], [])
    for first, more in zip(greedy, sampled):
        for completion in [first.outputs[0]] + (more.outputs if more is not None else []):
            answers.sequences.append(first.prompt_token_ids + list(completion.token_ids))
            answers.starts.append(len(first.prompt_token_ids))
    return answers


def train_eagle(model: str, out: Path, draft_vocab_size: int = 4096, max_tokens: int = 192, epochs: int = 4,
                lr: float = 1e-3, num_prompts: int | None = None, dtype: str = "auto", samples: int = 1,
                batch_size: int = 8, num_self_prompts: int = 1000) -> dict:
    """The whole recipe; returns the figures written to training.json. The target answers through sobrio's
    engine and its features come from the same engine (the ones the head reads when serving). Besides the
    shipped prompts it answers `num_self_prompts` requests it wrote itself (draft_training/self_prompts.py); the
    held-out answers are the first shipped prompts' only."""
    from sobrio.data import DRAFT_PROMPTS, read_text
    from sobrio.draft_training.self_prompts import self_prompts
    from sobrio.draft_training.train import draft_vocabulary, plot_losses
    from sobrio.llm import LLM

    started = time.monotonic()
    prompts = [p for p in read_text(DRAFT_PROMPTS).splitlines() if p.strip()][:num_prompts]
    llm = LLM(model, dtype=dtype, max_model_len=1024)
    written = self_prompts(llm, num_self_prompts) if num_self_prompts else []
    answers = answer_prompts(llm, prompts + written, max_tokens, samples)
    runner = llm.engine.runner
    hidden = [runner.hidden_states(seq).to(torch.bfloat16) for seq in tqdm(answers.sequences, desc="features")]
    held = max(1, len(prompts) // 10) * (1 + samples)  # the first prompts' answers, all of them
    vocab_ids = draft_vocabulary(Answers(answers.sequences[held:], answers.starts[held:]), draft_vocab_size)
    vocab_size = runner.hf_config.vocab_size
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[vocab_ids] = torch.arange(len(vocab_ids))
    config = layer_config(runner.hf_config, len(vocab_ids))
    target = runner.model
    head = EagleTrainee(config, target.model.embed_tokens.weight.float(), target.model.embed_scale,
                        target.lm_head_weight().float()[vocab_ids])
    del llm, runner, target
    train_set = (answers.sequences[held:], answers.starts[held:], hidden[held:])
    held_set = (answers.sequences[:held], answers.starts[:held], hidden[:held])
    before = held_out_top1(head, held_set, index)
    losses = fit(head, train_set, index, epochs, lr, batch_size)
    head.save(out, config, vocab_ids, model, vocab_size)
    plot_losses(losses, out / "loss.png")
    figures = {"method": "eagle", "model": model, "prompts": len(prompts), "self_prompts": len(written),
               "answers": len(answers.sequences),
               "held_out_answers": held, "positions": sum(len(s) - st for s, st in zip(*train_set[:2])),
               "draft_vocab_size": len(vocab_ids), "epochs": epochs,
               "final_loss": sum(losses[-20:]) / len(losses[-20:]), "held_out_top1_before": before,
               "held_out_top1": held_out_top1(head, held_set, index), "seconds": time.monotonic() - started,
               "bytes": (out / WEIGHTS).stat().st_size}
    (out / "training.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def _layer_keys(config) -> dict:
    """The layer config's keys that EagleFiles.layer_config builds it back from."""
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "hidden_act", "rope_parameters", "max_position_embeddings", "vocab_size",
            "tie_word_embeddings", "attention_bias", "mlp_bias", "model_type")
    return {k: getattr(config, k) for k in keys}


def fit(head: EagleTrainee, data, index: torch.Tensor, epochs: int, lr: float, batch_size: int) -> list[float]:
    """AdamW, one cycle, gradients clipped at norm 1; the loss of every step."""
    return one_cycle(head, lambda generator: batches(*data, index, batch_size, generator),
                     epochs * -(-len(data[0]) // batch_size), epochs, lr,
                     lambda batch: step_loss(head, batch, FEATURE_NOISE)[0], "training the EAGLE head", clip=1.0)


@torch.no_grad()
def held_out_top1(head: EagleTrainee, data, index: torch.Tensor) -> float:
    """The first draft's top-1 on held-out answers, with the true features (its acceptance is near this)."""
    correct = counted = 0
    for batch in batches(*data, index, 8, None):
        _, right, total = step_loss(head, batch, 0.0)
        correct, counted = correct + int(right), counted + int(total)
    return correct / max(counted, 1)
