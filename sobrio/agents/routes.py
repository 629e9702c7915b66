"""`POST /v1/agents/runs`: a team (the team file's structure, as JSON) and a task; the run's trace, or its
events as server-sent events (each agent's trace as it ends, then the run's) with `"stream": true`.

The sub-agents call this same server over loopback with the caller's own key, so each of their requests
passes the gate like any other: the caller's tenant, limits, router and ledger rows. A team from HTTP may
use the skills the server was started with (`--agent-skills`) and no Python tools (none can come over HTTP).
"""

import asyncio
import json

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from sobrio.errors import ConfigError, InvalidRequestError
from sobrio.gateway.gate import bearer


class AgentRunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    team: dict
    task: str = Field(min_length=1, max_length=100_000)
    stream: bool = False


def register(app: FastAPI, server) -> None:
    @app.post("/v1/agents/runs")
    async def agent_runs(body: AgentRunRequest, request: Request):
        from sobrio.agents.orchestrator import Orchestrator, Team

        if server.self_url is None:
            raise InvalidRequestError("this server cannot call itself (it was not started by `sobrio serve`)")
        team = _team(body.team, server.agent_skills, Team)
        key = bearer(request.headers.get("authorization", "").encode("latin-1")) or "none"
        client = _loopback_client(server.self_url, key)
        try:
            orchestrator = Orchestrator(team, client)
        except ConfigError as exc:
            await client.close()
            raise InvalidRequestError(str(exc), param="team") from None
        if not body.stream:
            try:
                return JSONResponse(await orchestrator.run(body.task))
            finally:
                await client.close()
        return StreamingResponse(_events(orchestrator, body.task, client), media_type="text/event-stream")


def _team(data: dict, skills_source: str | None, team_class):
    if data.get("skills") not in (None, skills_source):
        raise InvalidRequestError("a team sent over HTTP may use only the server's skills (--agent-skills)",
                                  param="team.skills")
    if _any_role_names(data, "tools"):
        raise InvalidRequestError("a team sent over HTTP cannot name Python tools", param="team.roles")
    try:
        return team_class.from_dict({**data, "skills": skills_source if _any_role_names(data, "skills") else None})
    except ConfigError as exc:
        raise InvalidRequestError(str(exc), param="team") from None


def _any_role_names(data: dict, key: str) -> bool:
    """Whether any of the team's roles sets `key` (tools, skills)."""
    roles = data.get("roles")
    return isinstance(roles, dict) and any(isinstance(r, dict) and r.get(key) for r in roles.values())


def _loopback_client(base_url: str, key: str):
    import openai

    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0,
                              http_client=httpx.AsyncClient(verify=False, timeout=600))  # our own certificate


async def _events(orchestrator, task: str, client):
    events: asyncio.Queue = asyncio.Queue()
    run = asyncio.ensure_future(orchestrator.run(task, events))
    try:
        while not run.done() or not events.empty():
            getter = asyncio.ensure_future(events.get())
            await asyncio.wait([getter, run], return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield f"data: {json.dumps(getter.result())}\n\n"
            else:
                getter.cancel()
        yield f"data: {json.dumps({'type': 'run', **run.result()})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        run.cancel()
        await client.close()
