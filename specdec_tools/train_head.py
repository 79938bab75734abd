"""`specdec train-head`: train an EAGLE-3 feature head for a target from the target's own completions.

Two steps, each its own command:

  specdec train-head --generate   the target completes specdec_tools/head_data/prompts.jsonl through
                                  the service at gamma 0 (greedy, and sampled at --temperature);
                                  the token ids go to head_data/<target>.completions.jsonl.gz
                                  (committed: a later run never regenerates them)
  specdec train-head --out DIR    trains a head on them and writes it to DIR in the layout the
                                  draft worker loads (specdec/eagle3.py), then reports held-out
                                  acceptance

Training (Li et al. 2025, EAGLE-3; self-distillation as the public heads for small Qwen2.5 models):
the target, loaded as its worker loads it (the same quantization), runs each prompt + completion
once (teacher forcing) and gives the features of every row (the residual stream entering its
three feature layers) and its top --top next-token logits; both stay in memory, never on disk.
The head learns the target's distribution over the draft vocabulary (cross-entropy against the
target's top-k, renormalized) with the training-time test: step 1 reads the target's features,
steps 2..--ttt-steps read the head's own state from the step before at the same position,
attending to the target-fed rows up to where the chain started and to the chain's own rows, as
at drafting time. Frozen: the target's embedding and output rows (lm_head rows of the draft
vocabulary, not stored in the head). Trained: fc, the layer, its norms, the final norm.

The draft vocabulary (d2t) is the --draft-vocab most frequent tokens of the completions (then
of the prompts, then by id: Qwen's byte-pair merges come roughly in frequency order). Prompts
whose index is a multiple of --holdout-every are held out: the report is on them alone.

Checkpoints go to DIR/checkpoint.pt every --checkpoint-minutes; a stopped run started again with
the same flags resumes from it (its features are recomputed: about 11 ms a row on 2 cores).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

DATA_DIR = Path(__file__).parent / "head_data"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET

    p.add_argument("--target", default=DEFAULT_TARGET, help="the target the head drafts for (default pair's)")
    p.add_argument("--generate", action="store_true",
                   help="only complete the prompt set with the target (through the service, gamma 0)")
    p.add_argument("--data", default="", help="completions file (default head_data/<target>.completions.jsonl.gz)")
    p.add_argument("--out", default="", help="where the trained head goes (a directory)")
    g = p.add_argument_group("generating")
    g.add_argument("--address", default="", help="an orchestrator to use (default: start one on the target)")
    g.add_argument("--draft", default=DEFAULT_DRAFT, help="the draft of the stack it starts (unused at gamma 0)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7, help="of the sampled completions")
    g.add_argument("--sampled-every", type=int, default=2, help="a sampled completion for every Nth prompt")
    g.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    g.add_argument("--prompts", type=int, default=0, help="the first N prompts only (0: all)")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=float, default=2.0, help="passes over the training sequences")
    t.add_argument("--ttt-steps", type=int, default=4, help="training-time test: steps unrolled")
    t.add_argument("--intermediate", type=int, default=4096, help="the head's MLP width")
    t.add_argument("--draft-vocab", type=int, default=16384)
    t.add_argument("--top", type=int, default=32, help="target logits kept a row (the soft labels)")
    t.add_argument("--prompt-rows", action=argparse.BooleanOptionalAction, default=False,
                   help="train on the prompts' rows too (the target's distribution there; text it did not write)")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--batch-tokens", type=int, default=512,
                   help="completion rows an optimizer step, about (whole sequences: as many as make it on average)")
    t.add_argument("--holdout-every", type=int, default=20, help="prompt indices divisible by it are held out")
    t.add_argument("--limit", type=int, default=0, help="train on N of the sequences only, a sample fixed by --seed (0: all)")
    t.add_argument("--eval-every", type=int, default=0, help="held-out report every N optimizer steps (0: at the end)")
    t.add_argument("--checkpoint-minutes", type=float, default=10.0)
    t.add_argument("--variants", default="", metavar="K=V,..;..",
                   help="the ablation: before the head, train each variant from scratch on the same rows (keys: "
                        "ttt, intermediate, vocab, epochs, lr) and report it beside the head")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save", choices=("int8", "bfloat16", "float32"), default="int8",
                   help="how the head's Linear weights are stored (int8: per-row scales)")
    t.add_argument("--quantize", default="auto", help="the target's, as its worker's --quantize (the features it gives)")
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="matmuls in bfloat16 (autocast), weights and optimizer in float32")


# ---------------------------------------------------------------------------------------------
# data


def data_path(a) -> Path:
    from specdec.model_store import MODEL_ALIASES

    name = MODEL_ALIASES.get(a.target, a.target)
    return Path(a.data) if a.data else DATA_DIR / f"{Path(name).name}.completions.jsonl.gz"


def read_completions(path: Path) -> list[dict]:
    """The records of a completions file; a run stopped while writing leaves a last line cut short,
    which is dropped (--generate then makes it again)."""
    if not path.is_file():
        return []
    records = []
    try:
        with gzip.open(path, "rt") as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    break
    except (EOFError, gzip.BadGzipFile, zlib.error):
        pass
    return records


def write_completions(path: Path, records: list[dict]) -> None:
    """One gzip member, records by prompt and mode (what is committed)."""
    tmp = path.with_suffix(".tmp")
    with gzip.GzipFile(tmp, "wb", mtime=0) as f:  # mtime 0: the same records give the same bytes
        for r in sorted(records, key=lambda r: (r["prompt"], r["mode"])):
            f.write((json.dumps(r, separators=(",", ":")) + "\n").encode())
    tmp.replace(path)


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The ids the orchestrator sends for a one-message chat (orchestrator/decoder.py)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def cmd_generate(a) -> int:
    from transformers import AutoTokenizer

    from orchestrator.client import Client
    from specdec.model_store import resolve_model
    from specdec_tools.head_data.prompts import PROMPTS
    from specdec_tools.stack import ProcessStack

    path = data_path(a)
    target_dir = str(resolve_model(a.target))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = PROMPTS[: a.prompts] if a.prompts else PROMPTS
    records = read_completions(path)
    if records:
        write_completions(path, records)  # a tail cut short is dropped before appending
    done = {(r["prompt"], r["mode"]) for r in records}
    jobs = [(i, "greedy") for i in range(len(prompts))]
    jobs += [(i, "sampled") for i in range(len(prompts)) if i % a.sampled_every == 0]
    jobs = [j for j in jobs if j not in done]
    print(f"[train-head] {len(jobs)} completions to generate ({len(done)} already in {path})", flush=True)
    if not jobs:
        return 0
    stack = None
    address = a.address
    if not address:
        stack = ProcessStack(target_dir, str(resolve_model(a.draft))).start()
        stack.wait_until_ready(900)
        address = stack.address
    lock, count, tokens, t0 = threading.Lock(), [0], [0], time.monotonic()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with Client(address, timeout_s=3600) as client, gzip.open(path, "at") as out:
            def one(job):
                i, mode = job
                ids = prompt_ids(tokenizer, prompts[i]["prompt"])
                temperature = 0.0 if mode == "greedy" else a.temperature
                r = client.generate(token_ids=ids, max_new_tokens=a.max_new_tokens, temperature=temperature,
                                    gamma=0, **({"seed": i} if temperature > 0 else {}))
                record = {"prompt": i, "kind": prompts[i]["kind"], "mode": mode, "temperature": temperature,
                          "seed": i if temperature > 0 else None, "prompt_ids": ids, "ids": list(r.token_ids),
                          "finish": r.finish_reason}
                with lock:
                    out.write(json.dumps(record, separators=(",", ":")) + "\n")
                    out.flush()  # readable up to here if the run is stopped
                    records.append(record)
                    count[0] += 1
                    tokens[0] += len(r.token_ids)
                    elapsed = time.monotonic() - t0
                    eta = elapsed / count[0] * (len(jobs) - count[0])
                    print(f"[train-head] {count[0]}/{len(jobs)} completions, {tokens[0]} tokens, "
                          f"{tokens[0] / elapsed:.1f} tok/s, ETA {eta / 60:.1f} min", flush=True)

            with ThreadPoolExecutor(a.concurrency) as pool:
                for _ in pool.map(one, jobs):
                    pass
    finally:
        if stack is not None:
            stack.stop()
        write_completions(path, records)
    return 0


def draft_vocabulary(records: list[dict], vocab_size: int, size: int) -> torch.Tensor:
    """The draft vocabulary: target ids, most frequent in the completions first (then prompts, then by id)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for r in records:
        counts.index_add_(0, torch.tensor(r["ids"], dtype=torch.long), torch.ones(len(r["ids"]), dtype=torch.float64))
        counts.index_add_(0, torch.tensor(r["prompt_ids"], dtype=torch.long),
                          torch.full((len(r["prompt_ids"]),), 1e-3, dtype=torch.float64))
    counts -= torch.arange(vocab_size, dtype=torch.float64) * 1e-12  # ties: lower ids first
    return torch.sort(torch.topk(counts, size).indices).values


