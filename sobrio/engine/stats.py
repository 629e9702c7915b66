"""Counts the engine core keeps for /metrics that a scrape cannot rebuild from a snapshot of its state."""

from bisect import bisect_left

# vLLM's buckets of vllm:iteration_tokens_total (tokens one engine step computes)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class StepTokenCounts:
    """A histogram of the tokens each step computes (prompt chunks and decodes), as bucket counts (the last
    one past the largest bound) and their sum: a few numbers that cross to the API process with the stats."""

    def __init__(self) -> None:
        self.counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.total = 0

    def observe(self, num_tokens: int) -> None:
        self.counts[bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self.total += num_tokens

    def snapshot(self) -> tuple[list[int], int]:
        return list(self.counts), self.total
