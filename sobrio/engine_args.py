"""Command-line flags built from the config dataclasses' fields, so no default is written twice.

`add_config_args(parser, ConfigClass)` adds one flag per `flag()` field (a nested config's fields too), in an
argument group per class; `config_from_args(args, ConfigClass)` builds the config back. The engine's flags
are every concern of `SobrioConfig`; `sobrio serve` adds `ServerConfig`'s. Shared by `sobrio generate | chat`
(cli.py) and `sobrio serve` (server/app.py); it imports only the config, so both can use it.
"""

import argparse
import types
from dataclasses import Field, fields
from typing import Any

from sobrio.config import SobrioConfig
from sobrio.config.fields import default_of, is_flag, is_nested

SHOWN = " (default: %(default)s)"


def flag_fields(config_class: type, skip: tuple[str, ...] = ()) -> list[Field]:
    """The fields of one config class that are flags, nested configs' aside."""
    return [f for f in fields(config_class) if is_flag(f) and f.name not in skip]


def engine_flag_fields(skip: tuple[str, ...] = ()) -> list[Field]:
    """Every engine concern's flag fields, in SobrioConfig's order."""
    return [f for concern in SobrioConfig.concerns().values() for f in flag_fields(concern, skip)]


def add_config_args(parser: argparse.ArgumentParser, config_class: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field, grouped under the class's name in --help; then each nested config's group."""
    doc = (config_class.__doc__ or "").strip().split("\n\n")[0]
    group = parser.add_argument_group(config_class.__name__, " ".join(doc.split()))
    for f in flag_fields(config_class, skip):
        group.add_argument("--" + f.name.replace("_", "-"), **_argument(f))
    for f in fields(config_class):
        if is_nested(f):
            add_config_args(parser, f.type)


def config_from_args(args: argparse.Namespace, config_class: type, skip: tuple[str, ...] = ()) -> Any:
    """The config the parsed flags describe; its own checks run (ConfigError on a bad value)."""
    values = {f.name: getattr(args, f.name) for f in flag_fields(config_class, skip)}
    nested = {f.name: config_from_args(args, f.type) for f in fields(config_class) if is_nested(f)}
    return config_class(**values, **nested)


def add_engine_args(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
    """Every engine concern's flags; `sobrio serve` leaves `--model` to ServerConfig (repeatable there)."""
    for concern in SobrioConfig.concerns().values():
        add_config_args(parser, concern, skip=() if with_model else ("model",))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine fields the flags set, flat (`SobrioConfig.from_kwargs`' form), the model aside."""
    return {f.name: getattr(args, f.name) for f in engine_flag_fields(skip=("model",))}


def _argument(f: Field) -> dict[str, Any]:
    """argparse keywords for one field. Help ends with the default unless it is None or empty (the help then
    says what unset means); a bool is an on switch (off by default) or --[no-]name (on by default)."""
    default = default_of(f)
    shown = default is not None and default != []
    kwargs: dict[str, Any] = {"default": default, "help": f.metadata["help"] + (SHOWN if shown else "")}
    if "action" in f.metadata:
        return kwargs | {"action": f.metadata["action"]}
    if f.type is bool:
        return kwargs | {"action": argparse.BooleanOptionalAction if default else "store_true"}
    kwargs["type"] = f.metadata.get("type") or _scalar_type(f.type)
    if "choices" in f.metadata:
        kwargs["choices"] = list(f.metadata["choices"])
    return kwargs


def _scalar_type(annotation: Any) -> type:
    """`int | None` -> int: the type argparse converts a value to."""
    if isinstance(annotation, types.UnionType):
        (annotation,) = [t for t in annotation.__args__ if t is not type(None)]
    return annotation
