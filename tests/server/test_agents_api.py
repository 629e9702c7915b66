"""`POST /v1/agents/runs` on the real server: a team of two roles on SmolLM2 runs through the server's own
API (its sub-agents are ordinary requests), as one JSON trace or as server-sent events; a team the server
cannot honour is a 400."""

import json

import httpx

TEAM = {"max_concurrency": 2, "max_subtasks": 2,
        "roles": {"planner": {"model": "smollm2-135m", "instructions": "Split the task: one `worker: question` "
                              "a line.", "max_tokens": 24, "max_turns": 1},
                  "worker": {"model": "smollm2-135m", "instructions": "Answer in one sentence.", "max_tokens": 16,
                             "max_turns": 2}}}
TASK = "What is the capital of France, and what is the capital of Italy?"


def test_a_team_runs_through_the_servers_own_api_and_returns_its_trace(server):
    answer = httpx.post(f"{server.base_url}/v1/agents/runs", json={"team": TEAM, "task": TASK}, timeout=300)
    assert answer.status_code == 200, answer.text
    trace = answer.json()
    roles = [a["role"] for a in trace["agents"]]
    assert roles[0] == "planner" and roles[-1] == "planner" and 1 <= roles.count("worker") <= 2
    assert all(a["model"] == "smollm2-135m" and a["turns"] >= 1 for a in trace["agents"])
    assert all(a["completion_tokens"] <= 24 for a in trace["agents"])  # every limit held
    assert trace["totals"]["prompt_tokens"] > 0 and trace["totals"]["energy_j"] > 0
    assert isinstance(trace["answer"], str)


def test_the_run_streams_each_agent_then_the_run(server):
    with httpx.stream("POST", f"{server.base_url}/v1/agents/runs", json={"team": TEAM, "task": TASK, "stream": True},
                      timeout=300) as answer:
        assert answer.status_code == 200
        events = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert [e["type"] for e in parsed[:-1]] == ["agent"] * (len(parsed) - 1) and parsed[-1]["type"] == "run"
    assert len(parsed[-1]["agents"]) == len(parsed) - 1


def test_a_team_the_server_cannot_honour_is_a_400(server):
    with_tools = {**TEAM, "roles": {**TEAM["roles"], "worker": {**TEAM["roles"]["worker"], "tools": ["shell"]}}}
    with_skills = {**TEAM, "roles": {**TEAM["roles"], "worker": {**TEAM["roles"]["worker"], "skills": ["x"]}}}
    no_planner = {"roles": {"worker": TEAM["roles"]["worker"]}}
    for team, words in ((with_tools, "Python tools"), (with_skills, "no skills source"), (no_planner, "planner"),
                        ({**TEAM, "skills": "/etc"}, "server's skills")):
        answer = httpx.post(f"{server.base_url}/v1/agents/runs", json={"team": team, "task": TASK})
        assert answer.status_code == 400 and words in answer.json()["error"]["message"], answer.text
