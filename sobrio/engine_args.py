"""Command-line flags built from the config dataclasses' fields, so no default is written twice.

`add_config_args(parser, ConfigClass)` adds one flag per `flag()` field (a nested config's fields too), in an
argument group per class; `config_from_args(args, ConfigClass)` builds the config back. The engine's flags
are every concern of `SobrioConfig` and the vLLM flags sobrio refuses (`UnsupportedConfig`); `sobrio serve`
adds `ServerConfig`'s. `apply_config_file` reads `--config FILE` (YAML) into the parser's defaults, so the
command line wins over the file. Shared by `sobrio generate | chat` (cli.py) and `sobrio serve`
(server/app.py); it imports only the config, so both can use it. `python -m sobrio.flags_doc` writes
docs/flags.md from the same parser.
"""

import argparse
import difflib
import types
from dataclasses import Field, fields
from typing import Any

from sobrio.config import SobrioConfig, UnsupportedConfig
from sobrio.config.fields import default_of, is_flag, is_nested
from sobrio.config.server import str_list
from sobrio.errors import ConfigError

SHOWN = " (default: %(default)s)"

ENVIRONMENT = """environment variables:
  SOBRIO_CACHE        where prepared GGUF folders and assembled model files live (default: ~/.cache/sobrio)
  SOBRIO_QUANTIZATION_CACHE
                      --quantization-cache auto's folder (or off; default: $SOBRIO_CACHE/quantized)
  SOBRIO_DISABLE_CPP  set (to anything): use the PyTorch path, not the C++ operators
  SOBRIO_DISABLE_VNNI 1: GGUF blocks, --quantization int4 and AWQ/GPTQ codes take aten's int4 kernel and
                      grouped_linear, not vnni_linear (and so no fused decode)
  SOBRIO_DISABLE_FUSED_DECODE
                      1: a decode step runs through the modules, not one C++ call (models/fused_decode.py)
  SOBRIO_DISABLE_HUGE_PAGES
                      1: the weights stay in 4 KB pages, not moved to transparent huge pages once the
                      engine idles after its start (docs/memory.md, "Weights in huge pages")
  XDG_CACHE_HOME      the C++ operators' fallback folder when the environment is read-only (default: ~/.cache)
  CXX                 the compiler that builds the C++ operators (default: c++)
  OMP_WAIT_POLICY, GOMP_SPINCOUNT
                      OpenMP's thread waiting; unless either is set, sobrio sets GOMP_SPINCOUNT=100000,
                      and 1000000 in serve's engine-core process
  OMP_NUM_THREADS     threads per engine (read by torch; default: one per core)"""


class HelpFormatter(argparse.HelpFormatter):
    """Wraps help text as argparse does, except text that holds its own line breaks (the environment list)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


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
        if f.metadata.get("positional"):
            group.add_argument(f.name, metavar=f.name.removesuffix("_tag").upper(), nargs="?", **_argument(f))
        else:
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
    """Every engine concern's flags, then the refused ones; `sobrio serve` leaves `--model` to ServerConfig
    (repeatable there)."""
    for concern in SobrioConfig.concerns().values():
        add_config_args(parser, concern, skip=() if with_model else ("model",))
    add_config_args(parser, UnsupportedConfig)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine fields the flags set, flat (`SobrioConfig.from_kwargs`' form, which also refuses the
    unsupported ones unless left at their default), the model aside."""
    names = [f.name for f in engine_flag_fields(skip=("model",))] + [f.name for f in flag_fields(UnsupportedConfig)]
    return {name: getattr(args, name) for name in names}


class Repeatable(argparse.Action):
    """A repeatable flag: one value per use (`append`) or several (`nargs="+"`). Its first use on the command
    line replaces a default (from a `--config` file) instead of adding to it: the command line wins."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        items = getattr(namespace, self.dest, None)
        items = [] if items is None or items is self.default else list(items)
        items.extend(values) if isinstance(values, list) else items.append(values)
        setattr(namespace, self.dest, items)


def _argument(f: Field) -> dict[str, Any]:
    """argparse keywords for one field. Help ends with the default unless it is None or empty (the help then
    says what unset means); a bool is an on switch (off by default) or --[no-]name (on by default)."""
    default = default_of(f)
    shown = default is not None and default != []
    kwargs: dict[str, Any] = {"default": default, "help": f.metadata["help"] + (SHOWN if shown else "")}
    if f.metadata.get("action") == "append" or f.metadata.get("nargs") == "+":
        return kwargs | {"action": Repeatable, "nargs": f.metadata.get("nargs")}
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


# ---- --config FILE ----

def config_file_of(argv: list[str]) -> str | None:
    """The value of `--config` in a command line, if any (read before parsing: it sets the defaults)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """`--config FILE`: a YAML mapping of flag names (without --, dashes or underscores) to values, as vLLM
    reads it. Each key becomes its flag's default, so a flag on the command line wins. `model: NAME` is the
    positional model where the command has one. A bad file, key or value exits 2 with its message."""
    data = _read_flags_file(parser, path)
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    defaults = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest == "model" and "model_tag" in actions and not isinstance(value, list):
            dest = "model_tag"
        if dest not in actions:
            close = difflib.get_close_matches(dest.replace("_", "-"), [d.replace("_", "-") for d in actions], n=1)
            parser.error(f"--config {path}: unknown flag {key!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
        defaults[dest] = _file_value(parser, actions[dest], path, key, value)
    parser.set_defaults(**defaults)


def _read_flags_file(parser: argparse.ArgumentParser, path: str):
    """A YAML file's mapping; a TOML file's top-level keys (its gateway tables are gateway/config.py's)."""
    if path.endswith(".toml"):
        from sobrio.gateway.config import GATEWAY_TABLES, read_toml

        try:
            data = read_toml(path)
        except ConfigError as exc:
            parser.error(str(exc))
        return {k: v for k, v in data.items() if k not in GATEWAY_TABLES}
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        parser.error(f"--config {path}: {exc.strerror or exc}")
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        parser.error(f"--config {path}: not valid YAML" + (f" (line {where.line + 1})" if where else ""))
    return {} if data is None else data


def _file_value(parser: argparse.ArgumentParser, action: argparse.Action, path: str, key: str, value: Any) -> Any:
    """A YAML value as the flag would have parsed it: converted by the flag's type when it is text, checked
    against its choices, a list for repeatable flags."""
    def bad(why: str):
        parser.error(f"--config {path}: {key}: {why}")

    def convert(item: Any) -> Any:
        if isinstance(item, str) and action.type is not None:
            try:
                return action.type(item)
            except argparse.ArgumentTypeError as exc:
                bad(str(exc))
            except (TypeError, ValueError):  # argparse's own words
                bad(f"invalid {getattr(action.type, '__name__', 'value')} value: {item!r}")
        return item

    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            bad("expected true or false")
        return value
    if isinstance(action, Repeatable):
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(i, (str, int, float)) for i in items):
            bad("expected a value or a list of values")
        return [str(i) for i in items]
    if action.type is str_list and isinstance(value, list):
        if not all(isinstance(i, str) for i in value):
            bad("expected a list of strings")
        return value
    if isinstance(value, (list, dict)) and action.type in (None, str, int, float):
        bad("expected a single value")
    value = convert(value)
    if action.type in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        bad(f"expected a number, got {value!r}")
    if action.choices is not None and value not in action.choices:
        bad(f"{value!r} is not one of {', '.join(map(str, action.choices))}")
    return float(value) if action.type is float else value
