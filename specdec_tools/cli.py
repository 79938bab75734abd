"""The tools' commands on the `specdec` command line. orchestrator/cli.py is the command; it finds
these through the entry-point group `specdec.commands` (pyproject.toml: command name -> one add_*
function here, as COMMANDS lists them), where this package is installed. Each add_*(subparsers,
name) adds its subparser and returns None, or, for a command that parses its own arguments, its
main.

  specdec run [--prompt TEXT] [--target M] [--draft M]               the whole stack on loopback
  specdec timeline SPANS|JAEGER_URL --out timeline.png                  draw one request's trace
  specdec train-head [--generate] --out DIR                            train a feature head from the target's completions
  specdec bench SCENARIO [...]                                         the benchmarks, one scenario each (SCENARIOS):
    serve [--hosts 0/1]      throughput and latency against concurrency through the three services
    kernels                  forward passes under each CPU quantization
    head                     a feature head's draft step against a target pass
    coupling                 coupled vs rejection sampling
    anchor --llama-server P  beside llama.cpp's server on the same GGUF files
    structured               JSON-schema output: speedup, draft mask, forced tokens
    tracing                  what telemetry costs
    load                     many clients for minutes on tiny models, with faults
    methods                  target alone, HF assisted, specdec in-process and over gRPC

The commands the scenarios replace (bench-serve, ..., loadtest, and `specdec bench` with the methods'
flags) still run, each saying its new form on stderr; `specdec --help` leaves them out.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

Main = Callable[[list[str]], int]

# `specdec bench SCENARIO`: scenario -> (module of specdec_tools, its command function, help);
# each module has add_arguments(parser) and the function takes the parsed arguments
SCENARIOS: dict[str, tuple[str, str, str]] = {
    "serve": ("bench_serve", "cmd_bench_serve", "throughput and latency against concurrency through the three "
              "services (users, setups, round trips, hosts apart)"),
    "kernels": ("bench_kernels", "cmd_bench_kernels", "forward passes under each CPU quantization: speed, exactness, "
                "quality"),
    "head": ("bench_head", "cmd_bench_head", "a feature head's draft step against a target pass (c), by sessions"),
    "coupling": ("bench_coupling", "cmd_bench_coupling", "coupled vs rejection sampling: acceptance on the same "
                 "contexts"),
    "anchor": ("bench_anchor", "cmd_bench_anchor", "this project beside llama.cpp's own server on the same GGUF files"),
    "structured": ("bench_structured", "cmd_bench_structured", "structured output: speculation with and without a "
                   "schema, ablated"),
    "tracing": ("bench_tracing", "cmd_bench_tracing", "what tracing and metrics cost: telemetry off vs on, side by "
                "side"),
    "load": ("loadtest", "cmd_loadtest", "many clients for minutes on tiny models, workers killed and restarted "
             "(or links cut)"),
    "methods": ("bench", "cmd_bench", "compare target alone, HF assisted, and specdec in-process and over gRPC"),
}

# the commands before `specdec bench SCENARIO`, still accepted: old name -> scenario
OLD_NAMES = {"bench-serve": "serve", "bench-kernels": "kernels", "bench-head": "head", "bench-coupling": "coupling",
             "bench-anchor": "anchor", "bench-structured": "structured", "bench-tracing": "tracing",
             "loadtest": "load"}


def run_scenario(scenario: str, argv: list[str]) -> int:
    module, func, help = SCENARIOS[scenario]
    tool = importlib.import_module(f"specdec_tools.{module}")
    p = argparse.ArgumentParser(prog=f"specdec bench {scenario}", description=help)
    tool.add_arguments(p)
    return getattr(tool, func)(p.parse_args(argv))


def add_bench(sub, name: str) -> Main:
    """`specdec bench SCENARIO ...`; `specdec bench --methods ...` (flags, no scenario) is the old
    `specdec bench`, now `specdec bench methods`."""
    sub.add_parser(name, help="the benchmarks: " + ", ".join(SCENARIOS), add_help=False).set_defaults(func=None)

    def main(argv: list[str]) -> int:
        if argv[:1] and argv[0] in SCENARIOS:
            return run_scenario(argv[0], argv[1:])
        if argv[:1] and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
            print(f"specdec {name} with the methods' flags is now `specdec {name} methods ...`", file=sys.stderr)
            return run_scenario("methods", argv)
        p = argparse.ArgumentParser(prog=f"specdec {name}", description="The benchmarks, one scenario each; "
                                    f"`specdec {name} SCENARIO --help` for its arguments.")
        scenarios = p.add_subparsers(dest="scenario", metavar="SCENARIO", required=True)
        for scenario, (_, _, help) in SCENARIOS.items():
            scenarios.add_parser(scenario, help=help, add_help=False)
        p.parse_args(argv)  # help, or a scenario it does not know: exits
        return 2

    return main


def _old_name(scenario: str) -> Callable:
    """add(subparsers, name) for an old command name: no parser (hidden from `specdec --help`), its
    main runs the scenario after one line on stderr."""
    def add(sub, name: str) -> Main:
        def main(argv: list[str]) -> int:
            print(f"specdec {name} is now `specdec bench {scenario}`", file=sys.stderr)
            return run_scenario(scenario, argv)

        return main

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


def add_train_head(sub, name: str) -> None:
    from specdec_tools import train_head

    p = sub.add_parser(name, help="train a feature head (EAGLE-3) on the target's own completions")
    train_head.add_arguments(p)
    p.set_defaults(func=train_head.cmd_train_head)


add_bench_serve, add_bench_kernels, add_bench_head = _old_name("serve"), _old_name("kernels"), _old_name("head")
add_bench_coupling, add_bench_anchor = _old_name("coupling"), _old_name("anchor")
add_bench_structured, add_bench_tracing, add_loadtest = _old_name("structured"), _old_name("tracing"), _old_name("load")

# the commands (`specdec --help` lists them by name, but for OLD_NAMES); pyproject.toml's entry points
# (group specdec.commands) name the same functions (tests/specdec/test_import_graph.py checks it)
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
