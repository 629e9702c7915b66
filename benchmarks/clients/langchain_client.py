"""LangChain's `ChatOpenAI` (invoke, stream, batch) and `OpenAIEmbeddings` (embed_documents, embed_query)
against a running `sobrio serve`, with asserts.

    .peers/clients/bin/python benchmarks/clients/langchain_client.py --base-url http://127.0.0.1:8000/v1 \
        [--chat-model smollm2-135m] [--embedding-model all-minilm-l6-v2] [--api-key KEY]

Offline: `OpenAIEmbeddings` would otherwise tokenize with tiktoken, which downloads its encodings at run
time; `check_embedding_ctx_length=False` (texts sent as they are) and `tiktoken_enabled=False` keep it from
trying. The client venv comes from benchmarks/clients/setup.sh; benchmarks/clients/run_all.sh starts the
server and runs this. Exits non-zero on any failure.
"""

import argparse
import math
import sys

from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI, OpenAIEmbeddings


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--chat-model", default="smollm2-135m")
    ap.add_argument("--embedding-model", default="all-minilm-l6-v2")
    args = ap.parse_args()

    llm = ChatOpenAI(model=args.chat_model, base_url=args.base_url, api_key=args.api_key, temperature=0,
                     max_tokens=24, max_retries=0, timeout=120)
    messages = [SystemMessage("You are a terse assistant."), HumanMessage("What is 2 + 2?")]
    msg = llm.invoke(messages)
    assert isinstance(msg, AIMessage) and isinstance(msg.content, str) and msg.content.strip(), msg
    um = msg.usage_metadata
    assert um and um["input_tokens"] > 0 and 0 < um["output_tokens"] <= 24, um
    assert um["total_tokens"] == um["input_tokens"] + um["output_tokens"], um
    assert msg.response_metadata.get("finish_reason") in ("stop", "length"), msg.response_metadata
    assert msg.response_metadata.get("model_name") == args.chat_model, msg.response_metadata
    print(f"ChatOpenAI.invoke: {msg.content!r} usage={um['input_tokens']}+{um['output_tokens']}")

    # stream_usage=True makes LangChain send stream_options.include_usage, as its docs recommend.
    streaming = ChatOpenAI(model=args.chat_model, base_url=args.base_url, api_key=args.api_key, temperature=0,
                           max_tokens=24, max_retries=0, timeout=120, stream_usage=True)
    chunks = list(streaming.stream(messages))
    assert chunks and all(isinstance(c, AIMessageChunk) for c in chunks), chunks
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.content == msg.content, (total.content, msg.content)
    assert total.usage_metadata and total.usage_metadata["output_tokens"] > 0, total.usage_metadata
    print(f"ChatOpenAI.stream: {len(chunks)} chunks, same text as invoke")

    outs = llm.batch(["Name a colour.", "Name a fruit."])
    assert len(outs) == 2 and all(o.content.strip() for o in outs), outs
    print(f"ChatOpenAI.batch: {[o.content for o in outs]!r}")

    emb = OpenAIEmbeddings(model=args.embedding_model, base_url=args.base_url, api_key=args.api_key,
                           check_embedding_ctx_length=False, tiktoken_enabled=False, max_retries=0)
    docs = ["The cat sits on the mat.", "A kitten is resting on a rug.", "Stock markets fell sharply today."]
    vecs = emb.embed_documents(docs)
    assert len(vecs) == len(docs), len(vecs)
    for v in vecs:
        assert len(v) == 384 and abs(math.sqrt(sum(x * x for x in v)) - 1.0) < 1e-3, len(v)
    q = emb.embed_query("Where is the cat?")
    assert len(q) == 384 and abs(math.sqrt(sum(x * x for x in q)) - 1.0) < 1e-3

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b))

    assert cos(vecs[0], vecs[1]) > cos(vecs[0], vecs[2]), "cat/kitten should be closer than cat/stocks"
    # The query matches the same text embedded as a document.
    same = emb.embed_documents([docs[0]])[0]
    assert max(abs(a - b) for a, b in zip(same, vecs[0])) < 1e-4
    print(f"OpenAIEmbeddings: {len(vecs)} documents + 1 query, 384 dimensions, unit norm; "
          f"cos(query, cat)={cos(q, vecs[0]):.3f} cos(query, stocks)={cos(q, vecs[2]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
