"""Seconds from an engine core's death to serving again: the 503s a server answers after `kill -9` of its core.

    python benchmarks/core_restart.py                 # smollm2-135m as `sobrio serve` runs it, 3 restarts
    python benchmarks/core_restart.py --restarts 2 --max-model-len 1024

Starts the model's engine-core process behind the client `sobrio serve` uses (`AsyncMPClient`), then kills the
core with SIGKILL `--restarts` times, a second after it is back each time, and times each kill until the client
is healthy on a new core. The core's log lines (INFO) show where the time goes: the process's start and imports
up to "loading", the weights, the KV cache, the warm-up.
"""

import argparse
import logging
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def time_restarts(client, restarts: int, bound_s: float = 600.0) -> list[float]:
    seconds = []
    for _ in range(restarts):
        pid = client.core.info.pid
        time.sleep(1)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        while client.core.info.pid == pid or not client.healthy:  # bounded: a restart that never ends stops here
            if time.monotonic() - killed > bound_s:
                raise SystemExit(f"no new core after {bound_s:.0f} s")
            time.sleep(0.01)
        seconds.append(time.monotonic() - killed)
        print(f"restart {len(seconds)}: serving again {seconds[-1]:.2f} s after the kill", flush=True)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model to serve (default smollm2-135m)")
    parser.add_argument("--restarts", type=int, default=3, help="kills of the core (default 3)")
    parser.add_argument("--max-model-len", type=int, default=None, help="as `sobrio serve`'s (default: the model's)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s.%(msecs)03d %(name)s: %(message)s", datefmt="%H:%M:%S")
    from sobrio.config import SobrioConfig
    from sobrio.engine.async_llm import AsyncMPClient

    start = time.monotonic()
    client = AsyncMPClient(SobrioConfig.from_kwargs(model=args.model, max_model_len=args.max_model_len),
                           max_restarts=args.restarts)
    print(f"first start: {time.monotonic() - start:.2f} s", flush=True)
    try:
        seconds = time_restarts(client, args.restarts)
    finally:
        client.shutdown()
    print(f"restarts: {', '.join(f'{s:.2f}' for s in seconds)} s; mean {sum(seconds) / len(seconds):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
