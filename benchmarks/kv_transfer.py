"""KV transfer for disaggregated prefill/decode: bytes and time to move a prompt's KV blocks from a prefill core
to a decode core, per 1,000 prompt tokens, through each connector, against computing that prefill again.

Export (gather each block from the cache, write it into a shared-memory segment, or keep it for the TCP
server), fetch (copy out of the segment and unlink it, or pull it over a localhost ZMQ socket), and import
(scatter into pool blocks, as the decode core's prefix lookup does), on the model's real KV cache layout.

    .venv/bin/python benchmarks/kv_transfer.py [--model smollm2-135m] [--dtype bfloat16] [--tokens 1000]
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sobrio import LLM, SamplingParams  # noqa: E402
from sobrio.distributed.kv_connector import KVConnector  # noqa: E402
from sobrio.kv.offload import BlockCodec  # noqa: E402


def transfer_once(codec: BlockCodec, connector: KVConnector, num_blocks: int) -> tuple[float, float, float]:
    """Seconds to export, fetch and import `num_blocks` blocks."""
    hashes = [os.urandom(16) for _ in range(num_blocks)]
    start = time.perf_counter()
    params = connector.export([codec.gather(b) for b in range(num_blocks)], hashes)
    exported = time.perf_counter()
    blocks = connector.fetch(params)
    fetched = time.perf_counter()
    for block_id, data in zip(range(num_blocks, 2 * num_blocks), blocks):
        codec.scatter(block_id, data)
    imported = time.perf_counter()
    assert len(blocks) == num_blocks
    return exported - start, fetched - exported, imported - fetched


def prefill_seconds(llm: LLM, tokens: int, repeats: int) -> float:
    ids = list(range(1000, 1000 + tokens))
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": [i + 1] + ids}], SamplingParams(max_tokens=1), use_tqdm=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with LLM(args.model, dtype=args.dtype, kv_cache_memory=256 << 20, max_model_len=2048) as llm:
        runner = llm.engine.core.executor.runner
        codec = BlockCodec([runner.kv_cache])
        num_blocks = args.tokens // runner.block_size
        assert 2 * num_blocks <= runner.num_blocks
        recompute = prefill_seconds(llm, args.tokens, args.repeats)
        nbytes = num_blocks * codec.block_nbytes
        print(f"{args.model} {args.dtype}: {args.tokens} prompt tokens = {num_blocks} blocks of "
              f"{codec.block_nbytes / 1024:.0f} KiB = {nbytes / 2**20:.1f} MiB; computing them: "
              f"{1000 * recompute:.1f} ms")
        for name in ("SharedMemoryConnector", "TcpConnector"):
            connector = KVConnector(name, "127.0.0.1", 0)
            runs = [transfer_once(codec, connector, num_blocks) for _ in range(args.repeats)]
            export, fetch, scatter = (statistics.median(r[i] for r in runs) for i in range(3))
            total = export + fetch + scatter
            print(f"  {name:22s} export {1000 * export:6.1f} ms, fetch {1000 * fetch:6.1f} ms, import "
                  f"{1000 * scatter:5.1f} ms: {1000 * total:6.1f} ms per 1,000 tokens "
                  f"({nbytes / total / 1e9:.2f} GB/s end to end), {total / recompute:.2f}x the prefill")
            connector.close()


if __name__ == "__main__":
    main()
