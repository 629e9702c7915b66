"""Replay a Poisson workload (64-448-token prompts, 128 out) through the real Scheduler with a fake runner
and a virtual clock, to compare prefill policies (--long-prefill-token-threshold and the partial-prefill
limits) on the same arrivals without HTTP or a shared machine's noise.

Each step lasts step_ms(D, P), a least-squares fit of step times measured with D decodes and P prompt
tokens (the MEASURED table: one host, one thread; re-measure on yours before trusting absolute figures).

    .venv/bin/python benchmarks/prefill_policy_replay.py 200 1,2 3   # requests, rates (req/s), seeds
"""

import random
import statistics
import sys

import numpy as np

from sobrio.config import SobrioConfig
from sobrio.engine.scheduler import Scheduler, is_decode
from sobrio.types.params import SamplingParams
from sobrio.types.request import Request

# Step times (ms) measured on the 2-core Intel AMX host of issue 10's second session, 2 threads, min of 3
# (a D-decode step, contexts ~200, plus one P-token prompt): rows D=1,16,32; columns P=0,64,128,256,448
MEASURED = {1: [19.0, 37.8, 48.0, 81.0, 125.3], 16: [25.6, 44.7, 54.0, 83.0, 123.5],
            32: [33.4, 56.4, 64.6, 90.2, 134.7]}
PS = [0, 64, 128, 256, 448]
X = [[1, d, p, d * p, p > 0] for d in MEASURED for p in PS]
Y = [t for d in MEASURED for t in MEASURED[d]]
COEF = np.linalg.lstsq(np.array(X, float), np.array(Y), rcond=None)[0]



def step_ms(d: int, p: int) -> float:
    return float(np.dot(COEF, [1, d, p, d * p, p > 0]))



def run(policy: dict, rate: float, num: int, seed: int, max_num_batched_tokens: int = 2048) -> dict:
    cfg = SobrioConfig.from_kwargs(max_num_seqs=64, max_num_batched_tokens=max_num_batched_tokens,
                                   enable_prefix_caching=False, **policy)
    sched = Scheduler(cfg, num_blocks=5825)
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for i in range(num):
        t += rng.expovariate(rate)
        arrivals.append((t, Request(str(i), [rng.randrange(100, 30000) for _ in range(rng.randint(64, 448))],
                                    SamplingParams(max_tokens=128), 128, frozenset(), arrival_time=t)))
    clock, first, last, steps, itl = 0.0, {}, {}, [], []
    pending = list(arrivals)
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= clock:
            sched.add_request(pending.pop(0)[1])
        if not sched.has_unfinished():
            clock = pending[0][0]
            continue
        decoding = {id(r) for r in sched.running if is_decode(r)}
        out = sched.schedule()
        d = sum(1 for r, _ in out.scheduled if id(r) in decoding)
        p = out.num_batched_tokens - d
        dt = step_ms(d, p) / 1000
        clock += dt
        steps.append((d, p, dt))
        for req in sched.update_after_step(out):
            sched.append_token(req, 5)
            if req.request_id in last:
                itl.append((clock - last[req.request_id]) * 1000)
            first.setdefault(req.request_id, clock)
            last[req.request_id] = clock
    reqs = [r for _, r in arrivals]
    ttft = [(first[r.request_id] - r.arrival_time) * 1000 for r in reqs]
    tpot = [(last[r.request_id] - first[r.request_id]) * 1000 / 127 for r in reqs]
    def q(xs, p):
        return float(np.percentile(xs, p))

    return dict(ttft50=q(ttft, 50), ttft99=q(ttft, 99), tpot50=q(tpot, 50), tpot99=q(tpot, 99),
                itl50=q(itl, 50), itl99=q(itl, 99), step_max=max(s[2] for s in steps) * 1000)


def policy(threshold: int, partial: int, long: int, tokens: int = 0) -> dict:
    return dict(long_prefill_token_threshold=threshold, max_num_partial_prefills=partial,
                max_long_partial_prefills=long, max_prompt_tokens_with_decodes=tokens)


POLICIES = {"off": policy(0, 64, 64), "512/1/1": policy(512, 1, 1), "256/2/1": policy(256, 2, 1),
            "512/8/1/512": policy(512, 8, 1, 512), "512/8/1/768": policy(512, 8, 1, 768),
            "256/8/1/512": policy(256, 8, 1, 512), "512/2/1": policy(512, 2, 1), "64/2/1": policy(64, 2, 1)}


def main() -> None:
    num, rates, seeds = int(sys.argv[1]), [float(r) for r in sys.argv[2].split(",")], range(int(sys.argv[3]))
    print("fit a, D, P, D*P, P>0:", np.round(COEF, 4))
    print(f"{'policy':9} {'rate':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8} {'max step':>9}")
    for rate in rates:
        for name, pol in POLICIES.items():
            rs = [run(pol, rate, num, s) for s in seeds]
            m = {k: statistics.mean(r[k] for r in rs) for k in rs[0]}
            print(f"{name:9} {rate:4g} {m['ttft50']:9.0f} {m['ttft99']:9.0f} {m['tpot50']:9.0f} {m['tpot99']:9.0f} "
                  f"{m['itl50']:8.0f} {m['itl99']:8.0f} {m['step_max']:9.0f}")


if __name__ == "__main__":
    main()
