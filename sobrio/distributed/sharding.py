"""Which part of each weight a tensor-parallel rank holds (Megatron-LM's split, as vLLM does it).

Per layer: q/k/v and gate/up are column-parallel (a rank holds some attention heads and some of the MLP's
intermediate channels), o_proj and down_proj row-parallel (the matching input columns; their outputs are
partial sums that an all-reduce adds up). The embedding and the LM head are vocab-parallel: a rank holds
`ceil(vocab / size)` rows, padded with zeros. Norms are replicated.

Heads follow their KV head: with at least as many KV heads as ranks, each rank takes a contiguous run of
KV heads (runs differ by at most one: SmolLM2's 3 KV heads over 2 ranks are 2 + 1) and their query heads;
with fewer (Gemma 3 270M's one), each KV head is replicated on `size / num_kv_heads` ranks, which split its
query heads. A rank's query heads always share KV heads evenly, so its attention is plain GQA.
"""

import copy
from dataclasses import dataclass

import torch

from sobrio.errors import ConfigError

OPTION = "--tensor-parallel-size"


@dataclass(frozen=True)
class RankShard:
    rank: int
    size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range  # rows of the full vocabulary this rank holds
    vocab_rows: int  # rows it allocates: ceil(vocab / size), the last rank's padded with zeros

    @property
    def first_rank(self) -> bool:
        return self.rank == 0


def _runs(total: int, parts: int) -> list[range]:
    """`total` items in `parts` contiguous runs whose lengths differ by at most one."""
    base, extra = divmod(total, parts)
    starts = [i * base + min(i, extra) for i in range(parts + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(parts)]


def refuse_experts(config) -> None:
    """A ConfigError for a mixture of experts: no rank splits its experts yet."""
    if getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None):
        raise ConfigError(f"tensor parallelism does not split mixture-of-experts models ({config.model_type}) "
                          f"yet: run it with {OPTION} 1", OPTION)


def plan_shards(config, size: int) -> list[RankShard]:
    """Every rank's share of a model of this Hugging Face config; a ConfigError when its heads cannot be split,
    or when it is a mixture of experts (`refuse_experts`)."""
    refuse_experts(config)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    group = heads // kv_heads
    if kv_heads >= size:
        kv_runs = _runs(kv_heads, size)
        q_runs = [range(r.start * group, r.stop * group) for r in kv_runs]
    elif size % kv_heads == 0 and group % (size // kv_heads) == 0:
        per_kv = size // kv_heads
        kv_runs = [range(rank // per_kv, rank // per_kv + 1) for rank in range(size)]
        share = group // per_kv
        q_runs = [range(k.start * group + (rank % per_kv) * share, k.start * group + (rank % per_kv + 1) * share)
                  for rank, k in enumerate(kv_runs)]
    else:
        raise ConfigError(f"{OPTION}={size} cannot split {heads} attention heads over {kv_heads} KV heads: use a "
                          f"size that is at most {kv_heads}, or a multiple of it that divides {heads}", OPTION)
    rows = -(-config.vocab_size // size)
    return [RankShard(rank, size, q_runs[rank], kv_runs[rank], _runs(config.intermediate_size, size)[rank],
                      range(min(rank * rows, config.vocab_size), min((rank + 1) * rows, config.vocab_size)), rows)
            for rank in range(size)]


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def local_config(config, shard: RankShard):
    """The config of the model a rank builds: its heads, channels and vocabulary rows; head_dim pinned (it
    would otherwise follow from hidden_size / heads)."""
    local = copy.deepcopy(config)
    local.head_dim = head_dim(config)
    local.num_attention_heads, local.num_key_value_heads = len(shard.q_heads), len(shard.kv_heads)
    local.intermediate_size, local.vocab_size = len(shard.intermediate), shard.vocab_rows
    return local


def shard_weight(name: str, tensor: torch.Tensor, shard: RankShard, dim: int) -> torch.Tensor:
    """This rank's part of one Hugging Face-named tensor; `dim` is the head dimension."""
    module, kind = name.split(".")[-2], name.split(".")[-1]
    if module == "q_proj":
        return tensor[shard.q_heads.start * dim:shard.q_heads.stop * dim]
    if module in ("k_proj", "v_proj"):
        return tensor[shard.kv_heads.start * dim:shard.kv_heads.stop * dim]
    if module in ("gate_proj", "up_proj"):
        return tensor[shard.intermediate.start:shard.intermediate.stop]
    if module in ("o_proj", "down_proj"):
        if kind == "bias":  # added once, by the first rank: the all-reduce sums the others' zeros
            return tensor if shard.first_rank else torch.zeros_like(tensor)
        cols = shard.q_heads if module == "o_proj" else shard.intermediate
        scale = dim if module == "o_proj" else 1
        return tensor[:, cols.start * scale:cols.stop * scale]
    if module in ("embed_tokens", "lm_head"):
        rows = torch.zeros(shard.vocab_rows, tensor.shape[1], dtype=tensor.dtype)
        rows[:len(shard.vocab)] = tensor[shard.vocab.start:shard.vocab.stop]
        return rows
    return tensor


def shard_weights(weights, config, shard: RankShard):
    """The weights iterator of a rank: each float tensor cut to its part (quantized records are refused
    before this: `check_supported`)."""
    dim = head_dim(config)
    for name, tensor in weights:
        assert isinstance(tensor, torch.Tensor), f"{name}: a quantized record cannot be sharded"
        yield name, shard_weight(name, tensor, shard, dim).contiguous()


@dataclass
class TPRank:
    """What a rank's model runner needs: its shard, every rank's (for the KV sizing), and the group."""

    shard: RankShard
    shards: list[RankShard]
    group: object  # distributed.group.TPGroup

    def widest_config(self, config):
        """The rank config with the most KV heads: every rank's cache gets as many blocks as that one's fits."""
        return local_config(config, max(self.shards, key=lambda s: len(s.kv_heads)))

    def __str__(self) -> str:
        s = self.shard
        return (f"tensor_parallel_rank={s.rank}/{s.size} (heads {s.q_heads.start}-{s.q_heads.stop - 1}, kv_heads "
                f"{s.kv_heads.start}-{s.kv_heads.stop - 1}, threads {torch.get_num_threads()})")
