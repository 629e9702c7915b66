"""`sobrio bench serve | sweep | autotune | roofline | perplexity`: the subcommands' wiring, kept apart from `serve.py`
so that `sweep` and `autotune`, which build on `serve`, are not imported back by it."""

import argparse

from sobrio.bench.autotune import add_autotune_args, cmd_bench_autotune
from sobrio.bench.perplexity import add_perplexity_args, cmd_bench_perplexity
from sobrio.bench.roofline import add_roofline_args, cmd_bench_roofline
from sobrio.bench.serve import add_serve_args, cmd_bench_serve
from sobrio.bench.sweep import add_sweep_args, cmd_bench_sweep

SUBCOMMANDS = [  # name, help, add its flags, run it
    ("serve", "timed streamed load against any OpenAI-compatible server", add_serve_args, cmd_bench_serve),
    ("sweep", "bench serve over request rates or concurrencies, one plot", add_sweep_args, cmd_bench_sweep),
    ("autotune", "find the serve config with the highest rate meeting SLOs", add_autotune_args, cmd_bench_autotune),
    ("roofline", "machine peaks and the share an engine step reaches", add_roofline_args, cmd_bench_roofline),
    ("perplexity", "perplexity, weight and KV bytes of each quantization mode on a held-out text",
     add_perplexity_args, cmd_bench_perplexity),
]


def add_bench_parser(sub) -> None:
    """`bench` and its subcommands under the top-level parser's subparsers."""
    bench = sub.add_parser("bench", help="benchmarks: serve, sweep, autotune, roofline, perplexity")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, help_text, add_args, run in SUBCOMMANDS:
        parser = bench_sub.add_parser(name, help=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_args(parser)
        parser.set_defaults(func=run)
