"""Texts shipped with sobrio; README.md beside this file says what each is and where it came from."""

from importlib import resources

HELDOUT = "heldout_alice_in_wonderland.txt"  # `sobrio bench perplexity` measures on it: never calibrate on it
CALIBRATION = "calibration_as_you_like_it.txt"  # activation-aware quantization calibrates on it: never measure on it
DRAFT_PROMPTS = "draft_prompts.txt"  # `sobrio train-draft` has the target answer these, one a line


def read_text(name: str) -> str:
    """One shipped text, read from the installed package (a wheel or the source tree alike)."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
