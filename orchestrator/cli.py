"""The `specdec` command line.

  specdec serve [--target M] [--draft M] [--port P] [--http-port P]    the service, up until stopped
  specdec generate --server HOST:PORT --prompt TEXT [...] [--json]   one request to an orchestrator
  specdec workers --server HOST:PORT [--add-target A] [--add-draft A]  an orchestrator's worker pools

and, where the tools are installed (specdec_tools, `pip install '.[bench]'` from a checkout; not in
the service image), the tools' commands: run, bench (serve, kernels, load, ...),
timeline, ... They are found through the entry-point group `specdec.commands` (pyproject.toml;
specdec_tools/cli.py defines them), so nothing here imports the tools.
"""

from __future__ import annotations

import argparse
import json
import sys

from specdec import envs
from specdec.errors import ServiceError

SERVICE_COMMANDS = ("serve", "generate", "workers")
TOOLS_EXTRA = "pip install '.[bench]' from a checkout of this repository"


# ---- arguments and output shared with the tools' commands -------------------------------------


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default here, as the README's examples; the API's default is 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="0 = off (default)")
    p.add_argument("--top-p", type=float, default=None, help="1 = off (default)")
    p.add_argument("--seed", type=int, default=None, help="sampled output is a fixed function of it (coupled "
                   "sampling: the same tokens whatever gamma or load); default: drawn by the server, in the stats")
    p.add_argument("--sampling-mode", default=None, choices=["coupled", "rejection"],
                   help="how a sampled request draws; default: the server's (--sampling, coupled unless changed)")
    p.add_argument("--gamma", type=int, default=None, help="drafts per round, 0 = target only; default 4")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def request_kwargs(a: argparse.Namespace) -> dict:
    return dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                seed=a.seed, gamma=a.gamma, stop=a.stop, sampling_mode=a.sampling_mode)


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default="localhost:50050", help="orchestrator HOST:PORT")
    p.add_argument("--tls-ca", default=envs.get("SPECDEC_TLS_CA") or None,
                   help="the orchestrator speaks TLS: verify it against this PEM CA")
    p.add_argument("--tls-cert", default=envs.get("SPECDEC_TLS_CERT") or None, help="mutual TLS: our PEM certificate")
    p.add_argument("--tls-key", default=envs.get("SPECDEC_TLS_KEY") or None, help="mutual TLS: our PEM key")
    p.add_argument("--token", default=envs.get("SPECDEC_TOKEN") or None,
                   help="bearer token for an orchestrator that requires one (default $SPECDEC_TOKEN)")


def connect(a: argparse.Namespace, timeout_s):
    """A Client for the orchestrator named by add_connection_args' arguments."""
    from orchestrator.client import Client
    from specdec.security import ClientTls

    return Client(a.server, timeout_s=timeout_s, tls=ClientTls(a.tls_ca, a.tls_cert, a.tls_key), token=a.token)


# why an answer ended, in words (the stats line's first part)
FINISH_WORDS = {"length": "cut at the token limit (--max-new-tokens)", "eos": "the model ended its answer",
                "stop_string": "a stop string", "stop_token": "a stop token", "tool_calls": "tool calls"}


def format_stats(finish_reason: str, s: dict) -> str:
    return (
        f"[ended: {FINISH_WORDS.get(finish_reason, finish_reason)}] {s['generated_tokens']} tokens in "
        f"{s['total_s']:.2f} s ({s['tokens_per_second']:.2f} tok/s), "
        f"gamma {s['gamma']}, {s['rounds']} rounds, acceptance {s['acceptance_rate']:.1%} "
        f"({s['accepted_tokens']}/{s['drafted_tokens']}), {s['mean_accepted_length']:.2f} tokens/round, "
        f"{s['target_forward_passes']} target passes, {s['wire_bytes_per_round']:.0f} wire bytes/round"
    )


# ---- the service's commands ---------------------------------------------------------------------


