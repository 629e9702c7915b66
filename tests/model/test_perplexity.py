"""`sobrio bench perplexity` on SmolLM2: the engine's per-token negative log-likelihoods equal transformers'
on the same weights and windows, and the command prints a finite perplexity that agrees with them."""

import json
import math

import pytest
import torch

from sobrio import data
from sobrio.bench.perplexity import Window, special_prefix, token_nlls, windows
from sobrio.cli import main
from tests.model.reference import hf_model

ALIAS = "smollm2-135m"


def heldout_ids(tokenizer, count: int) -> list[int]:
    return tokenizer(data.read_text(data.HELDOUT), add_special_tokens=False).input_ids[:count]


def hf_nlls(prefix: list[int], ids: list[int], spans: list[Window]) -> list[float]:
    """transformers' negative log-likelihood of each scored token, window by window, as the bench scores them."""
    nlls = []
    with torch.inference_mode():
        for w in spans:
            logits = hf_model(ALIAS)(torch.tensor([prefix + ids[w.begin:w.end]])).logits[0]
            logprobs = logits.float().log_softmax(dim=-1)
            row = len(prefix) - w.begin - 1  # logits at prompt position p score prompt token p + 1
            nlls += [-logprobs[t + row, ids[t]].item() for t in range(w.first, w.end)]
    return nlls


def test_token_nlls_equal_transformers(smollm2):
    """float32 engine against float32 transformers: each token's NLL, over overlapping windows."""
    tokenizer = smollm2.get_tokenizer()
    prefix, ids = special_prefix(tokenizer), heldout_ids(tokenizer, 160)
    spans = windows(len(ids), 64, 32, score_first=bool(prefix))
    assert len(spans) == 4
    engine, reference = token_nlls(smollm2, ids, spans), hf_nlls(prefix, ids, spans)
    assert len(engine) == len(reference) == len(ids) - (0 if prefix else 1)
    assert engine == pytest.approx(reference, abs=2e-3)


def test_cli_prints_a_finite_perplexity_equal_to_transformers(smollm2, tmp_path, capsys):
    """The command end to end, in its default dtype (bfloat16 where the CPU has fast bf16): its perplexity
    equals transformers' float32 one on the same tokens within bf16 rounding."""
    result_json = tmp_path / "ppl.json"
    argv = ["bench", "perplexity", "--max-tokens", "128", "--window", "64", "--stride", "32", "--no-progress",
            "--result-json", str(result_json)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "mode" in out and "perplexity" in out and "\nnone " in out
    row = json.loads(result_json.read_text())["results"][0]
    assert row["mode"] == "none" and row["tokens"] == 127 and math.isfinite(row["perplexity"])
    itemsize = 2 if row["dtype"] == "bfloat16" else 4
    assert row["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * itemsize  # layers x (keys, values) x kv heads x head dim
    assert row["weight_bytes"] >= 134e6 * itemsize  # 134.5 M parameters, and the kernels' packed copies
    tokenizer = smollm2.get_tokenizer()
    prefix, ids = special_prefix(tokenizer), heldout_ids(tokenizer, 128)
    nlls = hf_nlls(prefix, ids, windows(len(ids), 64, 32, score_first=bool(prefix)))
    assert row["perplexity"] == pytest.approx(math.exp(sum(nlls) / len(nlls)), rel=0.02)
