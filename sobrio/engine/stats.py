"""Counts the engine core keeps for /metrics that a scrape cannot rebuild from a snapshot of its state."""

from bisect import bisect_left

# vLLM's buckets of vllm:iteration_tokens_total (tokens one engine step computes)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


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


class StepTokenCounts(Histogram):
    """A histogram of the tokens each step computes (prompt chunks, decodes and forced tokens)."""

    def __init__(self) -> None:
        super().__init__(ITERATION_TOKENS_BUCKETS)


