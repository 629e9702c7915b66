"""`sobrio serve` as `vllm serve`: the positional model, several names for one model, --config, --root-path,
CORS, --seed across restarts, TLS, and a chat template that lets the base Gemma 3 270M chat.

Two servers of Gemma 3 270M in all (each check rides on one of them); the flag parsing itself is in
tests/unit/test_config_flags.py, without servers.
"""

import datetime
import io
import ipaddress
import os
import ssl
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from sobrio import cli
from tests.server.conftest import ServerProcess, serving

SMALL_ENGINE = ("--kv-cache-memory", str(64 << 20), "--max-model-len", "512")
SEEDED = {"prompt": "The best thing about the sea is", "max_tokens": 12, "temperature": 1.0}  # no "seed"
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' "
                  "else 'user' }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def first_sample(srv: ServerProcess, model: str, client: httpx.Client | None = None) -> str:
    """The text of the server's first request: an unseeded sample at temperature 1."""
    client = client or httpx.Client()
    body = client.post(f"{srv.base_url}/v1/completions", json={**SEEDED, "model": model}, timeout=120).json()
    return body["choices"][0]["text"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`sobrio serve MODEL` with two names for it, a prefix, a seed, one allowed origin and a --config file
    (whose `port` the command line overrides)."""
    folder = tmp_path_factory.mktemp("cli")
    config = folder / "serve.yaml"
    config.write_text(f"port: 1\nkv-cache-memory: {64 << 20}\nmax_model_len: 512\nmax-logprobs: 3\n")
    with serving("gemma3-270m", "--served-model-name", "a", "b", "--root-path", "/api", "--seed", "7",
                 "--allowed-origins", '["http://app.example"]', "--config", str(config)) as srv:
        srv.first = first_sample(srv, "a")
        yield srv


def test_positional_model_several_names_root_path_and_config_file(server):
    for prefix in ("/api", ""):  # behind a path-routing proxy, and direct
        models = httpx.get(f"{server.base_url}{prefix}/v1/models").json()["data"]
        assert [(m["id"], m["root"], m["max_model_len"]) for m in models] == [("a", "a", 512), ("b", "a", 512)]
    reply = httpx.post(f"{server.base_url}/api/v1/completions", timeout=60,
                       json={"model": "b", "prompt": "Hi", "max_tokens": 2, "temperature": 0}).json()
    assert reply["model"] == "b"  # the name the request used
    too_many = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                          json={"model": "a", "prompt": "Hi", "max_tokens": 2, "logprobs": 4})
    assert too_many.status_code == 400 and "--max-logprobs" in too_many.json()["error"]["message"]  # from --config
    log = server.log_text()
    assert "listening on http://127.0.0.1:" in log and "/api: a = b (start-up took" in log
    for step in ("resolving model gemma3-270m: done in", "loading the weights of gemma3-270m: done in",
                 "warming up gemma3-270m: done in"):
        assert step in log


def test_cors_admits_only_the_allowed_origin(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    ok = httpx.options(f"{server.base_url}/v1/completions", headers={"Origin": "http://app.example", **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": "http://elsewhere.example"})
    assert "access-control-allow-origin" not in other.headers


def test_seed_repeats_sampling_across_restarts_over_tls(server, tmp_path):
    """A second start with the same --seed (over HTTPS with a self-signed certificate, and a chat template
    that lets the base model chat; without one, chat is a 400) samples the same first answer; the next request
    differs."""
    key, cert = self_signed_certificate(tmp_path)
    second = first_sample(server, "a")
    assert second != server.first  # the seed is per request, not one fixed stream for every request
    tls = httpx.Client(verify=ssl.create_default_context(cafile=str(cert)))
    template = tmp_path / "gemma.jinja"
    template.write_text(GEMMA_TEMPLATE)
    no_template = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": "a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert no_template.status_code == 400 and "--chat-template" in no_template.json()["error"]["message"]
    with serving_tls(tls, "--model", "gemma3-270m", "--seed", "7", "--chat-template", str(template),
                     "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), *SMALL_ENGINE) as restarted:
        assert restarted.base_url.startswith("https://")
        assert first_sample(restarted, "gemma3-270m", tls) == server.first
        chat = tls.post(f"{restarted.base_url}/v1/chat/completions", timeout=120, json={
            "model": "gemma3-270m", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"].strip()
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(restarted.base_url.replace("https://", "http://") + "/health")
        tls.close()  # else the server's TLS shutdown waits out asyncio's 30 s for the idle keep-alive connection


def test_chat_from_a_pipe_prints_only_the_answers(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n\nWhat is 2 + 2?\n"))
    assert cli.main(["chat", "--model", "smollm2-135m", "--max-tokens", "3", "--kv-cache-memory", str(32 << 20),
                     "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 2 and "sobrio chat" not in out and "> " not in out  # two answers, nothing else


# ---- helpers ----

class _TlsServer(ServerProcess):
    """ServerProcess over HTTPS: polls /health with a client that trusts the test's certificate."""

    client: httpx.Client

    def _wait_healthy(self, timeout: float) -> None:
        self.base_url = self.base_url.replace("http://", "https://")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited early:\n{self.log_text()[-3000:]}"
            try:
                if self.client.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise TimeoutError(f"server did not start:\n{self.log_text()[-3000:]}")


@contextmanager
def serving_tls(client: httpx.Client, *args: str) -> Iterator[ServerProcess]:
    srv = type("TlsServer", (_TlsServer,), {"client": client})(*args)
    try:
        yield srv
    finally:
        srv.stop()
        os.unlink(srv.log.name)


def self_signed_certificate(folder):
    """A key and a self-signed certificate for 127.0.0.1, made with `cryptography`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_path, cert_path = folder / "key.pem", folder / "cert.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path
