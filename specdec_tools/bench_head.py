"""`specdec bench head`: what a feature head's draft step costs next to a target pass (c).

In one process, through the workers' own engines (their sessions, their ragged passes), on one
thread pool: the target's step (a Verify of one row per session, no drafts) and a feature
head's step (a Propose of one draft per session), at 1 and more sessions, each session holding
--cached tokens. The head has the shape EAGLE-3 heads for the target have (one decoder layer of
the target's width, a --draft-vocab output head) and random weights: its speed, not its
acceptance. The 0.5B-class model draft is timed beside it where --draft names one.

c = the head's pass seconds / the target's pass seconds (the model alone: what the gamma policy
fits), with the calls' seconds beside them (the engine's work around the pass too): the median
over --rounds rounds, each timing every step (its median of --repeats) in turn, the order
reversed from round to round. Writes table.md to --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec_tools import report


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.model_store import DEFAULT_TARGET

    p.add_argument("--target", default=DEFAULT_TARGET, help="the target: a model spec (the default pair's target)")
    p.add_argument("--draft", default="", help="also time this model draft's step (e.g. the default pair's draft)")
    p.add_argument("--head", default="", help="a head directory (default: a random head of the target's shape)")
    p.add_argument("--modes", default="none,int8-rows,q4k-rows", help="the head's quantizations to time")
    p.add_argument("--draft-vocab", type=int, default=32000, help="the random head's output rows (EAGLE-3: 32k)")
    p.add_argument("--sessions", default="1,4,16", help="sessions in one step")
    p.add_argument("--cached", type=int, default=200, help="tokens each session holds before the timed steps")
    p.add_argument("--repeats", type=int, default=8, help="steps timed a round (their median)")
    p.add_argument("--rounds", type=int, default=5, help="rounds over every step, alternating the order")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (on CUDA the target replays captured graphs)")
    p.add_argument("--dtype", default="auto", help="auto: float32 on CPU (quantized by --modes), bfloat16 on CUDA")
    report.add_out_argument(p, "head-")


def _random_head(target_path: Path, out: Path, draft_vocab: int) -> Path:
    from transformers import AutoConfig

    from specdec_tools.testing.tiny_models import build_head_dir

    config = AutoConfig.from_pretrained(target_path).get_text_config(decoder=True)
    layers = config.num_hidden_layers  # EAGLE-3's low, middle and high layers; a tiny target's own where it has few
    feature_layers = (2, layers // 2, layers - 3) if layers >= 6 else (0, layers // 2, layers - 1)
    return build_head_dir(out, target_hidden=config.hidden_size, target_vocab=config.vocab_size, seed=0,
                          feature_layers=feature_layers,
                          heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                          intermediate=config.intermediate_size, draft_vocab=draft_vocab, std=0.02,
                          rope_theta=float(getattr(config, "rope_theta", 10000.0) or 10000.0))


def _time(step, repeats: int) -> tuple[float, float]:
    """(median pass seconds, median call seconds) of step() -> pass seconds, after one warm-up."""
    step()
    passes, calls = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        passes.append(step())
        calls.append(time.perf_counter() - t0)
    return statistics.median(passes), statistics.median(calls)


def _target_step(engine, ids: list[str], length: int):
    from specdec.protocol import SamplingParams
    from specdec.wire import VerifyCall

    greedy = SamplingParams(temperature=0)

    def step() -> float:  # one row a session, rolled back after: every repeat is the same step
        results = engine.verify_batch([VerifyCall(s, length - 1, [7], [], greedy) for s in ids])
        return results[0].pass_s
    return step


def _draft_step(engine, ids: list[str], length: int, features):
    from specdec.protocol import SamplingParams
    from specdec.wire import ProposeCall

    greedy = SamplingParams(temperature=0)

    turn = [0]

    def step() -> float:  # the last token replaced (7 and 8 in turn: a model draft then holds no proposal
        turn[0] += 1  # for it), then one draft
        results = engine.propose_batch([ProposeCall(s, length - 1, [7 + turn[0] % 2], 1, greedy, 0,
                                                    features=features) for s in ids])
        return results[0][-1].pass_s
    return step


def cmd_bench_head(a: argparse.Namespace) -> int:
    from draft_service.engine import DraftEngine
    from specdec.modeling import load_model, resolve_model_dir
    from specdec.wire import Features
    from specdec_tools.stack import DEFAULT_DRAFT_VOCAB
    from target_service.engine import TargetEngine

    log = lambda msg: print(f"[bench-head] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    out = report.out_dir(a.out, "head-")
    sessions = [int(s) for s in a.sessions.split(",")]
    most = max(sessions)
    ids = [f"s{i}" for i in range(most)]
    log(f"loading the target {a.target}")
    target = TargetEngine(load_model(a.target, device=a.device, dtype=a.dtype), max_sessions=most + 1)
    high = min(5000, target.vocab_size)  # ordinary token ids (a tiny model's vocabulary is smaller)
    prompt = [int(t) for t in torch.randint(min(100, high // 2), high, (a.cached,),
                                            generator=torch.Generator().manual_seed(1))]
    for s in ids:
        target.open_session(s, prompt)
    steps = {("target pass", n): _target_step(target, ids[:n], a.cached) for n in sessions}
    engines = [target]
    with tempfile.TemporaryDirectory() as tmp:
        head = a.head or str(_random_head(resolve_model_dir(a.target), Path(tmp) / "head", a.draft_vocab))
        where = dict(device=a.device, dtype=a.dtype)
        modes = a.modes.split(",") if a.device == "cpu" else ["none"]
        loads = [(f"head, {mode}", lambda mode=mode: load_model(head, role="draft", quantization=mode,
                                                                target_model=a.target, **where)) for mode in modes]
        if a.draft:  # as served: its 32k most common ids
            loads.append((f"draft {a.draft}", lambda: load_model(a.draft, role="draft", head_rows=DEFAULT_DRAFT_VOCAB,
                                                                 **where)))
        for name, load in loads:
            log(f"loading {name}")
            engine = DraftEngine(load(), max_sessions=most + 1)
            engines.append(engine)
            width = engine.info.feature_size
            for s in ids:  # each session holds the prompt (a head: with the target's features, random here)
                engine.open_session(s, prompt[:1] if width else prompt)
                catch_up = Features(0, torch.randn(a.cached - 1, width)) if width else None
                list(engine.propose(s, 1, prompt[1:], 1, _greedy(), 0, features=catch_up))
            features = Features(a.cached - 2, torch.randn(1, width)) if width else None
            steps.update({(name, n): _draft_step(engine, ids[:n], a.cached, features) for n in sessions})
    times: dict[tuple[str, int], list[tuple[float, float]]] = {key: [] for key in steps}
    keys = list(steps)
    for r in range(a.rounds):  # every step in turn, the order reversed each round: drift weighs on all alike
        for key in keys if r % 2 == 0 else keys[::-1]:
            times[key].append(_time(steps[key], a.repeats))
        log(f"round {r + 1} of {a.rounds} done")
    for engine in engines:
        engine.close()
    rows = [(name, n, statistics.median(p for p, _ in times[(name, n)]),
             statistics.median(c for _, c in times[(name, n)])) for name, n in keys]
    target_pass = {n: p for name, n, p, _ in rows if name == "target pass"}
    table = report.markdown_table(["step", "sessions", "pass ms", "call ms", "c (pass / target pass)"], (
        [name, n, f"{p * 1e3:.2f}", f"{c * 1e3:.2f}", f"{p / target_pass[n]:.3f}"] for name, n, p, c in rows)) + "\n"
    report.write_table(out, table)
    log(f"wrote {out / 'table.md'}")
    return 0


def _greedy():
    from specdec.protocol import SamplingParams

    return SamplingParams(temperature=0)
