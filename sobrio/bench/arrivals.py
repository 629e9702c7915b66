"""Request arrival times: Poisson (burstiness 1) or gamma-distributed gaps; `inf` sends all at once."""

import math

import numpy as np


def arrival_gaps(count: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Gaps (seconds) before each request; mean 1 / rate, coefficient of variation 1 / sqrt(burstiness)."""
    if math.isinf(rate):
        return np.zeros(count)
    assert rate > 0 and burstiness > 0
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
