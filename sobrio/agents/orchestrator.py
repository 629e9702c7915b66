"""An orchestrator that splits a task among sub-agents, each on the model its role names, over sobrio's own
OpenAI API (so the agents go through the gateway: keys, tenants, router, ledger, energy).

A team file (TOML) names the skills source and the roles:

    skills = "./skills"                  # a folder, or REPO@REV:PATH pinned to a commit
    max_concurrency = 2                  # sub-agents running at once
    max_subtasks = 4
    [roles.planner]                      # splits the task (one sub-task a line, "role: sub-task"), then answers
    model = "gemma3-270m"
    instructions = "Split the task into independent sub-questions, one per line."
    [roles.worker]
    model = "auto"                       # through the router
    instructions = "Answer the question in one sentence."
    skills = ["unit-conversion"]         # names and descriptions in its prompt; bodies via load_skill
    tools = ["calculator"]               # Python functions registered by name
    max_tokens = 256                     # limits: completion tokens, model calls, wall time
    max_turns = 4
    max_seconds = 60

A run returns its answer and a trace (agents, models that answered, skills and their revision, tool calls,
tokens, time, energy from the gateway's headers). A limit stops an agent cleanly with what it has; a tool's
failure goes back to the model as the tool's answer. Nothing of a run is written anywhere: the trace is
returned, and written only where the caller asks (`sobrio agents run --trace FILE`).
"""

import asyncio
import re
import time
from dataclasses import asdict, dataclass, field

from sobrio.agents.skills import SkillSet, load_skills
from sobrio.agents.tools import Tool, ToolBox, skill_tools
from sobrio.errors import ConfigError

_LINE_PREFIX = re.compile(r"^\s*(?:[-*]|\d+[.)])\s*")


@dataclass(frozen=True)
class Role:
    name: str
    model: str
    instructions: str = ""
    skills: tuple[str, ...] = ()
    tools: tuple[str, ...] = ()
    max_tokens: int = 512
    max_turns: int = 4
    max_seconds: float = 120.0


@dataclass(frozen=True)
class Team:
    roles: dict[str, Role]
    skills: str | None = None
    max_concurrency: int = 2
    max_subtasks: int = 4

    @classmethod
    def load(cls, path: str) -> "Team":
        from sobrio.gateway.config import read_toml

        return cls.from_dict(read_toml(path), path)

    @classmethod
    def from_dict(cls, data: dict, where: str = "team") -> "Team":
        """A team from a team file's mapping (or the JSON of `POST /v1/agents/runs`)."""
        data = dict(data)
        roles = data.pop("roles", {})
        if not isinstance(roles, dict) or "planner" not in roles or len(roles) < 2:
            raise ConfigError(f"{where}: a team needs [roles.planner] and at least one other role")
        try:
            built = {name: Role(name, **{k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()})
                     for name, spec in roles.items()}
            return cls(built, **data)
        except (TypeError, AttributeError) as exc:
            raise ConfigError(f"{where}: {exc}") from None


@dataclass
class AgentTrace:
    role: str
    task: str
    model: str | None = None  # the model that answered (the router's choice for "auto")
    turns: int = 0
    tool_calls: list[dict] = field(default_factory=list)  # {"name", "ok"}
    prompt_tokens: int = 0
    completion_tokens: int = 0
    energy_j: float = 0.0
    started: float = 0.0
    seconds: float = 0.0
    stopped: str = ""  # "answer", "max_turns", "max_tokens", "max_seconds", "error"
    answer: str | None = None