# ---------------------------------------------------------------------------------------------
# the teacher: the target's features and next-token logits, by teacher forcing


@dataclass
class Sequence:
    prompt: int
    mode: str
    ids: torch.Tensor  # [n] prompt + completion
    start: int  # prompt length: rows start - 1 .. n - 2 predict completion tokens
    features: torch.Tensor  # [n, 3 d] bfloat16
    labels_from: int  # the first row with the target's distribution: start - 1, or 0 with prompt rows
    top_ids: torch.Tensor  # [n - labels_from, top] int32 target ids, rows labels_from .. n - 1
    top_logits: torch.Tensor  # [.., top] float16
    lse: torch.Tensor  # [.., 2] float32: logsumexp of the full logits at temperature 1 and 0.7


class Teacher:
    def __init__(self, target: str, feature_layers: tuple[int, ...] | None, quantization: str = "auto"):
        from specdec.eagle3 import default_feature_layers
        from specdec.modeling import load_model
        from specdec.worker.forward import model_forward

        self.loaded = load_model(target, role="target", quantization=quantization)
        self.model = self.loaded.model
        self.config = self.model.config
        self.layers = tuple(feature_layers or default_feature_layers(self.config.num_hidden_layers))
        self.forward = model_forward(self.model)

    @torch.inference_mode()
    def run(self, record: dict, top: int, prompt_rows: bool = False) -> Sequence:
        from transformers import DynamicCache

        from specdec.worker.batching import RaggedCache

        ids = torch.tensor(record["prompt_ids"] + record["ids"], dtype=torch.long)
        n, start = len(ids), len(record["prompt_ids"])
        labels_from = 0 if prompt_rows else start - 1
        cache = RaggedCache([DynamicCache(config=self.config)], [n])
        keep = torch.arange(labels_from, n)
        logits, features = self.forward(ids[None], torch.arange(n)[None], cache, keep, aux=self.layers)
        logits = logits[0].float()
        values, idx = torch.topk(logits, top, dim=-1)
        lse = torch.stack([torch.logsumexp(logits, -1), torch.logsumexp(logits / 0.7, -1)], -1)
        return Sequence(record["prompt"], record["mode"], ids, start, features.to(torch.bfloat16), labels_from,
                        idx.to(torch.int32), values.to(torch.float16), lse)


