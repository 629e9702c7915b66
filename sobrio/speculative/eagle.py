"""EAGLE draft head (Li et al. 2024): one decoder layer that runs on the target's own features.

At position j the head reads f_j, the target's final hidden state there (what its LM head reads), and the
embedding of x_{j+1}, the token the target chose from it: x = fc([e(x_{j+1}); f_j]), then one Llama decoder
layer and a final norm give f'_{j+1}, a guess at the target's next feature, and the target's head rows of a
draft vocabulary (the tokens the target produces most, FR-Spec's idea) turn it into a draft token. Later
drafts feed the head its own guess f' with the token it drafted: autoregression on features, which the
target's features make far easier than on tokens alone. Unlike Medusa's heads, its attention reads every
earlier position's feature through a KV cache of its own (one layer, in the target's block ids).

Features are kept per request (`FeatureTrail`) from each step's hidden states until the head has read them:
its KV for a position is written when the request next drafts, so a step where nobody drafts costs nothing
more. Positions whose features were never kept (a prefix-cache hit, a busy stretch with drafting off) keep
whatever KV their slots hold: drafts get worse there, never the output, which the target verifies.

Files (from `sobrio train-draft --method eagle`): `eagle.safetensors` in transformers' names
(`model.layers.0.*`, `model.norm.weight`, `model.embed_tokens.weight` = the draft vocabulary's head rows,
tied), `fc.weight`, `fc.bias`, `vocab_ids`; `config.json` with the layer's Llama config.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from sobrio.config.speculative import OPTION
from sobrio.errors import ConfigError

WEIGHTS, CONFIG = "eagle.safetensors", "config.json"
MAX_TRAIL = 4096  # feature rows kept per request; older ones are dropped (their KV stays as it is)


def layer_config(target_config, draft_vocab_size: int):
    """The head's decoder layer: a Llama layer of the target's widths (heads, KV heads, head size, MLP), its
    global RoPE base, and a vocabulary of the draft tokens (tied: the embedding matrix is the head)."""
    from transformers import LlamaConfig

    from sobrio.models.llama import head_dim_of

    c = target_config
    rope = getattr(c, "rope_parameters", None) or {"rope_theta": getattr(c, "rope_theta", 10000.0)}
    rope = rope.get("full_attention", rope)  # Gemma 3: per layer type
    return LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=1,
                       num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                       head_dim=head_dim_of(c), rms_norm_eps=c.rms_norm_eps, hidden_act="silu",
                       rope_parameters={"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)},
                       max_position_embeddings=c.max_position_embeddings, vocab_size=draft_vocab_size,
                       tie_word_embeddings=True, attention_bias=False, mlp_bias=False)


@dataclass
class EagleFiles:
    config: dict  # method, base_model, vocab_size (the target's), layer (Llama config as a dict)
    tensors: dict[str, torch.Tensor]

    @classmethod
    def read(cls, folder: str | Path) -> "EagleFiles":
        folder = Path(folder)
        if not (folder / WEIGHTS).is_file() or not (folder / CONFIG).is_file():
            raise ConfigError(f"{OPTION}: {folder} holds no EAGLE head ({WEIGHTS} and {CONFIG}; "
                              "`sobrio train-draft --method eagle` writes them)", OPTION)
        config = json.loads((folder / CONFIG).read_text())
        if config.get("method") != "eagle":
            raise ConfigError(f"{OPTION}: {folder} holds a {config.get('method')!r} draft, not an EAGLE head",
                              OPTION)
        return cls(config, load_file(str(folder / WEIGHTS)))

    def layer_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(**self.config["layer"])


class EagleDraft(torch.nn.Module):
    """The head at serving time: sobrio's own Llama layer (paged attention on the head's KV cache, the
    packed matmuls) behind `fc`, reading the target's input embedding."""

    def __init__(self, files: EagleFiles, target, dtype: torch.dtype, max_positions: int, attention_backend: str,
                 quantization: str | None = None):
        """`quantization` (the speculative config's key): the head's own matrices in int8 or int4, as the
        target's would be (no calibration: the head has no text of its own), so each draft reads half the
        bytes or less. The drafts may change a little; the output cannot (the target verifies)."""
        super().__init__()
        from sobrio.layers.linear import Linear
        from sobrio.layers.quantization import quantized_linear
        from sobrio.models.registry import build_model

        tensors = files.tensors
        self.lm = build_model(files.layer_config(), max_positions,
                              ((n, t) for n, t in tensors.items() if n.startswith("model.")), dtype, attention_backend,
                              quantization=quantization, calibration_ids=[])
        d = self.lm.config.hidden_size
        self.fc = Linear(2 * d, d, bias=True)
        with torch.no_grad():
            self.fc.weight.copy_(tensors["fc.weight"])
            self.fc.bias.copy_(tensors["fc.bias"])
        self.fc = self.fc.to(dtype).requires_grad_(False)
        if quantization is None:
            self.fc.prepack()
        else:
            self.fc = quantized_linear(self.fc.weight, self.fc.bias, quantization, "eagle fc")
        self.register_buffer("vocab_ids", tensors["vocab_ids"].long())
        self.embed = target.model.embed  # the target's (not a module of this one: never copied)
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """Each position's (token, feature) -> the head's guess at the next position's feature [N, d]."""
        x = self.fc(torch.cat([self.embed(input_ids), features.to(self.dtype)], dim=-1))
        layer = self.lm.model.layers[0]
        x, residual = layer(positions, x, None, meta)
        return self.lm.model.norm.add_and_norm(x, residual)[0]

    def greedy(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Guessed features -> the draft tokens (ids of the target's vocabulary) and the head's probability of
        each (over the draft vocabulary: its confidence, which tracks how often the target agrees)."""
        confidence, index = torch.softmax(self.lm.compute_logits(features), dim=-1).max(dim=-1)
        return self.vocab_ids[index], confidence


@dataclass
class FeatureTrail:
    """A request's target features not yet read by the head: contiguous chunks (first position, rows)."""

    chunks: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def add(self, start: int, rows: torch.Tensor) -> None:
        """Rows for positions start.. (a step's); what was kept from `start` on is replaced (rejected drafts,
        a preemption's recompute), and a gap drops everything before it."""
        kept = []
        for first, chunk in self.chunks:
            if first < start:
                kept.append((first, chunk[:start - first]))
        if kept and kept[-1][0] + len(kept[-1][1]) != start:
            kept = []
        kept.append((start, rows))
        while sum(len(c) for _, c in kept) > MAX_TRAIL and len(kept) > 1:
            kept.pop(0)
        self.chunks = kept

    @property
    def first(self) -> int | None:
        return self.chunks[0][0] if self.chunks else None

    def take(self, begin: int, end: int) -> torch.Tensor | None:
        """Rows for positions [begin, end) (all of them held), and drop those before `end`; else None."""
        parts = [chunk[max(0, begin - first):end - first] for first, chunk in self.chunks
                 if first < end and first + len(chunk) > begin]
        rows = torch.cat(parts) if parts else None
        if rows is None or len(rows) != end - begin:
            return None
        self.chunks = [(max(first, end), chunk[max(0, end - first):]) for first, chunk in self.chunks
                       if first + len(chunk) > end]
        return rows


class EagleProposer:
    """Drafts from the EAGLE head for the requests that get KV slots for them (`ModelRunner.draft_eagle`)."""

    needs_hidden = False
    needs_step_features = True

    def __init__(self, draft, reserve, num_speculative_tokens: int, min_confidence: float):
        self.draft, self.reserve, self.k = draft, reserve, num_speculative_tokens
        self.min_confidence = min_confidence

    def observe(self, reqs: list, features: dict[str, tuple[int, torch.Tensor]]) -> None:
        """Keep the last step's features of these requests (the rows are copied: the step's tensor goes)."""
        for req in reqs:
            found = features.get(req.request_id)
            if found is not None:
                if req.draft_features is None:
                    req.draft_features = FeatureTrail()
                req.draft_features.add(found[0], found[1].clone())

    def propose_batch(self, todo: list, hidden: dict) -> dict[str, list[int]]:
        ready, rows, starts = [], [], []
        for req, limit in todo:
            n, trail = req.num_computed_tokens, req.draft_features
            if trail is None or trail.first is None or trail.first >= n:
                continue  # no feature of its newest position: nothing to draft from
            begin = max(min(req.num_draft_kv, n - 1), trail.first)
            count = min(self.k, limit)
            if not self.reserve(req, count):
                continue
            features = trail.take(begin, n)
            if features is None:
                continue
            ready.append((req, count))
            rows.append(features)
            starts.append(begin)
        if not ready:
            return {}
        drafts = self.draft([r for r, _ in ready], [c for _, c in ready], starts, rows, self.min_confidence)
        for req, _ in ready:
            req.num_draft_kv = req.num_computed_tokens
        return {req.request_id: tokens for (req, _), tokens in zip(ready, drafts)}
