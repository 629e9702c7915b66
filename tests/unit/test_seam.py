"""The server's seam to the engine (issue 44): what server/, gateway/ and agents/ may import of `sobrio.engine`,
and typed errors answered by a lookup of what each error class says of itself."""

import json

import grimp
import pytest

from sobrio import errors
from sobrio.gateway.gateway import InvalidApiKey
from sobrio.gateway.proxy import BackendFailed, BackendTimeout

SEAM = {"sobrio.engine.client", "sobrio.engine.launch", "sobrio.engine.outputs"}
ABOVE = ("sobrio.server", "sobrio.gateway", "sobrio.agents")


def import_graph() -> dict[str, set[str]]:
    """Each sobrio module and the sobrio modules it imports (at any depth, late imports too): grimp's graph,
    the one the layer contracts (.importlinter) are checked on."""
    graph = grimp.build_graph("sobrio", exclude_type_checking_imports=False)
    return {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}


def test_the_layers_above_the_engine_import_only_its_seam():
    graph = import_graph()
    leaks = {m: sorted(t for t in targets if t.startswith("sobrio.engine.") and t not in SEAM)
             for m, targets in graph.items() if m.startswith(ABOVE)}
    assert {m: t for m, t in leaks.items() if t} == {}
    launcher_users = sorted(m for m, targets in graph.items() if m.startswith(ABOVE) and "sobrio.engine.launch" in
                            targets)
    assert launcher_users == ["sobrio.server.serving"]  # one place builds clients
    assert not any(t.startswith("sobrio.agents") for m, ts in graph.items() if m.startswith("sobrio.server")
                   for t in ts)  # the agents sit on top: cli.py joins their routes to the server's


@pytest.mark.parametrize(("error", "status", "kind", "headers"), [
    (errors.InvalidRequestError("bad", param="n"), 400, "invalid_request_error", None),
    (errors.UnknownModelError("no such model"), 404, "invalid_request_error", None),
    (errors.PermissionDeniedError("not yours"), 403, "permission_error", None),
    (errors.EngineOverloadedError("full"), 429, "rate_limit_error", {"Retry-After": "1"}),
    (errors.BudgetExceededError("spent", retry_after=0), 429, "rate_limit_error", {"Retry-After": "1"}),
    (errors.EngineStepError("failed"), 500, "server_error", None),
    (errors.EngineUnavailableError("restarting"), 503, "server_error", None),
    (BackendFailed("refused"), 502, "server_error", None),
    (BackendTimeout("slow"), 504, "server_error", None),
    (InvalidApiKey("wrong key"), 401, "invalid_request_error", None),
])
def test_an_error_says_its_own_status_and_openai_type(error, status, kind, headers):
    from sobrio.server.errors import sobrio_error_response

    answer = sobrio_error_response(error)
    body = json.loads(answer.body)["error"]
    assert (answer.status_code, body["type"], body["message"]) == (status, kind, str(error))
    assert body["param"] == error.param and body["code"] == error.code
    for name, value in (headers or {}).items():
        assert answer.headers[name] == value