# ---------------------------------------------------------------------------------------------
# the head, as trained (specdec/eagle3.py's Eagle3Head is the one served)


class TrainHead(nn.Module):
    def __init__(self, d: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, n_features: int,
                 eps: float, rope_theta: float, embed: torch.Tensor, lm_rows: torch.Tensor, final_norm: torch.Tensor):
        super().__init__()
        self.d, self.heads, self.kv_heads, self.head_dim, self.eps = d, heads, kv_heads, head_dim, eps
        self.fc = nn.Linear(n_features * d, d, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(d))
        self.hidden_norm = nn.Parameter(torch.ones(d))
        self.post_attention_layernorm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(2 * d, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * d, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * d, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)
        self.gate_proj = nn.Linear(d, intermediate, bias=False)
        self.up_proj = nn.Linear(d, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, d, bias=False)
        self.norm = nn.Parameter(final_norm.clone().float())
        for m in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj,
                  self.down_proj):
            nn.init.normal_(m.weight, std=0.02)
        self.register_buffer("embed", embed, persistent=False)  # frozen: the target's
        self.register_buffer("lm_rows", lm_rows, persistent=False)  # frozen: the target's output rows
        inv = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _rms(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _rope(self, x, positions):  # x [t, h, hd]
        freqs = positions[:, None].to(x.dtype) * self.inv_freq[None].to(x.dtype)
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def unroll(self, ids: torch.Tensor, features: torch.Tensor, steps: int, first_slot: int):
        """The training-time test over one sequence. Row r (r >= 1) reads token ids[r] and the
        target's feature of row r - 1; slot s is row s + 1. Step k at slot s is the k-th draft of a
        chain rooted at row s + 1: its token is ids[s + k], its state the step before's at slot s,
        its position s + k; it predicts the token after row s + k. Yields (k, logits over the draft
        vocabulary of slots first_slot.., the slots' count)."""
        n = ids.shape[0]
        t = n - 1
        dtype = self.fc.weight.dtype
        emb = self._rms(self.embed[ids[1:]].to(dtype), self.input_layernorm)  # [t, d]: rows 1..n-1
        state = self.fc(features[:-1].to(dtype))  # [t, d]
        positions = torch.arange(1, n)
        group = self.heads // self.kv_heads
        scale = self.head_dim ** -0.5
        k1 = v1 = None
        diag_k, diag_v = [], []
        for k in range(1, steps + 1):
            slots = t - k + 1
            if slots <= first_slot:
                return
            x = torch.cat([emb[k - 1:k - 1 + slots], self._rms(state[:slots], self.hidden_norm)], -1)
            q = self._rope(self.q_proj(x).view(slots, self.heads, self.head_dim), positions[k - 1:k - 1 + slots])
            kk = self._rope(self.k_proj(x).view(slots, self.kv_heads, self.head_dim), positions[k - 1:k - 1 + slots])
            vv = self.v_proj(x).view(slots, self.kv_heads, self.head_dim)
            q = q.view(slots, self.kv_heads, group, self.head_dim).permute(1, 2, 0, 3)  # [kv, g, s, hd]
            if k == 1:
                k1, v1 = kk.permute(1, 0, 2), vv.permute(1, 0, 2)  # [kv, t, hd]
            main = torch.matmul(q, k1[:, None, :slots].transpose(-1, -2)) * scale  # [kv, g, s, s]
            causal = torch.ones(slots, slots, dtype=torch.bool).tril()
            main = main.masked_fill(~causal, float("-inf"))
            if k > 1:
                diag_k.append(kk.permute(1, 0, 2))
                diag_v.append(vv.permute(1, 0, 2))
                own = torch.stack([(q * dk[:, None, :slots]).sum(-1) for dk in diag_k], -1) * scale  # [kv,g,s,k-1]
                weights = torch.softmax(torch.cat([main, own], -1), -1)
                out = torch.matmul(weights[..., :slots], v1[:, None, :slots])
                out = out + sum(weights[..., slots + j, None] * dv[:, None, :slots] for j, dv in enumerate(diag_v))
            else:
                out = torch.matmul(torch.softmax(main, -1), v1[:, None, :slots])
            out = out.permute(2, 0, 1, 3).reshape(slots, -1)
            residual = state[:slots] + self.o_proj(out)
            h = self._rms(residual, self.post_attention_layernorm)
            state = residual + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
            logits = F.linear(self._rms(state[first_slot:], self.norm), self.lm_rows)
            yield k, logits, slots


def soft_labels(seq: Sequence, t2d: torch.Tensor, rows: torch.Tensor):
    """The target's distribution over the draft vocabulary at target rows `rows` (renormalized over
    its top-k that the draft vocabulary holds): (draft indices [r, top] (0 where masked), probs)."""
    local = rows - seq.labels_from
    ids = seq.top_ids[local].long()
    draft = t2d[ids]
    logits = seq.top_logits[local].float().masked_fill(draft < 0, float("-inf"))
    return draft.clamp(min=0), torch.softmax(logits, -1).nan_to_num(0.0)


def loss_rows(seq: Sequence, prompt_rows: bool) -> int:
    return len(seq.ids) - (1 if prompt_rows else seq.start)


def sequence_loss(head: TrainHead, seq: Sequence, t2d: torch.Tensor, steps: int, weights: list[float],
                  prompt_rows: bool = False):
    """(loss, rows, per-step (correct, count)) of one sequence: slot s step k learns the target's
    row s + k, for rows start - 1 .. n - 2 (with prompt rows, 1 .. n - 2)."""
    lowest = 1 if prompt_rows else seq.start - 1
    if lowest < seq.labels_from:
        raise ValueError("prompt rows asked for, but the teacher kept the completion's rows only")
    first = max(lowest - 1, 0)  # slot s = lowest - 1 is row lowest at step 1
    total, rows, stats = 0.0, 0, []
    n = seq.ids.shape[0]
    for k, logits, slots in head.unroll(seq.ids, seq.features, steps, first):
        target_rows = torch.arange(first, slots) + k
        valid = (target_rows >= lowest) & (target_rows <= n - 2)
        if not bool(valid.any()):
            continue
        logits, target_rows = logits[valid], target_rows[valid]
        idx, probs = soft_labels(seq, t2d, target_rows)
        logq = torch.log_softmax(logits.float(), -1)
        loss = -(probs * logq.gather(1, idx)).sum(-1)
        total = total + weights[k - 1] * loss.sum()
        rows += loss.numel()
        target_top = t2d[seq.top_ids[target_rows - seq.labels_from, 0].long()]
        stats.append((k, int((logits.argmax(-1) == target_top).sum()), loss.numel()))
    return total, rows, stats


# ---------------------------------------------------------------------------------------------
# held-out report


@torch.no_grad()
def evaluate(head: TrainHead, seqs: list[Sequence], t2d: torch.Tensor, d2t_ids: torch.Tensor, steps: int = 6):
    """First-token acceptance and mean tokens a round at gamma 1..steps, greedy (the chain's
    drafts equal the target's choices) and at temperature 0.7 (the expected acceptance sum min(p, q)
    of each step, the chain fed the target's tokens), over every held-out position where a round
    could start."""
    head.eval()
    greedy_rounds = torch.zeros(steps + 1)
    sampled_rounds = torch.zeros(steps + 1)
    first_greedy = first_sampled = 0.0
    roots = 0
    for seq in seqs:
        first = max(seq.start - 2, 0)
        n = seq.ids.shape[0]
        per_step_correct, per_step_alpha = [], []
        for k, logits, slots in head.unroll(seq.ids, seq.features, steps, first):
            # only roots whose whole chain lies in the completion: slots first .. n - 2 - steps
            m = n - 1 - steps - first
            if m <= 0:
                break
            logits = logits[:m]
            target_rows = torch.arange(first, first + m) + k
            local = target_rows - seq.labels_from
            top = seq.top_ids[local].long()
            draft = t2d[top]
            per_step_correct.append((d2t_ids[logits.argmax(-1)] == top[:, 0]).float())
            p = torch.exp(seq.top_logits[local].float() / 0.7 - seq.lse[local, 1:2])
            q = torch.softmax(logits / 0.7, -1).gather(1, draft.clamp(min=0)) * (draft >= 0)
            per_step_alpha.append(torch.minimum(p, q).sum(-1))
        if len(per_step_correct) < steps:
            continue
        c = torch.cumprod(torch.stack(per_step_correct, 1), 1)  # [m, steps]: the chain's first j all right
        s = torch.cumprod(torch.stack(per_step_alpha, 1), 1)
        roots += c.shape[0]
        first_greedy += float(c[:, 0].sum())
        first_sampled += float(s[:, 0].sum())
        for g in range(1, steps + 1):
            greedy_rounds[g] += float(c[:, :g].sum())
            sampled_rounds[g] += float(s[:, :g].sum())
    head.train()
    roots = max(roots, 1)
    return {"roots": roots, "first_greedy": first_greedy / roots, "first_sampled": first_sampled / roots,
            "tokens_greedy": [1 + float(x) / roots for x in greedy_rounds[1:]],
            "tokens_sampled": [1 + float(x) / roots for x in sampled_rounds[1:]]}


def report_lines(r: dict) -> list[str]:
    steps = len(r["tokens_greedy"])
    head = "| | first draft accepted | " + " | ".join(f"gamma {g}" for g in range(1, steps + 1)) + " |"
    lines = [head, "|---" * (steps + 2) + "|"]
    for name, first, tokens in (("greedy", r["first_greedy"], r["tokens_greedy"]),
                                ("temperature 0.7", r["first_sampled"], r["tokens_sampled"])):
        lines.append(f"| {name} | {first:.3f} | " + " | ".join(f"{t:.2f}" for t in tokens) + " |")
    return lines


# ---------------------------------------------------------------------------------------------
# saving in the layout the draft worker loads


def save_head(head: TrainHead, out: Path, d2t_ids: torch.Tensor, target_config, feature_layers, a, meta: dict):
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}

    def linear(name: str, w: torch.Tensor):
        w = w.detach().float()
        if a.save == "int8":
            scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127.0
            tensors[name + ".weight"] = torch.round(w / scale).to(torch.int8)
            tensors[name + ".weight_scale"] = scale.to(torch.float32)
        else:
            tensors[name + ".weight"] = w.to(getattr(torch, a.save))

    linear("fc", head.fc.weight)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        linear(f"midlayer.self_attn.{name}", getattr(head, name).weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        linear(f"midlayer.mlp.{name}", getattr(head, name).weight)
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{name}.weight"] = getattr(head, name).detach().float().clone()
    tensors["norm.weight"] = head.norm.detach().float().clone()
    tensors["d2t"] = (d2t_ids - torch.arange(len(d2t_ids))).to(torch.int64)
    save_file(tensors, str(out / "model.safetensors"))
    rope = getattr(target_config, "rope_parameters", None) or {"rope_type": "default",
                                                               "rope_theta": getattr(target_config, "rope_theta", 1e4)}
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": head.d, "intermediate_size": head.gate_proj.out_features,
        "num_attention_heads": head.heads, "num_key_value_heads": head.kv_heads, "head_dim": head.head_dim,
        "rms_norm_eps": head.eps, "rope_parameters": dict(rope), "rope_theta": float(rope.get("rope_theta", 1e4)),
        "max_position_embeddings": int(target_config.max_position_embeddings), "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "vocab_size": int(target_config.vocab_size),
        "draft_vocab_size": int(len(d2t_ids)), "target_hidden_size": int(target_config.hidden_size),
        "norm_before_residual": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(feature_layers)},
        "specdec": meta,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# training


