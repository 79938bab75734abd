"""The tools' commands on the `specdec` command line. orchestrator/cli.py is the command; it finds
these through the entry-point group `specdec.commands` (pyproject.toml: command name -> one add_*
function here, as COMMANDS lists them), where this package is installed. Each add_*(subparsers,
name) adds its subparser and returns None, or, for a command that parses its own arguments, its
main.

  specdec run [--prompt TEXT] [--target M] [--draft M]               the whole stack on loopback
  specdec timeline SPANS|JAEGER_URL --out timeline.png                  draw one request's trace
  specdec train-head [--generate] --out DIR                            train a feature head from the target's completions
  specdec bench SCENARIO ...                                           the benchmarks, one scenario each (SCENARIOS)
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

Main = Callable[[list[str]], int]

# `specdec bench SCENARIO` -> (module of specdec_tools, help): its add_arguments(parser) and cmd_<module>(args)
SCENARIOS: dict[str, tuple[str, str]] = {
    "serve": ("bench_serve", "throughput and latency against concurrency through the three services"),
    "kernels": ("bench_kernels", "forward passes under each CPU quantization: speed, exactness, quality"),
    "head": ("bench_head", "a feature head's draft step against a target pass (c), by sessions"),
    "coupling": ("bench_coupling", "coupled vs rejection sampling: acceptance on the same contexts"),
    "anchor": ("bench_anchor", "this project beside llama.cpp's own server on the same GGUF files"),
    "structured": ("bench_structured", "structured output: speculation with and without a schema, ablated"),
    "tracing": ("bench_tracing", "what tracing and metrics cost: telemetry off vs on, side by side"),
    "load": ("loadtest", "many clients for minutes on tiny models, workers killed and restarted (or links cut)"),
    "methods": ("bench", "compare target alone, HF assisted, and specdec in-process and over gRPC"),
}
# the commands before `specdec bench SCENARIO` (bench-serve -> serve, ..., loadtest -> load), still run, unlisted
OLD_NAMES = {module.replace("_", "-"): s for s, (module, _) in SCENARIOS.items() if s != "methods"}


def run_scenario(scenario: str, argv: list[str]) -> int:
    module, help = SCENARIOS[scenario]
    tool = importlib.import_module(f"specdec_tools.{module}")
    p = argparse.ArgumentParser(prog=f"specdec bench {scenario}", description=help)
    tool.add_arguments(p)
    return getattr(tool, f"cmd_{module}")(p.parse_args(argv))


def add_bench(sub, name: str) -> Main:
    sub.add_parser(name, help="the benchmarks: " + ", ".join(SCENARIOS), add_help=False).set_defaults(func=None)

    def main(argv: list[str]) -> int:
        if argv[:1] and argv[0] in SCENARIOS:
            return run_scenario(argv[0], argv[1:])
        if argv[:1] and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):  # the old `specdec bench`
            print(f"specdec {name} with the methods' flags is now `specdec {name} methods ...`", file=sys.stderr)
            return run_scenario("methods", argv)
        p = argparse.ArgumentParser(prog=f"specdec {name}", description="The benchmarks, one scenario each; "
                                    f"`specdec {name} SCENARIO --help` for its arguments.")
        scenarios = p.add_subparsers(dest="scenario", metavar="SCENARIO", required=True)
        for scenario, (_, help) in SCENARIOS.items():
            scenarios.add_parser(scenario, help=help, add_help=False)
        p.parse_args(argv)  # help, or no scenario it knows: exits
        return 2

    return main


def add_old_name(sub, name: str) -> Main:
    """An old name (OLD_NAMES): no parser (unlisted in `specdec --help`), a main that runs its scenario."""
    def main(argv: list[str]) -> int:
        print(f"specdec {name} is now `specdec bench {OLD_NAMES[name]}`", file=sys.stderr)
        return run_scenario(OLD_NAMES[name], argv)

    return main


# the functions the old names' entry points (pyproject.toml) name, each add_old_name
add_bench_serve = add_bench_kernels = add_bench_head = add_bench_coupling = add_bench_anchor = add_old_name
add_bench_structured = add_bench_tracing = add_loadtest = add_old_name


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


# the commands (`specdec --help` lists them, but for OLD_NAMES); pyproject.toml's entry points
# (group specdec.commands) name the same functions (tests/specdec/test_import_graph.py checks it)
COMMANDS: dict[str, Callable] = {"bench": add_bench, "run": add_run, "timeline": add_timeline,
                                 "train-head": add_train_head, **dict.fromkeys(OLD_NAMES, add_old_name)}

if __name__ == "__main__":
    # `python -m specdec_tools.cli COMMAND ...`: the same command line from a checkout that was never
    # installed (no entry points), as scripts/bench_gpu.sh runs it on a bare GPU machine
    from orchestrator.cli import main

    sys.exit(main(commands=COMMANDS))
