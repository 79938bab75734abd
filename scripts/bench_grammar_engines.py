"""Grammar engines for structured output, measured side by side on the default pair's tokenizer:
llguidance and xgrammar (whichever of the two is importable).

For each engine: wrapping the tokenizer; compiling a JSON schema (an extraction schema: 7 fields,
a nested object, an enum, an array of strings), `json_object` (any JSON object), a regex and a
choice list (fresh compile each time: no engine cache); creating a matcher for a session from a
compiled grammar; per-token mask cost while a valid document is fed token by token (teacher
forced: the tokenizer's own tokenization of the document) and while tokens are drawn at random
from the mask; rollback; the target's verify pattern (masks after each of gamma drafts, then
roll back). Then, engine-free, the cost of applying a packed mask to a 151,936-wide logits row.

xgrammar pulls triton (~1 GB), so it is measured from a throwaway virtualenv:

    python3 -m venv /tmp/xgr-venv
    /tmp/xgr-venv/bin/pip install torch==2.13.0 "transformers>=5.23,<5.24" xgrammar==0.2.8 llguidance==1.9.1
    /tmp/xgr-venv/bin/pip uninstall -y triton        # optional: shows the CPU path needs no triton
    /tmp/xgr-venv/bin/python scripts/bench_grammar_engines.py [--tokenizer DIR] [--json out.json]

With the project's virtualenv it measures llguidance alone: `.venv/bin/python scripts/bench_grammar_engines.py`.
--tokenizer defaults to the converted default target in the model cache (`specdec fetch` makes it).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

VOCAB = 151_936  # the default pair's embedding rows (the tokenizer may have fewer)
EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>
GAMMA = 5

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["engineer", "manager", "designer", "other"]},
        "skills": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "country"],
            "additionalProperties": False,
        },
        "email": {"type": "string"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "skills", "address", "active"],
    "additionalProperties": False,
}
SCHEMA_DOC = json.dumps({
    "name": "Ada Lovelace", "age": 36, "role": "engineer",
    "skills": ["mathematics", "poetry", "analytical engines"],
    "address": {"city": "London", "country": "United Kingdom"}, "email": "ada@example.org", "active": True,
})
REGEX = r"[A-Z][a-z]+ [A-Z][a-z]+, \d{4}-\d{2}-\d{2}, [a-z0-9._]+@[a-z0-9]+\.(com|org|net)"
REGEX_DOC = "Ada Lovelace, 1815-12-10, ada.lovelace@example.org"
CHOICES = ["positive", "negative", "neutral", "mixed"]

# name -> (kind, text, a document it accepts)
GRAMMARS = {
    "json_schema": ("json_schema", json.dumps(SCHEMA), SCHEMA_DOC),
    "json_object": ("json_object", '{"type": "object"}', SCHEMA_DOC),
    "regex": ("regex", REGEX, REGEX_DOC),
    "choice": ("choice", json.dumps(CHOICES), "neutral"),
}


class Llguidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.version = llguidance.__version__
        t0 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=VOCAB, eos_token=EOS)
        self.wrap_s = time.perf_counter() - t0

    def compile(self, kind: str, text: str):
        M = self.llg.LLMatcher
        grammar = {
            "json_schema": M.grammar_from_json_schema,
            "json_object": M.grammar_from_json_schema,
            "regex": M.grammar_from_regex,
            "choice": lambda t: self.llg.grammar_from("choice", t),
        }[kind](text)
        m = M(self.tok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m  # a pristine matcher is the compiled grammar: sessions deep_copy it

    def new_matcher(self, compiled):
        return compiled.deep_copy()

    def new_buffer(self):
        return np.zeros((VOCAB + 31) // 32, dtype=np.int32)

    def fill(self, m, buf) -> None:
        m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)

    def consume(self, m, token: int) -> bool:
        return m.consume_token(token)

    def rollback(self, m, n: int) -> None:
        assert m.rollback(n)

    def forced(self, m) -> list[int]:
        return m.compute_ff_tokens()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer):
        import xgrammar

        from importlib.metadata import version

        self.xgr = xgrammar
        self.version = version("xgrammar")
        t0 = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=VOCAB, stop_token_ids=EOS)
        self.wrap_s = time.perf_counter() - t0

    def compile(self, kind: str, text: str):
        # a new compiler per compile with its cache off: every compile is a cold one
        c = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        if kind in ("json_schema", "json_object"):
            return c.compile_json_schema(text)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in json.loads(text)))
        raise ValueError(kind)

    def new_matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def new_buffer(self):
        return self.xgr.allocate_token_bitmask(1, VOCAB)

    def fill(self, m, buf) -> None:
        m.fill_next_token_bitmask(buf)

    def consume(self, m, token: int) -> bool:
        return m.accept_token(token)

    def rollback(self, m, n: int) -> None:
        m.rollback(n)

    def forced(self, m) -> list[int]:
        return []  # xgrammar has find_jump_forward_string (a string, not tokens)


def allowed(buf) -> np.ndarray:
    words = buf.numpy() if isinstance(buf, torch.Tensor) else buf
    return np.unpackbits(words.reshape(-1).view(np.uint8), bitorder="little")[:VOCAB].astype(bool)


def us(seconds: list[float]) -> dict:
    xs = sorted(s * 1e6 for s in seconds)
    return {"n": len(xs), "mean": statistics.fmean(xs), "p50": xs[len(xs) // 2],
            "p99": xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))], "max": xs[-1]}


def bench_compile(engine, repeats: int) -> dict:
    out = {}
    for name, (kind, text, _) in GRAMMARS.items():
        compile_s, first_mask_s = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiled = engine.compile(kind, text)
            t1 = time.perf_counter()
            m = engine.new_matcher(compiled)
            engine.fill(m, engine.new_buffer())
            compile_s.append(t1 - t0)
            first_mask_s.append(time.perf_counter() - t1)
        out[name] = {"compile_ms": statistics.median(compile_s) * 1e3, "compile_first_ms": compile_s[0] * 1e3,
                     "first_mask_ms": statistics.median(first_mask_s) * 1e3}
    return out


def feed(engine, compiled, tokens: list[int], buf) -> tuple[list[float], list[float], int]:
    """Mask then consume, token by token; returns mask times, consume times, tokens the mask forbade."""
    m = engine.new_matcher(compiled)
    masks, consumes, forbidden = [], [], 0
    for t in tokens:
        t0 = time.perf_counter()
        engine.fill(m, buf)
        t1 = time.perf_counter()
        ok = engine.consume(m, t)
        t2 = time.perf_counter()
        masks.append(t1 - t0)
        consumes.append(t2 - t1)
        forbidden += not ok
    return masks, consumes, forbidden


def bench_tokens(engine, hf_tokenizer, docs: int, random_walks: int, seed: int) -> dict:
    out = {}
    buf = engine.new_buffer()
    for name, (kind, text, doc) in GRAMMARS.items():
        compiled = engine.compile(kind, text)
        tokens = hf_tokenizer.encode(doc, add_special_tokens=False) + [EOS[0]]
        cold_m, _, forbidden = feed(engine, compiled, tokens, buf)  # the first document: lexer states built
        warm_m, warm_c = [], []
        for _ in range(docs):
            mk, cs, _ = feed(engine, compiled, tokens, buf)
            warm_m += mk
            warm_c += cs
        # random walks: a uniformly drawn allowed token at each step (odd tokens, deep in strings)
        rng = random.Random(seed)
        walk_m = []
        for _ in range(random_walks):
            m = engine.new_matcher(compiled)
            for _ in range(64):
                t0 = time.perf_counter()
                engine.fill(m, buf)
                walk_m.append(time.perf_counter() - t0)
                ids = np.flatnonzero(allowed(buf))
                tok = int(ids[rng.randrange(len(ids))])
                if tok in EOS:
                    break
                assert engine.consume(m, tok)
        out[name] = {"doc_tokens": len(tokens), "doc_tokens_forbidden": forbidden, "cold_mask_us": us(cold_m),
                     "mask_us": us(warm_m), "consume_us": us(warm_c), "random_walk_mask_us": us(walk_m)}
    return out


def bench_rollback(engine, hf_tokenizer, repeats: int) -> dict:
    """At every position of the schema document: consume GAMMA tokens, roll them back (timed);
    and the verify pattern: mask, consume, ... GAMMA+1 masks, then the rollback (timed whole)."""
    kind, text, doc = GRAMMARS["json_schema"]
    compiled = engine.compile(kind, text)
    tokens = hf_tokenizer.encode(doc, add_special_tokens=False)
    buf = engine.new_buffer()
    rolls, verifies, new = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = engine.new_matcher(compiled)
        new.append(time.perf_counter() - t0)
        for pos in range(len(tokens) - GAMMA):
            drafts = tokens[pos:pos + GAMMA]
            for t in drafts:
                assert engine.consume(m, t)
            t0 = time.perf_counter()
            engine.rollback(m, GAMMA)
            rolls.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for t in drafts:
                engine.fill(m, buf)
                engine.consume(m, t)
            engine.fill(m, buf)
            engine.rollback(m, GAMMA)
            verifies.append(time.perf_counter() - t0)
            assert engine.consume(m, tokens[pos])
    return {"gamma": GAMMA, "rollback_us": us(rolls), "verify_masks_us": us(verifies), "new_matcher_us": us(new)}


def bench_apply(repeats: int) -> dict:
    """Engine-free: a packed mask (int32 words, bit i of word w = token 32w+i) applied in place to one
    float32 logits row of VOCAB, on three masks: 8 allowed ids (a JSON key position), 97% allowed
    (inside a string) and a random half (the worst case for branchy code). torch on one thread, and on
    two for the 97% mask: on a busy 2-core machine each torch op's OpenMP region then waits for a core."""
    threads = torch.get_num_threads()
    rng = np.random.default_rng(0)
    masks = {"8 allowed": np.isin(np.arange(VOCAB), rng.choice(VOCAB, 8, replace=False)),
             "97% allowed": rng.random(VOCAB) < 0.97, "random half": rng.random(VOCAB) < 0.5}
    shifts = torch.arange(32, dtype=torch.int32)
    bias = torch.empty(VOCAB, dtype=torch.int32)
    bias_np = bias.numpy()
    out = {}
    for mask_name, n_threads in [(name, 1) for name in masks] + [("97% allowed", 2)]:
        torch.set_num_threads(n_threads)
        mask = masks[mask_name]
        mask_name = f"{mask_name}, {n_threads} thread{'s' if n_threads > 1 else ''}"
        words = np.ascontiguousarray(np.packbits(np.pad(mask, (0, -VOCAB % 32)), bitorder="little").view(np.int32))
        inverted = np.empty_like(words)
        words_t = torch.from_numpy(words)
        row = torch.randn(VOCAB)

        def unpack_bool_masked_fill():
            bits = np.unpackbits(words.view(np.uint8), bitorder="little", count=VOCAB)
            row.masked_fill_(torch.from_numpy(bits).view(torch.bool).logical_not_(), float("-inf"))

        def torch_shift_masked_fill():
            bits = (words_t.unsqueeze(1) >> shifts).bitwise_and_(1).view(-1)[:VOCAB]
            row.masked_fill_(bits == 0, float("-inf"))

        def int_trick_add():  # branch-free: forbidden bit * 0xFF800000 is the bit pattern of -inf
            np.invert(words, out=inverted)
            forbidden = torch.from_numpy(np.unpackbits(inverted.view(np.uint8), bitorder="little", count=VOCAB))
            bias.copy_(forbidden).mul_(-8388608)
            row.add_(bias.view(torch.float32))

        def numpy_only():  # specdec.grammar's apply: no torch op, so no OpenMP region
            np.invert(words, out=inverted)
            forbidden = np.unpackbits(inverted.view(np.uint8), bitorder="little", count=VOCAB)
            np.multiply(forbidden, np.int32(-8388608), out=bias_np, casting="unsafe")
            r = row.numpy()
            np.add(r, bias_np.view(np.float32), out=r)

        def unpack_only():  # allowed_mask(): a bool tensor, no logits touched
            torch.from_numpy(np.unpackbits(words.view(np.uint8), bitorder="little", count=VOCAB)).view(torch.bool)

        cases = {"unpack to a bool tensor only": unpack_only,
                 "numpy unpackbits + masked_fill_": unpack_bool_masked_fill,
                 "torch shift-and + masked_fill_": torch_shift_masked_fill,
                 "numpy unpackbits + int32 -inf bias, torch add_": int_trick_add,
                 "the same all in numpy (specdec.grammar)": numpy_only}
        try:
            import xgrammar

            bm, row2 = words_t.unsqueeze(0), row.unsqueeze(0)
            cases["xgrammar.apply_token_bitmask_inplace (cpu)"] = lambda: xgrammar.apply_token_bitmask_inplace(row2, bm)
        except ImportError:
            pass
        for name, fn in cases.items():
            fn()
            times = []
            for _ in range(repeats):
                row.normal_()  # every call sees finite logits, as a real one does
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out.setdefault(name, {})[mask_name] = us(times)
    torch.set_num_threads(threads)
    return out


