"""`sobrio train-lora BASE DATA.jsonl OUT`: a LoRA adapter trained with PEFT on chat examples, written as the
PEFT folder `sobrio serve --enable-lora --lora-modules name=OUT` serves.

Each line of DATA.jsonl is `{"messages": [{"role": ..., "content": ...}, ...]}` with at least one assistant
message. A conversation is rendered with the base model's chat template; the loss counts the assistant
messages' tokens only (each one is what the template adds after the conversation up to it with the
generation prompt), so the adapter learns to answer, not to repeat prompts. The base stays float32 and
frozen on the CPU; only the LoRA matrices train (AdamW, constant learning rate).
"""

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from sobrio.errors import ConfigError

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IGNORE = -100  # transformers' label for a position the loss skips


@dataclass(frozen=True)
class TrainOptions:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    targets: tuple[str, ...] = TARGETS
    epochs: int = 3
    lr: float = 2e-4
    batch_size: int = 4
    max_length: int = 1024
    seed: int = 0
    max_steps: int | None = None


def read_examples(path: Path) -> list[list[dict]]:
    """The conversations of a JSONL file; a malformed line is an error naming its number."""
    examples = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"{path}:{number}: expected a JSON object with \"messages\"", "data") from None
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                         for m in messages):
                raise ConfigError(f"{path}:{number}: messages must be a list of {{role, content}}", "data")
            if not any(m["role"] == "assistant" for m in messages):
                raise ConfigError(f"{path}:{number}: no assistant message to learn from", "data")
            examples.append(messages)
    if not examples:
        raise ConfigError(f"{path}: no examples", "data")
    return examples


def tokenize_example(tokenizer, messages: list[dict], max_length: int) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one conversation: labels are the ids on assistant tokens, IGNORE elsewhere."""
    def render(msgs, generation_prompt=False):
        return list(tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=generation_prompt,
                                                  return_dict=False))

    ids = render(messages)
    labels = [IGNORE] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[:i + 1])
        if through[:len(before)] != before or ids[:len(through)] != through:
            raise ConfigError("the chat template does not render a conversation as its turns one after the other: "
                              "the assistant's tokens cannot be told apart", "data")
        labels[len(before):len(through)] = through[len(before):]
    return ids[:max_length], labels[:max_length]


def train_lora(base: str, data: Path, out: Path, options: TrainOptions = TrainOptions()) -> dict:
    """Train and write the adapter; its figures (examples, steps, first and last loss, seconds)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sobrio.loader.load import load_model_files

    files = load_model_files(base)
    if not getattr(files.tokenizer, "chat_template", None):
        raise ConfigError(f"{base}: its tokenizer has no chat template to render the examples with", "base")
    examples = [tokenize_example(files.tokenizer, m, options.max_length) for m in read_examples(data)]
    torch.manual_seed(options.seed)
    model = AutoModelForCausalLM.from_pretrained(files.folder, dtype=torch.float32)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in options.targets if t in present]
    if not targets:
        raise ConfigError(f"{base} has none of the target modules {list(options.targets)}", "--target-modules")
    peft = get_peft_model(model, LoraConfig(r=options.rank, lora_alpha=options.alpha, lora_dropout=options.dropout,
                                            target_modules=targets, task_type="CAUSAL_LM"))
    trainable = [p for p in peft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=options.lr)
    pad = files.tokenizer.pad_token_id if files.tokenizer.pad_token_id is not None else 0
    order, losses, start = random.Random(options.seed), [], time.monotonic()
    peft.train()
    for _ in range(options.epochs):
        batch_order = list(range(len(examples)))
        order.shuffle(batch_order)
        for first in range(0, len(batch_order), options.batch_size):
            if options.max_steps is not None and len(losses) >= options.max_steps:
                break
            loss = peft(**_batch([examples[i] for i in batch_order[first:first + options.batch_size]], pad)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    peft.save_pretrained(out)
    return {"examples": len(examples), "steps": len(losses), "first_loss": losses[0], "last_loss": losses[-1],
            "seconds": time.monotonic() - start, "targets": targets}


def _batch(items: list[tuple[list[int], list[int]]], pad: int) -> dict:
    """Right-padded input ids, attention mask and labels of a few examples."""
    import torch

    width = max(len(ids) for ids, _ in items)
    ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in items])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in items])
    labels = torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in items])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def add_train_lora_parser(sub) -> None:
    defaults = TrainOptions()
    train = sub.add_parser("train-lora", help="train a LoRA adapter (PEFT) on chat examples, to serve with "
                                              "--enable-lora --lora-modules name=OUT")
    train.add_argument("base", help="alias, HF model folder or .gguf file: the model the adapter is for")
    train.add_argument("data", help='a JSONL file, one {"messages": [{"role", "content"}, ...]} a line; the loss '
                                    "counts the assistant messages only")
    train.add_argument("out", help="the adapter folder to write (adapter_config.json, adapter_model.safetensors)")
    train.add_argument("--rank", type=int, default=defaults.rank, help=f"LoRA rank r (default: {defaults.rank})")
    train.add_argument("--alpha", type=float, default=defaults.alpha,
                       help=f"lora_alpha: the product is scaled by alpha / r (default: {defaults.alpha:g})")
    train.add_argument("--dropout", type=float, default=defaults.dropout,
                       help=f"dropout on the LoRA input while training (default: {defaults.dropout:g})")
    train.add_argument("--target-modules", nargs="+", default=list(defaults.targets), choices=TARGETS,
                       help="the projections that get an adapter, those the model has (default: all seven)")
    train.add_argument("--epochs", type=int, default=defaults.epochs,
                       help=f"passes over the examples (default: {defaults.epochs})")
    train.add_argument("--lr", type=float, default=defaults.lr, help=f"AdamW learning rate (default: {defaults.lr:g})")
    train.add_argument("--batch-size", type=int, default=defaults.batch_size,
                       help=f"examples a step (default: {defaults.batch_size})")
    train.add_argument("--max-length", type=int, default=defaults.max_length,
                       help=f"tokens kept of each example (default: {defaults.max_length})")
    train.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (default: none)")
    train.add_argument("--seed", type=int, default=defaults.seed, help=f"random seed (default: {defaults.seed})")
    train.set_defaults(func=cmd_train_lora)


def cmd_train_lora(args: argparse.Namespace) -> int:
    for name in ("rank", "epochs", "batch_size", "max_length", "max_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}", f"--{name}")
    options = TrainOptions(args.rank, args.alpha, args.dropout, tuple(args.target_modules), args.epochs, args.lr,
                           args.batch_size, args.max_length, args.seed, args.max_steps)
    figures = train_lora(args.base, Path(args.data), Path(args.out), options)
    print(f"wrote {args.out}: rank {options.rank} on {', '.join(figures['targets'])}, {figures['steps']} steps over "
          f"{figures['examples']} examples in {figures['seconds']:.0f} s; loss {figures['first_loss']:.3f} -> "
          f"{figures['last_loss']:.3f}")
    return 0
