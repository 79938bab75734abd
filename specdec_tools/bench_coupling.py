"""`specdec bench coupling`: what coupled sampling costs in acceptance, position by position.

End-to-end benchmarks (`specdec bench methods --modes sampled,coupled,...`) compare different texts: a
coupled and a rejection-sampled request write different answers, so their acceptance rates mix
the method with the text. Here both are measured on the same contexts. The target writes each
prompt's answer (greedy; with --contexts sampled, one answer per setting, sampled by the target
alone under that setting: the texts sampled requests see, where the two models disagree more
often); at every position of it, under each sampling setting, from the target's p and the draft's
q (both processed: temperature, top-p, the draft's vocabulary head):

  rejection  the probability that rejection sampling keeps the draft: sum min(p, q) = 1 - TV(p, q)
  coupled    the probability that the draft's and the target's seeded Gumbel-max choices agree,
             estimated over --seeds seeds (specdec/sampling.py, coupled_choice)
  bound      Daliri et al.'s lower bound on the coupled one, (1 - TV) / (1 + TV)

Writes table.md and positions.csv to --out.
"""

from __future__ import annotations

import argparse
import sys

import torch

from specdec_tools import report

SETTINGS = {"T 0.7, top-p 0.95": dict(temperature=0.7, top_p=0.95), "T 1.0": dict(temperature=1.0, top_p=1.0)}
CONTEXT_SEED = 1_000_003  # --contexts sampled: prompt i's answer under setting k is drawn with seed
# CONTEXT_SEED + 1000 k + i, apart from the seeds 0..--seeds-1 the agreement is measured with


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET
    from specdec_tools.stack import DEFAULT_DRAFT_VOCAB

    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--prompts", type=int, default=4, help="how many of `specdec bench methods`' fresh prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seeds", type=int, default=200, help="seeds per position for the coupled agreement")
    p.add_argument("--contexts", choices=["greedy", "sampled"], default="greedy",
                   help="the texts measured: greedy, the target's greedy answer to each prompt (one for all settings); "
                        "sampled, per setting an answer the target alone samples under it (default greedy)")
    p.add_argument("--quantize", default="auto", choices=["auto", "none", "fp16", "int8", "int8-rows", "int4-rows", "q4k-rows"])
    p.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB)
    report.add_out_argument(p, "coupling-")


def cmd_bench_coupling(a: argparse.Namespace) -> int:
    from specdec.model_store import resolve_model
    from specdec.modeling import eos_token_ids, load_model
    from specdec.protocol import SamplingParams
    from specdec.sampling import coupled_choice, process_logits
    from specdec_tools.bench import PROMPTS

    out = report.out_dir(a.out, "coupling-")
    log = lambda msg: print(f"[bench-coupling] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    target = load_model(str(resolve_model(a.target)), quantization=a.quantize)
    draft = load_model(str(resolve_model(a.draft)), quantization=a.quantize, head_rows=a.draft_vocab, role="draft")
    tok, vocab = target.tokenizer, target.model.config.vocab_size
    eos = set(eos_token_ids(target.model, tok))

    def greedy_answer(ids: list[int]) -> list[int]:
        return target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=a.max_new_tokens, do_sample=False, top_k=None, top_p=None,
                                     temperature=None)[0].tolist()

    def sampled_answer(ids: list[int], params, seed: int) -> list[int]:
        """Plain target decoding with coupled noise of `seed`: an exact draw from the target."""
        tokens = list(ids)
        for _ in range(a.max_new_tokens):
            logits = target.model(torch.tensor([tokens]), logits_to_keep=1).logits[0, -1]
            tokens.append(coupled_choice(process_logits(logits, params, vocab), seed, len(tokens)))
            if tokens[-1] in eos:
                break
        return tokens

    rows = []
    for i, prompt in enumerate(PROMPTS[: a.prompts]):
        ids = tok(tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                          add_generation_prompt=True), add_special_tokens=False).input_ids
        logits: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}  # by text: p's and q's rows
        for k, (name, kw) in enumerate(SETTINGS.items()):
            params = SamplingParams(**kw)
            with torch.inference_mode():
                if a.contexts == "sampled":  # a seed of its own per setting: answers drawn apart
                    text = tuple(sampled_answer(ids, params, CONTEXT_SEED + 1000 * k + i))
                elif logits:  # the greedy answer, the same for every setting
                    text = next(iter(logits))
                else:
                    text = tuple(greedy_answer(ids))
                if text not in logits:
                    # position t (t >= len(ids)) is predicted by row t - 1 of one pass over the whole text
                    logits[text] = (target.model(torch.tensor([text])).logits[0, len(ids) - 1:-1],
                                    draft.model(torch.tensor([text])).logits[0, len(ids) - 1:-1])
                    log(f"prompt {i}: {len(text) - len(ids)} positions" +
                        (f" ({name}, sampled)" if a.contexts == "sampled" else ""))
            p_logits, q_logits = logits[text]
            for j in range(p_logits.shape[0]):
                p = process_logits(p_logits[j], params, vocab)
                q = process_logits(q_logits[j], params, vocab)
                tv = float((p.dense() - q.dense()).abs().sum()) / 2
                agree = sum(coupled_choice(p, s, len(ids) + j) == coupled_choice(q, s, len(ids) + j)
                            for s in range(a.seeds)) / a.seeds
                rows.append({"setting": name, "prompt": i, "position": j, "rejection": round(1 - tv, 4),
                             "coupled": round(agree, 4), "bound": round((1 - tv) / (1 + tv), 4)})
    report.write_csv(out / "positions.csv", rows)
    cells = []
    for name in SETTINGS:
        rs = [r for r in rows if r["setting"] == name]
        mean = lambda k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        cells.append([name, len(rs)] + [f"{x:.3f}" for x in (mean("rejection"), mean("coupled"), mean("bound"),
                                                             mean("coupled") / mean("rejection"))])
    answers = (f"the target's greedy answer of {a.max_new_tokens} tokens each" if a.contexts == "greedy" else
               f"answers of {a.max_new_tokens} tokens the target samples, one per setting")
    header = (f"{a.prompts} prompts, {answers}, {a.seeds} seeds per "
              f"position, quantization {a.quantize}, draft vocabulary {a.draft_vocab or 'all'}")
    table = report.markdown_table(["setting", "positions", "rejection: mean 1 - TV", "coupled: mean agreement",
                                   "bound (1-TV)/(1+TV)", "coupled / rejection"], cells)
    report.write_table(out, f"{header}\n\n{table}")
    return 0
