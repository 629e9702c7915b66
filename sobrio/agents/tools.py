"""Tools an agent may call: Python functions registered by name with a JSON schema, and the built-ins
`load_skill` and `read_reference` (progressive disclosure of Skills). A tool that fails, or is called with
arguments that are not a JSON object, answers the model with an error message: a run never crashes on it."""

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass

from sobrio.agents.skills import SkillError, SkillSet


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of its arguments (an object)
    fn: Callable  # called with the arguments as keywords; may be async; returns text (or anything str() takes)

    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


class ToolBox:
    def __init__(self, tools: list[Tool]):
        self.tools = {t.name: t for t in tools}

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    async def call(self, name: str, arguments: str) -> tuple[str, bool]:
        """(the tool's answer, True) or (an error message for the model, False)."""
        tool = self.tools.get(name)
        if tool is None:
            return f"error: no tool {name!r}; the tools are: {', '.join(self.tools) or 'none'}", False
        try:
            kwargs = json.loads(arguments or "{}")
        except ValueError:
            return "error: the arguments are not valid JSON", False
        if not isinstance(kwargs, dict):
            return "error: the arguments must be a JSON object", False
        try:
            result = tool.fn(**kwargs)
            if inspect.isawaitable(result):
                result = await result
            return str(result), True
        except Exception as exc:  # noqa: BLE001 - the model hears of it, the run goes on
            return f"error: {type(exc).__name__}: {exc}", False


def skill_tools(skills: SkillSet, names: list[str]) -> list[Tool]:
    """`load_skill` and `read_reference`, limited to the skills a role may use."""
    def load_skill(name: str) -> str:
        if name not in names:
            raise SkillError(f"skill {name!r} is not one of this agent's: {', '.join(names)}")
        skill = skills[name]
        refs = skill.references()
        return skill.body() + (f"\n\nReferences (read_reference): {', '.join(refs)}" if refs else "")

    def read_reference(skill: str, file: str) -> str:
        if skill not in names:
            raise SkillError(f"skill {skill!r} is not one of this agent's: {', '.join(names)}")
        return skills[skill].read_reference(file)

    name_schema = {"type": "string", "enum": list(names)}
    return [Tool("load_skill", "Load a skill's full instructions into the conversation.",
                 {"type": "object", "properties": {"name": name_schema}, "required": ["name"]}, load_skill),
            Tool("read_reference", "Read one reference file of a loaded skill.",
                 {"type": "object", "properties": {"skill": name_schema, "file": {"type": "string"}},
                  "required": ["skill", "file"]}, read_reference)]
