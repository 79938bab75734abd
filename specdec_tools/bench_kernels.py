"""`specdec bench kernels`: the target's (or draft's) forward pass under each CPU quantization.

For each `--quantize` mode, in one process, on the real model with `--cached` tokens in its
cache, through the worker's own pass (ragged attention, specdec/worker/batching.py):

  passes     median ms of a pass of 1, 2, 5, 9 and 17 new rows
  exact      whether a 9-row pass gives bitwise the logits of 9 one-row steps (what a verify of
             8 drafts must compute for speculative output to equal the target's own)
  profile    where a 1-row and a 5-row pass spend their time, by op kind (torch.profiler)
  quality    against --reference (fp16 by default), on `specdec bench methods`' prompts: whether the
             greedy text of --new-tokens tokens is the same, teacher-forced top-1 agreement on the
             reference's text, KL(reference || mode) and |log-prob difference| of the text's tokens

Writes table.md to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from specdec_tools import report


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.model_store import DEFAULT_TARGET

    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--role", default="target", choices=["target", "draft"])
    p.add_argument("--modes", default="fp16,int8-rows,int8", help="quantizations to compare")
    p.add_argument("--reference", default="fp16", help="the mode quality is measured against ('' to skip)")
    p.add_argument("--draft-vocab", type=int, default=0, help="a draft's head rows (0: all)")
    p.add_argument("--cached", type=int, default=100, help="tokens in the cache before each pass")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4, help="prompts for the quality check")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--profile", action="store_true", help="also a per-op profile of 1- and 5-row passes")
    report.add_out_argument(p, "kernels-")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (on an accelerator the only mode is none)")
    p.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--rows", default="1,2,5,9,17", help="new rows of each session in a timed pass")
    p.add_argument("--sessions", default="1",
                   help="sessions in one ragged pass (each with --cached tokens and the same new rows): a "
                        "batched step's cost, e.g. 1,4,16")
    p.add_argument("--rowwise", default=None, metavar="N,...",
                   help="decoding work's attention one query row at a time up to N new rows of a session (the "
                        "worker's ROWWISE_MAX_ROWS, specdec/worker/batching.py; 0: one SDPA call each): the "
                        "ablation, each value timed and checked (default: the worker's)")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pass(model, forward, cache, tokens: list[int], start: int, keep: int):
    return _batched_pass(model, forward, [cache], tokens, start, keep)


def _batched_pass(model, forward, caches: list, tokens: list[int], start: int, keep: int):
    """The same new `tokens` (at positions start..) appended to each of `caches` in one ragged
    pass of `forward` (the worker's: specdec/worker/forward.py); the logits of the last `keep` rows
    of each session, [len(caches) * keep, vocab]."""
    from specdec.worker.batching import RaggedCache

    n, s, device = len(tokens), len(caches), model.device
    keep_rows = [i * n + j for i in range(s) for j in range(n - keep, n)]
    return forward(torch.tensor([tokens * s], device=device),
                   torch.tensor([list(range(start, start + n)) * s], device=device),
                   RaggedCache(caches, [n] * s), torch.tensor(keep_rows, device=device))[0]


def _forward(mode: str, model):
    """The worker's forward for the model (model_forward); for a mode ending in -lean, lean_forward
    (the decoder layers in torch ops: the ablation of specdec/csrc/decoder.c)."""
    from specdec.worker.forward import lean_forward, model_forward

    if mode.endswith("-lean"):
        return lambda ids, positions, cache, keep: lean_forward(model, ids, positions, cache, keep)
    return model_forward(model)


def _load(path: str, mode: str, a: argparse.Namespace):
    """`mode` is a --quantize value, or int8-rows-fbgemm: int8-rows without its native kernel (the
    ablation of specdec/csrc/int8_rows.c), or int8-rows-avx2: the native kernel without its
    AVX-512 VNNI path (the same bits; timed with the kernel held to AVX2), or a mode with -lean
    after it: that quantization with its decoder layers in torch ops (see _forward)."""
    from specdec.modeling import load_model

    mode = mode.removesuffix("-lean")
    if mode == "int8-rows-avx2":
        mode = "int8-rows"
    if mode != "int8-rows-fbgemm":
        return load_model(path, device=a.device, dtype=a.dtype, quantization=mode, head_rows=a.draft_vocab,
                          role=a.role)
    before = os.environ.get("SPECDEC_NATIVE_KERNELS")
    os.environ["SPECDEC_NATIVE_KERNELS"] = "0"
    try:
        return load_model(path, quantization="int8-rows", head_rows=a.draft_vocab, role=a.role)
    finally:
        if before is None:
            del os.environ["SPECDEC_NATIVE_KERNELS"]
        else:
            os.environ["SPECDEC_NATIVE_KERNELS"] = before


def cmd_bench_kernels(a: argparse.Namespace) -> int:
    from specdec.model_store import resolve_model
    from specdec.worker import batching
    from specdec.worker.batching import use_ragged_attention
    from specdec_tools.bench import PROMPTS

    out = report.out_dir(a.out, "kernels-")
    log = lambda msg: print(f"[bench-kernels] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    path = str(resolve_model(a.model))
    modes = [m for m in a.modes.split(",") if m]
    if a.reference and a.reference not in modes:
        modes.append(a.reference)
    models = {m: _load(path, m, a) for m in modes}
    forwards = {m: _forward(m, loaded.model) for m, loaded in models.items()}
    tok = next(iter(models.values())).tokenizer
    prefix = tok("def merge(a, b):\n    result = []\n    i = j = 0\n" * 16).input_ids[: a.cached]
    rows_list = [int(r) for r in a.rows.split(",") if r]
    sessions_list = [int(s) for s in a.sessions.split(",") if s]
    passes = []  # a row per mode and sessions
    profiles = []
    rowwise = [int(v) for v in a.rowwise.split(",")] if a.rowwise else [batching.ROWWISE_MAX_ROWS]
    default_rowwise = batching.ROWWISE_MAX_ROWS
    for mode, loaded in models.items():
        use_ragged_attention(loaded.model)
        _native_isa("avx2" if mode == "int8-rows-avx2" else "best")
        for limit in rowwise:
            batching.ROWWISE_MAX_ROWS = limit
            label = mode if len(rowwise) == 1 else f"{mode}, {'row-wise attention' if limit > 1 else 'SDPA'}"
            table, exact = _time_passes(loaded.model, forwards[mode], prefix, rows_list, sessions_list, a, log, label, profiles)
            for sessions, cells in table.items():
                passes.append([label, sessions, *cells, "yes" if exact else "no"])
                log(" | ".join(map(str, passes[-1])))
    batching.ROWWISE_MAX_ROWS = default_rowwise
    where = (f"{torch.cuda.get_device_name(a.device)}, {next(iter(models.values())).dtype}, torch {torch.__version__}"
             if a.device.startswith("cuda") else f"torch threads {torch.get_num_threads()}")
    header = (f"{a.model} ({a.role}), ms per forward pass by new rows of each session, {a.cached} tokens cached "
              f"per session, median of {a.repeats}, {where}")
    head = ["mode", "sessions", *(f"{r} row{'s' if r > 1 else ''}" for r in rows_list), "9-row pass = 9 steps"]
    text = f"{header}\n\n{report.markdown_table(head, passes)}\n"
    if profiles:
        text += "\nWhere the time goes (self CPU time, top 5 ops):\n\n" + "\n".join(profiles) + "\n"
    if a.reference:
        text += "\n" + _quality(models, forwards, a, PROMPTS[: a.prompts], log) + "\n"
    report.write_table(out, text)
    return 0


def _native_isa(want: str) -> None:
    from specdec.kernels import native_library

    lib = native_library()
    if lib is not None:
        lib.set_isa(want)


def _time_passes(model, forward, prefix: list[int], rows_list: list[int], sessions_list: list[int], a, log, label: str,
                 profiles: list[str]) -> tuple[dict, bool]:
    """({sessions: [median ms of a pass of each rows_list entry]}, whether a 9-row pass is 9 steps bitwise)."""
    from transformers import DynamicCache

    device = model.device
    with torch.inference_mode():
        caches = [DynamicCache(config=model.config) for _ in range(max(sessions_list))]
        for cache in caches:
            _pass(model, forward, cache, prefix, 0, 1)
        cache = caches[0]
        start = len(prefix)
        table = {}
        for sessions in sessions_list:
            cells = []
            for rows in rows_list:
                new = prefix[-rows:]
                times = []
                for i in range(a.repeats + 2):
                    _sync(device)
                    t0 = time.perf_counter()
                    _batched_pass(model, forward, caches[:sessions], new, start, rows)
                    _sync(device)
                    times.append(time.perf_counter() - t0)
                    for c in caches[:sessions]:
                        c.crop(-rows)
                cells.append(f"{statistics.median(times[2:]) * 1e3:.1f}")
            table[sessions] = cells
        new = prefix[-9:]
        whole = _pass(model, forward, cache, new, start, 9)
        cache.crop(-9)
        steps = torch.stack([_pass(model, forward, cache, [token], start + i, 1)[0] for i, token in enumerate(new)])
        cache.crop(-9)
        exact = torch.equal(whole, steps)
        if not exact:
            log(f"{label}: 9-row pass vs 9 steps, max |logit difference| "
                f"{(whole.float() - steps.float()).abs().max():.3g}, argmax equal "
                f"{int((whole.argmax(-1) == steps.argmax(-1)).sum())}/9")
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            for rows in (1, 5):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for i in range(3):
                        _pass(model, forward, cache, prefix[-rows:], start, rows)
                        cache.crop(-rows)
                total = sum(e.self_cpu_time_total for e in prof.key_averages())
                top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:5]
                profiles.append(f"- {label}, {rows}-row pass: " + ", ".join(
                    f"{e.key} {100 * e.self_cpu_time_total / total:.1f}%" for e in top))
    return table, exact


def _quality(models: dict, forwards: dict, a: argparse.Namespace, prompts: list[str], log) -> str:
    ref = models[a.reference]
    tok = ref.tokenizer
    cells = []  # a row per mode
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False).input_ids for p in prompts]

    def greedy(mode, prompt):
        """--new-tokens greedy tokens through the worker's forward, one row a step as at gamma 0."""
        from transformers import DynamicCache

        model, cache, out = models[mode].model, DynamicCache(config=models[mode].model.config), []
        with torch.inference_mode():
            logits = _pass(model, forwards[mode], cache, prompt, 0, 1)
            for i in range(a.new_tokens):
                out.append(int(logits[-1].argmax()))
                logits = _pass(model, forwards[mode], cache, out[-1:], len(prompt) + i, 1)
        return out

    def teacher_forced(mode, prompt, text):
        """Log-probabilities of each position of `text` after the prompt, in one pass."""
        from transformers import DynamicCache

        model = models[mode].model
        with torch.inference_mode():
            logits = _pass(model, forwards[mode], DynamicCache(config=model.config), prompt + text, 0, len(text) + 1)
        return torch.log_softmax(logits[:-1].double(), -1)

    texts = [greedy(a.reference, p) for p in ids]
    for mode in models:
        if mode == a.reference:
            continue
        same, firsts, agree, total, kls, diffs = 0, [], 0, 0, [], []
        for prompt, text in zip(ids, texts):
            mine = greedy(mode, prompt)
            first = next((i for i, (x, y) in enumerate(zip(mine, text)) if x != y), None)
            same += first is None
            firsts.append("-" if first is None else str(first))
            lp_r, lp_m = teacher_forced(a.reference, prompt, text), teacher_forced(mode, prompt, text)
            agree += int((lp_r.argmax(-1) == lp_m.argmax(-1)).sum())
            total += len(text)
            kls.append((lp_r.exp() * (lp_r - lp_m)).sum(-1))
            t = torch.tensor(text)[:, None]
            diffs.append((lp_r.gather(-1, t) - lp_m.gather(-1, t)).abs()[:, 0])
        kl, d = torch.cat(kls), torch.cat(diffs)
        cells.append([mode, f"{same}/{len(ids)}", ", ".join(firsts), f"{agree}/{total}",
                      *(f"{x:.4f}" for x in (kl.mean(), kl.max(), d.mean(), d.max()))])
        log(" | ".join(cells[-1]))
    return (f"Against {a.reference}, {len(prompts)} prompts, {a.new_tokens} greedy tokens each:\n\n" + report.markdown_table(
        ["mode", "same greedy text", "first difference at", "top-1 agreement (teacher-forced)", "KL mean", "KL max",
         "mean abs log-prob diff", "max"], cells))
