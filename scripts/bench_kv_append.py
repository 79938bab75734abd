"""A decoding step's cost against the context it attends to: the KV cache appended in place
(specdec/worker/batching.py grow_append, the default) against transformers' DynamicLayer.update
(concatenation: every layer copies the session's whole cache at every step), side by side.

For each context length, two caches of the default target (or draft) are prefilled with the same
tokens, then 1-row steps alternate between them; prints the median ms a step of each. The logits
are the same bits either way (tests/specdec/worker/test_forward.py); only the time differs.

    .venv/bin/python scripts/bench_kv_append.py [--role target|draft] [--contexts 100,1000,2000] [--steps 24]
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
    p.add_argument("--contexts", default="100,1000,2000")
    p.add_argument("--steps", type=int, default=24)
    a = p.parse_args()
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model
    from specdec.modeling import load_model
    from specdec.threads import bound_openmp_spinning
    from specdec.worker.batching import RaggedCache, grow_append, use_ragged_attention
    from specdec.worker.forward import model_forward
    from specdec_tools.stack import DEFAULT_DRAFT_VOCAB

    bound_openmp_spinning()  # as every entry point does
    spec = DEFAULT_TARGET if a.role == "target" else DEFAULT_DRAFT
    model = load_model(str(resolve_model(spec)), quantization="auto", role=a.role,
                       head_rows=DEFAULT_DRAFT_VOCAB if a.role == "draft" else 0).model
    use_ragged_attention(model)
    forward = model_forward(model)
    appends = {"in place (grow_append)": grow_append, "concatenation (DynamicLayer.update)": DynamicLayer.update}
    print(f"| {a.role}: cached tokens | " + " | ".join(appends) + " |")
    print("|---|" + "---|" * len(appends))
    with torch.inference_mode():
        for context in (int(c) for c in a.contexts.split(",")):
            ids = [100 + i % 5000 for i in range(context)]
            caches = {}
            for name, append in appends.items():
                cache = DynamicCache(config=model.config)
                for start in range(0, context, 256):  # prefill in chunks, as the worker's passes do
                    chunk = ids[start:start + 256]
                    forward(torch.tensor([chunk]), torch.tensor([list(range(start, start + len(chunk)))]),
                            RaggedCache([cache], [len(chunk)], append=append), torch.tensor([len(chunk) - 1]))
                caches[name] = cache
            times: dict[str, list[float]] = {name: [] for name in appends}
            for step in range(a.steps):
                for name, append in appends.items():
                    t0 = time.perf_counter()
                    forward(torch.tensor([[5]]), torch.tensor([[context + step]]),
                            RaggedCache([caches[name]], [1], append=append), torch.tensor([0]))
                    times[name].append(time.perf_counter() - t0)
            cells = [f"{statistics.median(t[a.steps // 6:]) * 1e3:.2f} ms" for t in times.values()]
            print(f"| {context} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
