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

import importlib
import sys
from typing import Callable

Main = Callable[[list[str]], int]


def _tool(module: str, func: str, help: str) -> Callable:
    """add(subparsers, name) for specdec_tools.<module>: its add_arguments(parser), and func runs it."""
    def add(sub, name: str) -> None:
        tool = importlib.import_module(f"specdec_tools.{module}")
        p = sub.add_parser(name, help=help)
        tool.add_arguments(p)
        p.set_defaults(func=getattr(tool, func))

    return add


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

    r = sub.add_parser(name, help="start target, draft and orchestrator on loopback and answer a prompt")
    stack.add_arguments(r)
    add_sampling_args(r)
    r.set_defaults(func=stack.cmd_run)


add_bench = _tool("bench", "cmd_bench", "compare target alone, HF assisted, and specdec in-process and over gRPC")
add_bench_tracing = _tool("bench_tracing", "cmd_bench_tracing",
                          "what tracing and metrics cost: telemetry off vs on, side by side")
add_loadtest = _tool("loadtest", "cmd_loadtest",
                     "many clients for minutes on tiny models, workers killed and restarted")
add_bench_serve = _tool("bench_serve", "cmd_bench_serve",
                        "throughput and latency against concurrency through the three services")
add_bench_kernels = _tool("bench_kernels", "cmd_bench_kernels",
                          "forward passes under each CPU quantization: speed, exactness, quality")
add_bench_head = _tool("bench_head", "cmd_bench_head",
                       "a feature head's draft step against a target pass (c), by sessions")
add_train_head = _tool("train_head", "cmd_train_head", "train a feature head (EAGLE-3) on the target's own completions")
add_bench_coupling = _tool("bench_coupling", "cmd_bench_coupling",
                           "coupled vs rejection sampling: acceptance on the same contexts")
add_bench_anchor = _tool("bench_anchor", "cmd_bench_anchor",
                         "this project beside llama.cpp's own server on the same GGUF files")
add_bench_structured = _tool("bench_structured", "cmd_bench_structured",
                             "structured output: speculation with and without a schema, ablated")

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

    sys.exit(main(commands=COMMANDS))
