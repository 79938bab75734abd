"""`specdec bench methods`: this project's speculative decoding against the alternatives, in one run.

Methods, all on the same two models at the same precision, over the same chat-templated
prompts, one after another in this process (d's services run as child processes meanwhile):
  a  target alone: transformers `generate`
  b  transformers assisted generation (`assistant_model=` the draft, its default schedule)
  c  this project's speculative decoding, in-process (engines called directly)
  d  this project's speculative decoding through the three gRPC services on loopback
Modes (--modes): greedy; sampled (temperature 0.7, top-p 0.95, rejection sampling) and coupled
(the same, coupled sampling: specdec/sampling.py); sampled-t1 and coupled-t1 (temperature 1).
Then a gamma sweep of c.
Writes runs.csv, summary.csv, summary.json, sweep.csv, sweep.png and table.md to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec_tools import can_plot, report

# the prompt sets, data in bench_prompts.json: fresh, answers written from scratch (little to copy
# from the prompt); edit, code edits whose answers re-use most of the prompt's code; similar, a
# batch job's requests, the same kinds of code for different names ({name}, {Name}: see
# similar_names), over similar_nouns
_SETS = json.loads((Path(__file__).with_name("bench_prompts.json")).read_text(encoding="utf-8"))
FRESH, EDIT, SIMILAR, SIMILAR_NOUNS = _SETS["fresh"], _SETS["edit"], _SETS["similar"], _SETS["similar_nouns"]


def similar_names():
    """An endless run of distinct names (invoice, customer, ..., then invoice_2, ...): every request
    of a `similar` benchmark asks for another name."""
    for round_ in itertools.count(1):
        for noun in SIMILAR_NOUNS:
            yield noun if round_ == 1 else f"{noun}_{round_}"


def fill_similar(template: str, name: str) -> str:
    return template.format(name=name, Name="".join(part.capitalize() for part in name.split("_")))


# long prompts (~600 tokens, as a chat with history or a retrieved context): each code edit asked
# below the code of all six, so that a prompt's prefill takes seconds on a CPU while other
# requests decode
_CONTEXT = "Here is some of our code, for context:\n\n" + "\n\n".join(p[p.index("```"):] for p in EDIT)
LONG = [f"{_CONTEXT}\n\nNow the task. {p}" for p in EDIT]
PROMPT_SETS = {"fresh": FRESH, "edit": EDIT, "similar": SIMILAR, "long": LONG}
PROMPTS = FRESH
MODES = {  # sampled requests carry a seed: each names how it draws (coupled is the server's default with a seed)
    "greedy": dict(temperature=0.0, top_p=1.0),
    "sampled": dict(temperature=0.7, top_p=0.95, sampling_mode="rejection"),
    "coupled": dict(temperature=0.7, top_p=0.95, sampling_mode="coupled"),
    "sampled-t1": dict(temperature=1.0, top_p=1.0, sampling_mode="rejection"),
    "coupled-t1": dict(temperature=1.0, top_p=1.0, sampling_mode="coupled"),
}
METHODS = {"a": "target alone (generate)", "b": "HF assisted generation", "c": "specdec in-process",
           "d": "specdec over gRPC"}


@dataclass
class Run:
    method: str
    mode: str
    prompt: int
    new_tokens: int
    seconds: float
    tokens: list[int] = field(repr=False, default_factory=list)
    stats: dict = field(default_factory=dict)  # from specdec (c, d)


def hf_generate(model, prompt_ids, mode, max_new, seed, assistant=None) -> tuple[list[int], float]:
    kw = dict(max_new_tokens=max_new, top_k=None)
    if MODES[mode]["temperature"] == 0:
        kw.update(do_sample=False, temperature=None, top_p=None)
    else:
        kw.update(do_sample=True, temperature=MODES[mode]["temperature"], top_p=MODES[mode]["top_p"])
    if assistant is not None:
        kw["assistant_model"] = assistant
    torch.manual_seed(seed)
    ids = torch.tensor([prompt_ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0


def specdec_request(prompt_ids, mode, max_new, seed, gamma) -> dict:
    return dict(token_ids=prompt_ids, max_new_tokens=max_new, seed=seed, gamma=gamma, **MODES[mode])


def summarize(runs: list[Run], method: str, mode: str, baseline_tps: float | None, reference: dict) -> dict:
    rs = [r for r in runs if r.method == method and r.mode == mode]
    tokens, secs = sum(r.new_tokens for r in rs), sum(r.seconds for r in rs)
    row = {"method": method, "name": METHODS[method], "mode": mode, "prompts": len(rs), "new_tokens": tokens,
           "seconds": round(secs, 2), "tokens_per_s": round(tokens / secs, 3) if secs else 0.0}
    row["ratio_to_a"] = round(row["tokens_per_s"] / baseline_tps, 3) if baseline_tps else None
    if mode == "greedy" and reference:
        row["same_tokens_as_a"] = f"{sum(r.tokens == reference.get(r.prompt) for r in rs)}/{len(rs)}"
    if MODES[mode].get("sampling_mode") == "coupled" and method in ("c", "d") and reference:
        # coupled: the seed's own answer is plain target decoding with it (reference: gamma 0)
        row["same_tokens_as_gamma_0"] = f"{sum(r.tokens == reference.get(r.prompt) for r in rs)}/{len(rs)}"
    st = [r.stats for r in rs if r.stats]
    if st:
        total = lambda k: sum(s[k] for s in st)  # noqa: E731
        drafted, rounds = total("drafted_tokens"), total("rounds")
        row["acceptance_rate"] = round(total("accepted_tokens") / drafted, 3) if drafted else 0.0
        row["mean_accepted_length"] = round(total("generated_tokens") / rounds, 3) if rounds else 0.0
        width = max(len(s["drafted_by_position"]) for s in st)
        by_pos = []
        for i in range(width):
            d = sum(s["drafted_by_position"][i] for s in st if i < len(s["drafted_by_position"]))
            a = sum(s["accepted_by_position"][i] for s in st if i < len(s["accepted_by_position"]))
            by_pos.append(round(a / d, 3) if d else 0.0)
        row["acceptance_by_position"] = by_pos
        row["wire_bytes_per_round"] = round(total("wire_bytes") / rounds, 1) if rounds else 0.0
        row["target_passes"] = total("target_forward_passes")
        network = (total("draft_s") - total("draft_compute_s")) + (total("verify_s") - total("verify_compute_s"))
        client_hop = secs - total("total_s") if method == "d" else 0.0
        row["time_s"] = {
            "prefill": round(total("prefill_s"), 2),
            "draft": round(total("draft_compute_s"), 2),
            "verify": round(total("verify_compute_s"), 2),
            "sampling": round(total("sampling_s"), 3),
            "network_and_rpc": round(network + client_hop, 2),
        }
    return row


def format_table(rows: list[dict]) -> str:
    head = ["mode", "method", "tok/s", "vs a", "same tokens", "acceptance", "tokens/round", "by position",
            "wire B/round", "draft s", "verify s", "sampling s", "network s"]
    return report.markdown_table(head, (
        [r["mode"], f"{r['method']}: {r['name']}", f"{r['tokens_per_s']:.2f}", f"{r['ratio_to_a'] or 0:.2f}x",
         r.get("same_tokens_as_a", "") or _gamma0(r), r.get("acceptance_rate", ""), r.get("mean_accepted_length", ""),
         " ".join(f"{x:.2f}" for x in r.get("acceptance_by_position", [])), r.get("wire_bytes_per_round", "")]
        + [r.get("time_s", {}).get(k, "") for k in ("draft", "verify", "sampling", "network_and_rpc")] for r in rows))


def _gamma0(row: dict) -> str:
    return f"{row['same_tokens_as_gamma_0']} as gamma 0" if "same_tokens_as_gamma_0" in row else ""


def plot_sweep(sweep: list[dict], baseline: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax1 = plt.subplots(figsize=(7, 4.2))
    for mode, color in (("greedy", "tab:blue"), ("sampled", "tab:orange")):
        pts = [s for s in sweep if s["mode"] == mode]
        if not pts:
            continue
        ax1.plot([s["gamma"] for s in pts], [s["tokens_per_s"] for s in pts], "o-", color=color,
                 label=f"tokens/s, {mode}")
        if mode in baseline:
            ax1.axhline(baseline[mode], color=color, ls=":", lw=1, label=f"target alone, {mode}")
    ax1.set_xlabel("gamma (drafts per round)")
    ax1.set_ylabel("tokens / s")
    ax2 = ax1.twinx()
    for mode, color in (("greedy", "tab:green"), ("sampled", "tab:red")):
        pts = [s for s in sweep if s["mode"] == mode]
        if pts:
            ax2.plot([s["gamma"] for s in pts], [s["acceptance_rate"] for s in pts], "s--", color=color,
                     label=f"acceptance, {mode}")
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1)
    h1, l1 = ax1.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax1.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower right")
    ax1.set_title("specdec in-process: speed and acceptance against gamma")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cmd_bench(a: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    from draft_service.engine import DraftEngine
    from orchestrator.client import Client
    from orchestrator.decoder import SpeculativeDecoder
    from specdec.protocol import GenerationRequest
    from specdec.modeling import load_model, quantize, resolve_quantization
    from specdec.model_store import resolve_model
    from specdec_tools.stack import ProcessStack
    from specdec.worker.runner import new_model_thread
    from target_service.engine import TargetEngine

    out = report.out_dir(a.out)
    methods = [m for m in a.methods.split(",") if m]
    modes = [m for m in a.modes.split(",") if m]
    prompts = PROMPT_SETS[a.prompt_set][: a.prompts]
    log = lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    target_dir, draft_dir = str(resolve_model(a.target)), str(resolve_model(a.draft))
    log(f"loading models (quantization {a.quantize}, draft vocabulary {a.draft_vocab or 'all'})")
    model_thread = new_model_thread()  # as orchestrator.local does: one OpenMP team for both
    target = TargetEngine(load_model(target_dir, quantization=a.quantize), model_thread=model_thread)
    draft = DraftEngine(load_model(draft_dir, quantization=a.quantize, head_rows=a.draft_vocab, role="draft"),
                        model_thread=model_thread)
    decoder = SpeculativeDecoder(target, draft, tokenizer=target.tokenizer)
    tok = target.tokenizer
    encode = lambda p: tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,  # noqa: E731
                                                   add_generation_prompt=True), add_special_tokens=False).input_ids
    prompt_ids = [encode(p) for p in prompts]
    assistant = None
    if "b" in methods:  # HF's assistant needs the draft's full output head
        assistant = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
        quantize(assistant, resolve_quantization(a.quantize, "cpu", torch.float32, "draft"))
    stack = None
    if "d" in methods:
        stack = ProcessStack(target_dir, draft_dir, quantization=a.quantize, draft_vocab=a.draft_vocab).start()
        stack.wait_until_ready(1800)
    client = Client(stack.address) if stack else None

    runs: list[Run] = []
    gamma0: dict[tuple[str, int], list[int]] = {}  # coupled modes: the seed's answer at gamma 0, in-process
    try:
        # warm-up: first passes allocate and pack weights
        decoder.generate(GenerationRequest(token_ids=prompt_ids[0], max_new_tokens=8, temperature=0, gamma=a.gamma))
        if a.ablation:
            from orchestrator.proposers.ngram import NgramDraft

            drafts = {"ngram": NgramDraft()}
            for q in ("fp16", "int8"):
                drafts[q] = draft if draft.loaded.quantization == q else DraftEngine(
                    load_model(draft_dir, quantization=q, head_rows=a.draft_vocab), model_thread=model_thread)
            sets = {name: [encode(p) for p in PROMPT_SETS[name][: a.prompts]] for name in a.ablation.split(",")}
            ablation = run_ablation(a, target, drafts, sets, modes, log)
            report.write_table(out, f"{a.prompts} prompts per set, {a.max_new_tokens} new tokens, p_min {a.p_min}"
                               f"\n\n{format_ablation(ablation)}", "ablation.md")
            report.write_csv(out / "ablation.csv", ablation)
        if client:
            client.generate(token_ids=prompt_ids[0], max_new_tokens=8, temperature=0, gamma=a.gamma)
        for mode in modes:
            for i, ids in enumerate(prompt_ids):
                seed = 1000 + i
                for m in methods:
                    if m in ("a", "b"):
                        toks, secs = hf_generate(target.model, ids, mode, a.max_new_tokens, seed,
                                                 assistant if m == "b" else None)
                        runs.append(Run(m, mode, i, len(toks), secs, toks))
                    elif m == "c":
                        t0 = time.perf_counter()
                        r = decoder.generate(GenerationRequest(**specdec_request(ids, mode, a.max_new_tokens, seed, a.gamma)))
                        runs.append(Run(m, mode, i, len(r.token_ids), time.perf_counter() - t0, r.token_ids, r.stats))
                    elif m == "d":
                        t0 = time.perf_counter()
                        r = client.generate(**specdec_request(ids, mode, a.max_new_tokens, seed, a.gamma))
                        runs.append(Run(m, mode, i, len(r.token_ids), time.perf_counter() - t0, r.token_ids, r.stats))
                    last = runs[-1]
                    log(f"{mode} prompt {i} {m}: {last.new_tokens} tokens, {last.new_tokens / last.seconds:.2f} tok/s")
                if MODES[mode].get("sampling_mode") == "coupled" and {"c", "d"} & set(methods):
                    gamma0[mode, i] = decoder.generate(GenerationRequest(
                        **specdec_request(ids, mode, a.max_new_tokens, seed, 0))).token_ids
    finally:
        if client:
            client.close()
        if stack:
            stack.stop()

    rows, baseline = [], {}
    for mode in modes:
        reference = {r.prompt: r.tokens for r in runs if r.method == "a" and r.mode == mode}
        if MODES[mode].get("sampling_mode") == "coupled":
            reference = {i: toks for (m, i), toks in gamma0.items() if m == mode}
        base = summarize(runs, "a", mode, None, {})["tokens_per_s"] if "a" in methods else None
        baseline[mode] = base
        rows += [summarize(runs, m, mode, base, reference) for m in methods]
    header = (f"{len(prompts)} prompts, {a.max_new_tokens} new tokens, gamma {a.gamma}, quantization {a.quantize}, "
              f"draft vocabulary {a.draft_vocab or 'all'}, torch threads {torch.get_num_threads()}")
    config = {k: v for k, v in vars(a).items() if k != "func"}
    write_results(out, header, config, runs, rows, [], baseline)  # kept even if the sweep is cut short
    print(f"{header}\n{format_table(rows)}", flush=True)

    sweep = []
    gammas = [int(g) for g in a.sweep.split(",") if g] if a.sweep else []
    for mode in modes if gammas else []:
        for g in gammas:
            recs = []
            for i, ids in enumerate(prompt_ids[: a.sweep_prompts]):
                t0 = time.perf_counter()
                r = decoder.generate(GenerationRequest(**specdec_request(ids, mode, a.max_new_tokens, 1000 + i, g)))
                recs.append(Run("c", mode, i, len(r.token_ids), time.perf_counter() - t0, r.token_ids, r.stats))
            s = summarize(recs, "c", mode, None, {})
            sweep.append({"mode": mode, "gamma": g, "tokens_per_s": s["tokens_per_s"],
                          "acceptance_rate": s["acceptance_rate"], "mean_accepted_length": s["mean_accepted_length"]})
            log(f"sweep {mode} gamma {g}: {s['tokens_per_s']:.2f} tok/s, acceptance {s['acceptance_rate']:.2f}")
    if sweep:
        write_results(out, header, config, runs, rows, sweep, baseline)
    print(f"\nresults in {out}/")
    return 0


# The ablation ladder: each rung adds one technique to the one above it, so each gain is
# attributed; all run in-process (method c) in one run, on the same prompts and seeds.
# (label, draft, request gamma, gamma policy, DraftOptions fields)
LADDER = [
    ("target only (gamma 0)", None, 0, "fixed", {}),
    ("gamma 4, fp16 draft", "fp16", 4, "fixed", {}),
    ("+ int8 draft", "int8", 4, "fixed", {}),
    ("+ confidence stop", "int8", 4, "fixed", {"p_min": "P_MIN"}),
    ("+ lookup checked by the draft", "int8", 4, "fixed", {"p_min": "P_MIN", "lookup": 4}),
    ("+ gamma from live costs (max 4)", "int8", 4, "goodput", {"p_min": "P_MIN", "lookup": 4}),
    ("  ... max 8", "int8", 8, "goodput", {"p_min": "P_MIN", "lookup": 4}),
    ("n-gram draft only (no model)", "ngram", 8, "goodput", {}),
]


def run_ablation(a, target, drafts: dict, prompt_sets: dict, modes: list[str], log) -> list[dict]:
    """Runs every LADDER rung over every prompt set and mode; returns one row per (set, mode, rung)."""
    from orchestrator.decoder import SpeculativeDecoder
    from orchestrator.gamma import GammaPolicy
    from specdec.protocol import GenerationRequest
    from specdec.wire import DraftOptions

    rows = []
    for set_name, ids_list in prompt_sets.items():
        for mode in modes:
            base = None
            reference = None
            for label, draft_kind, gamma, policy, opts in LADDER:
                options = DraftOptions(**{k: (a.p_min if v == "P_MIN" else v) for k, v in opts.items()})
                decoder = SpeculativeDecoder(target, drafts[draft_kind] if draft_kind else None,
                                             tokenizer=target.tokenizer, draft_options=options,
                                             gamma_policy=GammaPolicy(adaptive=policy == "goodput"))
                recs = []
                for i, ids in enumerate(ids_list):
                    t0 = time.perf_counter()
                    r = decoder.generate(GenerationRequest(**specdec_request(ids, mode, a.max_new_tokens, 1000 + i,
                                                                             gamma if draft_kind else 0)))
                    recs.append(Run("c", mode, i, len(r.token_ids), time.perf_counter() - t0, r.token_ids, r.stats))
                s = summarize(recs, "c", mode, base, reference or {})
                if base is None:
                    base, reference = s["tokens_per_s"], {r.prompt: r.tokens for r in recs}
                st = [r.stats for r in recs]
                drafted = sum(x["drafted_tokens"] for x in st)
                row = {"prompts": set_name, "mode": mode, "config": label, "tokens_per_s": s["tokens_per_s"],
                       "vs_gamma_0": s["ratio_to_a"] or 1.0, "same_tokens": s.get("same_tokens_as_a", ""),
                       "acceptance_rate": s.get("acceptance_rate", 0.0),
                       "tokens_per_round": s.get("mean_accepted_length", 1.0),
                       "drafts_per_round": round(drafted / max(1, sum(x["rounds"] for x in st)), 2),
                       "draft_s": s.get("time_s", {}).get("draft", 0.0),
                       "verify_s": s.get("time_s", {}).get("verify", 0.0)}
                rows.append(row)
                log(f"ablation {set_name} {mode} {label}: {row['tokens_per_s']:.2f} tok/s ({row['vs_gamma_0']:.2f}x), "
                    f"{row['drafts_per_round']} drafts/round, acceptance {row['acceptance_rate']}")
    return rows


def format_ablation(rows: list[dict]) -> str:
    head = ["prompts", "mode", "configuration", "tok/s", "vs gamma 0", "greedy = gamma 0", "drafts/round", "acceptance",
            "tokens/round", "draft s", "verify s"]
    return report.markdown_table(head, ([r["prompts"], r["mode"], r["config"], f"{r['tokens_per_s']:.2f}",
                                         f"{r['vs_gamma_0']:.2f}x", r["same_tokens"], r["drafts_per_round"],
                                         r["acceptance_rate"], r["tokens_per_round"], r["draft_s"], r["verify_s"]]
                                        for r in rows))


def write_results(out: Path, header: str, config: dict, runs: list[Run], rows: list[dict], sweep: list[dict],
                  baseline: dict) -> None:
    report.write_json(out / "summary.json", {"config": config, "summary": rows, "sweep": sweep})
    report.write_csv(out / "runs.csv", [
        {"method": r.method, "mode": r.mode, "prompt": r.prompt, "new_tokens": r.new_tokens, "seconds": round(r.seconds, 3),
         "tokens_per_s": round(r.new_tokens / r.seconds, 3), **{k: r.stats.get(k, "") for k in (
             "acceptance_rate", "rounds", "wire_bytes")}} for r in runs])
    report.write_csv(out / "summary.csv", [{**{k: v for k, v in r.items() if k != "time_s"},
                                            **{f"time_{k}_s": v for k, v in r.get("time_s", {}).items()}} for r in rows])
    table = header + "\n\n" + format_table(rows) + "\n"
    if sweep:
        report.write_csv(out / "sweep.csv", sweep)
        if can_plot("sweep.png"):
            plot_sweep(sweep, baseline, out / "sweep.png")
        table += "\n" + report.markdown_table(["mode", "gamma", "tok/s", "acceptance", "tokens/round"], (
            [s["mode"], s["gamma"], f"{s['tokens_per_s']:.2f}", f"{s['acceptance_rate']:.2f}",
             f"{s['mean_accepted_length']:.2f}"] for s in sweep)) + "\n"
    (out / "table.md").write_text(table)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec_tools.stack import DEFAULT_DRAFT_VOCAB

    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many prompts of each set")
    p.add_argument("--prompt-set", default="fresh", choices=["fresh", "edit"],
                   help="fresh: code written from scratch; edit: code edits that re-use the prompt's code")
    p.add_argument("--ablation", default="", help="prompt sets (e.g. fresh,edit) for the ablation ladder, in-process: "
                   "each technique added to the one before ('' to skip)")
    p.add_argument("--p-min", type=float, default=0.3, help="the ablation's confidence stop")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--methods", default="a,b,c,d", help="comma-separated subset of a,b,c,d")
    p.add_argument("--modes", default="greedy,sampled")
    p.add_argument("--quantize", default="auto", choices=["auto", "none", "fp16", "int8", "int8-rows", "int4-rows", "q4k-rows"])
    p.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB)
    p.add_argument("--sweep", default="1,2,3,4,5,6,7,8", help="gammas for the sweep of c ('' to skip)")
    p.add_argument("--sweep-prompts", type=int, default=4)
    report.add_out_argument(p, "")
