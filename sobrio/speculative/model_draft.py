"""Drafts from a model run greedily a few tokens ahead: the served model cut short (`layer_skip`) or a smaller
model of the same tokenizer (`draft_model`).

`layer_skip` (LayerSkip's self-speculation): the model's first `exit_layer` layers, its final norm and its
head guess the next tokens. Their attention reads and writes the KV cache of those first layers, which the
full model fills with the same values for every position it computes: no second model, no second KV cache.
A model not trained for early exits guesses poorly from its shallow layers (`benchmarks/spec_decode.sh`).

`draft_model` (Leviathan et al.): a second, smaller model keeps its own KV cache, indexed by the target's
block ids (same block size, same number of blocks), so the block manager serves both unchanged. The draft
computes its KV only when it drafts: its first pass also feeds the tokens it has not seen
(`Request.num_draft_kv`: a request trusts only positions it wrote itself, which a preemption resets), so a
step that does not speculate (many requests in flight) costs nothing more, and a prefix-cache hit is
caught up in one pass.

Both draft into slots taken ahead of the verifying step (the scheduler's own allocation then finds them);
the verifying step rewrites those positions in both caches, so a rejected guess never outlives its step.
"""

import json
from collections.abc import Callable
from pathlib import Path

from sobrio.config import ModelConfig
from sobrio.config.speculative import OPTION
from sobrio.errors import ConfigError
from sobrio.loader.load import LoadedModelFiles, load_model_files
from sobrio.types.request import Request

Drafter = Callable[[list[Request], list[int], int | None], list[list[int]]]  # Executor.draft
Reserve = Callable[[Request, int], bool]  # KVCacheManager.allocate_slots


class ModelDraftProposer:
    needs_hidden = False

    def __init__(self, draft: Drafter, reserve: Reserve, exit_layer: int | None, num_speculative_tokens: int):
        self.draft, self.reserve = draft, reserve
        self.exit_layer, self.k = exit_layer, num_speculative_tokens

    def propose_batch(self, todo: list[tuple[Request, int]], hidden: dict) -> dict[str, list[int]]:
        """Drafts for the requests that get KV slots for them; one without free blocks does not draft."""
        ready = [(req, min(self.k, limit)) for req, limit in todo]
        ready = [(req, n) for req, n in ready if self.reserve(req, n)]
        if not ready:
            return {}
        drafts = self.draft([req for req, _ in ready], [n for _, n in ready], self.exit_layer)
        return {req.request_id: tokens for (req, _), tokens in zip(ready, drafts)}


def load_draft_model(name: str, quantization: str | None, target: LoadedModelFiles) -> LoadedModelFiles:
    """The draft model's config and weights, refused (ConfigError) unless it reads and writes text with the
    target's tokenizer: its token ids are the target's drafts."""
    files = load_model_files(ModelConfig(model=name, quantization=quantization), tokenizer=False)
    problem = tokenizer_mismatch(target.folder, files.folder)
    if problem or files.config.vocab_size < target.config.vocab_size:
        problem = problem or (f"its vocabulary has {files.config.vocab_size} rows, the target's "
                              f"{target.config.vocab_size}")
        raise ConfigError(f"{OPTION}: draft model {name!r} has another tokenizer than {target.source.name!r} "
                          f"({problem}); a draft model must share the target's tokenizer", OPTION)
    return files


def tokenizer_mismatch(target: Path, draft: Path) -> str | None:
    """Why two model folders' tokenizers differ (vocabulary, merges, special tokens), or None."""
    sides = [_tokenizer_json(folder) for folder in (target, draft)]
    if None in sides:
        return None if sides[0] is sides[1] else "only one of them has a tokenizer.json"
    a, b = sides
    if a["model"].get("vocab") != b["model"].get("vocab"):
        return "the vocabularies differ"
    if a["model"].get("merges") != b["model"].get("merges"):
        return "the merges differ"
    special = [{(t["id"], t["content"]) for t in side.get("added_tokens", [])} for side in sides]
    return None if special[0] == special[1] else "the special tokens differ"


def _tokenizer_json(folder: Path) -> dict | None:
    path = Path(folder) / "tokenizer.json"
    return json.loads(path.read_text()) if path.exists() else None
