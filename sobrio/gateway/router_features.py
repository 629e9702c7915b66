"""What the router sees of a prompt: 15 numbers about its form, computed in well under a millisecond, so that
routing stays off the answer's critical path (<= 5 ms p99 on 2 cores).

Subject-grouped cross-validation on RouteLLM's labels (docs/router.md) found that what transfers to subjects
a router never saw is the form of a question (its length, its stem against its options, rare words, digits,
negations, enumerations), not its topic: a classifier on MiniLM sentence or word embeddings ranked unseen
subjects worse than prompt length alone. MiniLM's WordPiece tokenizer gives the rare-word measures.
"""

import re
from functools import cached_property
from pathlib import Path

import numpy as np

TOKENIZER = "all-minilm-l6-v2"  # its tokenizer.json, from the installed package
FEATURES = "form-v1"
LENGTH_COLUMN = 0  # log(1 + characters)
MAX_CHARS = 8000  # tokenized for the rare-word measures: a prompt's first characters
_OPTION = re.compile(r"^([A-D])\. (.*)$", re.M)
_WORD = re.compile(r"[A-Za-z]+")
_NEGATION = re.compile(r"\b(NOT|EXCEPT|LEAST)\b")
_YEAR = re.compile(r"\b1[0-9]{3}\b|\b20[0-9]{2}\b")
_ROMAN = re.compile(r"\b(I|II|III|IV)\.")
_SYMBOL = re.compile(r"[=+*/^<>]")
NAMES = ("log chars", "log stem chars", "log mean option chars", "multiple choice", "digit share",
         "continuation-piece share", "mean log token id", "capitalized word share", "NOT/EXCEPT/LEAST",
         "Statement 1", "symbol share", "has a year", "question marks per 100 chars", "mean word length",
         "roman enumeration")


def form(text: str, tokens: list[str], ids: list[int]) -> list[float]:
    """The 15 numbers of `NAMES` for one prompt and its WordPiece tokens."""
    n = max(1, len(text))
    stem = text.split("\nA. ")[0]
    options = [m.group(2) for m in _OPTION.finditer(text)]
    words = _WORD.findall(text)
    return [float(np.log1p(len(text))), float(np.log1p(len(stem))),
            float(np.log1p(np.mean([len(o) for o in options]))) if options else 0.0, float(len(options) >= 4),
            sum(map(str.isdigit, text)) / n, sum(t.startswith("##") for t in tokens) / max(1, len(tokens)),
            float(np.mean(np.log1p(ids))) if ids else 0.0,
            sum(w[0].isupper() for w in words) / max(1, len(words)), float(bool(_NEGATION.search(text))),
            float("Statement 1" in text), len(_SYMBOL.findall(text)) / n, float(bool(_YEAR.search(text))),
            100 * text.count("?") / n, float(np.mean([len(w) for w in words])) if words else 0.0,
            float(bool(_ROMAN.search(text)))]


class PromptFeatures:
    """`form` for a batch of prompts, with MiniLM's tokenizer from the installed package (nothing downloaded)."""

    def __init__(self, folder: Path | None = None):
        self.folder = folder

    @cached_property
    def tokenizer(self):
        from tokenizers import Tokenizer

        from sobrio.loader.resolve import resolve_model

        folder = self.folder or resolve_model(TOKENIZER).path
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer.no_padding()
        tokenizer.no_truncation()
        return tokenizer

    def features(self, texts: list[str]) -> np.ndarray:
        encodings = self.tokenizer.encode_batch([t[:MAX_CHARS] for t in texts], add_special_tokens=False)
        return np.array([form(t, e.tokens, e.ids) for t, e in zip(texts, encodings)], dtype=np.float32)
