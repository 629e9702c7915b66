"""LoRA adapters over HTTP through the official openai client: a request names an adapter as its model and gets
transformers + PEFT's merged greedy output; /v1/models lists adapters with their parent; the operator loads
and unloads adapters at run time (a tenant's key or no key may not); a PEFT feature sobrio lacks is a 400
naming it; the router's two models may be an adapter and its base."""

import httpx
import pytest
from openai import NotFoundError, OpenAI, PermissionDeniedError

from sobrio.gateway.tenants import Limits, TenantStore
from tests.model.lora_adapters import ATTENTION, CHAT_TEMPLATE, MLP, merged_greedy, write_adapter
from tests.model.tiny_checkpoints import hf_greedy, prompt, tokenizer, write_checkpoint
from tests.server.conftest import serving

KEY = "operator-key-lora"
PROMPT = prompt(21, seed=5)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-api")
    base = write_checkpoint(root / "base", "llama", {})
    (base / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # the agents' requests are chat completions
    return {"base": base, "attn": write_adapter(base, root / "attn", ATTENTION, seed=1),
            "mlp": write_adapter(base, root / "mlp", MLP, seed=2),
            "dora": write_adapter(base, root / "dora", ATTENTION, seed=3, use_dora=True)}


@pytest.fixture(scope="module")
def srv(folders, tmp_path_factory):
    """The operator's key, and a tenant limited to the adapter "attn" (its key in `srv.tenant_key`)."""
    db = tmp_path_factory.mktemp("lora-db") / "gateway.db"
    store = TenantStore(db)
    store.create_tenant("sql-team", Limits(allowed_models=("attn",)))
    tenant_key = store.create_key("sql-team")[1]
    store.close()
    gateway = db.parent / "gateway.toml"  # model "auto": the router between the adapter and its base
    gateway.write_text('[router]\nsmall = "attn"\nlarge = "tiny"\nthreshold = 0.5\n')
    with serving(str(folders["base"]), "--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-memory",
                 str(32 << 20), "--max-model-len", "256", "--api-key", KEY, "--db", str(db), "--enable-lora",
                 "--max-loras", "2", "--lora-modules", f"attn={folders['attn']}", "--config", str(gateway)) as server:
        server.tenant_key = tenant_key
        yield server


def _text(client: OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def _expected(ids: list[int]) -> str:
    return tokenizer().decode(ids)


def _post(srv, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{srv.base_url}{path}", json=body, headers=headers, timeout=60)


def test_an_adapter_named_as_the_model_equals_transformers_with_it_merged(srv, folders):
    client = OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0)
    assert _text(client, "attn") == _expected(merged_greedy(folders["base"], folders["attn"], PROMPT, 8))
    assert _text(client, "tiny") == _expected(hf_greedy(folders["base"], PROMPT, 8, ignore_eos=True))
    cards = {m.id: m for m in client.models.list().data}
    assert cards["attn"].model_extra["parent"] == "tiny" and "parent" not in (cards["tiny"].model_extra or {})


def test_the_routers_two_models_may_be_an_adapter_and_its_base(srv, folders):
    """[router] small = the adapter, large = its base: model "auto" answers as the model it routed to."""
    client = OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0)
    expected = {"attn": _expected(merged_greedy(folders["base"], folders["attn"], PROMPT, 8)),
                "tiny": _expected(hf_greedy(folders["base"], PROMPT, 8, ignore_eos=True))}
    raw = client.completions.with_raw_response.create(model="auto", prompt=PROMPT, max_tokens=8, temperature=0,
                                                       extra_body={"ignore_eos": True})
    routed = raw.headers["x-sobrio-routed-to"]
    assert routed in expected and raw.parse().choices[0].text == expected[routed]


def test_the_operator_loads_and_unloads_adapters(srv, folders):
    client = OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0)
    body = {"lora_name": "mlp", "lora_path": str(folders["mlp"])}
    assert _post(srv, "/v1/load_lora_adapter", body, key=None).status_code == 401
    assert _post(srv, "/v1/load_lora_adapter", body).status_code == 200
    assert _post(srv, "/v1/load_lora_adapter", body).status_code == 400  # the name is taken
    assert "mlp" in {m.id for m in client.models.list().data}
    assert _text(client, "mlp") == _expected(merged_greedy(folders["base"], folders["mlp"], PROMPT, 8))
    assert _post(srv, "/v1/unload_lora_adapter", {"lora_name": "mlp"}).status_code == 200
    assert "mlp" not in {m.id for m in client.models.list().data}
    with pytest.raises(NotFoundError):
        _text(client, "mlp")
    refused = _post(srv, "/v1/load_lora_adapter", {"lora_name": "dora", "lora_path": str(folders["dora"])})
    assert refused.status_code == 400 and "use_dora" in refused.json()["error"]["message"]
    missing = _post(srv, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(folders["base"] / "nope")})
    assert missing.status_code == 400


def test_a_tenant_limited_to_an_adapter_and_its_ledger_rows_name_it(srv):
    tenant = OpenAI(base_url=f"{srv.base_url}/v1", api_key=srv.tenant_key, max_retries=0)
    _text(tenant, "attn")
    with pytest.raises(PermissionDeniedError):
        _text(tenant, "tiny")
    assert [m.id for m in tenant.models.list().data] == ["attn"]
    assert _post(srv, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}, key=srv.tenant_key
                 ).status_code == 403
    rows = httpx.get(f"{srv.base_url}/v1/usage", headers={"Authorization": f"Bearer {srv.tenant_key}"}).json()
    assert {row["served_model"] for row in rows["data"] if row["served_model"]} == {"attn"}


def test_a_sub_agent_role_names_an_adapter(srv, folders):
    """A team file's role whose model is an adapter runs on it (here through a tenant allowed only that adapter):
    the agents' requests are ordinary requests naming the adapter as their model."""
    roles = {"planner": {"model": "attn", "instructions": "Split the task.", "max_tokens": 4, "max_turns": 1},
             "worker": {"model": "attn", "instructions": "Answer.", "max_tokens": 4, "max_turns": 1}}
    answer = httpx.post(f"{srv.base_url}/v1/agents/runs", json={"team": {"roles": roles}, "task": "w7 w8"},
                        headers={"Authorization": f"Bearer {srv.tenant_key}"}, timeout=120)
    assert answer.status_code == 200, answer.text
    agents = answer.json()["agents"]
    assert agents and all(a["model"] == "attn" and a["stopped"] != "error" for a in agents), agents
