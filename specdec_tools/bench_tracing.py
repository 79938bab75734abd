"""Benchmark: what tracing and metrics cost.

  specdec bench tracing [--target M --draft M | --tiny] [--requests 6] [--max-new-tokens 64] [--repeats 2]

Two measurements, side by side in one run:
1. The three services as processes (as `specdec run` starts them), telemetry off, then on, in
   alternation: on = every span exported through the console exporter (serialised to JSON, sent
   to /dev/null) plus metrics on the Prometheus endpoint. The same greedy requests each time;
   the outputs must be identical. Reported: tok/s of each mode and the ratio, and per round the
   model compute (as the workers time it) and the overhead around it (RPC, serialisation,
   Python, telemetry): tok/s moves a few % with this machine's noise in compute, the overhead
   is where telemetry's own cost shows.
2. Telemetry off, in isolation: the per-round instrumentation (five no-op spans, the metric
   calls) timed in a loop, in microseconds per round, to compare with a round's duration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a Python generator is, with a short example.",
    "Write a function that merges two sorted lists.",
    "How do I read a CSV file with the csv module?",
    "Write a binary search in Python.",
    "What does the `with` statement do in Python?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET

    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--tiny", action="store_true",
                   help="tiny random models (specdec_tools.testing, no downloads): worst case, "
                        "rounds of a few ms make the overhead most visible")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="off/on alternations")
    p.add_argument("--startup-timeout", type=float, default=1800.0)


def noop_round_cost_us(rounds: int = 20000) -> float:
    """Microseconds the telemetry-off instrumentation adds to one round (loop cost subtracted)."""
    from opentelemetry import trace

    from orchestrator.metrics import DecodingMetrics
    from specdec.telemetry import Telemetry

    tel = Telemetry.off()
    tracer, metrics = tel.tracer, DecodingMetrics(tel.meter)
    ctx = trace.set_span_in_context(tracer.start_span("request"))

    def instrumented():
        with tracer.start_as_current_span("round", context=ctx) as span:
            for name in ("draft", "verify", "rejection_sampling", "rollback"):
                with tracer.start_as_current_span(name):
                    pass
            span.set_attributes({"a": 1, "b": 2})
        metrics.record_round(4, 3, 0.1, 0.1, 0.001, 500)

    def bare():
        pass

    def timed(fn):
        t0 = time.perf_counter()
        for _ in range(rounds):
            fn()
        return time.perf_counter() - t0

    return (min(timed(instrumented) for _ in range(3)) - min(timed(bare) for _ in range(3))) / rounds * 1e6


def _run_mode(target_dir, draft_dir, a, telemetry_on: bool) -> tuple[float, list[list[int]], dict]:
    """Starts the stack, runs the requests; returns (tok/s, outputs, per-round ms by part)."""
    from orchestrator.client import Client
    from specdec_tools.stack import ProcessStack

    saved = {k: os.environ.get(k) for k in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER",
                                            "OTEL_EXPORTER_PROMETHEUS_PORT", "OTEL_EXPORTER_PROMETHEUS_HOST")}
    os.environ.update({"OTEL_TRACES_EXPORTER": "console" if telemetry_on else "none",
                       "OTEL_METRICS_EXPORTER": "prometheus" if telemetry_on else "none",
                       "OTEL_EXPORTER_PROMETHEUS_PORT": "0", "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1"})
    stack = ProcessStack(target_dir, draft_dir, draft_vocab=0 if a.tiny else 32768)
    try:
        stack.start(stdout=subprocess.DEVNULL)  # the console exporter's JSON goes to /dev/null
        stack.wait_until_ready(a.startup_timeout)
        outputs, tokens, seconds, rounds = [], 0, 0.0, 0
        parts = dict.fromkeys(("draft_compute_s", "verify_compute_s", "draft_s", "verify_s", "sampling_s"), 0.0)
        with Client(stack.address, timeout_s=600) as client:
            client.generate(prompt="warm up", max_new_tokens=4, temperature=0, gamma=a.gamma)
            for prompt in PROMPTS[: a.requests]:
                r = client.generate(prompt=prompt, max_new_tokens=a.max_new_tokens, temperature=0, gamma=a.gamma)
                outputs.append(r.token_ids)
                tokens += r.stats["generated_tokens"]
                seconds += r.stats["total_s"]
                rounds += r.stats["rounds"]
                seconds_decoding = r.stats["total_s"] - r.stats["prefill_s"]
                parts["total_s"] = parts.get("total_s", 0.0) + seconds_decoding
                for k in parts:
                    if k != "total_s":
                        parts[k] += r.stats[k]
        per_round_ms = {k.removesuffix("_s"): v / rounds * 1e3 for k, v in parts.items()}
        # what is neither model compute nor sampling: RPC, serialisation, network, Python around them
        per_round_ms["overhead"] = per_round_ms["total"] - per_round_ms["draft_compute"] - \
            per_round_ms["verify_compute"] - per_round_ms["sampling"]
        return tokens / seconds, outputs, per_round_ms
    finally:
        stack.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cmd_bench_tracing(a: argparse.Namespace) -> int:
    if a.tiny:
        from specdec_tools.testing.tiny_models import build_tiny_pair

        target_dir, draft_dir = build_tiny_pair(tempfile.mkdtemp(prefix="specdec-tiny-"))
    else:
        from specdec.model_store import resolve_model

        target_dir, draft_dir = str(resolve_model(a.target)), str(resolve_model(a.draft))
    rates = {False: [], True: []}
    rounds_ms = {False: [], True: []}
    reference = None
    for repeat in range(a.repeats):
        for on in (False, True):
            rate, outputs, per_round = _run_mode(target_dir, draft_dir, a, on)
            rates[on].append(rate)
            rounds_ms[on].append(per_round)
            reference = reference or outputs
            same = outputs == reference
            print(f"[bench-tracing] repeat {repeat + 1}, telemetry {'on ' if on else 'off'}: {rate:.2f} tok/s, "
                  f"outputs {'identical' if same else 'DIFFER'}; ms per round: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in per_round.items()), file=sys.stderr)
            if not same:
                return 1
    noop_us = noop_round_cost_us()
    mean_round = statistics.mean(r["total"] for r in rounds_ms[False]) / 1e3
    for mode in (False, True):
        keys = rounds_ms[mode][0].keys()
        print(f"telemetry {'on ' if mode else 'off'}, ms per round: "
              + ", ".join(f"{k} {statistics.mean(r[k] for r in rounds_ms[mode]):.1f}" for k in keys))
    off, on = statistics.mean(rates[False]), statistics.mean(rates[True])
    print(f"telemetry off: {off:.2f} tok/s   on (console spans + Prometheus): {on:.2f} tok/s   "
          f"on/off: {on / off:.3f}")
    print(f"telemetry off, instrumentation alone: {noop_us:.1f} us per round = "
          f"{noop_us / (mean_round * 1e6):.3%} of a {mean_round * 1e3:.1f} ms round here")
    return 0
