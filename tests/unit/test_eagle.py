"""The EAGLE head (speculative/eagle.py) without a served model: the serving form (sobrio's layer on a paged KV
cache, written a position at a time) equals the training form (transformers' layer over the whole sequence),
its files load back, and the per-request feature trail keeps exactly the rows drafting needs."""

import types

import pytest
import torch

from sobrio.draft_training.eagle import EagleTrainee, batches, held_out_top1
from sobrio.engine.model_runner import ModelRunner
from sobrio.errors import ConfigError
from sobrio.kv.cache import KVCache
from sobrio.layers.attention import AttentionMetadata
from sobrio.models.sizing import kv_cache_spec
from sobrio.speculative.eagle import EagleDraft, EagleFiles, FeatureTrail, layer_config

D, VOCAB, DRAFT_VOCAB, BLOCK = 64, 90, 40, 16


def _target_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=D, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, vocab_size=VOCAB,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=256)


@pytest.fixture(scope="module")
def trained_folder(tmp_path_factory):
    """A head with random weights (norms too), saved as `sobrio train-draft --method eagle` saves one."""
    torch.manual_seed(0)
    config = layer_config(_target_config(), DRAFT_VOCAB)
    embed, head_rows = torch.randn(VOCAB, D), torch.randn(DRAFT_VOCAB, D)
    head = EagleTrainee(config, embed, None, head_rows)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp("eagle")
    vocab_ids = torch.arange(0, 2 * DRAFT_VOCAB, 2)
    head.save(folder, config, vocab_ids, "tiny", VOCAB)
    return folder, head, embed, vocab_ids


def _serving(folder, embed, quantization: str | None = None) -> EagleDraft:
    target = types.SimpleNamespace(model=types.SimpleNamespace(embed=lambda ids: embed[ids]))
    return EagleDraft(EagleFiles.read(folder), target, torch.float32, 256, "batched", quantization)


@pytest.mark.parametrize("quantization, tolerance", [("int8", 0.05), ("int8-weight-only", 0.05), ("int4", 0.15)])
def test_a_quantized_head_guesses_close_to_the_float_one(trained_folder, quantization, tolerance):
    """The speculative config's `quantization` rounds the head's own matrices (fc, its layer, its head rows):
    the guessed features stay close to the float head's (drafts may differ; the target verifies them). On these
    random Gaussian weights 4-bit groups of 32 err by about 10% (a step of ~1/3 of a weight's spread)."""
    folder, _, embed, _ = trained_folder
    plain, rounded = _serving(folder, embed), _serving(folder, embed, quantization)
    assert rounded.fc.__class__ is not plain.fc.__class__ and rounded.lm.quantized_lm_head is not None
    tokens, feats = torch.randint(0, VOCAB, (40,)), torch.randn(40, D)
    spec = kv_cache_spec(EagleFiles.read(folder).layer_config(), torch.float32, BLOCK)
    outs = [head(tokens, feats, torch.arange(40), _meta(KVCache.allocate(spec, 4), 0, 40)) for head in (plain, rounded)]
    error = (outs[1] - outs[0]).norm() / outs[0].norm()
    assert 0 < error < tolerance, error


def _meta(cache: KVCache, start: int, count: int) -> AttentionMetadata:
    positions = torch.arange(start, start + count)
    return AttentionMetadata(positions.clone(), [0, count], [start + count], torch.arange(4)[None], BLOCK, cache)


def test_the_serving_head_equals_the_training_head_whole_and_a_position_at_a_time(trained_folder):
    folder, head, embed, vocab_ids = trained_folder
    draft = _serving(folder, embed)
    tokens, feats = torch.randint(0, VOCAB, (40,)), torch.randn(40, D)
    with torch.no_grad():
        expected = head(tokens[None], feats[None], torch.tensor([40]))[0]
    spec = kv_cache_spec(EagleFiles.read(folder).layer_config(), torch.float32, BLOCK)
    cache = KVCache.allocate(spec, 4)
    whole = draft(tokens, feats, torch.arange(40), _meta(cache, 0, 40))
    torch.testing.assert_close(whole, expected, atol=2e-4, rtol=2e-4)
    cache = KVCache.allocate(spec, 4)
    rows = [draft(tokens[:25], feats[:25], torch.arange(25), _meta(cache, 0, 25))]
    rows += [draft(tokens[p:p + 1], feats[p:p + 1], torch.tensor([p]), _meta(cache, p, 1)) for p in range(25, 40)]
    torch.testing.assert_close(torch.cat(rows), expected, atol=2e-4, rtol=2e-4)
    tokens, confidence = draft.greedy(whole)
    assert set(tokens.tolist()) <= set(vocab_ids.tolist())  # target ids of the draft vocabulary
    logits = expected @ head.head_rows.T
    assert torch.equal(tokens, vocab_ids[logits.argmax(-1)])
    torch.testing.assert_close(confidence, logits.softmax(-1).amax(-1), atol=1e-4, rtol=1e-4)


def test_a_folder_without_a_head_or_of_another_method_is_refused(tmp_path, trained_folder):
    with pytest.raises(ConfigError, match="holds no EAGLE head"):
        EagleFiles.read(tmp_path)
    folder = trained_folder[0]
    (tmp_path / "eagle.safetensors").write_bytes((folder / "eagle.safetensors").read_bytes())
    (tmp_path / "config.json").write_text('{"method": "medusa"}')
    with pytest.raises(ConfigError, match="not an EAGLE head"):
        EagleFiles.read(tmp_path)


