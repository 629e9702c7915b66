"""`--override-generation-config` and the values `--generation-config` finds: which sampling fields a model's
defaults may set, and the check that they are valid (loader/generation.py reads them from the files)."""

from sobrio.errors import ConfigError, InvalidRequestError
from sobrio.types.params import SamplingParams

# generation_config.json key -> SamplingParams field (vLLM's list: get_diff_sampling_param)
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_overrides(overrides: dict | None) -> dict:
    """`--override-generation-config`: known sampling fields with valid values, or a ConfigError."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(HF_KEYS.values()))
    if unknown:
        raise ConfigError(f"--override-generation-config: unknown sampling parameter {unknown[0]!r} (known: "
                          f"{', '.join(HF_KEYS.values())})", "--override-generation-config")
    check_sampling(overrides, "--override-generation-config")
    return overrides


def check_sampling(values: dict, option: str) -> None:
    """Values SamplingParams accepts, or a ConfigError naming `option`."""
    try:
        SamplingParams(**values)
    except (InvalidRequestError, TypeError) as exc:
        raise ConfigError(f"{option}: {exc}", option) from None
