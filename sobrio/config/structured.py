"""Structured output in the engine core: how long a grammar may compile, and whether forced tokens skip sampling."""

from dataclasses import dataclass

from sobrio.config.fields import Checked, flag


@dataclass(frozen=True)
class StructuredOutputsConfig(Checked):
    """Structured output (vLLM's `StructuredOutputsConfig` names none of these: sobrio's own flags)."""

    structured_outputs_fast_forward: bool = flag(
        True, "emit the tokens a grammar forces (fixed keys, punctuation) without sampling them, computed in one "
              "forward with the next step; the output is the one token-by-token decoding gives")
    structured_outputs_compile_timeout: float = flag(
        10.0, "seconds a request's grammar may take to compile; past it the request fails with a 400 and the "
              "engine goes on")

    def __post_init__(self) -> None:
        self._require("structured_outputs_compile_timeout", self.structured_outputs_compile_timeout > 0,
                      "> 0 seconds")
