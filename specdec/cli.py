"""The `specdec` command line.

  specdec generate --server HOST:PORT --prompt TEXT [...] [--json]   one request to an orchestrator
  specdec run [--prompt TEXT] [--target M] [--draft M]               the whole stack on loopback
  specdec workers --server HOST:PORT [--add-target A] [--add-draft A]  an orchestrator's worker pools
  specdec timeline SPANS|JAEGER_URL --out timeline.png                  draw one request's trace
  specdec bench ...                                                    benchmarks (see specdec/bench.py)
  specdec bench-tracing / specdec loadtest                             telemetry cost / load with faults
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from specdec.errors import ServiceError


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy; default 1.0")
    p.add_argument("--top-k", type=int, default=None, help="0 = off (default)")
    p.add_argument("--top-p", type=float, default=None, help="1 = off (default)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--gamma", type=int, default=None, help="drafts per round, 0 = target only; default 4")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _request_kwargs(a: argparse.Namespace) -> dict:
    return dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                seed=a.seed, gamma=a.gamma, stop=a.stop)


def _add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default="localhost:50050", help="orchestrator HOST:PORT")
    p.add_argument("--tls-ca", default=os.environ.get("SPECDEC_TLS_CA"),
                   help="the orchestrator speaks TLS: verify it against this PEM CA")
    p.add_argument("--tls-cert", default=os.environ.get("SPECDEC_TLS_CERT"), help="mutual TLS: our PEM certificate")
    p.add_argument("--tls-key", default=os.environ.get("SPECDEC_TLS_KEY"), help="mutual TLS: our PEM key")
    p.add_argument("--token", default=os.environ.get("SPECDEC_TOKEN"),
                   help="bearer token for an orchestrator that requires one (default $SPECDEC_TOKEN)")


def _client(a: argparse.Namespace, timeout_s):
    from orchestrator.client import Client
    from specdec.security import ClientTls

    return Client(a.server, timeout_s=timeout_s, tls=ClientTls(a.tls_ca, a.tls_cert, a.tls_key), token=a.token)


def cmd_generate(a: argparse.Namespace) -> int:
    with _client(a, a.timeout) as client:
        kwargs = _request_kwargs(a)
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
    with _client(a, a.timeout) as client:
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


def format_stats(finish_reason: str, s: dict) -> str:
    return (
        f"[{finish_reason}] {s['generated_tokens']} tokens in {s['total_s']:.2f} s ({s['tokens_per_second']:.2f} tok/s), "
        f"gamma {s['gamma']}, {s['rounds']} rounds, acceptance {s['acceptance_rate']:.1%} "
        f"({s['accepted_tokens']}/{s['drafted_tokens']}), {s['mean_accepted_length']:.2f} tokens/round, "
        f"{s['target_forward_passes']} target passes, {s['wire_bytes_per_round']:.0f} wire bytes/round"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description="Speculative decoding over gRPC.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="send one request to an orchestrator")
    _add_connection_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    w = sub.add_parser("workers", help="list an orchestrator's workers, or add some (no restart)")
    _add_connection_args(w)
    w.add_argument("--add-target", action="append", default=[], metavar="HOST:PORT")
    w.add_argument("--add-draft", action="append", default=[], metavar="HOST:PORT")
    w.add_argument("--json", action="store_true")
    w.add_argument("--timeout", type=float, default=30.0)
    w.set_defaults(func=cmd_workers)

    t = sub.add_parser("timeline", help="draw one request's trace (console-exporter spans or Jaeger) as a PNG",
                       add_help=False)
    t.set_defaults(func=None)

    from specdec import stack

    r = sub.add_parser("run", help="start target, draft and orchestrator on loopback and answer a prompt")
    stack.add_arguments(r)
    _add_sampling_args(r)
    r.set_defaults(func=stack.cmd_run)

    from specdec import bench

    b = sub.add_parser("bench", help="compare target alone, HF assisted, and specdec in-process and over gRPC")
    bench.add_arguments(b)
    b.set_defaults(func=bench.cmd_bench)

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["timeline"]:  # its own parser: python -m specdec.timeline takes the same arguments
        from specdec import timeline

        return timeline.main(argv[1:], prog="specdec timeline")
    from specdec import bench_tracing

    bt = sub.add_parser("bench-tracing", help="what tracing and metrics cost: telemetry off vs on, side by side")
    bench_tracing.add_arguments(bt)
    bt.set_defaults(func=bench_tracing.cmd_bench_tracing)

    from specdec import loadtest

    lt = sub.add_parser("loadtest", help="many clients for minutes on tiny models, workers killed and restarted")
    loadtest.add_arguments(lt)
    lt.set_defaults(func=loadtest.cmd_loadtest)

    a = parser.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
