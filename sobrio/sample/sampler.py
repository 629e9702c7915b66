"""Turn a step's logits into tokens: penalties, min_tokens, greedy or temperature / top-k / top-p / min-p.

Random rows sample by inverse CDF, drawing their uniform from the request's own generator when it has a
seed, so its tokens do not depend on what else is in the batch.
"""

from dataclasses import dataclass

import torch

from sobrio.csrc import load as cpu_ops
from sobrio.sample.metadata import SamplingMetadata, TokenBitmask


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None  # raw model log-probability of the chosen token
    rank: int | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Repetition (prompt and output), frequency and presence (output) penalties, in place."""
    vocab = logits.shape[-1]
    for row in range(meta.num_rows):
        if not meta.has_penalties(row):
            continue
        out_ids = torch.tensor(meta.output_token_ids[row], dtype=torch.long)
        counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(logits.dtype)
        repetition = meta.repetition_penalty[row]
        if repetition != 1.0:
            seen = counts > 0
            seen[torch.tensor(meta.prompt_token_ids[row], dtype=torch.long)] = True
            x = logits[row]
            logits[row] = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        logits[row] -= (meta.frequency_penalty[row] * counts
                        + meta.presence_penalty[row] * (counts > 0).to(logits.dtype))


def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """OpenAI's logit_bias: each listed token's logit moves by its bias (before penalties, as vLLM), in place."""
    for row, bias in enumerate(meta.logit_bias):
        if bias:
            logits[row, torch.tensor(list(bias), dtype=torch.long)] += torch.tensor(list(bias.values()),
                                                                                  dtype=logits.dtype)


def apply_token_bitmask(logits: torch.Tensor, allowed: TokenBitmask) -> None:
    """-inf wherever a constrained row's bitmask forbids, in place: llguidance's kernel reads the packed bits
    (0.2 ms for 32 rows of a 49k vocabulary, where unpacking them to a bool mask and `masked_fill_` took 4 ms).
    Only the constrained rows: the others keep every token of the model's vocabulary. Imported here: the kernel is
    `torch.compile`d, and importing it imports torch's compiler (over half of an engine core's imports, which a
    restart after a core's death waits for) where no structured request may ever come."""
    from llguidance.torch import apply_token_bitmask_inplace

    constrained = logits[allowed.rows]
    apply_token_bitmask_inplace(constrained, allowed.bits[:, :(logits.shape[-1] + 31) // 32])
    logits[allowed.rows] = constrained


def apply_masks(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Banned tokens (min_tokens), the allowed-token mask (structured output), then logits processors."""
    for row, banned in enumerate(meta.banned_token_ids):
        if banned:
            logits[row, banned] = float("-inf")
    if meta.allowed_tokens is not None:
        apply_token_bitmask(logits, meta.allowed_tokens)
    for processor in meta.logits_processors:
        logits = processor(logits)
    return logits


TOP_CANDIDATES = 256  # the nucleus is looked for among a row's best tokens first (topk), the whole row if need be


def filter_top_k_top_p_min_p(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                             min_p: list[float]) -> torch.Tensor:
    """Set the logits outside each row's top-k, top-p nucleus and min-p floor to -inf."""
    vocab = logits.shape[-1]
    rows = [r for r, (k, p) in enumerate(zip(top_k, top_p)) if 0 < k < vocab or p < 1.0]
    if rows:
        k = torch.tensor([top_k[r] if 0 < top_k[r] < vocab else vocab for r in rows]).unsqueeze(1)
        p = torch.tensor([top_p[r] for r in rows], dtype=logits.dtype).unsqueeze(1)
        width = min(vocab, max([TOP_CANDIDATES] + [top_k[r] for r in rows if top_k[r] > 0]))
        chosen = logits[rows]
        kept, exact = _keep_top_k_top_p(chosen, k, p, width)
        if not exact.all():  # a nucleus wider than the candidates: sort those rows whole
            redo = exact.logical_not().nonzero().squeeze(1)
            kept[redo] = _keep_top_k_top_p(chosen[redo], k[redo], p[redo], vocab)[0]
        logits = logits.index_copy(0, torch.tensor(rows), kept)
    if any(min_p):
        probs = logits.softmax(dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, dtype=probs.dtype).unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _keep_top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor,
                      width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows filtered to their top k and top-p nucleus, looking at their `width` best tokens only; and, per row,
    whether that was exact (the cut fell among them). A [300, 49k] sort costs 1.4 s on one AMD EPYC core,
    a top-256 70 ms: most nuclei hold a few dozen tokens."""
    values, order = logits.topk(width, dim=-1) if width < logits.shape[-1] else logits.sort(dim=-1, descending=True)
    probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()
    before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
    keep = (torch.arange(width).unsqueeze(0) < k) & ((before < p) | (p >= 1))  # top-p 1 is off: a float cumsum
    # can reach 1 before the row's end and cut a top-k's last tokens
    keep[:, 0] = True
    exact = (k.squeeze(1) <= width) | (before[:, -1] + probs[:, -1] >= p.squeeze(1))
    kept = torch.full_like(logits, float("-inf")).scatter_(1, order, values.masked_fill_(~keep, float("-inf")))
    return kept, exact


def cpp_logits(logits: torch.Tensor) -> tuple[object, torch.Tensor] | None:
    """The C++ operators and the logits as they read them (float32 [B, V], V > 0, rows copied to unit stride
    where they are strided), or None where they are not built or cannot read these."""
    ops = cpu_ops()
    if ops is None or logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0:
        return None
    return ops, logits if logits.stride(1) == 1 else logits.contiguous()


def row_rules(meta: SamplingMetadata, rows: list[int]) -> tuple[torch.Tensor, ...]:
    """The rows' temperature, top-k, top-p and min-p as the C++ operators take them (`sample_rows`,
    `top_k_top_p_probs`)."""
    return (torch.tensor([meta.temperature[r] for r in rows], dtype=torch.float32),
            torch.tensor([meta.top_k[r] for r in rows], dtype=torch.long),
            torch.tensor([meta.top_p[r] for r in rows], dtype=torch.float32),
            torch.tensor([meta.min_p[r] for r in rows], dtype=torch.float32))


def sample_random(logits: torch.Tensor, meta: SamplingMetadata, rows: list[int]) -> torch.Tensor:
    """Inverse-CDF sampling over each row's kept tokens in vocabulary order: one uniform per row, from the
    request's own generator when it is seeded. Leaves `logits` alone.

    The C++ `sample_rows` does the temperature, top-k, top-p and min-p of float32 rows in a few passes over
    each (a histogram of the weights finds where a nucleus ends; nothing else is sorted), where this PyTorch
    path makes several [B, V] tensors and sorts whole rows when a nucleus is wider than its 256 candidates: at a
    128k vocabulary that cost more than a decode step's matmuls (docs/benchmarks.md). The path stays for other
    dtypes and for CPUs without the operators.
    """
    uniform = torch.rand(len(rows))
    for i, row in enumerate(rows):
        generator = meta.generators.get(row)
        if generator is not None:
            uniform[i] = torch.rand(1, generator=generator)
    rules = row_rules(meta, rows)
    if (cpp := cpp_logits(logits)) is not None:
        ops, rows_read = cpp
        return ops.sample_rows(rows_read, *rules, uniform)
    logits = filter_top_k_top_p_min_p(logits / rules[0].to(logits.dtype).unsqueeze(1),
                                      [meta.top_k[r] for r in rows], [meta.top_p[r] for r in rows],
                                      [meta.min_p[r] for r in rows])
    cdf = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_().cumsum_(dim=-1)  # unnormalized
    tokens = torch.searchsorted(cdf, uniform.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    return tokens.clamp_(max=logits.shape[-1] - 1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, by torch.max's rule (the first of equal maxima; a row's first NaN, if it has one):
    the C++ `argmax_rows` over float32 rows, both threads (torch.max took ~1 ms of a batch-32 step in one),
    else torch.max (itself 2.5x faster than argmax on a [32, 49152] step)."""
    if (cpp := cpp_logits(logits)) is not None:
        ops, rows_read = cpp
        return ops.argmax_rows(rows_read)
    return logits.max(dim=-1).indices


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> list[SampledToken]:
        """logits: [B, V] float32, one row per sampling request (left unchanged: edits are made on a copy)."""
        assert logits.shape[0] == meta.num_rows
        want_logprobs = any(n is not None for n in meta.num_logprobs)
        raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
        if not meta.rewrites_logits():  # all greedy, nothing to apply: no copy of [32, 49152] a step (1%)
            return [with_logprobs(t, raw_logprobs, i, meta.num_logprobs[i])
                    for i, t in enumerate(greedy_tokens(logits).tolist())]
        if meta.edits_logits():  # on a copy: the engine's logits are inference tensors, and logprobs read them
            logits = logits.clone()
            apply_logit_bias(logits, meta)
            apply_penalties(logits, meta)
            logits = apply_masks(logits, meta)
        random_rows = [i for i in range(meta.num_rows) if not meta.is_greedy(i)]
        if random_rows and len(random_rows) == meta.num_rows:  # not a step with no rows: 0 == 0
            tokens = sample_random(logits, meta, random_rows)  # no argmax: no row would keep it
        else:
            tokens = greedy_tokens(logits)
            if random_rows:
                rows = torch.tensor(random_rows)
                tokens[rows] = sample_random(logits[rows], meta, random_rows)
        token_list = tokens.tolist()
        return [with_logprobs(token_list[i], raw_logprobs, i, meta.num_logprobs[i]) for i in range(meta.num_rows)]


def with_logprobs(token: int, raw_logprobs: torch.Tensor | None, row: int, n: int | None) -> SampledToken:
    """The token with its raw logprob, rank and the row's top n, when `n` asks for them (None: not)."""
    if n is None:
        return SampledToken(token)
    row_lp = raw_logprobs[row]
    chosen = row_lp[token].item()
    rank = int((row_lp > chosen).sum().item()) + 1
    top = []
    if n > 0:
        values, ids = row_lp.topk(n)
        top = list(zip(ids.tolist(), values.tolist()))
    return SampledToken(token, chosen, rank, top)
