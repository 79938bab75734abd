"""How much suffix drafts could give one request at most: the target's greedy outputs, replayed.

For each prompt of a bench prompt set (specdec_tools.bench: fresh, edit) the target's greedy
output is generated once (transformers, cached in --cache), then replayed step by step as the
step loop would serve it with suffix drafts alone: at each step the draft of orchestrator/proposers/suffix.py
(the request's own tokens and the earlier requests' prompts and outputs, as `--suffix-cache on`)
is sent whole, the target keeps its longest agreeing prefix plus one token, and the step costs
ALPHA + BETA x its draft's length (a one-row pass and a row's extra cost on this CPU's pass line,
overhead included). No selection, no exploration, no draft model: an upper bound for what
sending suffix drafts can add to plain decoding, and the share of steps that have one at all.

    .venv/bin/python scripts/suffix_ceiling.py --prompt-set edit --max-new-tokens 160
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def generate(prompt_set: str, max_new_tokens: int, cache: Path) -> list[dict]:
    """[{prompt, output}] token ids per prompt of the set: the target's greedy output (cached)."""
    key = f"{prompt_set}-{max_new_tokens}"
    saved = json.loads(cache.read_text()) if cache.exists() else {}
    if key in saved:
        return saved[key]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.model_store import DEFAULT_TARGET, resolve_model
    from specdec_tools.bench import PROMPT_SETS

    path = str(resolve_model(DEFAULT_TARGET))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    seqs = []
    for prompt in PROMPT_SETS[prompt_set]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        seqs.append({"prompt": ids, "output": out[0, len(ids):].tolist()})
        print(f"generated {len(seqs)}/{len(PROMPT_SETS[prompt_set])}", flush=True)
    saved[key] = seqs
    cache.write_text(json.dumps(saved))
    return seqs


def replay(seqs: list[dict], alpha: float, beta: float, k: int) -> dict:
    from orchestrator.proposers.suffix import RequestIndex, SuffixIndex

    index = SuffixIndex(65536)
    steps = with_draft = tokens = 0
    seconds = plain = 0.0
    kept = collections.Counter()
    for seq in seqs:
        prompt, out = seq["prompt"], seq["output"]
        own, t = RequestIndex(), 0
        while t < len(out):
            draft, _ = index.draft("scope", prompt + out[:t], own, min(k, len(out) - t - 1))
            a = 0
            while a < len(draft) and out[t + a] == draft[a]:
                a += 1
            steps += 1
            with_draft += bool(draft)
            if draft:
                kept[a] += 1
            seconds += alpha + beta * len(draft)
            t += a + 1
        tokens += len(out)
        plain += alpha * len(out)
        index.add("scope", prompt + out)
    return {"tokens": tokens, "steps": steps, "steps_with_a_draft": with_draft,
            "drafts_by_tokens_kept": dict(sorted(kept.items())), "ceiling_vs_plain": round(plain / seconds, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-set", default="edit", choices=["fresh", "edit"])
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--alpha-ms", type=float, default=42.0, help="a one-row step (default 42: this VM's plain steps)")
    p.add_argument("--beta-ms", type=float, nargs="+", default=[3.0, 6.0],
                   help="a draft token's extra cost in the target's pass (default 3 and 6: this VM's pass line "
                        "measured 6-8.6 ms a row)")
    p.add_argument("--max-draft", type=int, default=16, help="the longest draft (MAX_GAMMA)")
    p.add_argument("--cache", default="bench_results/suffix-ceiling-outputs.json")
    a = p.parse_args()
    cache = Path(a.cache)
    cache.parent.mkdir(parents=True, exist_ok=True)
    seqs = generate(a.prompt_set, a.max_new_tokens, cache)
    for beta in a.beta_ms:
        print(json.dumps({"prompt_set": a.prompt_set, "alpha_ms": a.alpha_ms, "beta_ms": beta,
                          **replay(seqs, a.alpha_ms / 1e3, beta / 1e3, a.max_draft)}))


if __name__ == "__main__":
    main()