def _log(msg: str) -> None:
    print(f"[train-head] {msg}", flush=True)


@dataclass
class Prepared:
    """What every head trained in one run shares: the teacher's rows, the target's frozen parts."""

    seqs: list[Sequence]
    held: list[Sequence]
    config: object  # the target's
    path: Path  # the target's directory
    feature_layers: tuple[int, ...]
    embed: torch.Tensor
    final_norm: torch.Tensor
    feature_s: float


def prepare(a) -> Prepared | None:
    records = read_completions(data_path(a))
    if not records:
        print(f"train-head: no completions at {data_path(a)}; run with --generate first", file=sys.stderr)
        return None
    teacher = Teacher(a.target, None, a.quantize)
    held = [r for r in records if r["prompt"] % a.holdout_every == 0 and r["mode"] == "greedy"]
    train = [r for r in records if r["prompt"] % a.holdout_every != 0]
    train = subset(train, a.limit, a.seed)
    completion = torch.cat([torch.tensor(r["ids"]) for r in train])
    vocab = int(teacher.config.vocab_size)
    counts = torch.bincount(completion, minlength=vocab).sort(descending=True).values.cumsum(0) / completion.numel()
    coverage = ", ".join(f"{size}: {float(counts[size - 1]):.4f}" for size in (4096, 8192, 16384, 32768) if size <= vocab)
    _log(f"{len(train)} training sequences ({completion.numel()} completion tokens), {len(held)} held out; "
         f"share of completion tokens in the most frequent N: {coverage}")
    seqs, held_seqs, t0 = [], [], time.monotonic()
    todo = train + held
    prompt_rows = a.prompt_rows or any(v.get("prompt_rows") for v in parse_variants(a.variants))
    rows_total = sum(len(r["prompt_ids"]) + len(r["ids"]) for r in todo)
    rows_done = 0
    for i, r in enumerate(todo):
        (seqs if i < len(train) else held_seqs).append(teacher.run(r, a.top, prompt_rows))
        rows_done += len(r["prompt_ids"]) + len(r["ids"])
        if i % 20 == 0 or i == len(todo) - 1:
            el = time.monotonic() - t0
            _log(f"features {i + 1}/{len(todo)} sequences, {rows_done}/{rows_total} rows, "
                 f"{1000 * el / rows_done:.1f} ms a row, ETA {el / rows_done * (rows_total - rows_done) / 60:.1f} min")
    from specdec.modeling import target_embedding

    prepared = Prepared(seqs, held_seqs, teacher.config, teacher.loaded.path, teacher.layers,
                        target_embedding(teacher.loaded.path), teacher.model.model.norm.weight.detach().float().clone(),
                        time.monotonic() - t0)
    del teacher
    import gc

    gc.collect()
    return prepared


