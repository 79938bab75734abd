"""The `specdec` command line.

  specdec serve [--target M] [--draft M] [--port P] [--http-port P]    the service, up until stopped
  specdec generate --server HOST:PORT --prompt TEXT [...] [--json]   one request to an orchestrator
  specdec run [--prompt TEXT] [--target M] [--draft M]               the whole stack on loopback
  specdec workers --server HOST:PORT [--add-target A] [--add-draft A]  an orchestrator's worker pools
  specdec timeline SPANS|JAEGER_URL --out timeline.png                  draw one request's trace
  specdec bench ...                                                    benchmarks (see specdec_tools/bench.py)
  specdec bench-tracing / specdec loadtest                             telemetry cost / load with faults
  specdec bench-serve                                                  throughput and latency against concurrency
  specdec bench-ahead                                                  drafting ahead on split cores vs target alone
  specdec bench-anchor --llama-server PATH                             beside llama.cpp's server on the same GGUF files
  specdec bench-structured                                             JSON-schema output: speedup, draft mask, forced tokens
"""

from __future__ import annotations

import argparse
import json
import sys

from specdec.errors import ServiceError
from specdec_tools.cli_args import add_connection_args, add_sampling_args, connect, format_stats, request_kwargs


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


def main(argv: list[str] | None = None) -> int:
    from specdec.threads import bound_openmp_spinning

    bound_openmp_spinning()  # the local stack and the benchmarks share cores (specdec/threads.py)
    from specdec import __version__

    parser = argparse.ArgumentParser(prog="specdec", description="Speculative decoding over gRPC.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from orchestrator import serve

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

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["timeline"]:  # its own parser: python -m specdec_tools.timeline takes the same arguments
        from specdec_tools import timeline

        return timeline.main(argv[1:], prog="specdec timeline")
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

    from specdec_tools import bench_coupling

    bc = sub.add_parser("bench-coupling", help="coupled vs rejection sampling: acceptance on the same contexts")
    bench_coupling.add_arguments(bc)
    bc.set_defaults(func=bench_coupling.cmd_bench_coupling)

    from specdec_tools import bench_ahead

    ba = sub.add_parser("bench-ahead", help="drafting ahead, draft and target on cores of their own, side by side")
    bench_ahead.add_arguments(ba)
    ba.set_defaults(func=bench_ahead.cmd_bench_ahead)

    from specdec_tools import bench_anchor

    an = sub.add_parser("bench-anchor", help="this project beside llama.cpp's own server on the same GGUF files")
    bench_anchor.add_arguments(an)
    an.set_defaults(func=bench_anchor.cmd_bench_anchor)

    from specdec_tools import bench_structured

    bst = sub.add_parser("bench-structured", help="structured output: speculation with and without a schema, ablated")
    bench_structured.add_arguments(bst)
    bst.set_defaults(func=bench_structured.cmd_bench_structured)

    if argv[:1] == ["serve"]:  # the flags it does not know go to the services
        a, extra = parser.parse_known_args(argv)
        return a.func(a, extra)
    a = parser.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
