"""`model="auto"`: the weak (cheaper) model unless the prompt needs the strong one, decided per request.

The router scores a prompt by where it ranks among its training prompts on two counts, equally weighted:
its length (RouteLLM's strongest simple baseline) and a linear model of its form (router_features.py: stem
and option lengths, rare words, digits, negations, ...). The model is trained (`sobrio router train`) on
per-prompt correctness of a strong and a weak model, within subjects: features and the strong-minus-weak
outcome are centred per subject before a ridge fit, so it learns which questions of a subject need the
strong model, which is what transferred to unseen subjects in cross-validation (docs/router.md). A request
goes to the strong model when its score reaches the threshold; `--router-strong-share` picks the threshold
that sent that share of the training prompts to it.
The shipped weights (sobrio/data/router_minilm.json) are
trained on RouteLLM's GPT-4 / Mixtral labels (docs/router.md has the figures and the commands); which two
served or remote models they route between is the configuration's `[router]` (or the weights' names).
"""

import json
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from sobrio.gateway.router_features import FEATURES, LENGTH_COLUMN, TOKENIZER, PromptFeatures

DEFAULT_WEIGHTS = "router_minilm.json"  # in sobrio/data
QUANTILES = 101  # training scores' percentiles kept with the weights: a strong share to a threshold
L2 = 0.1  # ridge penalty per prompt, on standardized features (cross-validated, docs/router.md)
MIX = 1.0  # the classifier's rank beside the length's (subject-grouped cross-validation, docs/router.md)


@dataclass
class RouterWeights:
    small: str  # the weak model served by default
    large: str  # the strong model
    threshold: float
    bias: float
    weights: list[float]
    mean: list[float] = field(default_factory=list)  # the features' standardization, from training
    scale: list[float] = field(default_factory=list)
    score_quantiles: list[float] = field(default_factory=list)  # of the training prompts' scores, 0..100%
    length_quantiles: list[float] = field(default_factory=list)  # of their log(1 + characters)
    logit_quantiles: list[float] = field(default_factory=list)  # of the classifier's logits
    mix: float = MIX
    quality: dict = field(default_factory=dict)  # cross-validated metrics (docs/router.md), for the dashboard
    features: str = FEATURES
    tokenizer: str = TOKENIZER

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: str | Path | None = None) -> "RouterWeights":
        """A weights file; None: the one shipped with sobrio."""
        text = (Path(path).read_text() if path is not None
                else resources.files("sobrio.data").joinpath(DEFAULT_WEIGHTS).read_text())
        weights = cls(**json.loads(text))
        if weights.features != FEATURES:
            raise ValueError(f"router weights {path or DEFAULT_WEIGHTS}: features {weights.features!r}, this "
                             f"sobrio computes {FEATURES!r}; retrain with `sobrio router train`")
        return weights

    def logits(self, features: np.ndarray) -> np.ndarray:
        """The linear model's output for each row of features: high where the strong model is worth it."""
        x = (features - np.asarray(self.mean, dtype=np.float32)) / np.asarray(self.scale, dtype=np.float32)
        return x @ np.asarray(self.weights, dtype=np.float32) + self.bias

    def scores(self, features: np.ndarray) -> np.ndarray:
        """Scores in [0, 1]: the prompt's length rank among the training prompts, plus `mix` times its
        model's rank, over 1 + mix."""
        length = _rank(features[:, LENGTH_COLUMN], self.length_quantiles)
        return (length + self.mix * _rank(self.logits(features), self.logit_quantiles)) / (1.0 + self.mix)

    def threshold_for_share(self, strong_share: float) -> float:
        """The score from which `strong_share` of the training prompts went to the strong model."""
        if not 0.0 <= strong_share <= 1.0:
            raise ValueError(f"a strong share is in [0, 1], not {strong_share}")
        if strong_share == 0.0:
            return float("inf")
        return float(np.interp(1.0 - strong_share, np.linspace(0, 1, len(self.score_quantiles)),
                               self.score_quantiles))


class Router:
    """Serving: a request's text to (model name, score), in the calling thread (well under a millisecond)."""

    def __init__(self, weights: RouterWeights, threshold: float | None = None):
        self.weights = weights
        self.features = PromptFeatures()
        self.threshold = weights.threshold if threshold is None else threshold
        self.decision_seconds: list[float] = []
        self.features.features(["warm up"])  # load the tokenizer now, not on the first request

    def choose(self, text: str) -> tuple[str, float]:
        start = time.perf_counter()
        score = float(self.weights.scores(self.features.features([text]))[0])
        self.decision_seconds = (self.decision_seconds + [time.perf_counter() - start])[-1000:]
        return (self.weights.large if score >= self.threshold else self.weights.small), score


# ---- training ----

def fit_within_subjects(x: np.ndarray, outcome: np.ndarray, subjects: list[str], l2: float = L2) -> np.ndarray:
    """Ridge regression of the outcome on the features, both centred within each subject (no intercept):
    what makes a question need the strong model more than its subject's others."""
    groups = np.unique(np.asarray(subjects), return_inverse=True)[1]
    x, y = _centred(x.astype(np.float64), groups), _centred(outcome.astype(np.float64), groups)
    return np.linalg.solve(x.T @ x + l2 * len(x) * np.eye(x.shape[1]), x.T @ y)


def _centred(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Each row less its group's mean."""
    sums = np.zeros((groups.max() + 1, *values.shape[1:]))
    np.add.at(sums, groups, values)
    counts = np.bincount(groups).reshape(-1, *([1] * (values.ndim - 1)))
    return values - (sums / counts)[groups]


def train(features: np.ndarray, strong: np.ndarray, weak: np.ndarray, subjects: list[str], small: str,
          large: str, strong_share: float = 0.5, l2: float = L2, mix: float = MIX) -> RouterWeights:
    """Weights fitted on these prompts, with their percentiles (length, model, score) and the threshold
    sending `strong_share` of them to the strong model."""
    mean = features.mean(axis=0)
    scale = np.maximum(features.std(axis=0), 1e-6)
    w = fit_within_subjects((features - mean) / scale, strong - weak, subjects, l2)
    weights = RouterWeights(small, large, 0.5, 0.0, _rounded(w), _rounded(mean), _rounded(scale), mix=mix)
    weights.length_quantiles = _quantiles(features[:, LENGTH_COLUMN])
    weights.logit_quantiles = _quantiles(weights.logits(features))
    weights.score_quantiles = _quantiles(weights.scores(features))
    weights.threshold = weights.threshold_for_share(strong_share)
    return weights


def _rounded(values, digits: int = 6) -> list[float]:
    return [round(float(v), digits) for v in values]


def _quantiles(values: np.ndarray) -> list[float]:
    return _rounded(np.quantile(values, np.linspace(0, 1, QUANTILES)), 7)


def _rank(values: np.ndarray, quantiles: list[float]) -> np.ndarray:
    """Where each value falls among the training prompts' (0: below all, 1: above all), interpolated."""
    return np.interp(values, quantiles, np.linspace(0, 1, len(quantiles)))
