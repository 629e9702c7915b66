"""Self-speculative drafts (LayerSkip's idea): the model's own first layers, its final norm and its head
guess the next tokens; no second model and no second KV cache.

The draft's attention reads and writes the KV cache of those first layers, which the full model fills with
the same values for every position it computes (same weights, same inputs): the draft needs no catching
up, only slots for the positions it guesses at, which it takes ahead of the verifying step (the
scheduler's own allocation then finds them). The verifying step recomputes those positions through every
layer, so what an early exit wrote there never outlives a rejected guess.

A model not trained for early exits (LayerSkip trains with layer dropout and an early-exit loss) guesses
poorly from its shallow layers: `benchmarks/spec_decode.sh` measures the acceptance rate at each exit.
"""

from collections.abc import Callable

from sobrio.engine.request import Request

Drafter = Callable[[list[Request], list[int], int], list[list[int]]]  # Executor.draft_by_early_exit
Reserve = Callable[[Request, int], bool]  # KVCacheManager.allocate_slots


class LayerSkipProposer:
    needs_hidden = False

    def __init__(self, draft: Drafter, reserve: Reserve, exit_layer: int, num_speculative_tokens: int):
        self.draft, self.reserve = draft, reserve
        self.exit_layer, self.k = exit_layer, num_speculative_tokens

    def propose_batch(self, todo: list[tuple[Request, int]], hidden: dict) -> dict[str, list[int]]:
        """Drafts for the requests that get KV slots for them; one without free blocks does not draft."""
        ready = [(req, min(self.k, limit)) for req, limit in todo]
        ready = [(req, n) for req, n in ready if self.reserve(req, n)]
        if not ready:
            return {}
        drafts = self.draft([req for req, _ in ready], [n for _, n in ready], self.exit_layer)
        return {req.request_id: tokens for (req, _), tokens in zip(ready, drafts)}
