"""`specdec bench serve`: throughput and latency against concurrency, through the three services.

  specdec bench serve [--target M --draft M | --tiny] [--concurrency 1,2,4,8,16] [--requests-per-level N]
                      [--max-new-tokens 48] [--gamma on,off] [--users fresh,one] [--temperature 0,0.7,1.0]
                      [--sampling-mode default|coupled|rejection|both] [--prompts 8] [--out DIR]
                      [--setups default,fixed-gamma,FLAG=VALUE+...] [--link-rtt-ms 0,1,10]

Starts target, draft and orchestrator as processes on loopback (`specdec_tools.stack.ProcessStack`,
as `specdec run` does), once for the whole run. For each mode (--gamma: `on` leaves the request's
gamma unset, so the server's default applies; `off` is gamma 0, the target alone; a number asks
for that gamma) one short warm-up request, then for each concurrency level c, each mode in turn (the
order alternating from level to level, so drift over the run weighs on the modes alike; on CUDA
after c untimed requests of 8 tokens at once, which warm the level's shapes; with --warm-up full
after the whole level once untimed, so that the gamma policy's measurements of that load have
begun): c client threads,
one `orchestrator.client.Client` each, take requests from a shared list (the chat-templated
prompts of specdec_tools.bench.PROMPTS in turn, sent as a user message) until the level's
--requests-per-level are done (default max(8, 2c)), each streamed so that the first token shows.
Each request comes from a client of its own (a bearer token never sent before: --users fresh), so
none finds another's prompt in the workers' prefix caches or its answer in the suffix cache, both
on as served: what a new request costs. --users one sends all of a mode's requests as one client
(<mode>-one-user), whose prompts, sent before by earlier levels and modes, are then found cached.
The c clients start together (their requests then end and join in waves), or, with --arrivals
staggered, client k once the first request has k/c of its tokens (requests then end and join one
at a time, as a server's users do).
Measured per request: wall latency, time to first token (the first chunk carrying token ids),
generated tokens and tok/s (generated / latency), the server's acceptance counts and gamma.
Per mode and level: aggregate tok/s (all generated tokens / the level's wall time), mean
per-request tok/s, TTFT and latency p50/p95, acceptance rate (sum accepted / sum drafted),
mean gamma, the ratio of aggregate tok/s to the same mode's concurrency 1, and the ratio of
each mode to `off` at the same level, and the bytes that crossed between the orchestrator and
its workers a round (the server's wire_bytes over its rounds: token ids for greedy and coupled
rounds, both models' distributions for rejection-sampled ones). --temperature takes a list: the
modes run at each temperature, side by side in every level, and at a temperature above 0 once
per --sampling-mode (default: the request names none and the server chooses; coupled,
rejection, or both), sampled request i of a level with seed i + 1 (two requests of one prompt
draw apart; request i of every mode and level has the same seed); a row's ratios are to the `off`
row of the same temperature and sampling mode. Greedy rows (temperature 0) also check that every
output at concurrency > 1 equals the concurrency-1 output of the same prompt and mode: batching
across sessions must not change what a request gets (the count and the list are printed).
--api grpc,http runs the stack's own orchestrator's levels through its OpenAI-compatible door too
(chat completions streamed over one kept-alive connection per client), beside the gRPC run, with
the gap between tokens after the first (ms/token) for both. --setups runs the same levels through more orchestrators on the same two workers, each with
its own flags (SETUPS, or FLAG=VALUE: the ablation); --link-rtt-ms puts each worker behind a
delaying TCP proxy (specdec_tools/link.py: this kernel has no netem) with that round trip between
the orchestrator and each worker, and reports the RPCs and bytes that crossed the links per
generated token and per round (0 = the proxy, counting, without delay; left out: no proxy); the
orchestrators behind links poll their workers' load every 30 s instead of every second
(--poll-interval 30), so the counts are the requests' own RPCs (sessions opened and closed,
Propose/Verify or their batched forms) but for a poll or two per level.
Writes runs.csv (one row per request), summary.csv, summary.json (plus the machine, the models
and the command line), table.md and serve.png (aggregate tok/s and p95 latency against
concurrency, one line per mode) to --out; prints the table. Exit 1 if a request failed or a
greedy output differed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from specdec_tools import can_plot, report

DEFAULT_CONCURRENCY = "1,2,4,8,16"
DEFAULT_PROMPTS = 8  # = the concurrency-1 level's default request count: every prompt gets a reference
# orchestrator flags of each --setups name: the server as shipped, and the gamma policy turned off
# (every round drafts the request's gamma)
SETUPS = {
    "default": (),
    "fixed-gamma": ("--gamma-policy", "fixed"),
}


# ---------------------------------------------------------------------------------------------
# arguments


@dataclass(frozen=True)
class Mode:
    name: str  # "on", "off" or "gamma<N>"; "<mode>-<draft>" through --second-draft's; "<mode>-one-user" (--users)
    gamma: int | None  # the request's gamma; None = unset, the server's default
    server: str | None = None  # another orchestrator than the setup's (--second-draft's)
    users: str = "fresh"  # fresh: each request a client (bearer token) of its own; one: all the run's one client
    temperature: float = 0.0  # --temperature: 0 = greedy
    sampling: str | None = None  # --sampling-mode: the request's sampling_mode (None: it names none)


def parse_modes(text: str) -> list[Mode]:
    """'on,off' -> [Mode('on', None), Mode('off', 0)]; numbers ask for that gamma (0 = off)."""
    modes: list[Mode] = []
    for item in (s.strip().lower() for s in text.split(",") if s.strip()):
        if item in ("on", "default", "spec"):
            mode = Mode("on", None)
        elif item in ("off", "0"):
            mode = Mode("off", 0)
        elif item.isdigit():
            mode = Mode(f"gamma{int(item)}", int(item))
        else:
            raise argparse.ArgumentTypeError(f"--gamma: '{item}' is not on, off or a number")
        if mode in modes:  # named twice: a second run of it, whose ratio to the first is the run's noise
            mode = Mode(f"{mode.name}-again", mode.gamma)
        if mode not in modes:
            modes.append(mode)
    if not modes:
        raise argparse.ArgumentTypeError("--gamma: no mode given")
    return modes


def parse_users(text: str) -> list[str]:
    kinds = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not kinds or any(k not in ("fresh", "one") for k in kinds):
        raise argparse.ArgumentTypeError(f"--users: '{text}' is not fresh, one or fresh,one")
    return kinds


def with_users(modes: list[Mode], kinds: list[str]) -> list[Mode]:
    """The modes once per --users kind: those of one client named <mode>-one-user."""
    return [m if kind == "fresh" else Mode(f"{m.name}-one-user", m.gamma, m.server, "one")
            for kind in kinds for m in modes]


def parse_temperatures(text: str) -> list[float]:
    """'0,0.7,1.0' -> [0.0, 0.7, 1.0] (each once, in the order given)."""
    try:
        temperatures = list(dict.fromkeys(float(s) for s in text.split(",") if s.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--temperature: '{text}' is not a list of numbers") from None
    if not temperatures or any(not 0 <= t < math.inf for t in temperatures):
        raise argparse.ArgumentTypeError("--temperature: give one or more temperatures >= 0")
    return temperatures


SAMPLING_MODES = ("default", "coupled", "rejection")  # default: the request names none, the server chooses


def parse_sampling_modes(text: str) -> list[str]:
    """'both' -> ['coupled', 'rejection']; else a list of SAMPLING_MODES."""
    names = [s.strip().lower() for s in text.split(",") if s.strip()]
    names = list(dict.fromkeys(n for name in names for n in (("coupled", "rejection") if name == "both" else (name,))))
    if not names or set(names) - set(SAMPLING_MODES):
        raise argparse.ArgumentTypeError(f"--sampling-mode: '{text}' is not default, coupled, rejection or both")
    return names


def with_sampling(modes: list[Mode], temperatures: list[float], sampling_modes: list[str]) -> list[Mode]:
    """The modes once per temperature, and at a temperature above 0 once per sampling mode (a
    greedy request has but one way to draw)."""
    return [replace(m, temperature=t, sampling=None if s == "default" else s) for t in temperatures
            for s in (("default",) if t == 0 else sampling_modes) for m in modes]


def mode_label(mode: Mode) -> str:
    """The mode's name, and how it samples where it does: 'on', 'on T0.7 rejection'."""
    return mode.name if mode.temperature == 0 else f"{mode.name} T{mode.temperature:g} {mode.sampling or 'default'}"


