"""`sobrio bench perplexity`: what each quantization mode costs in quality and saves in memory. For each
mode, the model's perplexity on a held-out text (shipped in `sobrio/data`, never used for calibration),
the bytes of its resident weights and of its KV cache per token, in one table.

Method (Hugging Face's "perplexity of fixed-length models", computed by the engine itself): the text is
tokenized once, without special tokens, and cut into windows of `--window` tokens starting `--stride`
tokens apart. Each window runs as one prompt with `prompt_logprobs=0`, which returns log p(token | the
window's tokens before it) at every position. A token is scored once, in the first window that holds it
past the previous window's end: past the first window every scored token sees at least `window - stride`
tokens of context. Where the tokenizer puts special tokens before a prompt (a BOS), each window starts
with them and its first text token is scored too; otherwise nothing predicts a window's first token, so
the text's first token goes unscored, and with `stride = window` (windows that do not overlap) each
window's first. Perplexity = exp(mean negative log-likelihood).

Prompts run in chunks of `--prompt-chunk` tokens (32), so that every chunk past a window's first reads the
keys and values before it back from the KV cache, as a decode does: a quantized cache (`--kv-cache-dtype`)
would not show otherwise, since a prompt computed in one chunk attends over its fresh keys. Every mode
runs with the same chunks, so the rows compare.
"""

import gc
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sobrio import data
from sobrio.config import SobrioConfig
from sobrio.config.model import DTYPES
from sobrio.errors import ConfigError

UNQUANTIZED = "none"  # the mode without quantization: vLLM's quantization=None
KV_CACHE_MEMORY = 256 << 20  # the windows run a few at a time; the default share of RAM (up to 2 GiB) only costs time


@dataclass(frozen=True)
class Mode:
    """One engine configuration to measure: a weight quantization and a KV-cache dtype."""

    quantization: str = UNQUANTIZED
    kv_cache_dtype: str = "auto"

    @property
    def name(self) -> str:
        return self.quantization + ("" if self.kv_cache_dtype == "auto" else f" + kv {self.kv_cache_dtype}")

    def engine_kwargs(self) -> dict:
        """Engine arguments beyond the defaults: none for the unquantized run, so that it runs on any engine."""
        kwargs = {} if self.quantization == UNQUANTIZED else {"quantization": self.quantization}
        return kwargs | ({} if self.kv_cache_dtype == "auto" else {"kv_cache_dtype": self.kv_cache_dtype})


@dataclass(frozen=True)
class Window:
    """Text tokens [begin, end) run as one prompt; those from `first` on are scored."""

    begin: int
    end: int
    first: int


@dataclass
class ModeResult:
    mode: str
    perplexity: float
    weight_bytes: int
    kv_bytes_per_token: int
    tokens: int  # scored tokens
    seconds: float  # scoring the text, the model's load excluded
    dtype: str


def parse_list(text: str, flag: str) -> list[str]:
    """`none,int8`: the names in order, each once."""
    names = [name.strip() for name in text.split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise ConfigError(f"{flag} takes names separated by commas, each once (got {text!r})", flag)
    return names


def parse_modes(quantization: str, kv_cache_dtype: str = "auto") -> list[Mode]:
    """Every weight quantization with every KV-cache dtype, in the order given."""
    return [Mode(q, kv) for q in parse_list(quantization, "--quantization")
            for kv in parse_list(kv_cache_dtype, "--kv-cache-dtype")]


def check_modes(model: str, dtype: str, modes: list[Mode]) -> None:
    """Refuse a mode the engine does not know before any model loads, so the error comes at once."""
    for mode in modes:
        SobrioConfig.from_kwargs(model=model, dtype=dtype, **mode.engine_kwargs())


def windows(num_tokens: int, window: int, stride: int, score_first: bool) -> list[Window]:
    """Windows of `window` tokens, `stride` apart, until the text ends, each token scored in exactly one.
    `score_first`: special tokens come before each window, so its first token has a context too."""
    spans: list[Window] = []
    scored_to = begin = 0
    while scored_to < num_tokens:
        end = min(begin + window, num_tokens)
        spans.append(Window(begin, end, max(scored_to, begin if score_first else begin + 1)))
        scored_to, begin = end, begin + stride
    return spans


def special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before any prompt (a BOS), as the engine gets them for text."""
    return tokenizer("", add_special_tokens=True).input_ids


def token_nlls(llm, ids: list[int], spans: list[Window], use_tqdm: bool = False) -> list[float]:
    """The negative log-likelihood of each scored token, in text order, from the engine's prompt logprobs."""
    from sobrio import SamplingParams

    prefix = special_prefix(llm.get_tokenizer())
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": prefix + ids[w.begin:w.end]} for w in spans], params, use_tqdm)
    nlls = []
    for w, out in zip(spans, outputs):
        offset = len(prefix) - w.begin  # text token t is prompt token t + offset
        nlls += [-out.prompt_logprobs[t + offset][ids[t]].logprob for t in range(w.first, w.end)]
    return nlls


def measure(mode: Mode, args, text: str) -> ModeResult:
    """Load the model in this mode and score the text with it; the model is freed when this returns."""
    from sobrio import LLM
    from sobrio.models.weights import resident_bytes

    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=KV_CACHE_MEMORY,
              max_num_batched_tokens=args.prompt_chunk, **mode.engine_kwargs())
    tokenizer, runner = llm.get_tokenizer(), llm.engine.runner
    ids = tokenizer(text, add_special_tokens=False).input_ids[:args.max_tokens]
    prefix = special_prefix(tokenizer)
    if len(prefix) + args.window > llm.engine.max_model_len:
        raise ConfigError(f"--window {args.window} does not fit the model's context of {llm.engine.max_model_len} "
                          "tokens", "--window")
    spans = windows(len(ids), args.window, args.stride, score_first=bool(prefix))
    start = time.perf_counter()
    nlls = token_nlls(llm, ids, spans, use_tqdm=not args.no_progress)
    seconds = time.perf_counter() - start
    if not nlls:
        raise ConfigError(f"the text has {len(ids)} token(s): nothing to score", "--text")
    return ModeResult(mode.name, math.exp(sum(nlls) / len(nlls)), resident_bytes(runner.model),
                      runner.kv_spec.token_bytes, len(nlls), seconds, str(runner.dtype).removeprefix("torch."))


