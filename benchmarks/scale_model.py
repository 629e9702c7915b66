"""Paper model: what tensor parallelism (TP) and data parallelism (DP) would give for decode, from measured figures.

Why: a multi-socket server or a second machine is not at hand, so before building for one we estimate, from
one measured decode step and one measured all-reduce, whether splitting a model (TP) or running copies of it
(DP) would pay, and on which interconnect.

Model, per decode step of B tokens on k ranks:
    communication (TP only): 2 all-reduces per layer (attention and MLP outputs) of B * hidden * dtype_bytes
        bytes, plus one all-gather of the float32 logits, B * vocab * 4 bytes (each rank contributes 1/k).
    ring all-reduce = 2(k-1) * latency + 2(k-1)/k * bytes / bandwidth
    ring all-gather =  (k-1) * latency +  (k-1)/k * bytes / bandwidth
    compute (TP)    = step_ms / min(k, D), D = memory-bandwidth domains: decode is memory-bound and each rank
        reads 1/k of the weights, but ranks that share a domain share its bandwidth.
        D = 1 on one host, sockets on a multi-socket server, 2 * sockets on two machines.
    TP tokens/s     = B / (compute + communication)
    DP (k replicas, no communication): tokens/s = min(k, D) * B / step_ms; each replica's step is
        step_ms * k / min(k, D).
On two machines the k ranks are split evenly (k/2 each), so every ring with k > 1 crosses the network; a ring
moves at its slowest link, so the whole ring is costed with the network latency and bandwidth.

    .venv/bin/python benchmarks/scale_model.py [--model llama3-8b] [--step-ms 30] [--json]
"""

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    layers: int
    vocab: int
    params: float
    step_ms: float | None  # measured one-rank step at the default batch; None: estimate from the roofline


@dataclass(frozen=True)
class Platform:
    name: str
    latency_us: float
    gbs: float
    domains: int  # memory-bandwidth domains
    note: str


@dataclass(frozen=True)
class Row:
    platform: str
    layout: str
    ranks: int
    step_ms: float
    comm_ms: float
    comm_pct: float
    tokens_s: float
    speedup: float


MODELS = {
    "smollm2-135m": Model("smollm2-135m", 576, 30, 49152, 135e6, 28.1),  # bf16, batch 32 (tensor_parallel.py)
    "llama3-8b": Model("llama3-8b", 4096, 32, 128256, 8.0e9, None),
}
RANKS = (1, 2, 4, 8)


def transfer_ms(steps: float, share: float, nbytes: float, p: Platform) -> float:
    """`steps` latency hops plus `share` of `nbytes` over the link, in ms."""
    return steps * p.latency_us / 1e3 + share * nbytes / (p.gbs * 1e6)


def comm_ms(m: Model, batch: int, dtype_bytes: int, k: int, p: Platform) -> float:
    if k == 1:
        return 0.0
    allreduce = transfer_ms(2 * (k - 1), 2 * (k - 1) / k, batch * m.hidden * dtype_bytes, p)
    allgather = transfer_ms(k - 1, (k - 1) / k, batch * m.vocab * 4, p)
    return 2 * m.layers * allreduce + allgather


def rows_for(m: Model, p: Platform, step_ms: float, batch: int, dtype_bytes: int) -> list[Row]:
    base = batch / step_ms * 1e3
    rows = []
    for k in RANKS:
        comm = comm_ms(m, batch, dtype_bytes, k, p)
        step = step_ms / min(k, p.domains) + comm
        tps = batch / step * 1e3
        rows.append(Row(p.name, f"TP={k}", k, step, comm, 100 * comm / step, tps, tps / base))
    for k in RANKS[1:]:
        used = min(k, p.domains)
        tps = used * base
        rows.append(Row(p.name, f"DP={k}", k, step_ms * k / used, 0.0, 0.0, tps, tps / base))
    return rows


def reading(rows: list[Row]) -> str:
    tp = [r for r in rows if r.layout.startswith("TP")]
    fastest = min(tp, key=lambda r: r.step_ms)
    if fastest.ranks == 1:
        latency = "TP does not shorten the step here (TP=1 is fastest)"
    else:
        latency = f"{fastest.layout} gives the shortest step ({fastest.step_ms:.2f} ms, {fastest.speedup:.2f}x)"
    best = max(rows, key=lambda r: (round(r.tokens_s, 6), r.layout.startswith("DP"), -r.ranks))
    if best.speedup < 1 + 1e-9:
        throughput = "no layout beats one rank"
    else:
        throughput = f"{best.layout} gives the most ({best.tokens_s:,.0f} tok/s, {best.speedup:.2f}x)"
    return f"reading: latency: {latency}; throughput: {throughput}"


