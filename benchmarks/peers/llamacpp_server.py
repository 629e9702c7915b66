"""Start llama.cpp's server (xllamacpp) on a GGUF file: continuous batching, N parallel slots, 2 threads.

    .peers/llamacpp/bin/python benchmarks/peers/llamacpp_server.py --model FILE.gguf --port 8080 --parallel 32

The GGUF of an alias: `.venv/bin/python -c "from sobrio.loader.resolve import resolve_model as r;
print(r('smollm2-135m').path)"`. Stops on Ctrl-C / SIGTERM.
"""

import argparse
import signal
import threading

import xllamacpp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--parallel", type=int, default=32)
    parser.add_argument("--ctx-per-slot", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.n_parallel = args.parallel
    params.n_ctx = args.parallel * args.ctx_per_slot
    params.cont_batching = True
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.hostnames = [args.host]
    params.port = args.port
    server = xllamacpp.Server(params)  # serves until this process ends
    print(f"llama.cpp server on http://{args.host}:{args.port} ({args.parallel} slots)", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    del server


if __name__ == "__main__":
    main()
