"""`model="auto"`: the smallest served model that can answer, chosen per request by a difficulty classifier.

The classifier is logistic regression on the prompt's all-MiniLM-L6-v2 sentence embedding (384 numbers,
unit length). It is trained (`sobrio router train`) on `sobrio/data/router_set.jsonl`, prompts with
checkable answers that both models answered (benchmarks/router/build_router_set.py): label 1 where the small
model is wrong and the large one right, the calls worth the large model. A request goes to the large model
when its score reaches the threshold; a lower threshold buys quality with more large calls
(`sobrio router eval` prints the trade on the held-out split, with RouteLLM's APGR).
"""

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import numpy as np

EMBEDDER = "all-minilm-l6-v2"
DEFAULT_WEIGHTS = "router_minilm.json"  # in sobrio/data


@dataclass
class RouterWeights:
    small: str
    large: str
    threshold: float
    bias: float
    weights: list[float]
    embedder: str = EMBEDDER

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path | None = None) -> "RouterWeights":
        """A weights file; None: the one shipped with sobrio."""
        text = (Path(path).read_text() if path is not None
                else resources.files("sobrio.data").joinpath(DEFAULT_WEIGHTS).read_text())
        return cls(**json.loads(text))

    def scores(self, embeddings: np.ndarray) -> np.ndarray:
        """P(the large model is worth it) for each row of unit-length embeddings."""
        logits = embeddings @ np.asarray(self.weights, dtype=np.float32) + self.bias
        return 1.0 / (1.0 + np.exp(-logits))


def open_embedder():
    """The sentence embedder, in this process (22M parameters; a prompt takes a few milliseconds)."""
    from sobrio.config import SobrioConfig
    from sobrio.engine.embedding import EmbeddingEngine

    return EmbeddingEngine.from_config(SobrioConfig.from_kwargs(model=EMBEDDER, max_num_seqs=64))


async def embed(embedder, texts: list[str]) -> np.ndarray:
    rows = await asyncio.to_thread(embedder.tokenize_inputs, texts, embedder.max_model_len)
    return np.asarray(await embedder.embed(rows), dtype=np.float32)


def embed_all(embedder, texts: list[str], batch: int = 64) -> np.ndarray:
    return np.concatenate([asyncio.run(embed(embedder, texts[i:i + batch])) for i in range(0, len(texts), batch)])


class Router:
    """Serving: a request's text to (model name, score)."""

    def __init__(self, weights: RouterWeights, embedder, threshold: float | None = None):
        self.weights = weights
        self.embedder = embedder
        self.threshold = weights.threshold if threshold is None else threshold
        self.decision_seconds: list[float] = []

    async def choose(self, text: str) -> tuple[str, float]:
        start = time.perf_counter()
        score = float(self.weights.scores(await embed(self.embedder, [text]))[0])
        self.decision_seconds = (self.decision_seconds + [time.perf_counter() - start])[-1000:]
        return (self.weights.large if score >= self.threshold else self.weights.small), score


# ---- training and evaluation ----

def labels(rows: list[dict]) -> np.ndarray:
    return np.array([not r["small_correct"] and r["large_correct"] for r in rows], dtype=np.float32)


def train(embeddings: np.ndarray, y: np.ndarray, l2: float = 1e-2) -> tuple[np.ndarray, float]:
    """Logistic regression (L-BFGS, L2 on the weights); the positive class reweighted to balance."""
    import torch

    x, t = torch.from_numpy(embeddings), torch.from_numpy(y)
    w, b = torch.zeros(x.shape[1], requires_grad=True), torch.zeros(1, requires_grad=True)
    pos = float(t.mean().clamp(1e-3, 1 - 1e-3))
    weight = torch.where(t > 0, 0.5 / pos, 0.5 / (1 - pos))
    opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

    def loss_fn():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, t, weight=weight) + l2 * w.square().sum()
        loss.backward()
        return loss

    opt.step(loss_fn)
    return w.detach().numpy(), float(b.detach())


@dataclass
class Point:
    threshold: float
    share_large: float
    quality: float


def curve(rows: list[dict], scores: np.ndarray, thresholds: list[float]) -> list[Point]:
    small = np.array([r["small_correct"] for r in rows], dtype=float)
    large = np.array([r["large_correct"] for r in rows], dtype=float)
    points = []
    for t in thresholds:
        to_large = scores >= t
        points.append(Point(t, float(to_large.mean()), float(np.where(to_large, large, small).mean())))
    return points


def apgr(rows: list[dict], scores: np.ndarray) -> float:
    """RouteLLM's average performance gap recovered: the area under PGR(share of large calls) from 0 to 1,
    PGR = (router quality - small's) / (large's - small's), over every threshold the scores allow."""
    q_small = float(np.mean([r["small_correct"] for r in rows]))
    q_large = float(np.mean([r["large_correct"] for r in rows]))
    if q_large <= q_small:
        return float("nan")
    thresholds = [float("inf"), *sorted(set(scores.tolist()), reverse=True)]
    points = curve(rows, scores, thresholds)
    shares = np.array([p.share_large for p in points])
    pgr = (np.array([p.quality for p in points]) - q_small) / (q_large - q_small)
    return float(np.trapezoid(pgr, shares))


def read_set(split: str | None = None) -> list[dict]:
    text = resources.files("sobrio.data").joinpath("router_set.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r for r in rows if split is None or r["split"] == split]
