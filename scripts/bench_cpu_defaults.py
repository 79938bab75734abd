"""The CPU defaults of issue 21, ablated side by side in one run: the target's kernel (fp16
weights vs int8-rows) x OpenMP's idle threads (PASSIVE vs a bounded spin, GOMP_SPINCOUNT); then
int8-rows on fbgemm vs the native AVX2 kernel (specdec/csrc/int8_rows.c), the draft's kernel, the
native kernel's AVX-512 VNNI path, and the GGUF's own 4-bit blocks (int4-rows, the default), with
its weights on 4 KiB pages or huge pages and transformers' forward or the lean one, and the lean
forward's decoder layers in torch ops or in C (specdec/csrc/decoder.c: the default), and the GGUF's
Q6_K tensors requantized to int8-rows or read as their own blocks (the default), and the draft on
int8-rows or on Q4_K blocks (q4k-rows, the default).

Each setup starts the three services as `make run` does (specdec_tools.stack.ProcessStack, the
default pair, draft vocabulary 32k), then times 4 of `specdec bench`'s prompts, greedy, 48 new
tokens: one client at gamma 0 and at gamma 4 (the goodput policy), then four clients at once.
Prints one table row per setup (generated tokens over wall time).

    .venv/bin/python scripts/bench_cpu_defaults.py [--new-tokens 48] [--setups all]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPIN = {"GOMP_SPINCOUNT": "200000"}
FBGEMM = {**SPIN, "SPECDEC_NATIVE_KERNELS": "0"}
SETUPS = {  # name: (--quantize, environment, more draft flags)
    "fp16, PASSIVE (before)": ("fp16", {"OMP_WAIT_POLICY": "PASSIVE", "SPECDEC_NATIVE_KERNELS": "0"}, ()),
    "fp16, spin": ("fp16", FBGEMM, ()),
    "int8-rows, PASSIVE": ("int8-rows", {"OMP_WAIT_POLICY": "PASSIVE", "SPECDEC_NATIVE_KERNELS": "0"}, ()),
    "int8-rows, spin": ("int8-rows", FBGEMM, ()),
    # the native kernel: target only, then the draft on it too
    "int8-rows native, draft int8": ("int8-rows", SPIN, ("--quantize", "int8")),
    "int8-rows native, draft int8-rows native": ("int8-rows", SPIN, ()),
    # the native kernel held to AVX2 on a CPU with AVX-512 VNNI (the ablation of its VNNI path), and not
    "int8-rows native AVX2 (VNNI off)": ("int8-rows", {**SPIN, "SPECDEC_NATIVE_ISA": "avx2"}, ()),
    "int8-rows native, VNNI where the CPU has it": ("int8-rows", SPIN, ()),
    # the GGUF's own Q4_K blocks for the target (specdec/kernels.py, int4-rows), the draft int8-rows,
    # the native kernels' weights on 4 KiB pages (the ablation of weight_memory's huge pages), transformers'
    # forward instead of specdec/worker/forward.py's lean one (its ablation), both, and neither
    "int4-rows target, 4 KiB pages, transformers' forward": (
        "auto", {**SPIN, "SPECDEC_HUGE_PAGES": "0", "SPECDEC_LEAN_FORWARD": "0"}, ()),
    "int4-rows target, 4 KiB pages": ("auto", {**SPIN, "SPECDEC_HUGE_PAGES": "0"}, ()),
    "int4-rows target, transformers' forward": ("auto", {**SPIN, "SPECDEC_LEAN_FORWARD": "0"}, ()),
    # the decoder layers in torch ops (lean_forward) instead of C (NativeForward: the ablation of decoder.c)
    "int4-rows target, decoder layers in torch": ("auto", {**SPIN, "SPECDEC_NATIVE_FORWARD": "0"}, ()),
    # the GGUF's Q6_K tensors (the head, half the attention values and MLP outputs) requantized to
    # int8-rows instead of read as their own blocks (the ablation of Q6KRowLinear)
    "int4-rows target, Q6_K tensors as int8-rows": ("auto", {**SPIN, "SPECDEC_Q6K": "0"}, ()),
    # the draft on int8-rows instead of Q4_K blocks (the ablation of q4k-rows, the draft's default)
    "int4-rows target, int8-rows draft": ("auto", SPIN, ("--quantize", "int8-rows")),
    "int4-rows target (the default)": ("auto", SPIN, ()),
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--setups", default="all", help="names of SETUPS separated by semicolons (they hold commas), or all")
    a = p.parse_args()
    from transformers import AutoTokenizer

    from orchestrator.client import Client
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model
    from specdec_tools.bench import PROMPTS
    from specdec_tools.stack import DEFAULT_DRAFT_VOCAB, ProcessStack

    target, draft = str(resolve_model(DEFAULT_TARGET)), str(resolve_model(DEFAULT_DRAFT))
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False).input_ids
               for p in PROMPTS[:4]]
    names = list(SETUPS) if a.setups == "all" else [n.strip() for n in a.setups.split(";")]
    print("| setup | 1 client, gamma 0 | 1 client, gamma 4 | 4 clients, gamma 0 | 4 clients, gamma 4 |")
    print("|---|---|---|---|---|")
    # every variable a setup may set: each setup starts from none of them
    saved = {k: os.environ.get(k) for k in sorted({k for _, env, _ in SETUPS.values() for k in env})}
    outputs: dict[tuple, list[int]] = {}  # (setup, gamma, clients, prompt) -> greedy token ids
    for name in names:
        quantization, env, draft_args = SETUPS[name]
        for k in saved:
            os.environ.pop(k, None)
        os.environ.update(env)
        with ProcessStack(target, draft, quantization=quantization, draft_vocab=DEFAULT_DRAFT_VOCAB,
                          draft_args=draft_args) as stack:
            stack.wait_until_ready(900)
            with Client(stack.address, timeout_s=900) as client:
                def run(ids, gamma, key=None):
                    out = list(client.generate(token_ids=ids, max_new_tokens=a.new_tokens, temperature=0,
                                               gamma=gamma).token_ids)
                    if key is not None:
                        outputs[key] = out
                    return len(out)

                run(prompts[0][:8], 0)  # warm-up
                cells = []
                for gamma in (0, 4):
                    t0 = time.perf_counter()
                    n = sum(run(ids, gamma, (name, gamma, 1, i)) for i, ids in enumerate(prompts))
                    cells.append(n / (time.perf_counter() - t0))
                for gamma in (0, 4):
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(4) as pool:
                        n = sum(pool.map(lambda item: run(item[1], gamma, (name, gamma, 4, item[0])),
                                         enumerate(prompts)))
                    cells.append(n / (time.perf_counter() - t0))
        print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)
    for k, v in saved.items():
        os.environ.pop(k, None)
        if v is not None:
            os.environ[k] = v
    # greedy: per setup, gamma 4 and four clients must give gamma 0's one-client tokens; across
    # setups only kernels of the same integer sums (int8-rows on any backend or ISA) must agree
    for name in names:
        ref = {i: outputs[name, 0, 1, i] for i in range(len(prompts))}
        same = sum(out == ref[key[3]] for key, out in outputs.items() if key[0] == name)
        print(f"{name}: {same}/{sum(key[0] == name for key in outputs)} greedy outputs equal its gamma-0 one-client ones")
    first = names[0]
    for name in names[1:]:
        same = sum(outputs[name, 0, 1, i] == outputs[first, 0, 1, i] for i in range(len(prompts)))
        print(f"{name} vs {first}: {same}/{len(prompts)} gamma-0 outputs identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
