"""Speculative decoding: vLLM's `--speculative-config` JSON (`LLM(speculative_config={...})`), checked once.

`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}` proposes the
tokens that followed the latest earlier occurrence of the sequence's last n tokens (prompt lookup);
`{"method": "medusa", "model": FOLDER, "num_speculative_tokens": 3}` drafts with heads `sobrio train-draft`
trained for the model (spec/medusa.py); `{"method": "eagle", "model": FOLDER, "num_speculative_tokens": 3}`
drafts with an EAGLE head (one decoder layer on the target's own features, spec/eagle.py) from `sobrio
train-draft --method eagle`; `{"method": "layer_skip", "exit_layer": 15, "num_speculative_tokens": 3}`
drafts with the model itself cut after its first `exit_layer` layers (LayerSkip's self-speculation: no second
model, the draft's KV is the model's own for those layers); `{"method": "draft_model", "model": NAME,
"num_speculative_tokens": 3}` drafts with a smaller model of the same tokenizer (vLLM's key `quantization`
quantizes it at load, and an EAGLE head's own matrices too), which keeps its own KV cache in the target's
block ids (spec/model_draft.py).
`disable_by_batch_size` turns speculation off for a step with more requests running than that (vLLM's key);
`min_acceptance_rate` (sobrio's) stops it for a request whose drafts are rarely accepted;
`min_draft_confidence` (sobrio's, EAGLE only; EAGLE-2's dynamic draft length; default 0.2, 0 for always k)
ends a step's drafts where the head's joint probability of them falls below it, so k is a ceiling rather than
a fixed count: on SmolLM2 with k = 3 it took one request at a time from 1.06x to 1.28x the plain engine
(`benchmarks/spec_offline.py`), its drafts now stopping where they would mostly be rejected.
"""

from dataclasses import dataclass
from typing import Any

from sobrio.config.fields import Checked, flag, json_object_flag, json_object_with_defaults, require
from sobrio.config.model import CHECKPOINT_QUANTIZATION, QUANTIZATION_METHODS
from sobrio.errors import ConfigError

OPTION = "--speculative-config"
METHODS = ("ngram", "medusa", "eagle", "layer_skip", "draft_model")
NOT_YET = ("eagle3", "mlp_speculator", "deepseek_mtp")
DEFAULTS: dict[str, Any] = {"method": None, "num_speculative_tokens": None, "prompt_lookup_min": 2,
                            "prompt_lookup_max": 5, "disable_by_batch_size": 8, "min_acceptance_rate": 0.1,
                            "min_draft_confidence": 0.2,
                            "model": None, "exit_layer": None, "quantization": None}


@dataclass(frozen=True)
class SpeculativeConfig(Checked):
    """Speculative decoding (vLLM's `SpeculativeConfig`, passed whole as one JSON object)."""

    speculative_config: dict | None = flag(
        None, 'speculative decoding as JSON, vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_min": 2, "prompt_lookup_max": 5, "disable_by_batch_size": 8}; method "draft_model" '
              'with "model" (a smaller model of the same tokenizer; "quantization" optional); method "medusa" '
              'or "eagle" with "model": a folder from `sobrio train-draft` (eagle: "quantization" int8, '
              'int8-weight-only or int4 rounds the head, default none); sobrio\'s: method "layer_skip" with '
              '"exit_layer" '
              '(default: half the layers) drafts with the model\'s own first layers, and "min_acceptance_rate" '
              '(0.1) stops a request\'s drafts when fewer are accepted; "min_draft_confidence" (eagle, 0.2) ends a '
              'step\'s drafts where the head\'s joint probability of them falls below it',
        type=json_object_flag(OPTION))

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            spec = json_object_with_defaults(self.speculative_config, OPTION, DEFAULTS)
            object.__setattr__(self, "speculative_config", self._checked(spec))

    @staticmethod
    def _checked(spec: dict) -> dict:
        method, k = spec["method"], spec["num_speculative_tokens"]
        if method in NOT_YET:
            raise ConfigError(f"{OPTION}: sobrio does not support method {method!r} yet (supported: "
                              f"{', '.join(METHODS)})", OPTION)
        _require(method in METHODS, f"method must be one of {', '.join(METHODS)}, got {method!r}")
        _require(isinstance(k, int) and 1 <= k <= 16,
                 f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        _require(method not in ("medusa", "eagle") or isinstance(spec["model"], str),
                 f'method "{method}" needs "model": the folder `sobrio train-draft` wrote')
        _require(method != "draft_model" or isinstance(spec["model"], str),
                 'method "draft_model" needs "model": a model alias or path with the same tokenizer')
        methods = QUANTIZATION_METHODS + (CHECKPOINT_QUANTIZATION if method != "eagle" else ())
        _require(spec["quantization"] is None or spec["quantization"] in methods,
                 f"quantization (the draft model's, or the EAGLE head's) must be one of {', '.join(methods)} or "
                 f"null, got {spec['quantization']!r}")
        exit_layer = spec["exit_layer"]
        _require(exit_layer is None or (isinstance(exit_layer, int) and exit_layer >= 1),
                 f"exit_layer must be an integer >= 1 (the layers the draft runs; unset: half), got {exit_layer!r}")
        low, high = spec["prompt_lookup_min"], spec["prompt_lookup_max"]
        _require(isinstance(low, int) and isinstance(high, int) and 1 <= low <= high,
                 "prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max, "
                 f"got {low!r}, {high!r}")
        size = spec["disable_by_batch_size"]
        _require(size is None or (isinstance(size, int) and size >= 1),
                 f"disable_by_batch_size must be an integer >= 1 (or null: never), got {size!r}")
        rate = spec["min_acceptance_rate"]
        _require(isinstance(rate, int | float) and 0 <= rate <= 1,
                 f"min_acceptance_rate must be in [0, 1], got {rate!r}")
        confidence = spec["min_draft_confidence"]
        _require(isinstance(confidence, int | float) and 0 <= confidence <= 1,
                 f"min_draft_confidence must be in [0, 1], got {confidence!r}")
        return spec

    @property
    def enabled(self) -> bool:
        return self.speculative_config is not None

    def get(self, key: str) -> Any:
        assert self.speculative_config is not None, "speculative decoding is off"
        return self.speculative_config[key]


def _require(ok: bool, message: str) -> None:
    require(ok, message, OPTION)
