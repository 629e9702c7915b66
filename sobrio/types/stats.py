"""Plain counters that cross processes with the engine's stats and that low packages (structured/) fill."""

from bisect import bisect_left


class Histogram:
    """Bucket counts (the last one past the largest bound) and their sum: a few numbers that cross to the API
    process with the stats, where `/metrics` turns them into a Prometheus histogram."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        assert list(bounds) == sorted(bounds), "bucket bounds must be increasing"
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> tuple[list[int], float]:
        return list(self.counts), self.total
