"""BERT encoders (all-MiniLM-L6-v2 and other sentence-transformers BERTs) and their pooling.

Unlike the decoders, an encoder step has no KV cache and no causal mask: each input is padded to the
longest of its batch and a key mask keeps the padding out of attention. The forward takes
`[batch, tokens]` ids and a `[batch, tokens]` mask and returns the last hidden states; `Pooler` turns
them into one vector per input, as the model's sentence-transformers configuration says.
"""

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from sobrio.layers.linear import Linear

# HF name inside `encoder.layer.<i>.` -> (sobrio module, shard of the packed q/k/v matrix or None)
_LAYER_NAMES = {
    "attention.self.query": ("qkv", 0),
    "attention.self.key": ("qkv", 1),
    "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("attn_out", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("intermediate", None),
    "output.dense": ("output", None),
    "output.LayerNorm": ("out_norm", None),
}
_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class BertLayer(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv = Linear(hidden, 3 * hidden)  # query, key, value packed: one matmul
        self.attn_out = Linear(hidden, hidden)
        self.attn_norm = torch.nn.LayerNorm(hidden, eps=eps)
        self.intermediate = Linear(hidden, config.intermediate_size)
        self.output = Linear(config.intermediate_size, hidden)
        self.out_norm = torch.nn.LayerNorm(hidden, eps=eps)
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported BERT activation {config.hidden_act!r}")
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden]; key_mask: [B, 1, 1, T], True where a token may be attended to."""
        b, t, hidden = x.shape
        flat = x.reshape(b * t, hidden)
        q, k, v = self.qkv(flat).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        attn = attn.transpose(1, 2).reshape(b * t, hidden)
        flat = self.attn_norm(flat + self.attn_out(attn))
        flat = self.out_norm(flat + self.output(self.act(self.intermediate(flat))))
        return flat.view(b, t, hidden)


class BertModel(torch.nn.Module):
    """Embeddings (word + position + token type, then LayerNorm) and the encoder layers; no pooler head."""

    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = torch.nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = torch.nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = torch.nn.Embedding(config.type_vocab_size, hidden)
        self.embed_norm = torch.nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = torch.nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.max_positions = config.max_position_embeddings

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask: [B, T] (mask 1 for tokens, 0 for padding) -> [B, T, hidden]."""
        t = input_ids.shape[1]
        assert t <= self.max_positions, f"{t} tokens, the model has {self.max_positions} positions"
        positions = torch.arange(t, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None] \
            + self.token_type_embeddings.weight[0]  # a single segment: token type 0 everywhere
        x = self.embed_norm(x)
        key_mask = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, key_mask)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF BertModel names (with or without the `bert.` prefix); the pooler head and buffers are skipped.
        Every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, tensor in weights:
            target, shard = _sobrio_name(name.removeprefix("bert."))
            if target not in params:
                continue  # pooler.*, embeddings.position_ids, MLM heads
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    assert param.shape == tensor.shape, f"{name}: {tuple(tensor.shape)} vs {tuple(param.shape)}"
                    param.copy_(tensor)
                else:
                    size = param.shape[0] // 3
                    assert tensor.shape[0] == size, f"{name}: {tensor.shape[0]} rows, expected {size}"
                    param[shard * size:(shard + 1) * size].copy_(tensor)
            filled.add(f"{target}#{shard}")
        expected = {f"{n}#{s}" for n in params for s in ((0, 1, 2) if ".qkv." in n else (None,))}
        missing = sorted(expected - filled)
        assert not missing, f"weights missing from the checkpoint: {missing[:5]}"

    def prepack(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()


def _sobrio_name(name: str) -> tuple[str, int | None]:
    if name.startswith("embeddings."):
        rest = name.removeprefix("embeddings.")
        if rest.startswith("LayerNorm."):
            return "embed_norm." + rest.removeprefix("LayerNorm."), None
        return rest, None
    if name.startswith("encoder.layer."):
        index, rest = name.removeprefix("encoder.layer.").split(".", 1)
        module, param = rest.rsplit(".", 1)
        if module in _LAYER_NAMES:
            target, shard = _LAYER_NAMES[module]
            return f"layers.{index}.{target}.{param}", shard
    return name, None


POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len")  # sentence-transformers' order when several are on


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, modes: tuple[str, ...], normalize: bool) -> torch.Tensor:
    """[B, T, H] hidden states -> [B, H x len(modes)] sentence vectors, as sentence-transformers' Pooling (and
    Normalize, when `normalize`) compute them; padding (mask 0) takes no part."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(hidden[:, 0])
        elif mode == "max":
            parts.append(hidden.masked_fill(mask == 0, -1e9).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len"):
            summed = (hidden * mask).sum(dim=1)
            count = mask.sum(dim=1).clamp(min=1e-9)
            parts.append(summed / (count if mode == "mean" else count.sqrt()))
        else:
            raise ValueError(f"unsupported pooling mode {mode!r}; supported: {', '.join(POOLING_MODES)}")
    vectors = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    return F.normalize(vectors, p=2, dim=1) if normalize else vectors
