"""Turn a rank's model (built from `sharding.local_config`, loaded from its sharded weights) into its
part of the tensor-parallel model: row-parallel outputs all-reduced, vocab-parallel embedding and LM head."""

import torch
import torch.nn.functional as F

from sobrio.distributed.group import TPGroup
from sobrio.distributed.sharding import RankShard
from sobrio.layers.linear import BlockedEmbedding


class VocabParallelEmbedding(torch.nn.Embedding):
    """Rows [start, start + n) of the vocabulary: a token outside looks up zeros, and the all-reduce adds the
    one rank's row that holds it (exact: the other terms are zeros)."""

    start: int = 0
    group: TPGroup

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0))


def _all_reduce_output(group: TPGroup):
    return lambda module, args, output: group.all_reduce(output)


def parallelize(model, shard: RankShard, group: TPGroup, vocab_size: int) -> None:
    """Hook the collectives into a built rank model (names and weights unchanged); the fused decode
    (models/fused_decode.py) would step past the hooks, so the modules run every step."""
    model.model.fused_decode = None
    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(_all_reduce_output(group))
        layer.mlp.down_proj.register_forward_hook(_all_reduce_output(group))
    if isinstance(model.model.embed_tokens, BlockedEmbedding):  # a slice of the vocabulary: plain rows again
        model.model.embed_tokens = model.model.embed_tokens.plain()
    embedding = model.model.embed_tokens
    assert type(embedding) is torch.nn.Embedding, "tensor parallelism takes float weights"
    embedding.__class__ = VocabParallelEmbedding
    embedding.start, embedding.group = shard.vocab.start, group
    model.gather_logits = lambda logits: group.gather_vocab(logits, vocab_size)
