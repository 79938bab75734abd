"""`specdec bench-coupling`: what coupled sampling costs in acceptance, position by position.

End-to-end benchmarks (`specdec bench --modes sampled,coupled,...`) compare different texts: a
coupled and a rejection-sampled request write different answers, so their acceptance rates mix
the method with the text. Here both are measured on the same contexts. The target writes each
prompt's answer (greedy); at every position of it, under each sampling setting, from the target's
p and the draft's q (both processed: temperature, top-p, the draft's vocabulary head):

  rejection  the probability that rejection sampling keeps the draft: sum min(p, q) = 1 - TV(p, q)
  coupled    the probability that the draft's and the target's seeded Gumbel-max choices agree,
             estimated over --seeds seeds (specdec/sampling.py, coupled_choice)
  bound      Daliri et al.'s lower bound on the coupled one, (1 - TV) / (1 + TV)

Writes table.md and positions.csv to --out.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

SETTINGS = {"T 0.7, top-p 0.95": dict(temperature=0.7, top_p=0.95), "T 1.0": dict(temperature=1.0, top_p=1.0)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec_tools.stack import DEFAULT_DRAFT_VOCAB

    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--prompts", type=int, default=4, help="how many of `specdec bench`'s fresh prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seeds", type=int, default=200, help="seeds per position for the coupled agreement")
    p.add_argument("--quantize", default="auto", choices=["auto", "none", "fp16", "int8", "int8-rows", "int4-rows", "q4k-rows"])
    p.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB)
    p.add_argument("--out", default=None, help="results folder (default bench_results/coupling-<time>)")


def cmd_bench_coupling(a: argparse.Namespace) -> int:
    from specdec.model_store import resolve_model
    from specdec.modeling import load_model
    from specdec.protocol import SamplingParams
    from specdec.sampling import coupled_choice, process_logits
    from specdec_tools.bench import PROMPTS

    out = Path(a.out or f"bench_results/coupling-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(f"[bench-coupling] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    target = load_model(str(resolve_model(a.target)), quantization=a.quantize)
    draft = load_model(str(resolve_model(a.draft)), quantization=a.quantize, head_rows=a.draft_vocab, role="draft")
    tok, vocab = target.tokenizer, target.model.config.vocab_size
    rows = []
    for i, prompt in enumerate(PROMPTS[: a.prompts]):
        ids = tok(tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                          add_generation_prompt=True), add_special_tokens=False).input_ids
        with torch.inference_mode():
            text = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                         max_new_tokens=a.max_new_tokens, do_sample=False, top_k=None, top_p=None,
                                         temperature=None)[0].tolist()
            # position t (t >= len(ids)) is predicted by row t - 1 of one pass over the whole text
            p_logits = target.model(torch.tensor([text])).logits[0, len(ids) - 1:-1]
            q_logits = draft.model(torch.tensor([text])).logits[0, len(ids) - 1:-1]
        log(f"prompt {i}: {len(text) - len(ids)} positions")
        for name, kw in SETTINGS.items():
            params = SamplingParams(**kw)
            for j in range(p_logits.shape[0]):
                p = process_logits(p_logits[j], params, vocab)
                q = process_logits(q_logits[j], params, vocab)
                tv = float((p.dense() - q.dense()).abs().sum()) / 2
                agree = sum(coupled_choice(p, s, len(ids) + j) == coupled_choice(q, s, len(ids) + j)
                            for s in range(a.seeds)) / a.seeds
                rows.append({"setting": name, "prompt": i, "position": j, "rejection": round(1 - tv, 4),
                             "coupled": round(agree, 4), "bound": round((1 - tv) / (1 + tv), 4)})
    with open(out / "positions.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = ["| setting | positions | rejection: mean 1 - TV | coupled: mean agreement | bound (1-TV)/(1+TV) | coupled / rejection |",
             "|---|---|---|---|---|---|"]
    for name in SETTINGS:
        rs = [r for r in rows if r["setting"] == name]
        mean = lambda k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        lines.append(f"| {name} | {len(rs)} | {mean('rejection'):.3f} | {mean('coupled'):.3f} | {mean('bound'):.3f} | "
                     f"{mean('coupled') / mean('rejection'):.3f} |")
    header = (f"{a.prompts} prompts, the target's greedy answer of {a.max_new_tokens} tokens each, {a.seeds} seeds per "
              f"position, quantization {a.quantize}, draft vocabulary {a.draft_vocab or 'all'}")
    table = "\n".join(lines)
    (out / "table.md").write_text(f"{header}\n\n{table}\n")
    print(header)
    print(table, flush=True)
    return 0
