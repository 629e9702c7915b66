"""docs/flags.md, written from the same parser `sobrio serve --help` prints: one table per config class.

The flags are built from the config dataclasses' fields (`engine_args.py`), so the page is too: run
`python -m sobrio.flags_doc` after changing a field's default or help; `tests/unit/test_flags_doc.py` fails
while the page is stale. Imports only the config and `engine_args`, so it runs without loading a model.
"""

import argparse
import sys
from pathlib import Path

from sobrio.config import ServerConfig
from sobrio.engine_args import SHOWN, add_config_args, add_engine_args

PAGE = Path(__file__).resolve().parent.parent / "docs" / "flags.md"
COMMAND = "python -m sobrio.flags_doc"

HEADER = f"""# Flags

Every flag of `sobrio serve` (`sobrio generate` and `sobrio chat` take the engine's: every table but
`ServerConfig`, `LimitsConfig` and `CorsConfig`), one table per config class in `sobrio/config/`, in the order
`sobrio serve --help` prints them. Generated from the config fields by `{COMMAND}`; do not edit by hand
(`tests/unit/test_flags_doc.py` fails when this page is stale). The flags are vLLM's where vLLM has one;
[server.md](server.md) says how they fit together, and each feature's page says more about its own.
A YAML or TOML file of the same names (without `--`) is read with `--config FILE`; the command line wins.
"""


def serve_parser() -> argparse.ArgumentParser:
    """The flags of `sobrio serve`, as `server/app.py` adds them (without importing the server)."""
    parser = argparse.ArgumentParser(prog="sobrio serve")
    add_config_args(parser, ServerConfig)
    add_engine_args(parser, with_model=False)
    return parser


def render() -> str:
    """The page's text."""
    sections = [HEADER]
    for group in serve_parser()._action_groups:
        actions = [a for a in group._group_actions if a.dest != "help"]
        if not actions:
            continue
        rows = "\n".join(_row(a) for a in actions)
        table = f"| flag | default | meaning |\n|---|---|---|\n{rows}\n"
        sections.append(f"## {group.title}\n\n{group.description}\n\n{table}")
    return "\n".join(sections)


def _row(action: argparse.Action) -> str:
    if not action.option_strings:
        name = action.metavar or action.dest.upper()
    elif isinstance(action, argparse.BooleanOptionalAction):
        name = action.option_strings[0].replace("--", "--[no-]", 1)
    else:
        name = action.option_strings[0]
    meaning = (action.help or "").removesuffix(SHOWN)
    if action.choices:
        meaning += " (one of: " + ", ".join(map(str, action.choices)) + ")"
    return f"| `{name}` | {_default(action.default)} | {_cell(meaning)} |"


def _default(value) -> str:
    if value is None or value == []:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    return _cell(f"`{value}`")


def _cell(text: str) -> str:
    """One table cell: no line breaks, no bare pipes, no `<` read as an HTML tag."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def main(argv: list[str] | None = None) -> int:
    """Write the page; `--check`: exit 1 if it differs from what would be written."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say whether docs/flags.md is up to date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = not PAGE.exists() or PAGE.read_text(encoding="utf-8") != text
        print(f"{PAGE} is stale: run `{COMMAND}`" if stale else f"{PAGE} is up to date")
        return int(stale)
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
