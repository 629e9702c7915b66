"""The orchestrator's mechanics against a scripted OpenAI-compatible server (at the HTTP transport, with the
official `openai` client): a plan, sub-agents that overlap in time, tool calls (a skill loaded on request,
a tool that raises, arguments that are not JSON), limits that stop an agent cleanly, and the trace."""

import asyncio
import json
import time

import httpx
import openai
import pytest
from dulwich import porcelain

from sobrio.agents.orchestrator import Orchestrator, Role, Team
from sobrio.agents.tools import Tool
from tests.unit.test_skills import commit_all, write_skill

SKILL_BODY = "Multiply digit by digit and show each partial product."


def reply(content=None, tool_calls=None, completion_tokens=5, model="scripted-model") -> dict:
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                  "function": {"name": name, "arguments": arguments}}
                                 for i, (name, arguments) in enumerate(tool_calls)]
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": completion_tokens,
                      "total_tokens": 10 + completion_tokens}}


class Script:
    """A server whose answers depend on the conversation so far; it records every request and when the
    sub-agents' calls ran."""

    def __init__(self, worker):
        self.worker = worker  # (messages) -> reply dict, for sub-agents
        self.requests: list[dict] = []
        self.intervals: list[tuple[float, float]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append(body)
        user = body["messages"][1]["content"]
        if user.startswith("Task:") and "Roles you can give" in user:
            answer = reply("worker: 12 times 3?\n2. worker: 7 times 6?")
        elif user.startswith("Task:"):
            answer = reply("FINAL " + user.split("Findings:\n", 1)[1].replace("\n", " | "))
        else:
            start = time.monotonic()
            await asyncio.sleep(0.2)
            answer = self.worker(body)
            self.intervals.append((start, time.monotonic()))
        return httpx.Response(200, json=answer, headers={"x-sobrio-energy-joules": "0.5"})


def client_for(script: Script) -> openai.AsyncOpenAI:
    transport = httpx.MockTransport(script)
    return openai.AsyncOpenAI(base_url="http://scripted/v1", api_key="k", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport))


def team(source: str | None = None, **worker) -> Team:
    roles = {"planner": Role("planner", "planner-model", "Split the task."),
             "worker": Role("worker", "auto", "Answer briefly.", **worker)}
    return Team(roles, skills=source)


def tool_messages(body: dict) -> list[str]:
    return [m["content"] for m in body["messages"] if m["role"] == "tool"]


def test_two_sub_agents_overlap_and_the_trace_has_them_all():
    script = Script(lambda body: reply("answer for " + body["messages"][1]["content"]))
    trace = asyncio.run(Orchestrator(team(), client_for(script)).run("Two products"))
    (a_start, a_end), (b_start, b_end) = script.intervals
    assert a_start < b_end and b_start < a_end  # both ran at once
    assert trace["answer"].startswith("FINAL - 12 times 3?: answer for 12 times 3?")
    assert [a["role"] for a in trace["agents"]] == ["planner", "worker", "worker", "planner"]
    assert all(a["stopped"] == "answer" and a["model"] == "scripted-model" for a in trace["agents"])
    assert trace["totals"] == {"prompt_tokens": 40, "completion_tokens": 20, "energy_j": 2.0}
    assert {r["model"] for r in script.requests} == {"planner-model", "auto"}


def test_a_sub_agent_that_never_stops_is_cut_by_its_limits_and_the_run_still_answers():
    never = Script(lambda body: reply(None, [("noop", "{}")]))
    noop = Tool("noop", "does nothing", {"type": "object", "properties": {}}, lambda: "ok")
    trace = asyncio.run(Orchestrator(team(tools=("noop",), max_turns=3), client_for(never), [noop]).run("t"))
    workers = [a for a in trace["agents"] if a["role"] == "worker"]
    assert all(w["stopped"] == "max_turns" and w["turns"] == 3 and w["answer"] is None for w in workers)
    assert "(no answer: max_turns)" in trace["answer"]
    greedy = Script(lambda body: reply(None, [("noop", "{}")], completion_tokens=40))
    trace = asyncio.run(Orchestrator(team(tools=("noop",), max_tokens=100), client_for(greedy), [noop]).run("t"))
    assert {a["stopped"] for a in trace["agents"] if a["role"] == "worker"} == {"max_tokens"}
    slow = Script(lambda body: reply("late"))
    trace = asyncio.run(Orchestrator(team(max_seconds=0.05), client_for(slow)).run("t"))
    assert {a["stopped"] for a in trace["agents"] if a["role"] == "worker"} == {"max_seconds"}
    assert trace["answer"].startswith("FINAL")


def test_a_failing_tool_and_bad_arguments_come_back_as_tool_messages():
    def worker(body):
        seen = tool_messages(body)
        if not seen:
            return reply(None, [("divide", '{"a": 1, "b": 0}'), ("divide", "not json")])
        return reply("saw " + " / ".join(seen))

    divide = Tool("divide", "a / b", {"type": "object", "properties": {"a": {"type": "number"},
                                                                      "b": {"type": "number"}}},
                  lambda a, b: a / b)
    script = Script(worker)
    trace = asyncio.run(Orchestrator(team(tools=("divide",)), client_for(script), [divide]).run("t"))
    worker_trace = trace["agents"][1]
    assert worker_trace["tool_calls"] == [{"name": "divide", "ok": False}, {"name": "divide", "ok": False}]
    assert "error: ZeroDivisionError: division by zero / error: the arguments are not valid JSON" in \
        worker_trace["answer"]


def test_a_skill_body_enters_the_context_only_after_load_skill_and_the_trace_names_its_revision(tmp_path):
    repo = tmp_path / "repo"
    porcelain.init(str(repo))
    write_skill(repo, "multiplication", "name: multiplication\ndescription: Multiply integers exactly.",
                SKILL_BODY)
    revision = commit_all(repo, "skills")
    write_skill(repo, "multiplication", "name: multiplication\ndescription: Multiply integers exactly.",
                "A later text.")
    commit_all(repo, "later")

    def worker(body):
        if not tool_messages(body):
            return reply(None, [("load_skill", '{"name": "multiplication"}')])
        return reply("36")

    script = Script(worker)
    source = f"{repo}@{revision}"
    trace = asyncio.run(Orchestrator(team(source, skills=("multiplication",)), client_for(script)).run("t"))
    one_worker = [r for r in script.requests if r["model"] == "auto" and r["messages"][1]["content"] == "12 times 3?"]
    first, after = one_worker
    assert "Multiply integers exactly." in first["messages"][0]["content"]  # the description, up front
    assert SKILL_BODY not in json.dumps(first) and SKILL_BODY in json.dumps(after)  # the body, on request
    assert {t["function"]["name"] for t in first["tools"]} == {"load_skill", "read_reference"}
    assert trace["skills"] == {"source": source, "revision": revision}


def test_a_team_file_and_its_errors(tmp_path):
    from sobrio.errors import ConfigError

    path = tmp_path / "team.toml"
    path.write_text('max_concurrency = 3\n[roles.planner]\nmodel = "m"\n[roles.worker]\nmodel = "auto"\n'
                    'tools = ["calc"]\nmax_turns = 2\n')
    loaded = Team.load(str(path))
    assert loaded.max_concurrency == 3 and loaded.roles["worker"].tools == ("calc",)
    with pytest.raises(ConfigError, match="not registered: calc"):
        Orchestrator(loaded, client=None)
    path.write_text('[roles.worker]\nmodel = "auto"\n')
    with pytest.raises(ConfigError, match="roles.planner"):
        Team.load(str(path))
