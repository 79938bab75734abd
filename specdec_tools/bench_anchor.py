"""`specdec bench anchor`: this project beside llama.cpp's own server on the same GGUF files, in one run.

  specdec bench anchor --llama-server PATH [--also-llama-server LABEL=PATH] [--target-gguf F --draft-gguf F] [--threads N]
                       [--max-new-tokens 48] [--prompts 4] [--concurrency 4] [--out DIR]

The anchor is the engine a CPU user would pick instead: llama.cpp's `llama-server` (built from the
llama-cpp-python sdist, see docs/performance.md), loaded from the very GGUF files our
default pair is converted from (`source.json` in the model store's converted directory), or
from --target-gguf / --draft-gguf. Rows, one after another, never two engines at once:

  llama.cpp, target alone      `llama-server -m TARGET -t N --parallel C`
  llama.cpp, target + draft    the same plus `-md DRAFT --spec-type draft-simple --spec-draft-n-max 8`
  ours, default                the three services as `specdec run` starts them (specdec_tools.stack),
                               request gamma unset: the server's gamma and its goodput policy
  ours, gamma 0                the same services, the target alone

Columns: the prompts one at a time, then all at once (--concurrency clients), each after one
warm-up request; generated tokens over wall time. Both engines get the same token ids (the
chat-templated prompts of specdec_tools.bench.PROMPTS, tokenized once here), greedy, at most
--max-new-tokens each; llama.cpp's `/completion` gets `cache_prompt: false`, so every run
prefills cold as ours does. Greedy agreement per prompt: leading tokens llama.cpp's target alone
shares with ours, whether the whole outputs are equal, ours default against ours gamma 0 and
llama.cpp with its draft against without; and, per row, whether all-at-once outputs equal
one-at-a-time ones (batch invariance). Our default target (int4-rows) computes with the GGUF's own
Q4_K and Q6_K blocks, int8 activations a row; --quantize fp16 makes
all its weights the GGUF's exactly dequantized (float activations: near-ties can differ either way).
Writes table.md and results.json to --out; prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec_tools import report

DEFAULT_OUT = "docs/benchmarks/anchor-llama-cpp"
ROWS = {  # key: title, in the order they run and print
    "llama": "llama.cpp server, target alone",
    "llama-draft": "llama.cpp server, target + draft (draft-simple)",
    "ours": "this project, default (speculative, goodput gamma)",
    "ours-g0": "this project, gamma 0 (target alone)",
}
ANCHOR = "llama"  # ratios are against this row
SEQUENTIAL, CONCURRENT = "one", "all"  # the two columns


# ---------------------------------------------------------------------------------------------
# arguments


def executable(text: str) -> str:
    """--llama-server: an existing executable file, checked before any model loads."""
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(
            f"'{text}' does not exist: build llama-server first (docs/performance.md: the llama-cpp-python "
            "sdist, cmake --build build --target llama-server) and pass build/bin/llama-server")
    if not os.access(path, os.X_OK):
        raise argparse.ArgumentTypeError(f"'{text}' is not executable")
    return str(path.resolve())


def labelled_executable(text: str) -> tuple[str, str]:
    """--also-llama-server LABEL=PATH: another llama-server build (e.g. avx512=.../llama-server)."""
    label, eq, path = text.partition("=")
    if not eq or not label.replace("-", "").isalnum():
        raise argparse.ArgumentTypeError(f"'{text}': give LABEL=PATH, e.g. avx512=build512/bin/llama-server")
    return label, executable(path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET

    p.add_argument("--llama-server", type=executable, required=True, metavar="PATH",
                   help="llama.cpp's llama-server binary")
    p.add_argument("--also-llama-server", type=labelled_executable, action="append", default=[],
                   metavar="LABEL=PATH", help="another llama-server build (e.g. one for AVX-512): a row of its "
                   "target alone beside the first's; repeatable")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"our target model (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"our draft model (default {DEFAULT_DRAFT})")
    p.add_argument("--quantize", default="auto", choices=["auto", "none", "fp16", "int8", "int8-rows", "int4-rows", "q4k-rows"],
                   help="our workers' --quantize (default auto: int4-rows for the target, int8-rows for the draft, "
                        "where the native kernel builds)")
    p.add_argument("--target-gguf", default=None, help="llama.cpp's target (default: the GGUF --target comes from)")
    p.add_argument("--draft-gguf", default=None, help="llama.cpp's draft (default: the GGUF --draft comes from)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t (default: all CPUs)")
    p.add_argument("--spec-n-max", type=int, default=8, help="llama-server --spec-draft-n-max (default 8)")
    p.add_argument("--ctx-size", type=int, default=8192, help="llama-server -c, shared by its slots (default 8192)")
    p.add_argument("--prompts", type=int, default=4, help="the first N of specdec_tools.bench.PROMPTS (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4,
                   help="clients of the all-at-once column, and llama-server --parallel (default 4)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--startup-timeout", type=float, default=1800.0)


# ---------------------------------------------------------------------------------------------
# results (pure)


@dataclass
class Output:
    """One request's answer."""
    prompt: int
    token_ids: list[int]
    seconds: float
    text: str = ""
    drafted: int = 0
    accepted: int = 0
    gamma: float | None = None  # ours: the mean gamma the server's policy chose


