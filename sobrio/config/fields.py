"""What every concern's config shares: fields that are flags, and checks that name the flag.

A field made with `flag(...)` is also a `--kebab-case` command-line flag: its default, help text and any
argparse special (choices, a converter, `append`) live in its metadata, and `sobrio/engine_args.py` reads
them, so no default is written twice. A field without `flag` is settable from Python only.
"""

from collections.abc import Callable
from dataclasses import MISSING, Field, field, fields, is_dataclass
from typing import Any

from sobrio.errors import ConfigError


def flag(default: Any, help_text: str, *, choices: tuple[str, ...] | None = None,
         action: str | None = None, type: Callable[[str], Any] | None = None) -> Any:
    """A field that is also a flag. A list default is copied per instance (a dataclass needs a factory)."""
    extra = {"choices": choices, "action": action, "type": type}
    metadata = {"help": help_text} | {k: v for k, v in extra.items() if v is not None}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def is_flag(f: Field) -> bool:
    return "help" in f.metadata


def is_nested(f: Field) -> bool:
    """A field holding a config of its own (`ServerConfig.limits`): its flags are the nested fields'."""
    return isinstance(f.type, type) and is_dataclass(f.type)


def default_of(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise TypeError(f"config field {f.name} needs a default")


def option_name(config: Any, name: str) -> str:
    """How a user names a field: by its flag if it has one (`--block-size`), else by its Python name."""
    f = next(f for f in fields(config) if f.name == name)
    return "--" + name.replace("_", "-") if is_flag(f) else name


class Checked:
    """Base of the concern configs: `_require` turns a broken rule into a ConfigError naming the flag."""

    def _require(self, name: str, ok: bool, rule: str) -> None:
        if not ok:
            option = option_name(self, name)
            raise ConfigError(f"{option} must be {rule}, got {getattr(self, name)!r}", option)

    def _at_least(self, minimum: int, *names: str, optional: bool = False) -> None:
        """Each named field >= minimum (or None, when `optional`)."""
        for name in names:
            value = getattr(self, name)
            ok = (optional and value is None) or (value is not None and value >= minimum)
            self._require(name, ok, f">= {minimum}" + (" (or unset)" if optional else ""))