def cmd_generate(a: argparse.Namespace) -> int:
    with connect(a, a.timeout) as client:
        kwargs = request_kwargs(a)
        if a.chat:
            kwargs["messages"] = [{"role": "user", "content": a.prompt}]
        else:
            kwargs["prompt"] = a.prompt
        try:
            if a.json:
                r = client.generate(**kwargs)
                print(json.dumps({"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                                  "stats": r.stats}))
                return 0
            for chunk in client.stream(**kwargs):
                print(chunk.text_delta, end="", flush=True)
                if chunk.stats is not None:
                    print()
                    print(format_stats(chunk.finish_reason, chunk.stats), file=sys.stderr)
        except ServiceError as err:
            print(f"{err.code.name}: {err.message}", file=sys.stderr)
            return 1
    return 0


def cmd_workers(a: argparse.Namespace) -> int:
    with connect(a, a.timeout) as client:
        try:
            if a.add_target or a.add_draft:
                workers = client.add_workers(target=a.add_target, draft=a.add_draft)
            else:
                workers = client.workers()
        except ServiceError as err:
            print(f"{err.code.name}: {err.message}", file=sys.stderr)
            return 1
    if a.json:
        print(json.dumps(workers))
        return 0
    print(f"{'role':<7} {'address':<24} {'state':<12} {'open':>5} {'ours':>5} {'placed':>7}  model / message")
    for w in workers:
        print(f"{w['role']:<7} {w['address']:<24} {w['state']:<12} {w['open_sessions']:>5} {w['active_sessions']:>5} "
              f"{w['placed_sessions']:>7}  {w['model_name'] or w['message']}")
    return 0


COMMANDS_GROUP = "specdec.commands"  # entry points: name -> add(subparsers, name), returning a main or None


def _tool_commands() -> dict:
    """The tools' commands (entry points of COMMANDS_GROUP: name -> add) whose code is installed
    here. The service image installs this distribution without specdec_tools: its entry points
    are listed but their module is missing, so they are left out."""
    from importlib.metadata import entry_points

    found = {}
    for ep in entry_points(group=COMMANDS_GROUP):
        if ep.name in found or ep.name in SERVICE_COMMANDS:
            continue
        try:
            found[ep.name] = ep.load()
        except ModuleNotFoundError as err:
            if err.name is None or not (ep.module == err.name or ep.module.startswith(err.name + ".")):
                raise  # the tool's module is there, but something it imports is not: say so
    return found


def main(argv: list[str] | None = None, commands: dict | None = None) -> int:
    """The command; commands: the tools' (name -> add), instead of the installed entry points
    (`python -m specdec_tools.cli` passes its own, for a checkout that was never installed)."""
    from specdec.threads import bound_openmp_spinning

    bound_openmp_spinning()  # the local stack and the benchmarks share cores (specdec/threads.py)
    from orchestrator import serve
    from specdec import __version__

    argv = sys.argv[1:] if argv is None else argv
    tools = sorted(dict(_tool_commands() if commands is None else commands).items())  # by name
    parser = argparse.ArgumentParser(
        prog="specdec", description="Speculative decoding over gRPC.",
        epilog=None if tools else f"The benchmarks and tools (run, bench, timeline, ...) are not "
                                  f"installed here: {TOOLS_EXTRA}.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    sv = sub.add_parser("serve", help="run target, draft and orchestrator (with the OpenAI API on port 8000) until "
                        "stopped; other flags go to the services that take them",
                        description="Run target, draft and orchestrator as supervised processes until stopped. "
                        "Any flag of the three services may follow (python -m orchestrator --help, "
                        "python -m target_service --help): each goes to the services that take it.")
    serve.add_arguments(sv)
    sv.set_defaults(func=serve.cmd_serve)

    g = sub.add_parser("generate", help="send one request to an orchestrator")
    add_connection_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    w = sub.add_parser("workers", help="list an orchestrator's workers, or add some (no restart)")
    add_connection_args(w)
    w.add_argument("--add-target", action="append", default=[], metavar="HOST:PORT")
    w.add_argument("--add-draft", action="append", default=[], metavar="HOST:PORT")
    w.add_argument("--json", action="store_true")
    w.add_argument("--timeout", type=float, default=30.0)
    w.set_defaults(func=cmd_workers)

    if tools:
        mains = {name: add(sub, name) for name, add in tools}  # a main where it parses its own arguments
        if argv[:1] and mains.get(argv[0]) is not None:
            return mains[argv[0]](argv[1:])
    elif argv[:1] and not argv[0].startswith("-") and argv[0] not in SERVICE_COMMANDS:
        print(f"specdec {argv[0]}: not a command of the service; the benchmarks and tools are not installed here "
              f"({TOOLS_EXTRA})", file=sys.stderr)
        return 2

    if argv[:1] == ["serve"]:  # the flags it does not know go to the services
        a, extra = parser.parse_known_args(argv)
        return a.func(a, extra)
    a = parser.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
