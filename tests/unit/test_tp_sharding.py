"""How a tensor-parallel rank's share of a model is chosen and cut (no model loaded)."""

from types import SimpleNamespace

import pytest
import torch

from sobrio.distributed.sharding import local_config, plan_shards, shard_weight
from sobrio.errors import ConfigError


def config(heads, kv_heads, intermediate=96, vocab=101, hidden=32, head_dim=8):
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
                           vocab_size=vocab, hidden_size=hidden, head_dim=head_dim)


def test_kv_heads_split_unevenly_and_query_heads_follow_them():
    shards = plan_shards(config(9, 3), 2)  # SmolLM2-135M's heads
    assert [(s.q_heads, s.kv_heads) for s in shards] == [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]
    assert [s.intermediate for s in shards] == [range(0, 48), range(48, 96)]
    assert [s.vocab for s in shards] == [range(0, 51), range(51, 101)] and shards[1].vocab_rows == 51


def test_fewer_kv_heads_than_ranks_are_replicated():
    shards = plan_shards(config(4, 1), 2)  # Gemma 3 270M's heads
    assert [(s.q_heads, s.kv_heads) for s in shards] == [(range(0, 2), range(0, 1)), (range(2, 4), range(0, 1))]
    assert len(plan_shards(config(8, 2), 4)) == 4


def test_a_split_that_breaks_a_query_group_is_refused():
    with pytest.raises(ConfigError, match="cannot split 9 attention heads over 3 KV heads") as exc:
        plan_shards(config(9, 3), 4)
    assert exc.value.option == "--tensor-parallel-size"


def test_the_cut_pieces_sum_back_to_the_whole_matmul():
    c = config(4, 2)
    shards = plan_shards(c, 2)
    x, w_o = torch.randn(3, 32), torch.randn(32, 32)  # o_proj: [hidden, heads * head_dim]
    parts = [x[:, s.q_heads.start * 8:s.q_heads.stop * 8] @ shard_weight("l.o_proj.weight", w_o, s, 8).T
             for s in shards]
    torch.testing.assert_close(parts[0] + parts[1], x @ w_o.T)
    bias = torch.ones(32)
    assert [shard_weight("l.o_proj.bias", bias, s, 8).sum().item() for s in shards] == [32.0, 0.0]
    embed = torch.randn(101, 32)
    rows = [shard_weight("model.embed_tokens.weight", embed, s, 8) for s in shards]
    assert torch.equal(torch.cat(rows)[:101], embed) and rows[1][-1].abs().sum() == 0  # a padding row
    local = local_config(c, shards[1])
    assert (local.num_attention_heads, local.num_key_value_heads, local.head_dim, local.vocab_size) == (2, 1, 8, 51)
