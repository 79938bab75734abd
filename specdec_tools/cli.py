"""The tools' commands on the `specdec` command line (orchestrator/cli.py is the command; it adds
these where this package is installed).

  specdec run [--prompt TEXT] [--target M] [--draft M]               the whole stack on loopback
  specdec timeline SPANS|JAEGER_URL --out timeline.png                  draw one request's trace
  specdec bench ...                                                    benchmarks (see specdec_tools/bench.py)
  specdec bench-tracing / specdec loadtest                             telemetry cost / load with faults
  specdec bench-serve [--hosts 0/1]                                    throughput and latency against concurrency
                                                                       (one host, or two hosts on this machine)
  specdec bench-kernels                                                forward passes under each CPU quantization
  specdec bench-head                                                   a feature head's draft step against a target pass
  specdec train-head [--generate] --out DIR                            train a feature head from the target's completions
  specdec bench-coupling                                               coupled vs rejection sampling
  specdec bench-anchor --llama-server PATH                             beside llama.cpp's server on the same GGUF files
  specdec bench-structured                                             JSON-schema output: speedup, draft mask, forced tokens
"""

from __future__ import annotations

import sys
from typing import Callable

from orchestrator.cli import add_sampling_args


def _timeline(argv: list[str]) -> int:
    """Its own parser: python -m specdec_tools.timeline takes the same arguments."""
    from specdec_tools import timeline

    return timeline.main(argv, prog="specdec timeline")


def add_commands(sub) -> dict[str, Callable[[list[str]], int]]:
    """Adds the tools' subcommands to the `specdec` parser's subparsers; returns those that parse
    their own arguments (name -> main taking the arguments after the name)."""
    t = sub.add_parser("timeline", help="draw one request's trace (console-exporter spans or Jaeger) as a PNG",
                       add_help=False)
    t.set_defaults(func=None)

    from specdec_tools import stack

    r = sub.add_parser("run", help="start target, draft and orchestrator on loopback and answer a prompt")
    stack.add_arguments(r)
    add_sampling_args(r)
    r.set_defaults(func=stack.cmd_run)

    from specdec_tools import bench

    b = sub.add_parser("bench", help="compare target alone, HF assisted, and specdec in-process and over gRPC")
    bench.add_arguments(b)
    b.set_defaults(func=bench.cmd_bench)

    from specdec_tools import bench_tracing

    bt = sub.add_parser("bench-tracing", help="what tracing and metrics cost: telemetry off vs on, side by side")
    bench_tracing.add_arguments(bt)
    bt.set_defaults(func=bench_tracing.cmd_bench_tracing)

    from specdec_tools import loadtest

    lt = sub.add_parser("loadtest", help="many clients for minutes on tiny models, workers killed and restarted")
    loadtest.add_arguments(lt)
    lt.set_defaults(func=loadtest.cmd_loadtest)

    from specdec_tools import bench_serve

    bs = sub.add_parser("bench-serve", help="throughput and latency against concurrency through the three services")
    bench_serve.add_arguments(bs)
    bs.set_defaults(func=bench_serve.cmd_bench_serve)

    from specdec_tools import bench_kernels

    bk = sub.add_parser("bench-kernels", help="forward passes under each CPU quantization: speed, exactness, quality")
    bench_kernels.add_arguments(bk)
    bk.set_defaults(func=bench_kernels.cmd_bench_kernels)

    from specdec_tools import bench_head

    bh = sub.add_parser("bench-head", help="a feature head's draft step against a target pass (c), by sessions")
    bench_head.add_arguments(bh)
    bh.set_defaults(func=bench_head.cmd_bench_head)

    from specdec_tools import train_head

    th = sub.add_parser("train-head", help="train a feature head (EAGLE-3) on the target's own completions")
    train_head.add_arguments(th)
    th.set_defaults(func=train_head.cmd_train_head)

    from specdec_tools import bench_coupling

    bc = sub.add_parser("bench-coupling", help="coupled vs rejection sampling: acceptance on the same contexts")
    bench_coupling.add_arguments(bc)
    bc.set_defaults(func=bench_coupling.cmd_bench_coupling)

    from specdec_tools import bench_anchor

    an = sub.add_parser("bench-anchor", help="this project beside llama.cpp's own server on the same GGUF files")
    bench_anchor.add_arguments(an)
    an.set_defaults(func=bench_anchor.cmd_bench_anchor)

    from specdec_tools import bench_structured

    bst = sub.add_parser("bench-structured", help="structured output: speculation with and without a schema, ablated")
    bench_structured.add_arguments(bst)
    bst.set_defaults(func=bench_structured.cmd_bench_structured)

    return {"timeline": _timeline}


if __name__ == "__main__":
    from orchestrator.cli import main

    sys.exit(main())
