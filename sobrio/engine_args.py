"""The engine's command-line flags, built from `EngineConfig`'s fields so no default is written twice.

Shared by `sobrio generate | chat` (cli.py) and `sobrio serve` (server/app.py); it imports only the config,
so both can use it without importing each other.
"""

import argparse
import types
from dataclasses import MISSING, Field, fields
from typing import Any

from sobrio.config import EngineConfig, option_name

MULTI_MODEL_HELP = "alias, HF folder or .gguf (repeatable; default: every installed alias)"


def flag_fields() -> list[Field]:
    """The fields that are flags: those whose metadata holds a help text; `model` is handled apart."""
    return [f for f in fields(EngineConfig) if "help" in f.metadata and f.name != "model"]


def add_engine_args(parser: argparse.ArgumentParser, multi_model: bool = False) -> None:
    """`--model` (repeatable for `serve`) and one flag per config field, with the field's default."""
    model = EngineConfig.__dataclass_fields__["model"]
    if multi_model:
        parser.add_argument("--model", action="append", default=None, help=MULTI_MODEL_HELP)
    else:
        parser.add_argument("--model", default=model.default, help=model.metadata["help"] + " (default: %(default)s)")
    for f in flag_fields():
        parser.add_argument(option_name(f.name), **_argument(f))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields that the flags set, as keyword arguments (the model is passed apart)."""
    return {f.name: getattr(args, f.name) for f in flag_fields()}


def _argument(f: Field) -> dict[str, Any]:
    """argparse keywords for one field: a bool is an on switch (off by default) or --[no-]name (on)."""
    if f.default is MISSING:
        raise TypeError(f"config field {f.name} needs a default to be a flag")
    shown = f.default is not None and f.default is not False  # None and an off switch say nothing
    kwargs: dict[str, Any] = {"default": f.default,
                              "help": f.metadata["help"] + (" (default: %(default)s)" if shown else "")}
    if f.type is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        return kwargs
    kwargs["type"] = _scalar_type(f.type)
    if "choices" in f.metadata:
        kwargs["choices"] = list(f.metadata["choices"])
    return kwargs


def _scalar_type(annotation: Any) -> type:
    """`int | None` -> int: the type argparse converts a value to."""
    if isinstance(annotation, types.UnionType):
        (annotation,) = [t for t in annotation.__args__ if t is not type(None)]
    return annotation