def format_table(results: list[ModeResult]) -> str:
    """One row per mode; `vs none`: the change of perplexity from the unquantized run, where there is one."""
    base = next((r.perplexity for r in results if r.mode == UNQUANTIZED), None)
    rows = [("mode", "perplexity", f"vs {UNQUANTIZED}", "weight MB", "KV bytes/token", "tokens evaluated", "seconds")]
    for r in results:
        versus = "-" if base is None or r.mode == UNQUANTIZED else f"{r.perplexity / base - 1:+.2%}"
        rows.append((r.mode, f"{r.perplexity:.4f}", versus, f"{r.weight_bytes / 1e6:.1f}", str(r.kv_bytes_per_token),
                     str(r.tokens), f"{r.seconds:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def add_perplexity_args(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="alias, HF model folder or .gguf file")
    parser.add_argument("--quantization", default=UNQUANTIZED,
                        help=f"modes to measure, separated by commas ({UNQUANTIZED}: unquantized), e.g. "
                             f"{UNQUANTIZED},int8,int8-weight-only")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="KV-cache dtypes to measure with each mode, separated by commas, e.g. auto,int8,fp8")
    parser.add_argument("--prompt-chunk", type=int, default=32,
                        help="tokens of a prompt computed per step: later chunks read the earlier ones back from "
                             "the KV cache, so its dtype counts")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--text", default=None,
                        help=f"UTF-8 text file to measure on (default: the shipped held-out text, {data.HELDOUT})")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    parser.add_argument("--window", type=int, default=512, help="tokens per evaluation window (its context length)")
    parser.add_argument("--stride", type=int, default=256,
                        help="tokens between window starts: past the first window, each scored token sees at "
                             "least window - stride tokens of context (stride = window: windows do not overlap)")
    parser.add_argument("--result-json", default=None)
    parser.add_argument("--no-progress", action="store_true")


def _check_args(args) -> None:
    if args.window < 2:
        raise ConfigError(f"--window must be >= 2 (got {args.window})", "--window")
    if not 1 <= args.stride <= args.window:
        raise ConfigError(f"--stride must be in [1, --window] (got {args.stride})", "--stride")
    if args.prompt_chunk < 1:
        raise ConfigError(f"--prompt-chunk must be >= 1 (got {args.prompt_chunk})", "--prompt-chunk")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ConfigError(f"--max-tokens must be >= 2 (got {args.max_tokens})", "--max-tokens")


def _read_text(path: str | None) -> tuple[str, str]:
    """(name, text) of --text, or of the shipped held-out text."""
    if path is None:
        return data.HELDOUT, data.read_text(data.HELDOUT)
    try:
        return path, Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--text {path}: {exc}", "--text") from None


def cmd_bench_perplexity(args) -> int:
    _check_args(args)
    modes = parse_modes(args.quantization, args.kv_cache_dtype)
    check_modes(args.model, args.dtype, modes)
    name, text = _read_text(args.text)
    results = []
    for mode in modes:
        results.append(measure(mode, args, text))
        gc.collect()  # the previous mode's weights go before the next mode's load
    print(f"{args.model} ({results[0].dtype}) on {name}: windows of {args.window} tokens every {args.stride}, "
          f"prompts in chunks of {args.prompt_chunk}")
    print(format_table(results))
    if args.result_json:
        report = {"model": args.model, "text": name, "window": args.window, "stride": args.stride,
                  "prompt_chunk": args.prompt_chunk,
                  "max_tokens": args.max_tokens, "results": [asdict(r) for r in results]}
        Path(args.result_json).write_text(json.dumps(report, indent=2))
    return 0