def setup_flags(name: str) -> tuple[str, ...]:
    """A --setups item: a name of SETUPS, or orchestrator flags as FLAG=VALUE joined by '+'
    (gamma-policy=fixed+draft-lookup=0 -> --gamma-policy fixed --draft-lookup 0)."""
    if name in SETUPS:
        return SETUPS[name]
    flags: list[str] = []
    for part in name.split("+"):
        flag, eq, value = part.partition("=")
        if not eq or not re.fullmatch(r"[a-z][a-z0-9-]*", flag) or not value:
            raise argparse.ArgumentTypeError(f"--setups: '{name}' is neither one of {', '.join(SETUPS)} nor "
                                             "FLAG=VALUE[+FLAG=VALUE...] (orchestrator flags without --)")
        flags += [f"--{flag}", value]
    return tuple(flags)


def parse_setups(text: str) -> list[str]:
    names = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not names:
        raise argparse.ArgumentTypeError("--setups: give one or more setups")
    for name in names:
        setup_flags(name)
    return names


def parse_hosts(text: str) -> dict[str, str] | None:
    """--hosts: None for one host, else the CPUs (taskset lists) of each process: the target's,
    and the draft's, which the orchestrator shares (its work is small)."""
    if text == "one":
        return None
    target, slash, draft = text.partition("/")
    if not slash or not re.fullmatch(r"[0-9,-]+", target) or not re.fullmatch(r"[0-9,-]+", draft):
        raise argparse.ArgumentTypeError(f"--hosts: 'one' or TARGET_CPUS/DRAFT_CPUS (e.g. 0/1), got '{text}'")
    return {"target": target, "draft": draft, "orchestrator": draft}