def test_drafts_end_before_the_first_whose_joint_confidence_falls_below_the_floor():
    """Scripted head passes (confidence by request and pass): a stays sure (joint 0.9, 0.81, 0.73), b doubts
    its second draft (joint 0.27), c its first (0.2), d may draft one token only. With a floor of 0.5 a drafts
    3, b 1, c none, d 1, and no pass runs a request whose drafts ended; with no floor each drafts its limit."""
    script = {"a": [0.9, 0.9, 0.9], "b": [0.9, 0.3, 0.9], "c": [0.2, 0.9, 0.9], "d": [0.99, 0.99, 0.99]}
    reqs = [types.SimpleNamespace(request_id=r, num_computed_tokens=5, all_token_ids=list(range(6))) for r in script]
    limits = [3, 3, 3, 1]

    def drafts_and_passes(floor: float) -> tuple[list[list[int]], list[list[str]]]:
        passes: list[list[str]] = []

        def scripted_pass(batch, token_ids, features, starts):
            step = len(passes)
            passes.append([r.request_id for r in batch])
            assert len(features) == len(batch) and all(len(t) == 1 for t in token_ids)
            return ([10 * step + ord(r.request_id) for r in batch], [script[r.request_id][step] for r in batch],
                    torch.zeros(len(batch), 4))

        runner = types.SimpleNamespace(_eagle_pass=scripted_pass)
        drafts = ModelRunner.draft_eagle(runner, reqs, limits, [4] * 4, [torch.zeros(1, 4)] * 4, floor)
        return drafts, passes

    drafts, passes = drafts_and_passes(0.5)
    assert [len(d) for d in drafts] == [3, 1, 0, 1]
    assert drafts[0] == [ord("a"), 10 + ord("a"), 20 + ord("a")] and drafts[1] == [ord("b")]
    assert passes == [["a", "b", "c", "d"], ["a", "b"], ["a"]]
    drafts, passes = drafts_and_passes(0.0)
    assert [len(d) for d in drafts] == limits and passes == [["a", "b", "c", "d"], ["a", "b", "c"], ["a", "b", "c"]]


def test_the_trail_keeps_contiguous_rows_replaces_rejected_ones_and_drops_what_was_read():
    rows = torch.arange(30.0)[:, None]
    trail = FeatureTrail()
    trail.add(0, rows[:10])  # a prompt's step
    assert trail.first == 0 and torch.equal(trail.take(3, 10), rows[3:10]) and trail.first is None
    trail.add(10, rows[10:13])  # a verifying step: positions 10-12, of which 12 was a rejected draft
    trail.add(12, rows[20:22])  # the next step recomputes 12 and computes 13
    assert torch.equal(trail.take(10, 14), torch.cat([rows[10:12], rows[20:22]]))
    assert trail.take(14, 15) is None  # never held
    trail.add(3, rows[:2])
    trail.add(8, rows[2:4])  # a gap: what came before it is of no use
    assert trail.first == 8 and trail.take(3, 5) is None


def test_training_batches_line_up_each_input_with_the_next_feature_and_the_token_after():
    sequences, starts = [[5, 6, 7, 8, 9], [1, 2, 3]], [2, 1]
    hidden = [torch.arange(5.0)[:, None].expand(5, 2) * 10, torch.arange(3.0)[:, None].expand(3, 2)]
    index = torch.full((10,), -1)
    index[torch.tensor([2, 3, 8, 9])] = torch.arange(4)
    tokens, feats, lengths, goal, labels = next(batches(sequences, starts, hidden, index, 2, None))
    assert lengths.tolist() == [4, 2]
    assert tokens[0].tolist() == [6, 7, 8, 9] and feats[0, :, 0].tolist() == [0, 10, 20, 30]
    assert goal[0, :, 0].tolist() == [10, 20, 30, 40]
    # input j reads f_j and x_{j+1}, labelled x_{j+2}; from the last prompt position (j = 1) on; 7 is outside
    assert labels[0].tolist() == [-100, index[8].item(), index[9].item(), -100]
    assert labels[1].tolist() == [index[3].item(), -100, -100, -100]  # padded to the longest


def test_training_raises_the_first_drafts_accuracy_on_a_learnable_sequence():
    """Counting sequences (each token the previous one plus one) whose features name their next token, as a
    model's do: the head must learn the token after (held-out top-1 from ~0 to high)."""
    from sobrio.draft_training.eagle import fit

    torch.manual_seed(0)
    config = layer_config(_target_config(), DRAFT_VOCAB)
    embed = torch.randn(VOCAB, D)
    head_rows = torch.randn(DRAFT_VOCAB, D)
    sequences = [((torch.arange(30) + start) % DRAFT_VOCAB).tolist() for start in torch.randint(0, DRAFT_VOCAB, (24,))]
    hidden = [head_rows[torch.tensor(s)].roll(-1, 0) for s in sequences]  # f_j: x_{j+1}'s head row
    index = torch.full((VOCAB,), -1)
    index[:DRAFT_VOCAB] = torch.arange(DRAFT_VOCAB)
    head = EagleTrainee(config, embed, None, head_rows)
    data = (sequences[4:], [1] * 20, hidden[4:])
    held = (sequences[:4], [1] * 4, hidden[:4])
    before = held_out_top1(head, held, index)
    losses = fit(head, data, index, epochs=30, lr=3e-3, batch_size=4)
    assert losses[-1] < losses[0] / 2
    assert held_out_top1(head, held, index) > max(0.8, before + 0.5)
