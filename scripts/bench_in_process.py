"""The in-process path (orchestrator/local.py, load_local) on the default pair: greedy tok/s at
gamma 0 and gamma 4 over three of `specdec bench`'s prompts, 48 new tokens each.

Run it on two checkouts to compare them side by side (one after the other, the same machine):

    GOMP_SPINCOUNT=200000 .venv/bin/python scripts/bench_in_process.py LABEL

Measured 2026-11-25 on this 2-core VM, models loaded on the caller's thread (before) vs on the
model thread that runs every pass (after), before / after / before again:
gamma 0 13.56 / 15.74 / 13.26 tok/s, gamma 4 15.80 / 23.20 / 15.65 tok/s. A 1-row draft pass on
a thread other than the one whose OpenMP team still lives: 25-27 ms, against 15 ms.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from orchestrator.local import load_local
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model
    from specdec.protocol import GenerationRequest
    from specdec_tools.bench import PROMPTS
    from specdec_tools.stack import DEFAULT_DRAFT_VOCAB

    label = sys.argv[1] if len(sys.argv) > 1 else "this checkout"
    decoder = load_local(str(resolve_model(DEFAULT_TARGET)), str(resolve_model(DEFAULT_DRAFT)),
                         draft_vocab=DEFAULT_DRAFT_VOCAB)
    time.sleep(3)  # the grammar compilers build in the background
    decoder.generate(GenerationRequest(prompt="hi", max_new_tokens=4, temperature=0))  # warm-up
    for gamma in (0, 4):
        t0, n = time.perf_counter(), 0
        for prompt in PROMPTS[:3]:
            n += len(decoder.generate(GenerationRequest(prompt=prompt, max_new_tokens=48, temperature=0,
                                                        gamma=gamma)).token_ids)
        print(f"{label}: gamma {gamma}: {n / (time.perf_counter() - t0):.2f} tok/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