def print_table(p: Platform, rows: list[Row]) -> None:
    print(f"\n{p.name}: latency {p.latency_us:g} us, {p.gbs:g} GB/s, {p.domains} bandwidth domain(s)")
    print(f"  {'layout':<7}{'step ms':>10}{'comm ms':>10}{'comm %':>8}{'tokens/s':>12}{'vs 1 rank':>11}")
    for r in rows:
        print(f"  {r.layout:<7}{r.step_ms:>10.2f}{r.comm_ms:>10.2f}{r.comm_pct:>7.1f}%"
              f"{r.tokens_s:>12,.0f}{r.speedup:>10.2f}x")
    print(f"  {reading(rows)}")
    print(f"  note: {p.note}")


def platforms(a: argparse.Namespace) -> list[Platform]:
    return [
        Platform("one host, shared memory (measured)", a.allreduce_us, a.local_gbs, 1,
                 "all ranks share one memory bus, so TP compute does not shrink and DP gives 1x "
                 "(k replicas split the same bandwidth)"),
        Platform("multi-socket server (shared memory, UPI)", a.socket_us, a.socket_gbs, a.sockets,
                 f"one rank per socket gets its own bandwidth; beyond {a.sockets} ranks they share sockets"),
        Platform("two machines, 25 Gb/s Ethernet (TCP)", a.net_us, a.net_gbs, 2 * a.sockets,
                 "k/2 ranks per machine, so every ring with k > 1 crosses the network and is costed at its figures"),
    ]


def step_figure(a: argparse.Namespace, m: Model) -> tuple[float, str]:
    weight_gb = m.params * a.dtype_bytes / 1e9
    roofline = weight_gb / a.mem_gbs * 1e3
    tail = f"roofline {weight_gb:.2f} GB weights / {a.mem_gbs:g} GB/s = {roofline:.2f} ms"
    if a.step_ms is not None:
        return a.step_ms, f"given ({tail})"
    if m.step_ms is not None:
        return m.step_ms, f"measured default ({tail})"
    return roofline, f"estimated ({tail})"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
    ap.add_argument("--dtype-bytes", type=int, default=2, help="bytes per activation element (2: bf16)")
    ap.add_argument("--batch", type=int, default=32, help="tokens per decode step")
    ap.add_argument("--step-ms", type=float, default=None, help="measured one-rank step (default: preset/roofline)")
    ap.add_argument("--mem-gbs", type=float, default=200.0, help="memory bandwidth per socket, GB/s")
    ap.add_argument("--allreduce-us", type=float, default=25.0, help="measured all-reduce latency between two "
                    "processes of this host (benchmarks/tensor_parallel.py, shared memory)")
    ap.add_argument("--local-gbs", type=float, default=3.1, help="measured all-reduce bandwidth, this host")
    ap.add_argument("--sockets", type=int, default=2, help="sockets per server")
    ap.add_argument("--socket-us", type=float, default=5.0)
    ap.add_argument("--socket-gbs", type=float, default=40.0)
    ap.add_argument("--net-us", type=float, default=30.0)
    ap.add_argument("--net-gbs", type=float, default=3.125)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    return ap.parse_args()


def main() -> None:
    a = parse_args()
    m = MODELS[a.model]
    step_ms, source = step_figure(a, m)
    plats = platforms(a)
    tables = [(p, rows_for(m, p, step_ms, a.batch, a.dtype_bytes)) for p in plats]
    if a.json:
        print(json.dumps([asdict(r) for _, rows in tables for r in rows]))
        return
    print(f"model {m.name}: hidden {m.hidden}, layers {m.layers}, vocab {m.vocab}, {m.params:.3g} params, "
          f"{a.dtype_bytes}-byte activations, batch {a.batch}")
    print(f"one-rank step {step_ms:.2f} ms: {source}")
    print(f"this host (shared memory, measured): all-reduce {a.allreduce_us:g} us, {a.local_gbs:g} GB/s; "
          f"{a.sockets} sockets per server")
    for p, rows in tables:
        print_table(p, rows)


if __name__ == "__main__":
    try:
        main()
        sys.stdout.flush()
    except BrokenPipeError:  # piped into `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