def parse_rtts(text: str) -> list[float]:
    try:
        rtts = list(dict.fromkeys(float(s) for s in text.split(",") if s.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--link-rtt-ms: '{text}' is not a list of numbers") from None
    if any(r < 0 for r in rtts):
        raise argparse.ArgumentTypeError("--link-rtt-ms: round trips are >= 0")
    return rtts


def parse_apis(text: str) -> list[str]:
    apis = list(dict.fromkeys(s.strip().lower() for s in text.split(",") if s.strip()))
    if not apis or set(apis) - {"grpc", "http"}:
        raise argparse.ArgumentTypeError("--api: grpc, http or both")
    return apis


def parse_acceptance(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:  # every draft kept forever is no benchmark
        raise argparse.ArgumentTypeError(f"--synthetic-acceptance must lie in [0, 1), got {text}")
    return value


def parse_levels(text: str) -> list[int]:
    try:
        levels = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--concurrency: '{text}' is not a list of integers") from None
    if not levels or levels[0] < 1:
        raise argparse.ArgumentTypeError("--concurrency: give one or more levels >= 1")
    return levels


def parse_prompts(text: str, available: int) -> list[int]:
    """'N' -> the first N prompts; 'i,j,...' (a comma present) -> those indices."""
    try:
        if "," in text:
            picked = [int(s) for s in text.split(",") if s.strip()]
        else:
            picked = list(range(min(int(text), available)))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompts: '{text}' is neither a count nor a list of indices") from None
    if not picked or any(not 0 <= i < available for i in picked):
        raise argparse.ArgumentTypeError(f"--prompts: pick from 0..{available - 1}")
    return picked


def requests_for_level(level: int, requests_per_level: int | None) -> int:
    return requests_per_level if requests_per_level else max(8, 2 * level)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET

    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model (default {DEFAULT_DRAFT})")
    p.add_argument("--second-draft", default="", metavar="SPEC",
                   help="also a second draft worker on the same target (a model or a feature head directory), with "
                        "an orchestrator of its own: each mode that drafts (on, a gamma) runs again through it, as "
                        "<mode>-<name> (head, or the model's name), alternating with the others at every level")
    p.add_argument("--tiny", action="store_true",
                   help="tiny random models (specdec_tools.testing, no downloads): a quick smoke run")
    p.add_argument("--random", metavar="TARGET+DRAFT", default=None,
                   help="random-weight models with real shapes (specdec_tools.testing.tiny_models.REAL_SHAPES, e.g. "
                        "qwen2.5-coder-1.5b+qwen2.5-coder-0.5b): for machines without the weights (a GPU); pair it "
                        "with --synthetic-acceptance, as random models never agree")
    p.add_argument("--synthetic-acceptance", type=parse_acceptance, default=0.0, metavar="A",
                   help="BENCHMARKS ONLY: the target worker keeps each greedy draft with probability A whatever its "
                        "model says (specdec_tools/synthetic_target.py; the orchestrator's suffix drafts off; not "
                        "exact: every table says so); 0: off")
    p.add_argument("--device", default="cpu", help="the workers' device (cpu, cuda, cuda:1, ...)")
    p.add_argument("--dtype", default="auto", help="the workers' dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--concurrency", type=parse_levels, default=parse_levels(DEFAULT_CONCURRENCY),
                   help=f"comma-separated client counts (default {DEFAULT_CONCURRENCY})")
    p.add_argument("--requests-per-level", type=int, default=None, metavar="N",
                   help="requests at each level (default max(8, 2 x level))")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="each level's modes run N times, in turn first and last (A B, B A, ...); a row sums its "
                        "rounds, and 'vs off by round' gives the ratio of each round's pair: its spread and a 95%% "
                        "interval (a few points between identical modes here: one round of a level is ~15 s) "
                        "(default 1)")
    p.add_argument("--users", type=parse_users, default=["fresh"],
                   help="fresh: every request comes from a client of its own (a bearer token never sent before), so "
                        "no request finds another's prompt or answer cached, as for new users; one: all requests "
                        "from one client, so a prompt sent before (by another level or mode) is found in the "
                        "workers' prefix caches and its answer drafts from the suffix cache (the modes run again as "
                        "<mode>-one-user, compared with off-one-user); fresh,one runs both (default fresh)")
    p.add_argument("--prefix-cache", choices=["on", "off"], default="on",
                   help="the workers' prefix cache (--prefix-cache-tokens), on as served (default on)")
    p.add_argument("--warm-up", choices=["auto", "off", "short", "full"], default="auto",
                   help="before each mode's timed level: short, c requests of 8 tokens at once (warms a GPU's "
                        "shapes); full, the whole level once untimed (the gamma policy's measurements of that load "
                        "begin first: its steady state, not its cold start); auto: short on CUDA, else off")
    p.add_argument("--suffix-cache", choices=["on", "off"], default="on",
                   help="suffix drafts from ended requests of the same client (the orchestrator's "
                        "--suffix-cache-tokens), on as served (default on; a request's own tokens are searched either way)")
    p.add_argument("--pass-lock", choices=["on", "off"], default="on",
                   help="on: the workers' --pass-lock default (auto: passes of workers whose CPUs overlap take "
                        "turns); off: none (--pass-lock off, the ablation)")
    p.add_argument("--hosts", default="one", metavar="one|TARGET_CPUS/DRAFT_CPUS",
                   type=lambda text: (parse_hosts(text), text)[1],
                   help="one: both workers on every core (one host); e.g. 0/1: two hosts on this machine, the "
                        "target pinned to CPU 0, the draft and the orchestrator to CPU 1 (taskset, an OpenMP thread "
                        "per CPU) (default one)")
    p.add_argument("--gamma", type=parse_modes, default=parse_modes("on,off"),
                   help="modes to compare: on (the server's default gamma), off (gamma 0) or a number "
                        "(default on,off); a mode named twice runs twice, the second as NAME-again (off,off: "
                        "the spread of a ratio between two identical modes, the machine's noise)")
    p.add_argument("--arrivals", choices=["together", "staggered"], default="together",
                   help="together: the c clients' first requests at once (then requests end and join in waves of "
                        "about c); staggered: client k sends its first request once the first client's first request "
                        "has k/c of --max-new-tokens, so requests end and join one at a time (default together)")
    p.add_argument("--temperature", type=parse_temperatures, default=[0.0], metavar="T,...",
                   help="comma-separated temperatures, each a row of its own (0 = greedy: outputs are compared) "
                        "(default 0)")
    p.add_argument("--sampling-mode", type=parse_sampling_modes, default=["default"],
                   help="how sampled requests (temperature > 0) draw: default (the request names no sampling_mode, "
                        "the server's choice), coupled, rejection, or both (coupled,rejection: rows side by side) "
                        "(default default)")
    p.add_argument("--prompt-set", default="fresh", choices=["fresh", "edit", "similar", "long"],
                   help="fresh: code written from scratch (specdec_tools.bench.FRESH); edit: code edits whose answers "
                        "re-use the prompt's code (EDIT, 6 prompts); similar: a batch job, four kinds of code each "
                        "request for another name (SIMILAR; no two requests of the run alike, so greedy outputs are "
                        "not compared; pair with --users one); long: each edit below the code of all six "
                        "(LONG, ~600 tokens: prefills that take seconds on a CPU while other requests decode)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS),
                   help=f"the first N of specdec_tools.bench.PROMPTS, or comma-separated indices "
                        f"(default {DEFAULT_PROMPTS})")
    p.add_argument("--out", default="bench_results/serve", help="output directory (default bench_results/serve)")
    p.add_argument("--setups", type=parse_setups, default=["default"],
                   help=f"orchestrator setups to compare on the same workers: {', '.join(SETUPS)}, or orchestrator "
                        "flags as FLAG=VALUE joined by + (e.g. gamma-policy=fixed+draft-lookup=0) (default default)")
    p.add_argument("--link-rtt-ms", type=parse_rtts, default=[], metavar="MS,...",
                   help="put each worker behind a delaying proxy with this round trip (ms; 0 = proxy, no delay), "
                        "and count the RPCs and bytes on the links (default: no proxy)")
    p.add_argument("--api", type=parse_apis, default=["grpc"],
                   help="client APIs to compare: grpc (the Python client), http (the OpenAI-compatible door, "
                        "streamed server-sent events over one kept-alive connection per client) (default grpc)")
    p.add_argument("--startup-timeout", type=float, default=1800.0)
    p.add_argument("--request-timeout", type=float, default=3600.0, help="each request's deadline in seconds")


# ---------------------------------------------------------------------------------------------
# statistics (pure)


@dataclass
class RequestRecord:
    mode: str
    concurrency: int
    request: int  # index within the level
    prompt: int  # index into specdec_tools.bench.PROMPTS
    thread: int
    start_s: float  # from the level's start
    latency_s: float
    ttft_s: float | None
    generated_tokens: int
    tokens_per_s: float
    finish_reason: str = ""
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    suffix_drafted_tokens: int = 0  # of drafted_tokens, suffix drafts' (no draft pass)
    suffix_accepted_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of them, those the target found in its prefix cache
    draft_prefill_tokens: int = 0  # tokens the draft model took in beyond one a round (its prompt, catch-ups)
    ahead_rounds: int = 0  # rounds whose drafts were asked for ahead (a draft with hardware of its own) ...
    ahead_hits: int = 0  # ... and found made
    rounds: int = 0
    gamma: int | None = None  # as the server's stats report it
    server_total_s: float = 0.0
    # where the server's time went (its stats): the rounds' draft and verify calls, and of them the
    # workers' forward passes alone
    server_prefill_s: float = 0.0  # the prompt's prefill (its wait for other prefills included)
    server_draft_s: float = 0.0
    server_verify_s: float = 0.0
    server_draft_compute_s: float = 0.0
    server_verify_compute_s: float = 0.0
    error: str = ""
    same_as_c1: bool | None = None  # greedy, concurrency > 1: equal to the concurrency-1 output
    setup: str = "default"  # --setups
    link_rtt_ms: float | None = None  # --link-rtt-ms; None: no proxy
    api: str = "grpc"  # --api
    ms_per_token: float | None = None  # (latency - TTFT) / (tokens after the first): the gap between tokens
    longest_gap_s: float | None = None  # the longest wait between two streamed tokens (a stall)
    round: int = 0  # --rounds: which of the level's rounds
    temperature: float = 0.0  # the request's
    sampling: str = ""  # how it drew, as the server's stats say (greedy, coupled, rejection)
    wire_bytes: int = 0  # bytes between the orchestrator and its workers (the server's stats)
    token_ids: list[int] = field(default_factory=list, repr=False)


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _round(x, digits=4):
    return None if x is None else round(x, digits)


def summarize_level(records: list[RequestRecord], wall_s: float) -> dict:
    """One mode x level's row: throughput, latency and acceptance over its successful requests."""
    ok = [r for r in records if not r.error]
    tokens = sum(r.generated_tokens for r in ok)
    drafted, accepted = sum(r.drafted_tokens for r in ok), sum(r.accepted_tokens for r in ok)
    gammas = [r.gamma for r in ok if r.gamma is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    lat = [r.latency_s for r in ok]
    prompted = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "wall_s": _round(wall_s, 3),
        "generated_tokens": tokens,
        "aggregate_tok_s": _round(tokens / wall_s if wall_s > 0 else 0.0, 3),
        "mean_request_tok_s": _round(sum(r.tokens_per_s for r in ok) / len(ok) if ok else None, 3),
        "ttft_p50_s": _round(percentile(ttfts, 50)),
        "ttft_p95_s": _round(percentile(ttfts, 95)),
        "latency_p50_s": _round(percentile(lat, 50)),
        "latency_p95_s": _round(percentile(lat, 95)),
        "acceptance_rate": _round(accepted / drafted if drafted else None),
        "mean_gamma": _round(sum(gammas) / len(gammas) if gammas else None, 3),
        # bytes between the orchestrator and its workers (both ways, both workers) a round; None
        # where the stats carry none (the HTTP door's)
        "wire_bytes_per_round": _round(sum(r.wire_bytes for r in ok) / sum(r.rounds for r in ok), 1)
        if any(r.wire_bytes for r in ok) and sum(r.rounds for r in ok) else None,
        # of the drafted tokens, those of suffix drafts, and of those the share kept
        "suffix_share": _round(sum(r.suffix_drafted_tokens for r in ok) / drafted if drafted else None, 3),
        "suffix_acceptance": _round(sum(r.suffix_accepted_tokens for r in ok) /
                                    max(sum(r.suffix_drafted_tokens for r in ok), 1)
                                    if any(r.suffix_drafted_tokens for r in ok) else None, 3),
        # the draft's prompt work beside the target's: tokens it took in (its prompts, catch-ups) per
        # prompt token the target prefilled (0: no draft prefilled anything); None where the stats
        # carry no prompt counts (the HTTP door's usage)
        "draft_prefill_share": _round(sum(r.draft_prefill_tokens for r in ok) /
                                      max(sum(r.prompt_tokens - r.cached_tokens for r in ok), 1), 3) if prompted else None,
        "cached_share": _round(sum(r.cached_tokens for r in ok) / prompted, 3) if prompted else None,
        # of the rounds asked for ahead (the draft working while the target verified), those whose
        # drafts were all made in time
        "ahead_hit_rate": _round(sum(r.ahead_hits for r in ok) / sum(r.ahead_rounds for r in ok), 3)
        if any(r.ahead_rounds for r in ok) else None,
        "ms_per_token_p50": _round(percentile([r.ms_per_token for r in ok if r.ms_per_token is not None], 50), 2),
        # each request's longest wait between two tokens, p95 over the requests: the stalls a user sees
        "longest_gap_p95_s": _round(percentile([r.longest_gap_s for r in ok if r.longest_gap_s is not None], 95)),
        **round_split(ok),
    }


SPLIT_COLUMNS = [  # round_split's keys: where a round's time went, ms a round
    ("split_tokens", "tokens a round", "{:.2f}"), ("split_draft_ms", "draft call", "{:.2f}"),
    ("split_draft_pass_ms", "of it passes", "{:.2f}"), ("split_verify_ms", "verify call", "{:.2f}"),
    ("split_verify_pass_ms", "of it passes", "{:.2f}"), ("split_orchestrator_ms", "orchestrator", "{:.2f}"),
    ("split_client_ms", "client and its link", "{:.2f}"), ("split_round_ms", "round", "{:.2f}"),
]


def round_split(records: list[RequestRecord]) -> dict:
    """Where a round's time went, ms a round over the requests' rounds (their server stats): the
    draft and verify calls (each RPC, a step's batched one included, as the orchestrator timed
    it) and of them the workers' forward passes, the orchestrator's own time (its total less
    prefill and calls), and the client's (latency less the server's total). The prefill is not a
    round's: left out."""
    rounds = sum(r.rounds for r in records)
    if not rounds:
        return {}

    def ms(values) -> float:
        return round(1e3 * sum(values) / rounds, 3)

    split = {
        "split_tokens": round(sum(r.generated_tokens for r in records) / rounds, 3),
        "split_draft_ms": ms(r.server_draft_s for r in records),
        "split_draft_pass_ms": ms(r.server_draft_compute_s for r in records),
        "split_verify_ms": ms(r.server_verify_s for r in records),
        "split_verify_pass_ms": ms(r.server_verify_compute_s for r in records),
        "split_orchestrator_ms": ms(r.server_total_s - r.server_prefill_s - r.server_draft_s - r.server_verify_s
                                    for r in records),
        "split_client_ms": ms(r.latency_s - r.server_total_s for r in records),
    }
    split["split_round_ms"] = round(sum(split[k] for k in ("split_draft_ms", "split_verify_ms", "split_orchestrator_ms",
                                                           "split_client_ms")), 3)
    return split


def format_split(rows: list[dict]) -> str:
    """The time split of a round (round_split), a row per mode and level (and temperature and
    sampling mode where some row samples)."""
    setups = any(r.get("setup", "default") != "default" for r in rows)
    sampled = any(r.get("temperature") for r in rows)
    head = ["setup"] * setups + ["temperature", "sampling"] * sampled + ["mode", "clients"]
    return report.markdown_table(head + [title for _, title, _ in SPLIT_COLUMNS], (
        [r.get("setup", "default")] * setups + [f"{r.get('temperature', 0.0):g}", r.get("sampling", "")] * sampled
        + [r["mode"], r["concurrency"]] + [fmt.format(r[key]) for key, _, fmt in SPLIT_COLUMNS]
        for r in rows if "split_tokens" in r))


def add_ratios(rows: list[dict], off_mode: str = "off") -> list[dict]:
    """Sets, on each row (keys mode, concurrency, aggregate_tok_s), vs_c1: aggregate tok/s over the
    same mode's concurrency-1 aggregate, and vs_off: over the `off_mode` row at the same level
    (None where that row is missing, or for the off mode itself). Returns rows."""
    def group(r):  # ratios stay within one setup, link, API, temperature and sampling mode
        return (r.get("setup", "default"), r.get("link_rtt_ms"), r.get("api", "grpc"), r.get("temperature", 0.0),
                r.get("sampling_mode", "default"))

    by_key = {(group(r), r["mode"], r["concurrency"]): r for r in rows}

    def ratio(row, other):
        if other is None or not other["aggregate_tok_s"]:
            return None
        return round(row["aggregate_tok_s"] / other["aggregate_tok_s"], 3)

    for r in rows:
        r["vs_c1"] = ratio(r, by_key.get((group(r), r["mode"], 1)))
        off_name = off_mode if r.get("users", "fresh") == "fresh" else f"{off_mode}-one-user"  # --users one
        off = None if r["mode"] == off_name else by_key.get((group(r), off_name, r["concurrency"]))
        r["vs_off"] = ratio(r, off)
        r["vs_off_rounds"] = round_ratios(r.get("round_tok_s"), off.get("round_tok_s") if off else None)
    return rows


def round_ratios(mine: list[float] | None, off: list[float] | None) -> dict | None:
    """--rounds: each round's ratio to the off mode's same round, their range, and a 95% interval
    of their geometric mean (Student's t on the log ratios: the rounds ran side by side, so the
    pairs share the machine's drift). None with fewer than two rounds."""
    if not mine or not off or len(mine) != len(off) or len(mine) < 2 or not all(mine) or not all(off):
        return None
    logs = [math.log(m / o) for m, o in zip(mine, off)]
    n = len(logs)
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = T95[min(n - 1, len(T95)) - 1] * sd / math.sqrt(n)
    return {"ratios": [round(math.exp(x), 3) for x in logs], "geomean": round(math.exp(mean), 3),
            "ci95": [round(math.exp(mean - half), 3), round(math.exp(mean + half), 3)]}


# Student's t, two-sided 95%, for 1..10 degrees of freedom (more: the 10's, a little wide)
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]


def format_rounds(value: dict) -> str:
    low, high = min(value["ratios"]), max(value["ratios"])
    return f"{low:.2f}-{high:.2f}x (95%: {value['ci95'][0]:.2f}-{value['ci95'][1]:.2f}x)"


def compare_outputs(records: list[RequestRecord]) -> dict:
    """Greedy outputs at concurrency > 1 against the concurrency-1 output of the same mode and
    prompt (its first, if it ran more than once; from any setup and link: they must all agree). Sets each record's same_as_c1 (None: no
    reference) and returns {"checked", "differ": [{mode, concurrency, request, prompt}], "unchecked"}.
    Sampled records (temperature > 0) are left out."""
    reference: dict[tuple[str, int], list[int]] = {}
    # HTTP answers carry text, not token ids
    records = [r for r in records if r.api == "grpc" and r.temperature == 0]
    for r in records:
        if r.concurrency == 1 and not r.error:
            reference.setdefault((r.mode, r.prompt), r.token_ids)
    checked, unchecked, differ = 0, 0, []
    for r in records:
        if r.concurrency == 1 or r.error:
            continue
        ref = reference.get((r.mode, r.prompt))
        if ref is None:
            r.same_as_c1 = None
            unchecked += 1
            continue
        r.same_as_c1 = r.token_ids == ref
        checked += 1
        if not r.same_as_c1:
            differ.append({"mode": r.mode, "concurrency": r.concurrency, "request": r.request, "prompt": r.prompt})
    return {"checked": checked, "differ": differ, "unchecked": unchecked}


def level_differences(records: list[RequestRecord], mode: str, level: int, setup: str = "default",
                      link_rtt_ms: float | None = None) -> str:
    """'differing/checked' for one setup x link x greedy mode x level ('' where nothing was compared)."""
    rs = [r for r in records if (r.mode, r.concurrency, r.setup, r.link_rtt_ms) == (mode, level, setup, link_rtt_ms)
          and r.api == "grpc" and r.temperature == 0 and r.same_as_c1 is not None]
    return f"{sum(not r.same_as_c1 for r in rs)}/{len(rs)}" if rs else ""


TABLE_COLUMNS = [
    ("api", "API", "{}"), ("setup", "setup", "{}"), ("link_rtt_ms", "link RTT ms", "{:g}"),
    ("temperature", "temperature", "{:g}"), ("sampling", "sampling", "{}"),
    ("mode", "mode", "{}"), ("concurrency", "clients", "{}"), ("requests", "requests", "{}"),
    ("aggregate_tok_s", "aggregate tok/s", "{:.2f}"), ("vs_c1", "vs c=1", "{:.2f}x"), ("vs_off", "vs off", "{:.2f}x"),
    ("vs_off_rounds", "vs off by round", format_rounds),
    ("mean_request_tok_s", "tok/s per request", "{:.2f}"), ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
    ("ttft_p95_s", "TTFT p95 s", "{:.3f}"), ("latency_p50_s", "latency p50 s", "{:.3f}"),
    ("latency_p95_s", "latency p95 s", "{:.3f}"), ("ms_per_token_p50", "ms/token after the first p50", "{:.1f}"),
    ("longest_gap_p95_s", "longest gap p95 s", "{:.3f}"),
    ("acceptance_rate", "acceptance", "{:.3f}"),
    ("mean_gamma", "gamma", "{:g}"), ("wire_bytes_per_round", "wire B/round", "{:,.0f}"),
    ("suffix_share", "suffix share of drafts", "{:.2f}"),
    ("suffix_acceptance", "suffix acceptance", "{:.3f}"), ("cached_share", "prompt cached", "{:.2f}"),
    ("draft_prefill_share", "draft prefill / target's", "{:.2f}"), ("ahead_hit_rate", "drafted ahead in time", "{:.2f}"),
    ("busy_target", "target host busy", "{:.2f}"), ("busy_draft", "draft host busy", "{:.2f}"),
    ("cpu_target_ms_per_token", "CPU ms/token target", "{:.1f}"), ("cpu_draft_ms_per_token", "draft", "{:.1f}"),
    ("cpu_orchestrator_ms_per_token", "orchestrator", "{:.1f}"), ("rpcs_per_token", "RPCs/token", "{:.2f}"),
    ("rpcs_per_round", "RPCs/round", "{:.2f}"), ("bytes_per_token", "bytes/token", "{:,.0f}"),
    ("outputs_differ", "differ from c=1", "{}"), ("errors", "errors", "{}"),
]


def format_table(rows: list[dict]) -> str:
    """The markdown table; columns no row fills (setup and link when not compared, link counts
    without --link-rtt-ms, temperature and sampling when every row is greedy) are left out."""
    optional = {"api", "setup", "link_rtt_ms", "rpcs_per_token", "rpcs_per_round", "bytes_per_token", "vs_off_rounds",
                "ahead_hit_rate", "busy_target", "busy_draft"}
    sampled = any(r.get("temperature") for r in rows)
    columns = [(key, title, fmt) for key, title, fmt in TABLE_COLUMNS
               if (sampled if key in ("temperature", "sampling") else
                   key not in optional or any(r.get(key) not in (None, "default", "grpc") for r in rows))]
    return report.markdown_table([title for _, title, _ in columns], (
        ["" if r.get(key) is None else fmt(r[key]) if callable(fmt) else fmt.format(r[key]) for key, _, fmt in columns]
        for r in rows))


# ---------------------------------------------------------------------------------------------
# running


def _one_request(client, mode: Mode, prompt: str, a: argparse.Namespace, seed: int, progress=None, token=None):
    """Streams one request as the client `token` (its bearer token); returns (latency_s, ttft_s,
    token_ids, finish_reason, stats, longest_gap_s: the longest wait between two chunks with
    tokens, None for fewer than two). progress: called with the tokens received so far, after each
    chunk that brings some."""
    kwargs = dict(messages=[{"role": "user", "content": prompt}], max_new_tokens=a.max_new_tokens,
                  temperature=mode.temperature, gamma=mode.gamma)
    if mode.temperature > 0:
        kwargs["seed"] = seed
        if mode.sampling:
            kwargs["sampling_mode"] = mode.sampling
    token_ids, ttft, finish, stats, gaps = [], None, "", {}, _Gaps()
    t0 = time.perf_counter()
    for chunk in client.stream(token=token, **kwargs):
        if chunk.token_ids:
            gaps.tick()
            if ttft is None:
                ttft = time.perf_counter() - t0
            token_ids.extend(chunk.token_ids)
            if progress is not None:
                progress(len(token_ids))
        if chunk.stats is not None:
            finish, stats = chunk.finish_reason or "", chunk.stats
    return time.perf_counter() - t0, ttft, token_ids, finish, stats, gaps.longest


class _Gaps:
    """The longest wait between two ticks (None before the second)."""

    def __init__(self):
        self.last, self.longest = None, None

    def tick(self) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.longest = max(self.longest or 0.0, now - self.last)
        self.last = now


class HttpClient:
    """The OpenAI-compatible door as a bench client: chat completions streamed as server-sent
    events over one kept-alive connection (as the openai SDK does)."""

    def __init__(self, base: str, timeout_s: float):
        import httpx

        self.base, self.http = base, httpx.Client(timeout=timeout_s)
        self.model = self.http.get(base + "/v1/models").json()["data"][0]["id"]

    def stream(self, messages, max_new_tokens: int, temperature: float, gamma=None, seed=None, token=None,
               sampling_mode=None):
        """Yields (text, finish_reason, usage) per event; token: the request's bearer token."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_new_tokens, "temperature": temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        body.update({k: v for k, v in (("gamma", gamma), ("seed", seed), ("sampling_mode", sampling_mode))
                     if v is not None})
        headers = {"authorization": f"Bearer {token}"} if token else None
        with self.http.stream("POST", self.base + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                choice = (event.get("choices") or [{}])[0]
                yield (choice.get("delta") or {}).get("content") or "", choice.get("finish_reason"), event.get("usage")

    def close(self) -> None:
        self.http.close()


def _one_http_request(client: HttpClient, mode: Mode, prompt: str, a: argparse.Namespace, seed: int,
                      progress=None, token=None):
    """As _one_request, over HTTP: (latency_s, ttft_s, [], finish_reason, stats with the token count,
    longest_gap_s); progress counts events with text (a step's tokens each)."""
    ttft, finish, stats, events, gaps = None, "", {}, 0, _Gaps()
    t0 = time.perf_counter()
    sampled = mode.temperature > 0
    for text, finish_reason, usage in client.stream([{"role": "user", "content": prompt}], a.max_new_tokens,
                                                    mode.temperature, mode.gamma, seed if sampled else None,
                                                    token, mode.sampling if sampled else None):
        if text:
            gaps.tick()
        if text and ttft is None:
            ttft = time.perf_counter() - t0
        if text and progress is not None:
            events += 1
            progress(events)
        if finish_reason:
            finish = finish_reason
        if usage:
            stats = {"generated_tokens": usage["completion_tokens"]}
    return time.perf_counter() - t0, ttft, [], finish, stats, gaps.longest


RUN = f"bench-{os.getpid()}-{time.time_ns()}"  # this run's clients' bearer tokens begin so
_fresh_clients = itertools.count()


def client_token(mode: Mode) -> str:
    """The bearer token of a request of `mode`: one never sent before (--users fresh), or the
    run's one client's."""
    return f"{RUN}-one" if mode.users == "one" else f"{RUN}-{next(_fresh_clients)}"


def run_level(address: str, mode: Mode, level: int, prompt_ids: list[int], a: argparse.Namespace,
              log, api: str = "grpc") -> tuple[list[RequestRecord], float]:
    """`level` threads, one client each (gRPC, or HTTP at `address` = its base URL), drain the
    level's request list; returns (records, wall_s)."""
    from orchestrator.client import Client
    from specdec_tools.bench import PROMPT_SETS, fill_similar

    prompts = PROMPT_SETS[getattr(a, "prompt_set", "fresh")]
    n = requests_for_level(level, a.requests_per_level)
    work: queue.Queue = queue.Queue()
    for i in range(n):
        p = prompt_ids[i % len(prompt_ids)]
        text = prompts[p]
        if getattr(a, "names", None) is not None:  # --prompt-set similar: another name for every request of the run
            text = fill_similar(text, next(a.names))
        work.put((i, p, text))
    records: list[RequestRecord] = []
    lock = threading.Lock()
    clients = [HttpClient(address, a.request_timeout) if api == "http" else Client(address, timeout_s=a.request_timeout)
               for _ in range(level)]
    one = _one_http_request if api == "http" else _one_request
    start = threading.Barrier(level + 1)
    t_level = [0.0]
    # staggered arrivals: client k sends its first request once the first client's first request
    # has k/level of --max-new-tokens (or has ended), so the clients' requests end and join one by
    # one, as a server's users do, not in waves of `level` that a step's difference can regroup
    staggered = getattr(a, "arrivals", "together") == "staggered" and level > 1
    spacing = a.max_new_tokens / level
    joined = [threading.Event() for _ in range(level)]
    joined[0].set()

    def lead_progress(tokens: int) -> None:
        for k in range(1, min(level, int(tokens / spacing) + 1)):
            joined[k].set()

    def release_all() -> None:  # the lead request ended, or nothing is left to send: nobody waits
        for event in joined:
            event.set()

    def worker(thread: int) -> None:
        start.wait()
        if staggered:
            joined[thread].wait()
        first = staggered and thread == 0
        while True:
            try:
                i, p, text = work.get_nowait()
            except queue.Empty:
                release_all()
                return
            t_start = time.perf_counter() - t_level[0]
            rec = RequestRecord(mode.name, level, i, p, thread, round(t_start, 4), 0.0, None, 0, 0.0,
                                temperature=mode.temperature)
            try:
                latency, ttft, ids, finish, stats, rec.longest_gap_s = one(
                    clients[thread], mode, text, a, seed=i + 1, progress=lead_progress if first else None,
                    token=client_token(mode))
                rec.latency_s, rec.ttft_s, rec.token_ids, rec.finish_reason = latency, ttft, ids, finish
                rec.generated_tokens = stats.get("generated_tokens", len(ids))
                rec.tokens_per_s = rec.generated_tokens / latency if latency > 0 else 0.0
                if ttft is not None and rec.generated_tokens > 1:
                    rec.ms_per_token = 1e3 * (latency - ttft) / (rec.generated_tokens - 1)
                rec.drafted_tokens = stats.get("drafted_tokens", 0)
                rec.accepted_tokens = stats.get("accepted_tokens", 0)
                rec.suffix_drafted_tokens = stats.get("suffix_drafted_tokens", 0)
                rec.suffix_accepted_tokens = stats.get("suffix_accepted_tokens", 0)
                for k in ("prompt_tokens", "cached_tokens", "draft_prefill_tokens", "ahead_rounds", "ahead_hits"):
                    setattr(rec, k, stats.get(k, 0))
                rec.rounds = stats.get("rounds", 0)
                rec.sampling, rec.wire_bytes = stats.get("sampling", ""), stats.get("wire_bytes", 0)
                rec.gamma = stats.get("mean_gamma", stats.get("gamma"))  # as the gamma policy chose it
                rec.server_total_s = stats.get("total_s", 0.0)
                for k in ("prefill_s", "draft_s", "verify_s", "draft_compute_s", "verify_compute_s"):
                    setattr(rec, f"server_{k}", stats.get(k, 0.0))
            except Exception as err:  # noqa: BLE001 - recorded, counted, and the run goes on
                rec.latency_s = time.perf_counter() - t_level[0] - t_start
                code = getattr(getattr(err, "code", None), "name", None)
                rec.error = f"{code or type(err).__name__}: {getattr(err, 'message', None) or err}"
                log(f"{mode.name} c={level} request {i}: {rec.error}")
            if first:
                first = False
                release_all()
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(level)]
    for t in threads:
        t.start()
    t_level[0] = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_level[0]
    for c in clients:
        c.close()
    records.sort(key=lambda r: r.request)
    return records, wall


def row_sampling(mode: Mode, records: list[RequestRecord]) -> str:
    """How a row's requests drew: greedy at temperature 0, else as the server's stats say (what
    the requests asked for where the stats say nothing: the HTTP door's)."""
    if mode.temperature == 0:
        return "greedy"
    said = sorted({r.sampling for r in records if r.sampling and not r.error})
    return ",".join(said) if said else mode.sampling or "default"


def _servers(stack, a: argparse.Namespace, links: dict) -> list[tuple[str, float | None, str]]:
    """(setup, link RTT or None, orchestrator address) to run, in order: the stack's own
    orchestrator for the default setup without links, one more orchestrator on the same workers
    for each other setup and link. links gets {rtt: (target link, draft link)}."""
    from specdec_tools.link import DelayLink

    servers = []
    for rtt in a.link_rtt_ms or [None]:
        route: tuple[str, ...] = ()
        if rtt is not None:
            links[rtt] = (DelayLink(f"127.0.0.1:{stack.ports['target']}", rtt),
                          DelayLink(f"127.0.0.1:{stack.ports['draft']}", rtt))
            # a load poll every 30 s, not every 1 s (one worker per pool needs none): the links carry the requests RPCs
            route = ("--target", links[rtt][0].address, "--draft", links[rtt][1].address, "--poll-interval", "30")
        for setup in a.setups:
            if setup == "default" and rtt is None:
                servers.append((setup, rtt, stack.address))
            else:
                servers.append((setup, rtt, stack.add_orchestrator(*setup_flags(setup), *route)))
    return servers


def _link_counts(pair):
    from specdec_tools.link import LinkCounts

    total = LinkCounts()
    for link in pair or ():
        c = link.snapshot()
        total = LinkCounts(total.rpcs + c.rpcs, total.bytes_up + c.bytes_up, total.bytes_down + c.bytes_down)
    return total


def cpu_per_token(cpu: dict[str, float], tokens: int) -> dict:
    """Each role's CPU time (all its processes on this host, every thread) per generated token,
    in ms: where a mode's work goes beside its wall time (a draft that never drafts should cost ~0)."""
    return {f"cpu_{role}_ms_per_token": round(1e3 * s / tokens, 2) for role, s in cpu.items() if tokens}


def busy_shares(cpu: dict[str, float], wall_s: float, hosts: dict[str, str] | None) -> dict:
    """With --hosts, the share of each worker's CPUs its process kept busy over the runs (CPU
    seconds over wall seconds times its CPUs): how much of the time a host of its own worked."""
    from specdec_tools.stack import cpu_count

    if not hosts or wall_s <= 0:
        return {}
    return {f"busy_{role}": round(cpu.get(role, 0.0) / wall_s / cpu_count(hosts[role]), 3) for role in ("target", "draft")}


def link_rates(counts, records: list[RequestRecord]) -> dict:
    """RPCs and bytes that crossed the links (both workers, both ways) per generated token and
    per round of the level's requests."""
    tokens = sum(r.generated_tokens for r in records if not r.error)
    rounds = sum(r.rounds for r in records if not r.error)
    moved = counts.bytes_up + counts.bytes_down
    return {"link_rpcs": counts.rpcs, "link_bytes": moved,
            "rpcs_per_token": _round(counts.rpcs / tokens if tokens else None, 3),
            "rpcs_per_round": _round(counts.rpcs / rounds if rounds else None, 3),
            "bytes_per_token": _round(moved / tokens if tokens else None, 1)}


def _model_dirs(a: argparse.Namespace, tmp: str) -> tuple[str, str, int, dict]:
    """(target dir, draft dir, draft vocabulary, description for summary.json)."""
    if a.tiny:
        from specdec_tools.testing.tiny_models import build_tiny_pair

        return *build_tiny_pair(tmp), 0, {"target": "tiny (seed 1, 2 layers)", "draft": "tiny (perturbed copy)",
                                            "draft_vocab": 0}
    from specdec_tools.stack import DEFAULT_DRAFT_VOCAB

    if a.random:
        from specdec_tools.testing.tiny_models import REAL_SHAPES, build_real_shape_dir

        names = a.random.split("+")
        if len(names) != 2 or not set(names) <= set(REAL_SHAPES):
            raise SystemExit(f"--random: TARGET+DRAFT, each one of {', '.join(REAL_SHAPES)}")
        build = a.device if a.device.startswith("cuda") else "cpu"  # random weights drawn where they will run
        target, draft = (str(build_real_shape_dir(Path(tmp) / f"random-{n}", n, seed=i, device=build))
                         for i, n in enumerate(names))
        return target, draft, DEFAULT_DRAFT_VOCAB, {"target": f"{names[0]} (random weights)",
                                                    "draft": f"{names[1]} (random weights)",
                                                    "draft_vocab": DEFAULT_DRAFT_VOCAB}
    from specdec.model_store import resolve_model

    # fetched and converted here first, so the two workers never race on the cache
    target, draft = str(resolve_model(a.target)), str(resolve_model(a.draft))
    return target, draft, DEFAULT_DRAFT_VOCAB, {"target": a.target, "draft": a.draft, "target_dir": target,
                                                "draft_dir": draft, "draft_vocab": DEFAULT_DRAFT_VOCAB}


RUN_FIELDS = [f for f in RequestRecord.__dataclass_fields__ if f != "token_ids"]


def write_outputs(out: Path, records: list[RequestRecord], rows: list[dict], meta: dict) -> str:
    """runs.csv, summary.csv, summary.json, table.md (printed), serve.png; returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    rounded = ("latency_s", "ttft_s", "tokens_per_s", "server_total_s", "server_prefill_s", "server_draft_s",
               "server_verify_s", "server_draft_compute_s", "server_verify_compute_s", "longest_gap_s")
    report.write_csv(out / "runs.csv", [{k: _round(v) if k in rounded else v for k, v in asdict(r).items()
                                         if k != "token_ids"} for r in records], RUN_FIELDS)
    report.write_csv(out / "summary.csv", rows, list(rows[0]))
    report.write_json(out / "summary.json", {**meta, "levels": rows}, indent=2)
    table = (format_table(rows) + "\n\nWhere a round's time went (ms a round; a round drafts, verifies and emits its "
             "tokens; prefill left out):\n\n" + format_split(rows))
    if meta.get("synthetic_acceptance"):
        table = (f"Synthetic acceptance {meta['synthetic_acceptance']:g} (--synthetic-acceptance: greedy drafts kept "
                 f"by a coin, not by the target; no suffix drafts; random-weight models; {meta['machine'].get('accelerator') or 'CPU'})"
                 f"\n\n{table}")
    report.write_table(out, table)
    if can_plot("serve.png"):
        plot(rows, out / "serve.png", title=f"{meta['models']['target']} + {meta['models']['draft']}")
    return table


def plot(rows: list[dict], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    def line(r):
        return (r.get("api", "grpc"), r.get("setup", "default"), r.get("link_rtt_ms"), r["mode"],
                r.get("temperature", 0.0), r.get("sampling", ""))

    lines = list(dict.fromkeys(map(line, rows)))
    levels = sorted({r["concurrency"] for r in rows})
    for api, setup, rtt, mode, temperature, sampling in lines:
        rs = sorted((r for r in rows if line(r) == (api, setup, rtt, mode, temperature, sampling)),
                    key=lambda r: r["concurrency"])
        label = "speculation on (server gamma)" if mode == "on" else "off (gamma 0)" if mode == "off" else mode
        if temperature:
            label += f", T {temperature:g} {sampling}"
        if setup != "default" or rtt is not None or api != "grpc":
            label += f" [{api} {setup}{'' if rtt is None else f', {rtt:g} ms RTT'}]"
        left.plot([r["concurrency"] for r in rs], [r["aggregate_tok_s"] for r in rs], "o-", label=label)
        pts = [(r["concurrency"], r["latency_p95_s"]) for r in rs if r["latency_p95_s"] is not None]
        right.plot([c for c, _ in pts], [v for _, v in pts], "o-", label=label)
    for ax, ylabel, name in ((left, "aggregate tokens/s", "throughput"), (right, "p95 latency (s)", "latency")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _accelerator(device: str) -> str | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from specdec_tools.bench import PROMPT_SETS, similar_names
    from specdec_tools.link import LinkCounts
    from specdec_tools.stack import ProcessStack

    log = lambda msg: print(f"[bench-serve] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    prompt_ids = parse_prompts(a.prompts, len(PROMPT_SETS[a.prompt_set]))
    a.names = similar_names() if a.prompt_set == "similar" else None  # run_level: another name each request
    modes, levels, out = a.gamma, a.concurrency, Path(a.out)
    # SIGTERM, like Ctrl-C, stops the services (they run in their own sessions)
    main_thread = threading.current_thread() is threading.main_thread()
    saved_term = signal.signal(signal.SIGTERM, signal.default_int_handler) if main_thread else None
    records: list[RequestRecord] = []
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="specdec-bench-serve-") as tmp:
        target_dir, draft_dir, draft_vocab, models = _model_dirs(a, tmp)
        from specdec_tools.stack import free_port

        http_port = free_port() if "http" in a.api else None  # the door of the stack's own orchestrator
        orchestrator_args = ("--http-port", str(http_port)) if http_port else ()
        stack = ProcessStack(target_dir, draft_dir, device=a.device, dtype=a.dtype, draft_vocab=draft_vocab,
                             pass_lock=a.pass_lock == "on", orchestrator_args=orchestrator_args,
                             cores=parse_hosts(a.hosts),
                             prefix_cache=a.prefix_cache == "on", suffix_cache=a.suffix_cache == "on",
                             synthetic_acceptance=a.synthetic_acceptance)
        links: dict[float, tuple] = {}
        try:
            t0 = time.monotonic()
            log(f"starting target, draft and orchestrator ({models['target']} + {models['draft']}) ...")
            stack.start(stdout=subprocess.DEVNULL)
            stack.wait_until_ready(a.startup_timeout)
            # the other setups' orchestrators start once the workers serve (those behind links poll no load)
            servers = [(setup, rtt, address, "grpc") for setup, rtt, address in _servers(stack, a, links)
                       if "grpc" in a.api]
            if http_port:  # beside the gRPC run of the same orchestrator
                servers.insert(1 if servers else 0, ("default", None, f"http://127.0.0.1:{http_port}", "http"))
            if a.second_draft:
                from specdec.model_store import resolve_model
                from specdec_tools.stack import _is_head_dir

                spec = a.second_draft if _is_head_dir(a.second_draft) else str(resolve_model(a.second_draft))
                second = stack.add_orchestrator("--draft", stack.add_draft(spec))
                name = "head" if _is_head_dir(spec) else Path(spec).name
                modes = [*modes, *(Mode(f"{m.name}-{name}", m.gamma, second) for m in modes if m.gamma != 0)]
                models["second_draft"] = a.second_draft
            modes = with_sampling(with_users(modes, a.users), a.temperature, a.sampling_mode)
            stack.start(stdout=subprocess.DEVNULL)
            stack.wait_until_ready(a.startup_timeout)
            log(f"all SERVING after {time.monotonic() - t0:.1f} s ({len(servers)} setups)")
            from orchestrator.client import Client

            for setup, rtt, address, api in servers:
                for server, gamma in dict.fromkeys((m.server, m.gamma) for m in modes):  # one warm-up each
                    with Client(server or (stack.address if api == "http" else address),
                                timeout_s=a.request_timeout) as client:
                        client.generate(messages=[{"role": "user", "content": "warm up"}], max_new_tokens=4,
                                        temperature=0.0, gamma=gamma)  # warm-up
                # the modes of a level side by side, in turn first and last (A B, B A, ...): the
                # machine warming up (or drifting) over the run weighs on each mode alike
                for i, level in enumerate(levels):
                    runs: dict[Mode, dict[str, list]] = {}  # mode -> its rounds' records, walls, tok/s, link counts
                    for turn in range(a.rounds):
                        for mode in (modes if (i + turn) % 2 == 0 else modes[::-1]):
                            warm_up = a.warm_up if a.warm_up != "auto" else "short" if a.device.startswith("cuda") else "off"
                            if turn > 0:  # warmed in the level's first round
                                warm_up = "off"
                            if warm_up == "short":  # the level's shapes once, untimed (the caching
                                # allocator growing, lazy initialisation): `level` requests at once, a few tokens each
                                warm = argparse.Namespace(**{**vars(a), "max_new_tokens": 8, "requests_per_level": level})
                                run_level(mode.server or address, mode, level, prompt_ids, warm, lambda *args: None, api)
                            elif warm_up == "full":  # the whole level once, untimed: the gamma policy's
                                # measurements of this load start before the timed run (its steady state)
                                run_level(mode.server or address, mode, level, prompt_ids, a, lambda *args: None, api)
                            before, cpu = _link_counts(links.get(rtt)), stack.cpu_seconds()
                            recs, wall = run_level(mode.server or address, mode, level, prompt_ids, a, log, api)
                            cpu = {role: s - cpu.get(role, 0.0) for role, s in stack.cpu_seconds().items()}
                            for r in recs:
                                r.setup, r.link_rtt_ms, r.api, r.round = setup, rtt, api, turn
                            records += recs
                            tok_s = summarize_level(recs, wall)["aggregate_tok_s"]
                            run = runs.setdefault(mode, {"recs": [], "walls": [], "tok_s": [], "moved": [], "cpu": {}})
                            run["recs"] += recs
                            for role, used in cpu.items():
                                run["cpu"][role] = run["cpu"].get(role, 0.0) + used
                            run["walls"].append(wall)
                            run["tok_s"].append(tok_s)
                            if rtt is not None:
                                run["moved"].append(_link_counts(links[rtt]) - before)
                            where = "" if setup == "default" and rtt is None and api == "grpc" else \
                                f"[{api} {setup}{'' if rtt is None else f', link {rtt:g} ms'}] "
                            log(f"{where}{mode_label(mode):>4} c={level:<3}"
                                f"{f' round {turn + 1}' if a.rounds > 1 else ''} "
                                f"{len(recs)} requests in {wall:.1f} s: {tok_s:.2f} tok/s aggregate")
                    for mode in modes:
                        run = runs[mode]
                        recs, walls = run["recs"], run["walls"]
                        row = {"api": api, "setup": setup, "link_rtt_ms": rtt, "mode": mode.name, "users": mode.users,
                               "request_gamma": "server default" if mode.gamma is None else mode.gamma,
                               "temperature": mode.temperature, "sampling_mode": mode.sampling or "default",
                               "sampling": row_sampling(mode, recs),
                               "concurrency": level, **summarize_level(recs, sum(walls))}
                        if a.rounds > 1:
                            row["round_tok_s"] = run["tok_s"]
                        row.update(cpu_per_token(run["cpu"], row["generated_tokens"]))
                        row.update(busy_shares(run["cpu"], sum(walls), parse_hosts(a.hosts)))
                        if run["moved"]:
                            row.update(link_rates(sum(run["moved"], LinkCounts()), recs))
                        rows.append(row)
                        log(f"{where}{mode_label(mode):>4} c={level:<3} {row['requests']} requests in "
                            f"{sum(walls):.1f} s: "
                            f"{row['aggregate_tok_s']:.2f} tok/s aggregate, latency p95 "
                            f"{row['latency_p95_s'] or 0:.3f} s, TTFT p95 {row['ttft_p95_s'] or 0:.3f} s"
                            + (f", {row['rpcs_per_token']:.2f} RPCs/token" if "rpcs_per_token" in row else "")
                            + (f", {row['wire_bytes_per_round']:,.0f} wire B/round"
                               if row["wire_bytes_per_round"] is not None else "")
                            + (f", {row['errors']} errors" if row["errors"] else ""))
            order = {(setup, rtt, api): i for i, (setup, rtt, _, api) in enumerate(servers)}
            names = [m.name for m in modes]
            draws = ["default", *a.sampling_mode]  # greedy rows' sampling_mode is default
            # the tables' order: by temperature, sampling mode and mode, then level
            rows.sort(key=lambda r: (order[(r["setup"], r["link_rtt_ms"], r["api"])],
                                     a.temperature.index(r["temperature"]), draws.index(r["sampling_mode"]),
                                     names.index(r["mode"]), levels.index(r["concurrency"])))
        except KeyboardInterrupt:
            log("interrupted; stopping the services")
            return 130
        finally:
            stack.stop()
            for pair in links.values():
                for link in pair:
                    link.stop()
            if main_thread:
                signal.signal(signal.SIGTERM, saved_term)

    add_ratios(rows)
    # greedy outputs are compared where the same prompt is sent again (similar sends each one once)
    greedy = 0 in a.temperature and a.prompt_set != "similar"
    comparison = compare_outputs(records) if greedy else None
    for row in rows:
        row["outputs_differ"] = level_differences(records, row["mode"], row["concurrency"], row["setup"],
                                                  row["link_rtt_ms"]) if greedy and row["temperature"] == 0 else ""
    meta = {
        "machine": report.machine(device=a.device, accelerator=_accelerator(a.device)),
        "synthetic_acceptance": a.synthetic_acceptance or None,
        "models": models,
        "command": report.command_line(),
        "settings": {"setups": {name: list(setup_flags(name)) for name in a.setups}, "link_rtt_ms": a.link_rtt_ms,
                     "links": "delaying TCP proxies (specdec_tools/link.py), no netem on this kernel"
                     if a.link_rtt_ms else None,
                     "apis": a.api, "concurrency": levels, "requests_per_level": {str(c): requests_for_level(c, a.requests_per_level)
                                                                   for c in levels},
                     "max_new_tokens": a.max_new_tokens, "rounds": a.rounds, "modes": [asdict(m) for m in modes],
                     "temperature": a.temperature, "sampling_mode": a.sampling_mode, "prompts": prompt_ids,
                     "users": a.users,
                     "prefix_cache": a.prefix_cache, "suffix_cache": a.suffix_cache, "pass_lock": a.pass_lock,
                     "hosts": a.hosts},
        "outputs": comparison if greedy else "not compared (temperature > 0)" if 0 not in a.temperature
        else "not compared (no prompt is sent twice)",
    }
    if greedy:
        meta["outputs"]["identical"] = not comparison["differ"]
        if any(a.temperature):
            meta["outputs"]["compared"] = "greedy rows only (temperature 0)"
    write_outputs(out, records, rows, meta)
    errors = sum(r["errors"] for r in rows)
    if greedy:
        differ = comparison["differ"]
        print(f"\ngreedy outputs at concurrency > 1 that differ from concurrency 1: {len(differ)} of "
              f"{comparison['checked']} compared" + (f" ({comparison['unchecked']} without a concurrency-1 output "
                                                      "of their prompt)" if comparison["unchecked"] else "")
              + ("" if 1 in levels else " (no concurrency-1 level: nothing to compare)"))
        for d in differ:
            print(f"  differs: mode {d['mode']}, concurrency {d['concurrency']}, request {d['request']}, "
                  f"prompt {d['prompt']}")
    if errors:
        print(f"{errors} requests failed (see runs.csv)")
    log(f"wrote runs.csv, summary.csv, summary.json, table.md, serve.png to {out}")
    return 1 if errors or (greedy and comparison["differ"]) else 0
