"""What every concern's config shares: fields that are flags, and checks that name the flag.

A field made with `flag(...)` is also a `--kebab-case` command-line flag: its default, help text and any
argparse special (choices, a converter, `append`, `nargs`, positional) live in its metadata, and
`sobrio/engine_args.py` reads them, so no default is written twice. A field without `flag` is settable from
Python only. `unsupported(...)` names a vLLM flag sobrio lacks: it parses, and any value but the default is
refused with "sobrio does not support ... yet".
"""

import argparse
import json
from collections.abc import Callable
from dataclasses import MISSING, Field, field, fields, is_dataclass
from typing import Any

from sobrio.errors import ConfigError


def flag(default: Any, help_text: str, *, choices: tuple[str, ...] | None = None,
         action: str | None = None, type: Callable[[str], Any] | None = None, nargs: str | None = None,
         positional: bool = False) -> Any:
    """A field that is also a flag. A list default is copied per instance (a dataclass needs a factory).
    `action="append"` and `nargs="+"` flags are repeatable, and a value from the command line replaces one
    from a `--config` file rather than adding to it. `positional`: an optional positional argument."""
    extra = {"choices": choices, "action": action, "type": type, "nargs": nargs, "positional": positional or None}
    return _field(default, {"help": help_text} | {k: v for k, v in extra.items() if v is not None})


def _field(default: Any, metadata: dict) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def unsupported(default: Any, what: str, **kwargs: Any) -> Any:
    """A vLLM flag for a feature sobrio lacks: recognized so that a script fails with a clear message (exit 2),
    not argparse's "unrecognized arguments". `Checked._refuse_unsupported` refuses any value but `default`."""
    metadata = dict(flag(default, f"not supported yet: {what}", **kwargs).metadata)
    return _field(default, metadata | {"unsupported": True})


def is_unsupported(f: Field) -> bool:
    return bool(f.metadata.get("unsupported"))


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

    def _refuse_unsupported(self) -> None:
        """Every `unsupported` field must keep its default (the no-op value)."""
        for f in fields(self):
            if is_unsupported(f) and getattr(self, f.name) != default_of(f):
                option = option_name(self, f.name)
                raise ConfigError(f"sobrio does not support {option} yet (got {getattr(self, f.name)!r})", option)

    def _at_least(self, minimum: int, *names: str, optional: bool = False) -> None:
        """Each named field >= minimum (or None, when `optional`)."""
        for name in names:
            value = getattr(self, name)
            ok = (optional and value is None) or (value is not None and value >= minimum)
            self._require(name, ok, f">= {minimum}" + (" (or unset)" if optional else ""))


def parse_json_object(text: str, option: str) -> dict:
    """A JSON object, or a ConfigError naming the flag."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{option} must be a JSON object: {exc}", option) from None
    if not isinstance(value, dict):
        raise ConfigError(f"{option} must be a JSON object, got {text!r}", option)
    return value


def json_object_flag(option: str) -> Callable[[str], dict]:
    """A JSON-object flag's converter: argparse shows its message (a ConfigError would read "invalid value")."""
    def convert(text: str) -> dict:
        try:
            return parse_json_object(text, option)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def json_object_with_defaults(value: dict | str, option: str, defaults: dict[str, Any]) -> dict:
    """A JSON-object flag's value (parsed if it is still text) with each key it lacks at its default; an
    unknown key is a ConfigError that lists the known ones (vLLM's config objects: speculative, KV transfer)."""
    spec = parse_json_object(value, option) if isinstance(value, str) else dict(value)
    unknown = sorted(set(spec) - set(defaults))
    require(not unknown, f"unknown key(s) {', '.join(unknown)}; known: {', '.join(defaults)}", option)
    return {**defaults, **spec}


def require(ok: bool, message: str, option: str) -> None:
    """A ConfigError "OPTION: message" unless `ok`."""
    if not ok:
        raise ConfigError(f"{option}: {message}", option)
