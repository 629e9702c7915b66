"""The one rule that picks a replica, shared by the gateway's backends and the data-parallel engine cores:
prefer the replica that has seen the longest prefix of this prompt (its prefix cache likely holds it), unless
it has `slack` more requests outstanding than the least loaded one; otherwise the least loaded (ties: the
one chosen longest ago). SGLang's cache-aware routing, on chained hashes of the prompt's blocks (text for
the gateway, token ids for the engine cores); each replica remembers an LRU of hashes, never the prompt."""

import time
from collections import OrderedDict
from collections.abc import Sequence

AFFINITY_ENTRIES = 16384  # hashes remembered per replica (a few hundred prompts' worth)


def chained_hashes(items: Sequence, block: int, max_blocks: int, seed=None) -> list[int]:
    """Hashes of the whole blocks of `items` (a string or token ids), each chained to the one before:
    equal lists up to i mean equal items up to block i. `seed` (a cache salt) starts the chain."""
    hashes, h = [], hash(seed)
    end = min(len(items), block * max_blocks)
    for start in range(0, end - block + 1, block):
        h = hash((h, tuple(items[start:start + block]) if not isinstance(items, str) else items[start:start + block]))
        hashes.append(h)
    return hashes


class Balanced:
    """What the rule reads of a replica: its outstanding requests and the prompt prefixes it has seen."""

    def __init__(self):
        self.in_flight = 0
        self.last_chosen = 0.0
        self.seen: OrderedDict[int, None] = OrderedDict()

    @property
    def outstanding(self) -> int:
        return self.in_flight

    def matched(self, hashes: list[int]) -> int:
        """How many leading blocks of the prompt this replica has seen."""
        count = 0
        for h in hashes:
            if h not in self.seen:
                break
            count += 1
        return count

    def remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self.seen[h] = None
            self.seen.move_to_end(h)
        while len(self.seen) > AFFINITY_ENTRIES:
            self.seen.popitem(last=False)


def choose(candidates: Sequence[Balanced], hashes: list[int], slack: int):
    """The replica for a prompt with these prefix hashes (candidates: non-empty, all usable)."""
    assert candidates, "choose needs at least one candidate"
    loads = {id(r): r.outstanding for r in candidates}
    least = min(loads.values())
    affine = max(candidates, key=lambda r: (r.matched(hashes), -loads[id(r)]))
    if affine.matched(hashes) > 0 and loads[id(affine)] <= least + slack:
        chosen = affine
    else:
        chosen = min(candidates, key=lambda r: (loads[id(r)], r.last_chosen))
    chosen.last_chosen = time.monotonic()
    chosen.remember(hashes)
    return chosen
