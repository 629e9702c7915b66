"""Counts the engine core keeps for /metrics that a scrape cannot rebuild from a snapshot of its state."""

from sobrio.types.stats import Histogram

# vLLM's buckets of vllm:iteration_tokens_total (tokens one engine step computes)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class StepTokenCounts(Histogram):
    """A histogram of the tokens each step computes (prompt chunks, decodes and forced tokens)."""

    def __init__(self) -> None:
        super().__init__(ITERATION_TOKENS_BUCKETS)


