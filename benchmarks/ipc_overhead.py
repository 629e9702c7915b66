"""IPC cost per engine step between the API process and the engine-core process, as a share of a step.

Measures, for a step's outputs message with 1 and with 64 requests (one new token each, as in decode):
- encode + decode with pickle (what `sobrio/engine/core_process.py` uses) and, if installed, msgspec;
- a ZMQ IPC round trip of that frame to a second process and back (one way is about half);
- the decode step it rides on (in-process engine, bf16, batch 1 and batch 32), for the share.

    .venv/bin/python benchmarks/ipc_overhead.py
"""

import multiprocessing
import pickle
import shutil
import statistics
import tempfile
import time

import zmq

import sobrio  # noqa: F401  (sets the OpenMP policy before torch loads)
from sobrio.engine.core import EngineCoreOutput


def outputs_message(batch: int) -> tuple:
    outputs = [EngineCoreOutput(f"cmpl-{i:032x}-0", [1234 + i], None, None, None, 48, 0, 1.0, 1.1, None)
               for i in range(batch)]
    stats = {"num_requests_running": batch, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.1,
             "prefix_cache_queries": 1000, "prefix_cache_hits": 500, "num_preemptions": 0,
             "tables": {"core_deferred": 0, "scheduler_requests": batch}}
    return ("outputs", outputs, stats)


def best_us(fn, repeat: int = 2000) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def codec_costs(message) -> dict[str, float]:
    frame = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    costs = {"pickle": best_us(lambda: pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))),
             "pickle_bytes": len(frame)}
    try:
        import msgspec
    except ImportError:
        return costs
    decoder = msgspec.msgpack.Decoder(tuple[str, list[EngineCoreOutput], dict])
    encoded = msgspec.msgpack.encode(message)
    costs["msgspec"] = best_us(lambda: decoder.decode(msgspec.msgpack.encode(message)))
    costs["msgspec_bytes"] = len(encoded)
    return costs


def _echo(address_in: str, address_out: str) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(address_in)
    push.connect(address_out)
    while True:
        frame = pull.recv()
        if frame == b"stop":
            return
        push.send(frame)


def round_trip_us(message, repeat: int = 2000) -> float:
    folder = tempfile.mkdtemp(prefix="sobrio-ipc-bench-")
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{folder}/a")
    pull.bind(f"ipc://{folder}/b")
    child = multiprocessing.get_context("spawn").Process(target=_echo, args=(f"ipc://{folder}/a", f"ipc://{folder}/b"))
    child.start()

    def once():
        push.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        pickle.loads(pull.recv())

    once()
    cost = best_us(once, repeat)
    push.send(b"stop")
    child.join(10)
    ctx.destroy(linger=0)
    shutil.rmtree(folder, ignore_errors=True)
    return cost


def decode_step_ms(llm, batch: int, steps: int = 10) -> float:
    from sobrio.bench.roofline import decode_step_time

    return decode_step_time(llm, batch, prompt_len=64, steps=steps)[0] * 1e3


def main() -> None:
    from sobrio import LLM

    llm = LLM("smollm2-135m", kv_cache_memory=256 << 20, max_model_len=512)
    print(f"{'batch':>5} {'pickle us':>10} {'msgspec us':>11} {'bytes':>7} {'zmq round trip us':>18} "
          f"{'step ms':>8} {'one way / step':>15}")
    for batch, step_batch in ((1, 1), (64, 32)):
        message = outputs_message(batch)
        codec = codec_costs(message)
        trip = round_trip_us(message)
        step = decode_step_ms(llm, step_batch)
        share = trip / 2 / (step * 1e3)
        print(f"{batch:>5} {codec['pickle']:>10.1f} {codec.get('msgspec', float('nan')):>11.1f} "
              f"{codec['pickle_bytes']:>7} {trip:>18.1f} {step:>8.2f} {share:>14.2%}  (step at batch {step_batch})")


if __name__ == "__main__":
    main()
