"""Incremental detokenization with stop strings.

`DecodeStream` (tokenizers) yields text only once the bytes form whole UTF-8 characters. Text that could
still turn out to be the start of a stop string is held back from streaming until it is decided.
"""

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from sobrio.types.params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stops: list[str] = list(params.stop or [])
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters already handed out as deltas

    def add(self, token_id: int) -> str | None:
        """Decode one token; return the stop string it completed, if any (text is then cut before it)."""
        piece = self.stream.step(self.tokenizer, token_id) or ""
        if not piece or not self.stops:
            self.text += piece
            return None
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        hit = min(((self.text.find(s, start), s) for s in self.stops if self.text.find(s, start) >= 0),
                  default=None)
        if hit is None:
            return None
        index, stop = hit
        self.text = self.text[: index + (len(stop) if self.include_stop else 0)]
        return stop

    def delta(self, finished: bool) -> str:
        """New text safe to show: all of it once finished, else all but what may start a stop string."""
        end = len(self.text) if finished or not self.stops else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