def subset(items: list, size: int, seed: int) -> list:
    """size of the items (all where size is 0 or more), drawn by seed, in their order."""
    if not size or size >= len(items):
        return items
    return [items[i] for i in sorted(random.Random(seed).sample(range(len(items)), size))]


def fit(a, data: Prepared, out: Path, name: str = "") -> tuple[TrainHead, torch.Tensor, dict, float]:
    """Trains one head on data with a's settings (resuming from out/checkpoint.pt); returns (head,
    its draft vocabulary's target ids, the run's state with its held-out curve, seconds)."""
    from specdec.modeling import target_output_rows

    config = data.config
    vocab = int(config.vocab_size)
    seqs = subset(data.seqs, a.limit, a.seed)  # a variant may train on fewer than were prepared
    records = [{"ids": s.ids[s.start:].tolist(), "prompt_ids": s.ids[: s.start].tolist()} for s in seqs]
    d2t_ids = draft_vocabulary(records, vocab, a.draft_vocab)
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[d2t_ids] = torch.arange(len(d2t_ids))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or {}
    torch.manual_seed(a.seed)
    head = TrainHead(config.hidden_size, a.intermediate, heads, kv_heads, head_dim, len(data.feature_layers),
                     float(config.rms_norm_eps), float(rope.get("rope_theta", getattr(config, "rope_theta", 1e4))),
                     data.embed, target_output_rows(data.path, d2t_ids), data.final_norm)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    weights = [0.8 ** k for k in range(a.ttt_steps)]
    rows_all = sum(loss_rows(s, a.prompt_rows) for s in seqs)
    batch_seqs = max(1, round(a.batch_tokens * len(seqs) / max(rows_all, 1)))  # sequences a step: ~batch_tokens rows
    total_steps = max(1, math.ceil(a.epochs * len(seqs) / batch_seqs))
    warmup = min(50, total_steps // 10)

    def lr_at(step):
        if step < warmup:
            return a.lr * (step + 1) / warmup
        return a.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

    state = {"step": 0, "seen_rows": 0, "curve": [], "order_seed": a.seed, "cursor": 0, "seconds": 0.0}
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint.pt"
    if ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False)
        head.load_state_dict(saved["head"], strict=False)
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        _log(f"{name}resumed from {ckpt} at step {state['step']}/{total_steps}")
    _log(f"{name}training {total_steps} steps of ~{a.batch_tokens} rows, {a.ttt_steps} TTT steps, "
         f"intermediate {a.intermediate}, draft vocabulary {a.draft_vocab}")

    def order(epoch):
        idx = list(range(len(seqs)))
        random.Random(state["order_seed"] * 1000 + epoch).shuffle(idx)
        return idx

    def held_out():
        r = evaluate(head, data.held, t2d, d2t_ids)
        state["curve"].append({"step": step, "rows": state["seen_rows"], "train_top1": state.get("train_top1"), **r})
        _log(f"{name}held-out at step {step}: first draft {r['first_greedy']:.3f} greedy / {r['first_sampled']:.3f} "
             f"t0.7, tokens a round at gamma 4 {r['tokens_greedy'][3]:.2f} / {r['tokens_sampled'][3]:.2f}")

    step, t_train, last_ckpt = state["step"], time.monotonic(), time.monotonic()
    seconds_before = state.get("seconds", 0.0)
    steps_at_start, cursor, per_epoch = step, state.get("cursor", 0), max(1, len(seqs))
    acc: dict[int, list[int]] = {}
    orders: dict[int, list[int]] = {}
    if a.eval_every and step == 0:
        held_out()
    while step < total_steps:
        batch_rows, batch_loss, loss_rows_seen = 0, 0.0, 0
        opt.zero_grad(set_to_none=True)
        for _ in range(batch_seqs):
            epoch, pos = divmod(cursor, per_epoch)
            if epoch not in orders:
                orders[epoch] = order(epoch)
            seq = seqs[orders[epoch][pos]]
            cursor += 1
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
                loss, rows, stats = sequence_loss(head, seq, t2d, a.ttt_steps, weights, a.prompt_rows)
            if rows == 0:
                continue
            (loss / a.batch_tokens).backward()
            batch_rows += loss_rows(seq, a.prompt_rows)
            batch_loss += float(loss.detach())
            loss_rows_seen += rows
            for k, right, count in stats:
                acc.setdefault(k, [0, 0])
                acc[k][0] += right
                acc[k][1] += count
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.step()
        step += 1
        state["seen_rows"] += batch_rows
        if step % 10 == 0 or step == total_steps:
            el = time.monotonic() - t_train
            eta = el / (step - steps_at_start) * (total_steps - step)
            state["train_top1"] = [acc[k][0] / max(acc[k][1], 1) for k in sorted(acc)]
            accs = " ".join(f"{x:.2f}" for x in state["train_top1"])
            _log(f"{name}step {step}/{total_steps} epoch {cursor / per_epoch:.2f} loss {batch_loss / loss_rows_seen:.3f} "
                 f"top-1 by TTT step {accs} lr {lr_at(step):.2e} ETA {eta / 60:.1f} min")
            acc = {}
        if a.eval_every and step % a.eval_every == 0 and step < total_steps:
            held_out()
        if time.monotonic() - last_ckpt > a.checkpoint_minutes * 60 or step == total_steps:
            state["step"], state["cursor"] = step, cursor
            state["seconds"] = seconds_before + time.monotonic() - t_train
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)
            last_ckpt = time.monotonic()
    held_out()
    return head, d2t_ids, state, seconds_before + time.monotonic() - t_train