@dataclass
class Run:
    """One row x column: its requests and the column's wall time."""
    row: str
    column: str  # SEQUENTIAL or CONCURRENT
    wall_s: float
    outputs: list[Output] = field(default_factory=list)
    load_1m: float | None = None  # the host's 1-min load average as the column started (ours included: ~2 is
    # the benchmark alone on 2 cores, well above it someone else's work)

    @property
    def tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


def parse_completion(body: dict, prompt: int, seconds: float) -> Output:
    """llama-server's non-streamed /completion answer (`return_tokens: true`) as an Output; its
    drafts are in timings.draft_n / draft_n_accepted, absent when nothing was drafted."""
    timings = body.get("timings") or {}
    ids = list(body.get("tokens") or [])
    if not ids and body.get("tokens_predicted"):
        raise ValueError("llama-server answered without token ids: is `return_tokens` supported by this build?")
    return Output(prompt, ids, seconds, body.get("content", ""), int(timings.get("draft_n", 0)),
                  int(timings.get("draft_n_accepted", 0)))


def common_prefix(a: list, b: list) -> int:
    """How many leading items a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarize(runs: list[Run], anchor: str = ANCHOR, titles: dict[str, str] | None = None) -> list[dict]:
    """One row per engine row: tok/s in each column, the ratio to the anchor row in the same
    column, acceptance (accepted / drafted over both columns), our mean gamma per column, and how
    many all-at-once outputs equal the same prompt's one-at-a-time output."""
    by = {(r.row, r.column): r for r in runs}

    def tps(run):
        return run.tokens / run.wall_s if run and run.wall_s > 0 else None

    rows = []
    for row in dict.fromkeys(r.row for r in runs):
        entry = {"row": row, "title": (titles or ROWS).get(row, ROWS.get(row, row))}
        for column in (SEQUENTIAL, CONCURRENT):
            mine, base = tps(by.get((row, column))), tps(by.get((anchor, column)))
            entry[f"{column}_tok_s"] = None if mine is None else round(mine, 2)
            entry[f"{column}_vs_anchor"] = round(mine / base, 3) if mine is not None and base else None
        outs = [o for c in (SEQUENTIAL, CONCURRENT) if (row, c) in by for o in by[row, c].outputs]
        drafted, accepted = sum(o.drafted for o in outs), sum(o.accepted for o in outs)
        entry["acceptance"] = round(accepted / drafted, 3) if drafted else None
        entry["drafted"], entry["accepted"] = drafted, accepted
        for column in (SEQUENTIAL, CONCURRENT):  # what our gamma policy chose, per request
            gammas = [o.gamma for o in by[row, column].outputs if o.gamma is not None] if (row, column) in by else []
            entry[f"{column}_mean_gamma"] = round(sum(gammas) / len(gammas), 2) if gammas else None
        seq, con = by.get((row, SEQUENTIAL)), by.get((row, CONCURRENT))
        if seq and con:
            ref = {o.prompt: o.token_ids for o in seq.outputs}
            same = sum(o.token_ids == ref.get(o.prompt) for o in con.outputs)
            entry["concurrent_same_as_sequential"] = f"{same}/{len(con.outputs)}"
        rows.append(entry)
    return rows


