"""GPU pass costs of one model: the eager pass over DynamicCaches (the worker's path before KV pages)
against the static pass over KV pages (specdec/worker/paged.py), eager and replayed from CUDA
graphs, by sessions and new rows a session; and how exact the graph path is.

    python scripts/bench_gpu_passes.py MODEL_DIR [--role draft --draft-vocab 32768] [--out FILE.md]

Each timed pass adds ROWS tokens to every session (CACHED tokens each already) and is rolled back
after, as a verify that kept nothing; the median of --repeats passes, each synchronised. Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--role", default="target")
    p.add_argument("--draft-vocab", type=int, default=0)
    p.add_argument("--sessions", default="1,4,16")
    p.add_argument("--rows", default="1,2,5,8")
    p.add_argument("--cached", type=int, default=100)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--greedy-tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script (EagerGraph, float32)")
    a = p.parse_args(argv)
    with torch.inference_mode():
        return measure(a)


def measure(a: argparse.Namespace) -> int:

    from transformers import DynamicCache

    from specdec.modeling import load_model
    from specdec.protocol import SamplingParams
    from specdec.worker.batching import Chain, RaggedCache, use_ragged_attention
    from specdec.worker.forward import model_forward
    from specdec.worker.paged import PAGE, CudaGraph, EagerGraph, KVPages, StaticForward, pick_bucket

    cuda = a.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    torch.set_num_threads(1)
    sessions_list = [int(v) for v in a.sessions.split(",")]
    rows_list = [int(v) for v in a.rows.split(",")]
    loaded = load_model(a.model, device=a.device, dtype="bfloat16" if cuda else "float32", quantization="none",
                        role=a.role, head_rows=a.draft_vocab)
    model = loaded.model
    use_ragged_attention(model)
    vocab = model.config.vocab_size
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (a.cached,), generator=gen).tolist()
    max_sessions = max(sessions_list)
    tokens = max_sessions * (a.cached + max(rows_list) + a.greedy_tokens + 2 * PAGE)

    pages = KVPages.for_model(model, tokens=tokens, sessions=max_sessions)
    graphs = StaticForward(model, pages, max_sessions=max_sessions, max_context=model.config.max_position_embeddings,
                           graph=CudaGraph if cuda else EagerGraph)
    sync()
    t0 = time.perf_counter()
    graphs.capture()
    say(f"{a.model} ({a.role}), {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, "
        f"{model.dtype}")
    say(f"KV pages: {pages.pages} of {PAGE} tokens, {pages.nbytes / 2**30:.2f} GiB; {len(graphs.buckets)} CUDA graphs "
        f"captured in {time.perf_counter() - t0:.1f} s, {graphs.capture_bytes / 2**30:.2f} GiB of graph memory")
    static_eager = StaticForward(model, pages, max_sessions=max_sessions, max_context=0, graph=None)
    eager = model_forward(model)

    def dyn_new():
        return DynamicCache(config=model.config)

    def run(kind, forward, caches, ids_rows, lengths, keep_all=True):
        """One pass: ids_rows[i] new tokens for session i -> logits [rows kept, vocab]."""
        ids = [t for rows in ids_rows for t in rows]
        positions = [p for L, rows in zip(lengths, ids_rows) for p in range(L, L + len(rows))]
        keep = list(range(len(ids))) if keep_all else [len(ids) - 1]
        device = a.device if kind == "eager" else "cpu"
        return forward(torch.tensor([ids], device=device), torch.tensor([positions], device=device),
                       RaggedCache(caches, [len(r) for r in ids_rows]), torch.tensor(keep, device=device))[0]

    def timed(fn, reset) -> float:
        """Median ms of --repeats calls of fn (after 3 untimed), each synchronised, reset() after each."""
        times = []
        for i in range(a.repeats + 3):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            if i >= 3:
                times.append(time.perf_counter() - t)
            reset()
        return statistics.median(times) * 1e3

    kinds = {"eager (DynamicCache, row-wise attention)": ("eager", eager, dyn_new),
             "static pass, eager": ("static", static_eager, pages.new_cache),
             "static pass, CUDA graphs": ("static", graphs, pages.new_cache)}
    results: dict[tuple[str, int, int], float] = {}
    for label, (kind, forward, new_cache) in kinds.items():
        for s in sessions_list:
            caches = [new_cache() for _ in range(s)]
            for c in caches:
                run(kind, forward, [c], [prefix], [0], keep_all=False)
            for r in rows_list:
                new = [torch.randint(0, vocab, (r,), generator=gen).tolist() for _ in range(s)]
                results[label, s, r] = timed(lambda: run(kind, forward, caches, new, [a.cached] * s),
                                             lambda: [c.crop(-r) for c in caches])  # DynamicCache: a count to drop
            if kind == "static":
                for c in caches:
                    c.free()
    say()
    say(f"ms per pass by new rows of each session ({a.cached} tokens cached each, median of {a.repeats})")
    say()
    say("| pass | sessions | " + " | ".join(f"{r} row{'s' * (r > 1)}" for r in rows_list) + " |")
    say("|---|---|" + "---|" * len(rows_list))
    for label in kinds:
        for s in sessions_list:
            say(f"| {label} | {s} | " + " | ".join(f"{results[label, s, r]:.2f}" for r in rows_list) + " |")
    base = "eager (DynamicCache, row-wise attention)"
    say()
    say("| speed-up of CUDA graphs over the eager pass | sessions | " + " | ".join(str(r) for r in rows_list) + " |")
    say("|---|---|" + "---|" * len(rows_list))
    for s in sessions_list:
        say(f"| | {s} | " + " | ".join(f"{results[base, s, r] / results['static pass, CUDA graphs', s, r]:.1f}x"
                                        for r in rows_list) + " |")

    # a draft of GAMMA tokens: a replay a step, the greedy choice read on the host each time,
    # against one replay and the steps after it chained on the device (StaticForward.chain),
    # choosing greedily or coupled (seeded sampling at temperature 1)
    gamma = 4
    modes = {"a replay a step": None, "chained": SamplingParams(temperature=0.0),
             "chained, coupled": SamplingParams(temperature=1.0, coupling_seed=1)}
    draft_ms: dict[tuple[str, int], float] = {}
    for s in sessions_list:
        caches = [pages.new_cache() for _ in range(s)]
        for c in caches:
            run("static", graphs, [c], [prefix], [0], keep_all=False)
        start = [[prefix[-1]] for _ in caches]

        def draft(params: SamplingParams | None) -> None:
            logits = run("static", graphs, caches, start, [a.cached] * s)
            if params is not None:
                graphs.chain(caches, logits, [Chain(gamma - 1, params, False)] * s)
                return
            for step in range(gamma - 1):
                chosen = [[int(v)] for v in logits.argmax(dim=-1).tolist()]
                logits = run("static", graphs, caches, chosen, [a.cached + 1 + step] * s)

        for label, params in modes.items():
            draft_ms[label, s] = timed(lambda: draft(params), lambda: [c.crop(a.cached) for c in caches])
        for c in caches:
            c.free()
    say()
    say(f"ms for a draft of {gamma} tokens from each session (median of {a.repeats})")
    say()
    say("| draft steps | " + " | ".join(f"{s} session{'s' * (s > 1)}" for s in sessions_list) + " |")
    say("|---|" + "---|" * len(sessions_list))
    for label in modes:
        say(f"| {label} | " + " | ".join(f"{draft_ms[label, s]:.2f}" for s in sessions_list) + " |")

    # exactness: one session, greedy, graphs against the eager pass; a k-row pass against k steps
    say()
    ours, theirs = pages.new_cache(), dyn_new()
    first_ours = run("static", graphs, [ours], [prefix], [0], keep_all=False)
    first_theirs = run("eager", eager, [theirs], [prefix], [0], keep_all=False)
    diff = (first_ours.float() - first_theirs.float()).abs().max().item()
    tok_ours, tok_theirs = [int(first_ours[-1].argmax())], [int(first_theirs[-1].argmax())]
    for i in range(a.greedy_tokens - 1):
        L = a.cached + i
        tok_ours.append(int(run("static", graphs, [ours], [[tok_ours[-1]]], [L])[-1].argmax()))
        tok_theirs.append(int(run("eager", eager, [theirs], [[tok_theirs[-1]]], [L])[-1].argmax()))
    same = next((i for i, (x, y) in enumerate(zip(tok_ours, tok_theirs)) if x != y), len(tok_ours))
    say(f"first pass (prefill {a.cached}): max |logit difference| graphs vs eager {diff:.3g}; greedy "
        f"{a.greedy_tokens} tokens one at a time: graphs and eager agree on the first {same}")
    ours.crop(-(a.greedy_tokens - 1))
    agree, total = 0, 0
    for start in range(0, a.greedy_tokens - 8, 8):  # 8-row passes over the greedy tokens (teacher forced)
        L = a.cached + start
        logits = run("static", graphs, [ours], [tok_ours[start:start + 8]], [L])
        agree += sum(int(logits[j].argmax()) == tok_ours[start + j + 1] for j in range(8))
        total += 8
    say(f"8-row graph passes over those tokens: argmax equal to the 1-row steps' at {agree}/{total} positions")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        run("static", graphs, [ours], [tok_ours[:4]], [ours.length])
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    say(f"synchronising calls in one replayed 4-row pass (torch.cuda.set_sync_debug_mode): "
        f"{sum('synchroniz' in str(w.message) for w in caught)}")
    last = run("static", graphs, [ours], [tok_ours[4:5]], [ours.length])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        graphs.chain([ours], last, [Chain(gamma - 1, modes["chained, coupled"], True)])
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    say(f"synchronising calls in one chain of {gamma - 1} draft steps: {sum('synchroniz' in str(w.message) for w in caught)}"
        " (one expected: the choices read at the end)")
    say(f"passes replayed {graphs.replays}, eager {graphs.eager_passes}")
    for rows in (1, 4):  # what a captured pass holds: its function run once outside the graph
        bucket = pick_bucket(graphs.buckets, 1, rows, a.cached + rows)
        captured = graphs._captured[bucket]
        n = launches(lambda: graphs._padded(bucket, captured.inputs), cuda)
        say(f"{'CUDA kernels' if cuda else 'tensor operations (not views; the CPU stand-in for kernels)'} of one "
            f"captured pass, 1 session x {rows} row{'s' * (rows > 1)}: {n} ({n / model.config.num_hidden_layers:.1f} "
            "a layer)")
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


# operations that launch no kernel (views and bookkeeping), left out of the CPU count
_NO_KERNEL = {"empty", "empty_strided", "as_strided", "view", "_reshape_alias", "resolve_conj", "resolve_neg",
              "detach", "lift_fresh", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
              "squeeze", "split", "chunk", "unflatten", "flatten", "alias", "_unsafe_view", "narrow", "unbind"}


def launches(fn, cuda: bool) -> int:
    """The kernels one call of fn launches (CUDA: as the profiler traces them), or on CPU the
    tensor operations it calls that are not views (each is a kernel or more on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.name[6:] not in _NO_KERNEL
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


if __name__ == "__main__":
    sys.exit(main())
