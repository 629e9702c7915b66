"""`--chat-template`: a file or an inline Jinja template, read and compiled once, at start-up (vLLM's rules)."""

from functools import lru_cache
from pathlib import Path

from sobrio.errors import ConfigError

_JINJA_CHARS = "{}\n"  # vLLM's test: a value with none of these is meant as a file path


def load_chat_template(value: str) -> str:
    """The template text: the file's content if `value` names a file, else `value` itself (its `\\n` escapes
    decoded, as vLLM does for a template typed on a command line). A ConfigError if it is neither a file nor
    a template, or if Jinja cannot compile it."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # a long inline template is no path
        is_file = False
    if is_file:
        text = path.read_text(encoding="utf-8")
    elif any(c in value for c in _JINJA_CHARS):
        text = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    else:
        raise ConfigError(f"--chat-template {value!r} looks like a file path, but there is no such file",
                          "--chat-template")
    _compile(text)
    return text


def _compile(text: str) -> None:
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).parse(text)
    except TemplateSyntaxError as exc:
        raise ConfigError(f"--chat-template is not a valid Jinja template: {exc.message} (line {exc.lineno})",
                          "--chat-template") from None


@lru_cache(maxsize=16)
def template_describes_tools(text: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (as Qwen's and Hermes' do): then the server
    passes OpenAI tools to it; otherwise (SmolLM2, Gemma 3) it writes its own system prompt (server/tool_calls.py)."""
    if not isinstance(text, str):
        return False
    from jinja2 import TemplateSyntaxError, meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        return "tools" in meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(text))
    except TemplateSyntaxError:
        return False