def agreement(runs: list[Run], anchor: str = ANCHOR, ours: str = "ours", ours_g0: str = "ours-g0",
              anchor_draft: str = "llama-draft") -> list[dict]:
    """Per prompt, one-at-a-time outputs: leading tokens the anchor shares with ours (default),
    whether the two are identical, ours default against ours gamma 0, and the anchor with its
    draft against without (each engine's speculation should not change its greedy output)."""
    seq = {r.row: {o.prompt: o.token_ids for o in r.outputs} for r in runs if r.column == SEQUENTIAL}
    rows = []
    for prompt in sorted(set(seq.get(anchor, {})) | set(seq.get(ours, {}))):
        a, b, g0, ad = (seq.get(k, {}).get(prompt) for k in (anchor, ours, ours_g0, anchor_draft))
        row = {"prompt": prompt, "anchor_tokens": None if a is None else len(a),
               "ours_tokens": None if b is None else len(b)}
        if a is not None and b is not None:
            row["shared_prefix"], row["identical"] = common_prefix(a, b), a == b
        if b is not None and g0 is not None:
            row["ours_equals_gamma0"] = b == g0
            row["ours_gamma0_shared_prefix"] = common_prefix(b, g0)
        if a is not None and ad is not None:
            row["anchor_draft_equals_anchor"] = ad == a
        rows.append(row)
    return rows


def _cell(value, fmt: str) -> str:
    return "" if value is None else fmt.format(value)


def _drafts(r: dict) -> str:
    """'0.638 (410/642)'; 'none drafted' for a speculative row whose drafting stayed off."""
    if r["drafted"]:
        return f"{r['acceptance']:.3f} ({r['accepted']}/{r['drafted']})"
    return "none drafted" if r["row"] in ("llama-draft", "ours") else ""


def format_table(rows: list[dict], concurrency: int) -> str:
    head = ["engine", "one at a time tok/s", "vs llama.cpp target alone", f"{concurrency} at once tok/s",
            "vs llama.cpp target alone", "acceptance (accepted/drafted)", f"{concurrency} at once = one at a time"]
    return report.markdown_table(head, ([r["title"], _cell(r["one_tok_s"], "{:.2f}"), _cell(r["one_vs_anchor"], "{:.2f}x"),
                                         _cell(r["all_tok_s"], "{:.2f}"), _cell(r["all_vs_anchor"], "{:.2f}x"), _drafts(r),
                                         r.get("concurrent_same_as_sequential", "")] for r in rows),
                                 align=["---", "---:", "---:", "---:", "---:", "---", "---"])


def format_agreement(rows: list[dict]) -> str:
    yes = {True: "yes", False: "no", None: ""}
    head = ["prompt", "tokens, llama.cpp / ours", "leading tokens shared", "identical", "ours default = ours gamma 0",
            "llama.cpp with draft = without"]
    return report.markdown_table(head, ([r["prompt"], f"{r['anchor_tokens']} / {r['ours_tokens']}",
                                         _cell(r.get("shared_prefix"), "{}"), yes[r.get("identical")],
                                         yes[r.get("ours_equals_gamma0")], yes[r.get("anchor_draft_equals_anchor")]]
                                        for r in rows), align=["---", "---", "---:", "---", "---", "---"])


def source_gguf(converted_dir: str) -> str:
    """The GGUF file the model store converted `converted_dir` from (its source.json), checked
    to be there with the size it had then."""
    meta_path = Path(converted_dir) / "source.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{converted_dir} has no source.json (not converted from a GGUF by the model "
                                "store): pass --target-gguf / --draft-gguf")
    meta = json.loads(meta_path.read_text())
    path = Path(meta["source_gguf"])
    if not path.is_file() or path.stat().st_size != meta.get("source_size", path.stat().st_size):
        raise FileNotFoundError(f"{path}, the GGUF {converted_dir} was converted from, is gone or changed: "
                                "pass --target-gguf / --draft-gguf")
    return str(path)


