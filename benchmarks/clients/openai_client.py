"""The official `openai` client against a running `sobrio serve`: chat (plain and streamed), completions
(plain and streamed), embeddings and the models list, with asserts on the shapes and contents.

    .peers/clients/bin/python benchmarks/clients/openai_client.py --base-url http://127.0.0.1:8000/v1 \
        [--chat-model smollm2-135m] [--embedding-model all-minilm-l6-v2] [--api-key KEY]

The client venv comes from benchmarks/clients/setup.sh; benchmarks/clients/run_all.sh starts the server
and runs this. Exits non-zero (an AssertionError or the client's own error) on any failure.
"""

import argparse
import math
import sys

from openai import OpenAI


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--chat-model", default="smollm2-135m")
    ap.add_argument("--embedding-model", default="all-minilm-l6-v2")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120)

    ids = [m.id for m in client.models.list().data]
    assert args.chat_model in ids and args.embedding_model in ids, ids
    assert client.models.retrieve(args.chat_model).id == args.chat_model
    print(f"models: {ids}")

    messages = [{"role": "user", "content": "What is 2 + 2? Answer in one short sentence."}]
    reply = client.chat.completions.create(model=args.chat_model, messages=messages, max_tokens=24,
                                           temperature=0)
    assert reply.object == "chat.completion" and reply.model == args.chat_model, reply
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content.strip(), reply
    assert choice.finish_reason in ("stop", "length"), choice.finish_reason
    u = reply.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 24, u
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u
    print(f"chat: {choice.message.content!r} usage={u.prompt_tokens}+{u.completion_tokens}")

    # Streamed, with the usage chunk OpenAI sends last when asked (stream_options.include_usage).
    pieces, finish, usage, roles = [], None, None, set()
    stream = client.chat.completions.create(model=args.chat_model, messages=messages, max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk", chunk
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.delta.role)
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    text = "".join(pieces)
    assert text.strip() and roles == {"assistant"} and finish in ("stop", "length"), (text, roles, finish)
    assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens > 0, usage
    # Greedy: the streamed answer is the plain one.
    assert text == choice.message.content, (text, choice.message.content)
    print(f"chat stream: {len(pieces)} pieces, {text!r}")

    comp = client.completions.create(model=args.chat_model, prompt="The capital of France is", max_tokens=16,
                                     temperature=0)
    assert comp.object == "text_completion" and comp.choices[0].text.strip(), comp
    assert comp.usage.prompt_tokens > 0 and 0 < comp.usage.completion_tokens <= 16, comp.usage
    print(f"completion: {comp.choices[0].text!r}")

    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=args.chat_model, prompt="The capital of France is", max_tokens=16, temperature=0, stream=True)
        if c.choices)
    assert streamed == comp.choices[0].text, (streamed, comp.choices[0].text)
    print("completion stream: same text")

    inputs = ["The cat sits on the mat.", "A kitten is resting on a rug.", "Stock markets fell sharply today."]
    emb = client.embeddings.create(model=args.embedding_model, input=inputs)
    assert emb.object == "list" and len(emb.data) == len(inputs), emb
    vecs = [d.embedding for d in sorted(emb.data, key=lambda d: d.index)]
    assert [d.index for d in emb.data] == list(range(len(inputs)))
    for v in vecs:
        assert len(v) == 384, len(v)
        norm = math.sqrt(sum(x * x for x in v))
        assert abs(norm - 1.0) < 1e-3, norm
    assert emb.usage.prompt_tokens > 0, emb.usage

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b))

    assert cos(vecs[0], vecs[1]) > cos(vecs[0], vecs[2]), "cat/kitten should be closer than cat/stocks"
    # The client's default asks for base64 floats; a list of floats must work too.
    one = client.embeddings.create(model=args.embedding_model, input="hello", encoding_format="float")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384, one
    print(f"embeddings: {len(vecs)} x 384, unit norm, cos(cat,kitten)={cos(vecs[0], vecs[1]):.3f} "
          f"> cos(cat,stocks)={cos(vecs[0], vecs[2]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