class Orchestrator:
    def __init__(self, team: Team, client, tools: list[Tool] | None = None):
        """`client`: an `openai.AsyncOpenAI` on sobrio's API (or any OpenAI-compatible server)."""
        self.team, self.client = team, client
        self.tools = {t.name: t for t in tools or []}
        self.skills: SkillSet | None = load_skills(team.skills) if team.skills else None
        self.events: asyncio.Queue | None = None
        for role in team.roles.values():
            missing = [t for t in role.tools if t not in self.tools]
            if missing:
                raise ConfigError(f"role {role.name!r} names tools that are not registered: {', '.join(missing)}")
            if role.skills and self.skills is None:
                raise ConfigError(f"role {role.name!r} names skills but the team has no skills source")

    async def run(self, task: str, events: asyncio.Queue | None = None) -> dict:
        """Plan, run the sub-tasks concurrently (bounded), answer; the trace as a dict. `events` gets each
        agent's trace as it ends ({"type": "agent", ...}), for a caller that streams them."""
        start = time.monotonic()
        planner = self.team.roles["planner"]
        self.events = events
        plan = await self.run_agent(planner, f"Task: {task}\n\nRoles you can give sub-tasks to: "
                                    f"{', '.join(r for r in self.team.roles if r != 'planner')}. Write one "
                                    "sub-task per line as `role: sub-task`.")
        subtasks = self.subtasks(plan.answer or "")
        gate = asyncio.Semaphore(self.team.max_concurrency)

        async def bounded(role: Role, subtask: str) -> AgentTrace:
            async with gate:
                return await self.run_agent(role, subtask)

        workers = await asyncio.gather(*(bounded(role, sub) for role, sub in subtasks))
        findings = "\n".join(f"- {w.task}: {w.answer or '(no answer: ' + w.stopped + ')'}" for w in workers)
        final = await self.run_agent(planner, f"Task: {task}\n\nFindings:\n{findings}\n\nWrite the final answer.")
        agents = [plan, *workers, final]
        return {"answer": final.answer, "seconds": time.monotonic() - start,
                "skills": None if self.skills is None else {"source": self.skills.source,
                                                            "revision": self.skills.revision},
                "agents": [asdict(a) for a in agents],
                "totals": {k: sum(getattr(a, k) for a in agents)
                           for k in ("prompt_tokens", "completion_tokens", "energy_j")}}

    def subtasks(self, plan: str) -> list[tuple[Role, str]]:
        """`role: sub-task` lines (a line naming no known role goes to the first non-planner role)."""
        default = next(r for name, r in self.team.roles.items() if name != "planner")
        found = []
        for line in plan.splitlines():
            line = _LINE_PREFIX.sub("", line).strip()
            if not line:
                continue
            name, _, rest = line.partition(":")
            role = self.team.roles.get(name.strip().lower())
            if role is not None and role.name != "planner" and rest.strip():
                found.append((role, rest.strip()))
            else:
                found.append((default, line))
        return found[:self.team.max_subtasks]

    async def run_agent(self, role: Role, task: str) -> AgentTrace:
        trace = AgentTrace(role.name, task, started=time.monotonic())
        try:
            await asyncio.wait_for(self._turns(role, task, trace), timeout=role.max_seconds)
        except TimeoutError:
            trace.stopped = "max_seconds"
        except Exception as exc:  # noqa: BLE001 - a failed call ends this agent, not the run
            trace.stopped, trace.answer = "error", trace.answer or f"error: {type(exc).__name__}"
        trace.seconds = time.monotonic() - trace.started
        if self.events is not None:
            await self.events.put({"type": "agent", **asdict(trace)})
        return trace

    async def _turns(self, role: Role, task: str, trace: AgentTrace) -> None:
        toolbox = self._toolbox(role)
        messages = [{"role": "system", "content": self._system_prompt(role)}, {"role": "user", "content": task}]
        while True:
            if trace.turns >= role.max_turns:
                trace.stopped = "max_turns"
                return
            left = role.max_tokens - trace.completion_tokens
            if left <= 0:
                trace.stopped = "max_tokens"
                return
            message = await self._call(role, messages, toolbox, left, trace)
            if not message.tool_calls:
                trace.answer, trace.stopped = message.content, "answer"
                return
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                result, ok = await toolbox.call(call.function.name, call.function.arguments)
                trace.tool_calls.append({"name": call.function.name, "ok": ok})
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})

    async def _call(self, role: Role, messages: list[dict], toolbox: ToolBox, max_tokens: int, trace: AgentTrace):
        kwargs = {"tools": toolbox.schemas()} if toolbox.tools else {}
        raw = await self.client.chat.completions.with_raw_response.create(
            model=role.model, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs)
        response = raw.parse()
        trace.turns += 1
        trace.model = response.model
        if response.usage is not None:
            trace.prompt_tokens += response.usage.prompt_tokens
            trace.completion_tokens += response.usage.completion_tokens
        trace.energy_j += float(raw.headers.get("x-sobrio-energy-joules", 0) or 0)
        return response.choices[0].message

    def _toolbox(self, role: Role) -> ToolBox:
        tools = [self.tools[name] for name in role.tools]
        if role.skills:
            tools += skill_tools(self.skills, list(role.skills))
        return ToolBox(tools)

    def _system_prompt(self, role: Role) -> str:
        if not role.skills:
            return role.instructions
        return (f"{role.instructions}\n\nSkills you can load with the load_skill tool when a task needs one:\n"
                f"{self.skills.prompt_block(list(role.skills))}")