# ---------------------------------------------------------------------------------------------
# llama.cpp


def llama_command(a: argparse.Namespace, target_gguf: str, draft_gguf: str | None, port: int,
                  binary: str | None = None) -> list[str]:
    cmd = [binary or a.llama_server, "-m", target_gguf, "-t", str(a.threads), "--parallel", str(a.concurrency),
           "-c", str(a.ctx_size), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    if draft_gguf:
        cmd += ["-md", draft_gguf, "--spec-type", "draft-simple", "--spec-draft-n-max", str(a.spec_n_max)]
    return cmd


def _http(url: str, body: dict | None = None, timeout: float = 3600.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class LlamaServer:
    """llama-server as a child process on loopback, its log in a file."""

    def __init__(self, cmd: list[str], port: int, log_path: Path):
        self.cmd, self.base, self.log_path = cmd, f"http://127.0.0.1:{port}", log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> dict:
        """Starts it and waits for /health; returns /props."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} during start-up:\n{tail}")
            try:
                _http(self.base + "/health", timeout=5)
                return _http(self.base + "/props", timeout=5)
            except (urllib.error.URLError, ConnectionError, TimeoutError):  # loading, or not listening yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def complete(self, ids: list[int], prompt: int, max_new_tokens: int) -> Output:
        body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": 0.0, "cache_prompt": False,
                "return_tokens": True, "stream": False}
        t0 = time.perf_counter()
        answer = _http(self.base + "/completion", body)
        return parse_completion(answer, prompt, time.perf_counter() - t0)

    def stop(self) -> None:
        from specdec_tools.stack import stop_processes

        stop_processes([self.proc] if self.proc else [], 30.0)


def cpu_model() -> str:
    """The CPU's model name and whether it has AVX-512 (Linux; '' elsewhere)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    return f"{name}, {'with' if ' avx512f' in info else 'no'} AVX-512"


def llama_version(path: str) -> str:
    try:
        r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unknown ({err})"
    return " ".join(line.strip() for line in (r.stdout + r.stderr).splitlines() if line.strip()
                    and (line.startswith("version") or line.startswith("built with")))


# ---------------------------------------------------------------------------------------------
# running


def _columns(row: str, one, prompts: list[list[int]], concurrency: int, log) -> list[Run]:
    """The prompts one at a time, then all at once (`concurrency` clients), after one warm-up
    request; one(ids, prompt index) -> Output."""
    one(prompts[0], -1)  # warm-up
    runs = []
    load, t0 = os.getloadavg()[0], time.perf_counter()
    seq = [one(ids, i) for i, ids in enumerate(prompts)]
    runs.append(Run(row, SEQUENTIAL, time.perf_counter() - t0, seq, load))
    load, t0 = os.getloadavg()[0], time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        con = list(pool.map(lambda item: one(item[1], item[0]), enumerate(prompts)))
    runs.append(Run(row, CONCURRENT, time.perf_counter() - t0, con, load))
    for r in runs:
        log(f"{ROWS.get(row, row)}, {'one at a time' if r.column == SEQUENTIAL else f'{concurrency} at once'}: "
            f"{r.tokens} tokens in {r.wall_s:.2f} s = {r.tokens / r.wall_s:.2f} tok/s "
            f"(load average {r.load_1m:.2f} at its start)")
    return runs


def cmd_bench_anchor(a: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from orchestrator.client import Client
    from specdec.model_store import resolve_model
    from specdec_tools.bench import PROMPTS
    from specdec_tools.stack import DEFAULT_DRAFT_VOCAB, ProcessStack, free_port

    log = lambda msg: print(f"[bench-anchor] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # like Ctrl-C: the children are stopped
    # fetched and converted first, so the workers never race on the cache
    target_dir, draft_dir = str(resolve_model(a.target)), str(resolve_model(a.draft))
    target_gguf = a.target_gguf or source_gguf(target_dir)
    draft_gguf = a.draft_gguf or source_gguf(draft_dir)
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False).input_ids
               for p in PROMPTS[: a.prompts]]
    runs: list[Run] = []
    llama: dict = {"path": a.llama_server, "version": llama_version(a.llama_server), "commands": {},
                   "also": {label: path for label, path in a.also_llama_server}}
    try:
        with tempfile.TemporaryDirectory(prefix="specdec-bench-anchor-") as tmp:
            servers = [("llama", a.llama_server, None), ("llama-draft", a.llama_server, draft_gguf),
                       *((f"llama-{label}", path, None) for label, path in a.also_llama_server)]
            for row, binary, draft in servers:
                port = free_port()
                cmd = llama_command(a, target_gguf, draft, port, binary)
                llama["commands"][row] = shlex.join(cmd)
                server = LlamaServer(cmd, port, Path(tmp) / f"{row}.log")
                try:
                    log(f"starting {shlex.join(cmd)}")
                    props = server.start(a.startup_timeout)
                    llama.setdefault("build_info", props.get("build_info"))
                    runs += _columns(row, lambda ids, i: server.complete(ids, i, a.max_new_tokens), prompts,
                                     a.concurrency, log)
                finally:
                    server.stop()
        stack = ProcessStack(target_dir, draft_dir, quantization=a.quantize, draft_vocab=DEFAULT_DRAFT_VOCAB)
        try:
            log(f"starting target, draft and orchestrator ({a.target} + {a.draft}) ...")
            stack.start(stdout=subprocess.DEVNULL)
            stack.wait_until_ready(a.startup_timeout)
            with Client(stack.address, timeout_s=3600.0) as client:
                for row, gamma in (("ours", None), ("ours-g0", 0)):
                    def one(ids, i, gamma=gamma):
                        t0 = time.perf_counter()
                        r = client.generate(token_ids=ids, max_new_tokens=a.max_new_tokens, temperature=0.0,
                                            gamma=gamma)
                        return Output(i, list(r.token_ids), time.perf_counter() - t0, r.text,
                                      r.stats.get("drafted_tokens", 0), r.stats.get("accepted_tokens", 0),
                                      r.stats.get("mean_gamma", r.stats.get("gamma")))

                    runs += _columns(row, one, prompts, a.concurrency, log)
        finally:
            stack.stop()
    except KeyboardInterrupt:
        log("interrupted; stopped the servers")
        return 130

    titles = {**ROWS, **{f"llama-{label}": f"llama.cpp server ({label} build), target alone"
                         for label, _ in a.also_llama_server}}
    rows, agree = summarize(runs, titles=titles), agreement(runs)
    import torch

    meta = {
        "machine": report.machine(cpu=cpu_model(), torch=torch.__version__, torch_threads=torch.get_num_threads(),
                                  load_average_at_end=os.getloadavg()),
        "llama_cpp": llama,
        "models": {"target": a.target, "draft": a.draft, "target_dir": target_dir, "draft_dir": draft_dir,
                   "target_gguf": target_gguf, "draft_gguf": draft_gguf, "our_draft_vocab": DEFAULT_DRAFT_VOCAB,
                   "our_quantize": a.quantize},
        "command": report.command_line(),
        "settings": {"prompts": a.prompts, "prompt_tokens": [len(p) for p in prompts],
                     "max_new_tokens": a.max_new_tokens, "concurrency": a.concurrency, "threads": a.threads,
                     "spec_n_max": a.spec_n_max, "ctx_size": a.ctx_size, "temperature": 0.0},
    }
    table = format_table(rows, a.concurrency)
    agree_table = format_agreement(agree)
    out = report.out_dir(a.out)
    report.write_table(out, f"{table}\n\nGreedy agreement, one at a time (llama.cpp target alone vs ours "
                            f"default):\n\n{agree_table}")
    report.write_json(out / "results.json", {**meta, "rows": rows, "agreement": agree, "runs": [asdict(r) for r in runs]})
    log(f"wrote table.md and results.json to {out}")
    return 0
