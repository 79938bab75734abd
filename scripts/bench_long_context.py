"""A decoding step's cost against the context it attends to, two techniques ablated side by side
(specdec/worker/batching.py), each off and on in one process, passes interleaved:

  append     the KV cache appended in place (grow_append, the default) against transformers'
             DynamicLayer.update (concatenation: every layer copies the session's whole cache at
             every step); 1-row steps
  attention  one query row's attention as two matmuls around a softmax from
             ONE_ROW_MATMUL_MIN_KEYS keys (the default) against SDPA for every row; a 1-row step
             and a 5-row verify pass (row by row, as every decoding row is)

For each context length a cache of the default target (or draft) is prefilled in 256-token chunks.
Prints the median ms of each. The logits are the same bits either way for `append`, and a k-row
verify equals k single steps either way for `attention` (tests/specdec/worker/test_forward.py).

    .venv/bin/python scripts/bench_long_context.py [--role target|draft] [--contexts 200,1000,2000] [--steps 20]

Measured 2026-11-26, default target, 2-core Zen 4 VM (docs/benchmarks/huge-pages-lean-forward/).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="target", choices=["target", "draft"])
    p.add_argument("--contexts", default="200,1000,2000")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model
    from specdec.modeling import load_model
    from specdec.threads import bound_openmp_spinning
    from specdec.worker import batching
    from specdec.worker.batching import RaggedCache, grow_append, use_ragged_attention
    from specdec.worker.forward import model_forward
    from specdec_tools.stack import DEFAULT_DRAFT_VOCAB

    bound_openmp_spinning()  # as every entry point does
    spec = DEFAULT_TARGET if a.role == "target" else DEFAULT_DRAFT
    model = load_model(str(resolve_model(spec)), quantization="auto", role=a.role,
                       head_rows=DEFAULT_DRAFT_VOCAB if a.role == "draft" else 0).model
    use_ragged_attention(model)
    forward = model_forward(model)
    matmul_from = batching.ONE_ROW_MATMUL_MIN_KEYS

    def prefill(context: int, append) -> DynamicCache:
        ids = [100 + i % 5000 for i in range(context)]
        cache = DynamicCache(config=model.config)
        for start in range(0, context, 256):  # in chunks, as the worker's passes do
            chunk = ids[start:start + 256]
            forward(torch.tensor([chunk]), torch.tensor([list(range(start, start + len(chunk)))]),
                    RaggedCache([cache], [len(chunk)], append=append), torch.tensor([len(chunk) - 1]))
        return cache

    def step(cache, context: int, rows: int, append=grow_append) -> float:
        t0 = time.perf_counter()
        forward(torch.tensor([[5] * rows]), torch.tensor([list(range(context, context + rows))]),
                RaggedCache([cache], [rows], append=append), torch.tensor([rows - 1]))
        return time.perf_counter() - t0

    def median_ms(times: list[float]) -> str:
        return f"{statistics.median(times[a.steps // 6:]) * 1e3:.2f} ms"

    appends = {"in place": grow_append, "concatenation": DynamicLayer.update}
    rows_of = {"matmul from %d keys, 1 row" % matmul_from: (matmul_from, 1), "SDPA, 1 row": (10**9, 1),
               "matmul, 5 rows": (matmul_from, 5), "SDPA, 5 rows": (10**9, 5)}
    print(f"| {a.role}: cached tokens | append in place | append by concatenation | " + " | ".join(rows_of) + " |")
    print("|---|" + "---|" * (2 + len(rows_of)))
    with torch.inference_mode():
        for context in (int(c) for c in a.contexts.split(",")):
            caches = {name: prefill(context, append) for name, append in appends.items()}
            times: dict[str, list[float]] = {name: [] for name in [*appends, *rows_of]}
            for i in range(a.steps):  # 1-row steps that grow the caches, interleaved
                for name, append in appends.items():
                    times[name].append(step(caches[name], context + i, 1, append))
            cache, length = caches["in place"], context + a.steps
            for _ in range(a.steps):  # the attention's ablation: passes rolled back after each
                for name, (threshold, rows) in rows_of.items():
                    batching.ONE_ROW_MATMUL_MIN_KEYS = threshold
                    times[name].append(step(cache, length, rows))
                    cache.crop(-rows)
            batching.ONE_ROW_MATMUL_MIN_KEYS = matmul_from
            print(f"| {context} | " + " | ".join(median_ms(t) for t in times.values()) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
