"""The tools' commands on the `specdec` command line. orchestrator/cli.py is the command; it finds
these through the entry-point group `specdec.commands` (pyproject.toml: command name -> one add_*
function here, as COMMANDS lists them), where this package is installed. Each add_*(subparsers,
name) adds its subparser and returns None, or, for a command that parses its own arguments, its
main.

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

Main = Callable[[list[str]], int]


def _add(sub, name: str, help: str, add_arguments, func) -> None:
    p = sub.add_parser(name, help=help)
    add_arguments(p)
    p.set_defaults(func=func)


def add_timeline(sub, name: str) -> Main:
    """Its own parser: python -m specdec_tools.timeline takes the same arguments."""
    sub.add_parser(name, help="draw one request's trace (console-exporter spans or Jaeger) as a PNG",
                   add_help=False).set_defaults(func=None)

    def main(argv: list[str]) -> int:
        from specdec_tools import timeline

        return timeline.main(argv, prog=f"specdec {name}")

    return main


def add_run(sub, name: str) -> None:
    from orchestrator.cli import add_sampling_args
    from specdec_tools import stack

    def add_arguments(p) -> None:
        stack.add_arguments(p)
        add_sampling_args(p)

    _add(sub, name, "start target, draft and orchestrator on loopback and answer a prompt", add_arguments,
         stack.cmd_run)


def add_bench(sub, name: str) -> None:
    from specdec_tools import bench

    _add(sub, name, "compare target alone, HF assisted, and specdec in-process and over gRPC",
         bench.add_arguments, bench.cmd_bench)


def add_bench_tracing(sub, name: str) -> None:
    from specdec_tools import bench_tracing

    _add(sub, name, "what tracing and metrics cost: telemetry off vs on, side by side",
         bench_tracing.add_arguments, bench_tracing.cmd_bench_tracing)


def add_loadtest(sub, name: str) -> None:
    from specdec_tools import loadtest

    _add(sub, name, "many clients for minutes on tiny models, workers killed and restarted",
         loadtest.add_arguments, loadtest.cmd_loadtest)


def add_bench_serve(sub, name: str) -> None:
    from specdec_tools import bench_serve

    _add(sub, name, "throughput and latency against concurrency through the three services",
         bench_serve.add_arguments, bench_serve.cmd_bench_serve)


def add_bench_kernels(sub, name: str) -> None:
    from specdec_tools import bench_kernels

    _add(sub, name, "forward passes under each CPU quantization: speed, exactness, quality",
         bench_kernels.add_arguments, bench_kernels.cmd_bench_kernels)


def add_bench_head(sub, name: str) -> None:
    from specdec_tools import bench_head

    _add(sub, name, "a feature head's draft step against a target pass (c), by sessions",
         bench_head.add_arguments, bench_head.cmd_bench_head)


def add_train_head(sub, name: str) -> None:
    from specdec_tools import train_head

    _add(sub, name, "train a feature head (EAGLE-3) on the target's own completions",
         train_head.add_arguments, train_head.cmd_train_head)


def add_bench_coupling(sub, name: str) -> None:
    from specdec_tools import bench_coupling

    _add(sub, name, "coupled vs rejection sampling: acceptance on the same contexts",
         bench_coupling.add_arguments, bench_coupling.cmd_bench_coupling)


def add_bench_anchor(sub, name: str) -> None:
    from specdec_tools import bench_anchor

    _add(sub, name, "this project beside llama.cpp's own server on the same GGUF files",
         bench_anchor.add_arguments, bench_anchor.cmd_bench_anchor)


def add_bench_structured(sub, name: str) -> None:
    from specdec_tools import bench_structured

    _add(sub, name, "structured output: speculation with and without a schema, ablated",
         bench_structured.add_arguments, bench_structured.cmd_bench_structured)


# the commands (`specdec --help` lists them by name); pyproject.toml's entry points (group
# specdec.commands) name the same functions (tests/specdec/test_import_graph.py checks it)
COMMANDS: dict[str, Callable] = {
    "bench": add_bench, "bench-anchor": add_bench_anchor, "bench-coupling": add_bench_coupling,
    "bench-head": add_bench_head, "bench-kernels": add_bench_kernels, "bench-serve": add_bench_serve,
    "bench-structured": add_bench_structured, "bench-tracing": add_bench_tracing, "loadtest": add_loadtest,
    "run": add_run, "timeline": add_timeline, "train-head": add_train_head,
}

if __name__ == "__main__":
    # `python -m specdec_tools.cli COMMAND ...`: the same command line from a checkout that was never
    # installed (no entry points), as scripts/bench_gpu.sh runs it on a bare GPU machine
    from orchestrator.cli import main

    sys.exit(main(commands=COMMANDS.items()))