def bench_matcher(hf_tokenizer, docs: int) -> dict | None:
    """specdec.grammar's Matcher over llguidance (project virtualenv only): what a worker pays a token."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        from specdec.grammar import GrammarCompiler, GrammarSpec
    except ImportError:
        return None
    compiler = GrammarCompiler(hf_tokenizer, VOCAB, EOS)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    compiled = compiler.compile(spec)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile(spec)
    hit_s = time.perf_counter() - t0
    tokens = hf_tokenizer.encode(SCHEMA_DOC, add_special_tokens=False) + [EOS[0]]
    row = torch.randn(VOCAB)
    times: dict[str, list[float]] = {k: [] for k in ("allowed_mask", "apply", "consume", "draft_masks", "truncate")}
    for _ in range(docs):
        m = compiled.matcher()
        for pos, t in enumerate(tokens):
            t0 = time.perf_counter()
            m.allowed_mask()
            t1 = time.perf_counter()
            m.apply(row)
            t2 = time.perf_counter()
            masks = m.draft_masks(tokens[pos + 1:pos + 1 + GAMMA]) if pos + 1 < len(tokens) else None
            t3 = time.perf_counter()
            m.consume([t])
            t4 = time.perf_counter()
            times["allowed_mask"].append(t1 - t0)
            times["apply"].append(t2 - t1)
            times["consume"].append(t4 - t3)
            if masks is not None and masks.shape[0] == GAMMA + 1:
                times["draft_masks"].append(t3 - t2)
            row.normal_()
        n = m.consumed
        t0 = time.perf_counter()
        m.truncate(n - GAMMA)
        times["truncate"].append(time.perf_counter() - t0)
    out = {k: us(v) for k, v in times.items()}
    out["compile_ms"] = compile_s * 1e3
    out["cache_hit_us"] = hit_s * 1e6
    return out


def default_tokenizer_dir() -> str:
    cache = Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")
    found = sorted(glob.glob(str(cache / "converted" / "qwen2.5-coder-1.5b-instruct-*")))
    if not found:
        sys.exit("no converted default target in the model cache: run `specdec fetch` or pass --tokenizer")
    return found[-1]


def table(results: dict) -> str:
    engines = list(results["engines"])
    lines = ["| measure | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]

    def row(label, get):
        cells = []
        for e in engines:
            try:
                cells.append(get(results["engines"][e]))
            except KeyError:
                cells.append("-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    def mean_p99(s: dict, digits: int = 1) -> str:
        return f"{s['mean']:.{digits}f} / {s['p99']:.{digits}f}"

    row("tokenizer wrap, ms", lambda r: f"{r['tokenizer_wrap_ms']:.0f}")
    for g in GRAMMARS:
        row(f"compile {g}, ms (median; first)",
            lambda r, g=g: f"{r['compile'][g]['compile_ms']:.2f}; {r['compile'][g]['compile_first_ms']:.2f}")
        row(f"first mask {g}, ms", lambda r, g=g: f"{r['compile'][g]['first_mask_ms']:.2f}")
    for g in GRAMMARS:
        n = results["engines"][engines[0]]["tokens"][g]["doc_tokens"]
        row(f"mask {g} ({n} tok), us mean / p99, warm", lambda r, g=g: mean_p99(r["tokens"][g]["mask_us"]))
        row(f"mask {g}, us mean / p99, first document", lambda r, g=g: mean_p99(r["tokens"][g]["cold_mask_us"]))
        row(f"mask {g}, us mean / p99, random walk", lambda r, g=g: mean_p99(r["tokens"][g]["random_walk_mask_us"]))
        row(f"consume {g}, us mean / p99", lambda r, g=g: mean_p99(r["tokens"][g]["consume_us"]))
        row(f"document tokens the mask forbade ({g})", lambda r, g=g: str(r["tokens"][g]["doc_tokens_forbidden"]))
    row(f"rollback of {GAMMA} tokens, us mean / p99", lambda r: mean_p99(r["rollback"]["rollback_us"]))
    row(f"verify: {GAMMA + 1} masks + {GAMMA} consumes + rollback, us mean / p99",
        lambda r: mean_p99(r["rollback"]["verify_masks_us"], 0))
    row("new matcher from a compiled grammar, us mean", lambda r: f"{r['rollback']['new_matcher_us']['mean']:.1f}")
    lines.append("")
    mask_names = list(next(iter(results["apply"].values())))
    lines.append(f"| applying a packed mask to a {VOCAB}-wide float32 row, us mean / p99 | "
                 + " | ".join(mask_names) + " |")
    lines.append("|---|" + "---|" * len(mask_names))
    for name, per_mask in results["apply"].items():
        lines.append(f"| {name} | " + " | ".join(mean_p99(per_mask[m]) for m in mask_names) + " |")
    if results.get("specdec_grammar"):
        g = results["specdec_grammar"]
        lines += ["", f"specdec.grammar.Matcher over llguidance, json_schema (compile {g['compile_ms']:.2f} ms, "
                  f"cache hit {g['cache_hit_us']:.1f} us):", "", "| call | us mean / p99 |", "|---|---|"]
        labels = {"allowed_mask": "allowed_mask() (bool [V])", "apply": "apply(logits row)",
                  "consume": "consume([t])", "draft_masks": f"draft_masks({GAMMA} drafts) -> [{GAMMA + 1}, V]",
                  "truncate": f"truncate(consumed - {GAMMA})"}
        for key, label in labels.items():
            lines.append(f"| {label} | {g[key]['mean']:.1f} / {g[key]['p99']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", help="a transformers tokenizer directory (default: the converted default target)")
    p.add_argument("--engines", default="llguidance,xgrammar", help="comma-separated; missing ones are skipped")
    p.add_argument("--compile-repeats", type=int, default=5)
    p.add_argument("--docs", type=int, default=20, help="warm passes over each document")
    p.add_argument("--random-walks", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args()
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(a.tokenizer or default_tokenizer_dir())
    results = {"python": sys.version.split()[0], "torch": torch.__version__, "cpus": os.cpu_count(),
               "triton_imported": None, "engines": {}}
    for name in a.engines.split(","):
        cls = {"llguidance": Llguidance, "xgrammar": Xgrammar}[name]
        try:
            engine = cls(hf)
        except ImportError as exc:
            print(f"{name}: not installed ({exc}); skipped", file=sys.stderr)
            continue
        print(f"{name} {engine.version}: measuring", file=sys.stderr)
        results["engines"][name] = {
            "version": engine.version, "tokenizer_wrap_ms": engine.wrap_s * 1e3,
            "compile": bench_compile(engine, a.compile_repeats),
            "tokens": bench_tokens(engine, hf, a.docs, a.random_walks, a.seed),
            "rollback": bench_rollback(engine, hf, max(1, a.docs // 4)),
        }
    results["apply"] = bench_apply(2000)
    results["specdec_grammar"] = bench_matcher(hf, a.docs)
    results["triton_imported"] = "triton" in sys.modules
    print(table(results))
    print(f"\ntriton imported during the run: {results['triton_imported']}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
