"""The arguments and output shared by the `specdec` subcommands (cli.py and stack.py both use them).

Light on purpose: argparse only; the client is imported when one is made.
"""

from __future__ import annotations

import argparse
import os


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy; default 1.0")
    p.add_argument("--top-k", type=int, default=None, help="0 = off (default)")
    p.add_argument("--top-p", type=float, default=None, help="1 = off (default)")
    p.add_argument("--seed", type=int, default=None, help="sampled output is a fixed function of it (coupled "
                   "sampling: the same tokens whatever gamma or load)")
    p.add_argument("--sampling-mode", default=None, choices=["coupled", "rejection"],
                   help="how a sampled request draws; default: coupled with --seed, rejection without")
    p.add_argument("--gamma", type=int, default=None, help="drafts per round, 0 = target only; default 4")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def request_kwargs(a: argparse.Namespace) -> dict:
    return dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                seed=a.seed, gamma=a.gamma, stop=a.stop, sampling_mode=a.sampling_mode)


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default="localhost:50050", help="orchestrator HOST:PORT")
    p.add_argument("--tls-ca", default=os.environ.get("SPECDEC_TLS_CA"),
                   help="the orchestrator speaks TLS: verify it against this PEM CA")
    p.add_argument("--tls-cert", default=os.environ.get("SPECDEC_TLS_CERT"), help="mutual TLS: our PEM certificate")
    p.add_argument("--tls-key", default=os.environ.get("SPECDEC_TLS_KEY"), help="mutual TLS: our PEM key")
    p.add_argument("--token", default=os.environ.get("SPECDEC_TOKEN"),
                   help="bearer token for an orchestrator that requires one (default $SPECDEC_TOKEN)")


def connect(a: argparse.Namespace, timeout_s):
    """A Client for the orchestrator named by add_connection_args' arguments."""
    from orchestrator.client import Client
    from specdec.security import ClientTls

    return Client(a.server, timeout_s=timeout_s, tls=ClientTls(a.tls_ca, a.tls_cert, a.tls_key), token=a.token)


def format_stats(finish_reason: str, s: dict) -> str:
    return (
        f"[{finish_reason}] {s['generated_tokens']} tokens in {s['total_s']:.2f} s ({s['tokens_per_second']:.2f} tok/s), "
        f"gamma {s['gamma']}, {s['rounds']} rounds, acceptance {s['acceptance_rate']:.1%} "
        f"({s['accepted_tokens']}/{s['drafted_tokens']}), {s['mean_accepted_length']:.2f} tokens/round, "
        f"{s['target_forward_passes']} target passes, {s['wire_bytes_per_round']:.0f} wire bytes/round"
    )
