"""Draft heads (speculative/medusa.py) and their training (draft_training/train.py) on synthetic data: the
labels line up with the token k + 1 places ahead, training learns a rule the heads can express, and a saved
folder loads back."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from sobrio.draft_training.train import IGNORE, OUTSIDE, Answers, draft_vocabulary, top1_accuracy, train, training_pairs
from sobrio.errors import ConfigError
from sobrio.speculative.medusa import DraftHeadProposer, DraftHeads, DraftHeadsConfig


def test_labels_are_the_tokens_k_plus_one_ahead_in_the_draft_vocabulary():
    answers = Answers([[7, 8, 1, 2, 3, 9]], [2])  # prompt 7 8, answer 1 2 3 9
    hidden = [torch.arange(6.0)[:, None].repeat(1, 4)]  # row t holds t
    vocab = torch.tensor([1, 2, 3])  # 9 is outside
    x, t, y = training_pairs(answers, hidden, 2, vocab, 10)
    assert x[:, 0].tolist() == [1, 2, 3, 4]  # from the last prompt token to the one before the end
    assert t.tolist() == [1, 2, 3, 9]  # the token each position produced
    # row t: head 1 labels token t + 2, head 2 token t + 3 (as indices into the draft vocabulary)
    assert y.tolist() == [[1, 2], [2, OUTSIDE], [OUTSIDE, IGNORE], [IGNORE, IGNORE]]
    assert draft_vocabulary(Answers([[5, 1, 1, 2, 1, 2, 4]], [1]), 2).tolist() == [1, 2]


def _synthetic(n: int, d: int = 16, vocab: int = 12, seed: int = 0):
    """Hidden states and produced tokens whose head-k label is a fixed function of both: head 1's of the
    state, head 2's of the produced token (which only the embedding tells)."""
    g = torch.Generator().manual_seed(seed)
    labels, produced = torch.randint(0, vocab, (n,), generator=g), torch.randint(0, vocab, (n,), generator=g)
    centers = torch.randn(vocab, d, generator=g) * 3
    x = centers[labels] + 0.3 * torch.randn(n, d, generator=g)
    y = torch.stack([(labels + 1) % vocab, (produced + 5) % vocab], dim=1)
    return x, produced, y


def test_training_lowers_the_loss_and_raises_each_heads_accuracy():
    x, t, y = _synthetic(2000)
    config = DraftHeadsConfig(2, 16, 12, 12, "synthetic")
    g = torch.Generator().manual_seed(1)
    heads = DraftHeads(config, torch.arange(12), torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g))
    before = top1_accuracy(heads, x, t, y)
    losses = train(heads, x, t, y, epochs=6, lr=1e-2, batch_size=128)
    after = top1_accuracy(heads, x, t, y)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert all(a > 0.75 and a > b + 0.5 for a, b in zip(after, before))


def test_saved_heads_load_back_and_propose_target_token_ids(tmp_path):
    config = DraftHeadsConfig(3, 8, 100, 5, "m")
    heads = DraftHeads(config, torch.tensor([3, 10, 42, 77, 99]), torch.randn(5, 8), torch.randn(5, 8))
    for block in heads.blocks:
        torch.nn.init.normal_(block.linear.weight)
    heads.save(tmp_path)
    loaded = DraftHeads.load(tmp_path)
    hidden, produced = torch.randn(4, 8), torch.tensor([3, 42, 5, 99])  # 5: outside, embeds as 0
    assert loaded.config == config and torch.equal(loaded.propose(hidden, produced), heads.propose(hidden, produced))
    assert set(loaded.propose(hidden, produced).flatten().tolist()) <= {3, 10, 42, 77, 99}
    assert torch.equal(heads.embed(produced)[2], torch.zeros(8)) and torch.equal(heads.embed(produced)[1],
                                                                                  heads.embed_rows[2])


def test_heads_of_an_earlier_layout_are_refused_with_what_to_do(tmp_path):
    """Heads saved before the token embedding joined them (no embed_rows, no fuse) name the fix."""
    config = DraftHeadsConfig(2, 8, 100, 5, "m")
    DraftHeads(config, torch.arange(5), torch.randn(5, 8), torch.randn(5, 8)).save(tmp_path)
    tensors = load_file(str(tmp_path / "draft_heads.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in ("embed_rows", "fuse.weight", "fuse.bias")},
              str(tmp_path / "draft_heads.safetensors"))
    with pytest.raises(ConfigError, match="another layout .*embed_rows.* train them again"):
        DraftHeads.load(tmp_path)


class _Req:
    def __init__(self, request_id: str, newest: int):
        self.request_id, self.output_token_ids = request_id, [7, newest]


def test_the_proposer_drafts_each_request_from_its_own_hidden_state_within_its_limit():
    heads = DraftHeads(DraftHeadsConfig(3, 8, 100, 5, "m"), torch.tensor([3, 10, 42, 77, 99]), torch.randn(5, 8),
                       torch.randn(5, 8))
    torch.nn.init.normal_(heads.fuse.weight)
    proposer = DraftHeadProposer(heads, 2)
    hidden = {"a": torch.randn(8), "b": torch.randn(8)}
    drafts = proposer.propose_batch([(_Req("a", 10), 2), (_Req("b", 77), 1), (_Req("c", 3), 2)], hidden)
    assert set(drafts) == {"a", "b"}  # c has no hidden state this step: no drafts
    assert drafts["a"] == heads.propose(hidden["a"][None], torch.tensor([10]))[0, :2].tolist()
    assert drafts["b"] == heads.propose(hidden["b"][None], torch.tensor([77]))[0, :1].tolist()