VARIANT_KEYS = {"ttt": "ttt_steps", "intermediate": "intermediate", "vocab": "draft_vocab", "epochs": "epochs",
                "lr": "lr", "prompt": "prompt_rows", "sequences": "limit"}


def parse_variants(text: str) -> list[dict]:
    """'ttt=1;intermediate=2048,vocab=8192' -> [{'ttt_steps': 1}, {'intermediate': 2048, 'draft_vocab': 8192}]"""
    variants = []
    for item in (v.strip() for v in text.split(";") if v.strip()):
        v = {}
        for pair in item.split(","):
            key, _, value = pair.partition("=")
            if key.strip() not in VARIANT_KEYS:
                raise argparse.ArgumentTypeError(f"--variants: {key!r} is not one of {', '.join(VARIANT_KEYS)}")
            kind = {"epochs": float, "lr": float, "prompt": lambda x: bool(int(x))}.get(key.strip(), int)
            v[VARIANT_KEYS[key.strip()]] = kind(value)
        variants.append(v)
    return variants


def cmd_train(a) -> int:
    if not a.out:
        print("train-head: give --out DIR (or --generate)", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(a.seed)
    t_start = time.monotonic()
    data = prepare(a)
    if data is None:
        return 2
    _log(f"features took {data.feature_s / 60:.1f} min")
    head, d2t_ids, state, train_s = fit(a, data, out)
    r = state["curve"][-1]
    rows_all = sum(loss_rows(s, a.prompt_rows) for s in data.seqs)
    meta = {"trained_by": "specdec train-head", "data": data_path(a).name, "sequences": len(data.seqs),
            "loss_rows": rows_all, "prompt_rows": a.prompt_rows, "epochs": a.epochs, "ttt_steps": a.ttt_steps, "lr": a.lr,
            "batch_tokens": a.batch_tokens, "draft_vocab": a.draft_vocab, "intermediate": a.intermediate,
            "steps": state["step"], "feature_minutes": round(data.feature_s / 60, 1),
            "train_minutes": round(train_s / 60, 1), "total_minutes": round((time.monotonic() - t_start) / 60, 1),
            "held_out": r}
    save_head(head, out, d2t_ids, data.config, data.feature_layers, a, meta)
    (out / "curve.json").write_text(json.dumps(state["curve"], indent=1) + "\n")
    del head
    ablation = []
    for i, overrides in enumerate(parse_variants(a.variants)):  # the ablation: each from scratch on the same rows
        va = argparse.Namespace(**{**vars(a), **overrides, "eval_every": 0})
        _, _, vstate, seconds = fit(va, data, out / "variants" / str(i), f"variant {overrides}: ")
        ablation.append((overrides, vstate["curve"][-1], seconds))
        (out / "variants" / str(i) / "held_out.json").write_text(
            json.dumps({"variant": overrides, "minutes": round(seconds / 60, 1), **vstate["curve"][-1]}, indent=1) + "\n")
    lines = [f"held-out acceptance ({r['roots']} round starts in {len(data.held)} held-out greedy completions; "
             f"mean tokens a round = kept drafts + 1):", "", *report_lines(r)]
    if ablation:
        lines += ["", "ablation (each trained from scratch on the same rows; held-out, greedy / temperature 0.7):", "",
                  "| variant | first draft accepted | tokens a round at gamma 4 | minutes |", "|---|---|---|---|"]
        for overrides, rv, seconds in ablation:
            lines.append(f"| {', '.join(f'{k}={v}' for k, v in overrides.items())} | {rv['first_greedy']:.3f} / "
                         f"{rv['first_sampled']:.3f} | {rv['tokens_greedy'][3]:.2f} / {rv['tokens_sampled'][3]:.2f} | "
                         f"{seconds / 60:.1f} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    _log("\n".join(lines))
    size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e6
    _log(f"head written to {out} ({size:.1f} MB); {meta['total_minutes']} min in all")
    return 0


def cmd_train_head(a) -> int:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    return cmd_generate(a) if a.generate else cmd_train(a)
