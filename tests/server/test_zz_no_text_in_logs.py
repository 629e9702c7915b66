"""A canary in prompts must reach no log line, on the normal, streaming, error and disconnect paths.

Named to run last against the shared debug-level server, so its log holds the whole session.
"""

import httpx

CANARY = "CANARY-7f3a9c-zebra"


def test_canary_never_logged(server):
    url = f"{server.base_url}/v1"
    body = {"model": "smollm2-135m", "prompt": f"Repeat after me: {CANARY} {CANARY}", "max_tokens": 12,
            "temperature": 0}
    assert httpx.post(f"{url}/completions", json=body, timeout=60).status_code == 200
    chat = {"model": "smollm2-135m", "messages": [{"role": "user", "content": f"Say {CANARY}"}], "max_tokens": 8}
    assert httpx.post(f"{url}/chat/completions", json=chat, timeout=60).status_code == 200
    with httpx.stream("POST", f"{url}/completions", json={**body, "stream": True}, timeout=60) as resp:
        assert "data:" in "".join(resp.iter_text())
    for bad in [{**body, "max_tokens": -5}, {**body, "prompt": CANARY * 3000}, {**body, "bogus": CANARY},
                {**body, "max_tokens": CANARY}]:
        assert httpx.post(f"{url}/completions", json=bad, timeout=60).status_code == 400
    bad_chat = {**chat, "messages": [{"role": CANARY, "content": CANARY}]}
    assert httpx.post(f"{url}/chat/completions", json=bad_chat, timeout=60).status_code == 400
    with httpx.stream("POST", f"{url}/completions", json={**body, "stream": True, "max_tokens": 200}, timeout=60) as r:
        next(r.iter_lines())  # then hang up mid-stream
    httpx.get(f"{server.base_url}/health")
    log = server.log_text()
    assert "POST /v1/completions" in log  # the log is really captured
    assert CANARY not in log
    assert "CANARY" not in log.upper()
