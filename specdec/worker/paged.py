"""KV pages and the static pass: a worker's passes at the GPU's speed (CUDA graphs over fixed buffers).

On a GPU an eager pass of a small model is launch-bound: hundreds of kernels launched from Python,
each far shorter than its launch, so a 1-row pass takes many times what reading the weights takes
(docs/benchmarks/gpu-h200-graphs/). A CUDA graph replays a captured pass in one launch, but every tensor it
touches must sit at a fixed address with a fixed shape. So on CUDA (Llama/Qwen2 family, the
models lean_forward runs) a worker keeps its KV cache in pages allocated once, at start-up:

- `KVPages`: per model, one tensor [layers, pages, PAGE, 2, kv_heads, head_dim] (a token's key
  and value side by side: one gather a layer reads both),
  sized by --max-cached-tokens (plus a partial page per session and a scratch page), and a free
  list. Pages rather than a slot per session: a slot must hold the longest context any session
  may reach (Qwen2.5: 32k tokens x 64 sessions = 60 GB for the 1.5B target), pages only what the
  sessions hold, and the attention gathers a session's keys either way (one index per layer).
- `PagedCache`: one session's pages and length, in place of the DynamicCache a CPU worker keeps:
  a rollback (`crop`) moves the length and frees pages past it, nothing is copied or recomputed;
  a fork (`copy.deepcopy`) copies the pages; `free` gives them back when the session leaves.
- `StaticForward`: the pass. Decoding work (every session with at most ROW_BUCKETS[-1] new rows)
  runs padded to a bucket (sessions, rows per session, keys): ids, positions, write slots and page
  tables are copied into that bucket's input buffer and its graph is replayed. Each layer writes
  the new keys and values into their pages (index_copy_), gathers each session's pages (one
  index) and runs one scaled-dot-product attention over all sessions, queries of a key/value head
  side by side (no repeated keys), a mask hiding keys past each row's position. Padding rows write
  into the scratch page and are never read back. Work outside the buckets (prefill chunks, more
  sessions or keys than captured) runs the same layers eagerly, unpadded, with one attention call
  a session. On CPU (tests) the same code runs without capture.

The graphs are captured at start-up, the largest first, into one memory pool, before the worker
reports SERVING (WorkerEngine logs their number, the seconds and the memory they took).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from specdec.errors import ResourceExhausted
from specdec.sampling import DeviceChoices
from specdec.worker.batching import Chain
from specdec.worker.forward import lean_forward_fits

log = logging.getLogger(__name__)

PAGE = 16  # tokens a page holds (vLLM's default block size)
SESSION_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # sessions a captured pass takes (up to --max-sessions)
ROW_BUCKETS = (1, 2, 4, 8)  # new rows of each session: a draft step, a verify of gamma + 1 <= 8
KEY_BUCKETS = (256, 512, 1024, 2048, 4096, 8192)  # keys each session's attention reads (up to max_context)
MAX_GRAPH_KEYS = 65536  # sessions x keys of the largest captured pass (its gathered keys' memory)


class KVPages:
    """Every session's keys and values on one worker, in pages of PAGE tokens allocated once.
    Page 0 is scratch: padding rows write there and nothing reads it back."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, tokens: int, sessions: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.pages = -(-tokens // PAGE) + sessions + 1  # each session's partial last page, the scratch page
        self.kv = torch.zeros((layers, self.pages, PAGE, 2, kv_heads, head_dim), dtype=dtype, device=device)
        self.keys, self.values = self.kv.select(3, 0), self.kv.select(3, 1)  # [layers, pages, PAGE, kv_heads, head_dim]
        self.nbytes = self.kv.numel() * self.kv.element_size()
        self._free = list(range(self.pages - 1, 0, -1))  # popped from the end: low pages first
        self._lock = threading.Lock()
        # pages freed while a pass runs are still in its page tables: they join the free list when it ends
        self._in_pass = False
        self._released: list[int] = []

    @classmethod
    def for_model(cls, model, *, tokens: int, sessions: int) -> "KVPages":
        config, attn = model.config, model.model.layers[0].self_attn
        weight = model.get_input_embeddings().weight
        return cls(config.num_hidden_layers, config.num_key_value_heads, attn.head_dim, tokens=tokens,
                   sessions=sessions, dtype=weight.dtype, device=weight.device)

    @property
    def free_pages(self) -> int:
        with self._lock:
            return len(self._free) + len(self._released)

    def new_cache(self) -> "PagedCache":
        return PagedCache(self)

    def alloc(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise ResourceExhausted(f"the KV cache has {len(self._free)} free pages of {PAGE} tokens; "
                                        f"{n} more are needed (--max-cached-tokens)")
            taken = self._free[-n:] if n else []
            del self._free[len(self._free) - n:]
            return taken

    def release(self, pages: list[int]) -> None:
        with self._lock:
            (self._released if self._in_pass else self._free).extend(pages)

    def begin_pass(self) -> None:
        with self._lock:
            self._in_pass = True

    def end_pass(self) -> None:
        with self._lock:
            self._in_pass = False
            self._free.extend(self._released)
            self._released.clear()


class PagedCache:
    """One session's KV cache in a KVPages: the pages holding tokens 0 .. length - 1, in order.
    Answers what the worker asks of a DynamicCache (get_seq_length, crop, deepcopy)."""

    is_compileable = False

    def __init__(self, pool: KVPages):
        self.pool = pool
        self.pages: list[int] = []
        self.length = 0
        self.freed = False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def reserve(self, tokens: int) -> None:
        """Pages for `tokens` tokens (the model thread, before a pass writes them)."""
        need = -(-tokens // PAGE) - len(self.pages)
        if need > 0:
            self.pages += self.pool.alloc(need)

    def crop(self, max_length: int) -> None:
        """transformers' DynamicCache.crop: keep max_length tokens (a negative count: drop that many)."""
        if max_length < 0:
            max_length = self.length + max_length
        self.length = max(0, min(self.length, max_length))
        keep = -(-self.length // PAGE)
        if len(self.pages) > keep:
            self.pool.release(self.pages[keep:])
            del self.pages[keep:]

    def free(self) -> None:
        """The session left: its pages go back (after the pass now running, if any)."""
        if not self.freed:
            self.freed = True
            self.pool.release(self.pages)
            self.pages, self.length = [], 0

    def __deepcopy__(self, memo) -> "PagedCache":
        """A fork: new pages holding a copy of this session's tokens."""
        return self.copy_prefix(self.length)

    def copy_prefix(self, tokens: int) -> "PagedCache":
        """New pages holding a copy of this session's first `tokens` tokens."""
        other = PagedCache(self.pool)
        other.reserve(tokens)
        if other.pages:
            n = len(other.pages)
            src = torch.tensor(self.pages[:n], device=self.pool.kv.device)
            dst = torch.tensor(other.pages, device=self.pool.kv.device)
            self.pool.kv.index_copy_(1, dst, self.pool.kv.index_select(1, src))
        other.length = tokens
        return other


def _pages_of(cache: PagedCache, tokens: int) -> np.ndarray:
    """The pages holding a session's first `tokens` tokens; for a session closed while its work
    waited, the scratch page throughout (its rows are computed and thrown away)."""
    blocks = -(-tokens // PAGE)
    if cache.freed:
        return np.zeros(blocks, dtype=np.int64)
    return np.asarray(cache.pages[:blocks], dtype=np.int64)


def _fill(bucket: "Bucket", host: np.ndarray, ids: list[int], caches, new: list[int], keep: list[int],
          start: list[int] | None = None) -> None:
    """A bucket's input buffer (host side): session b's new[b] tokens at positions start[b] ..
    (default: its cached length), padded to bucket.rows rows; padding rows write the scratch page."""
    T, R, blocks = bucket.tokens, bucket.rows, bucket.keys // PAGE
    host[:] = 0
    tok, pos, slot, kept = host[:T], host[T:2 * T], host[2 * T:3 * T], host[3 * T:4 * T]
    table = host[4 * T:].reshape(bucket.sessions, blocks)
    row = 0
    flat_to_padded = []
    for b, (c, n) in enumerate(zip(caches, new)):
        base, first = b * R, c.length if start is None else start[b]
        p = np.arange(first, first + n)
        pages = _pages_of(c, first + n)
        tok[base:base + n] = ids[row:row + n]
        pos[base:base + n] = p
        slot[base:base + n] = pages[p // PAGE] * PAGE + p % PAGE
        table[b, :len(pages)] = pages
        pos[base + n:base + R] = first + n - 1  # padding rows: the last row's keys, scratch slot 0
        flat_to_padded += range(base, base + n)
        row += n
    kept[:len(keep)] = [flat_to_padded[k] for k in keep]


@dataclass(frozen=True)
class Bucket:
    sessions: int
    rows: int  # new rows of each session
    keys: int  # keys each session's attention reads (a multiple of PAGE)

    @property
    def tokens(self) -> int:
        return self.sessions * self.rows

    @property
    def inputs(self) -> int:
        """int64s of its input buffer: ids, positions, write slots, rows to keep (T each), then the
        page table (sessions x keys / PAGE)."""
        return 4 * self.tokens + self.sessions * (self.keys // PAGE)


def buckets_for(max_sessions: int, max_context: int) -> list[Bucket]:
    """The captured shapes, largest first (their memory comes from one pool, reused by the smaller)."""
    sessions = [s for s in SESSION_BUCKETS if s <= max_sessions] or [1]
    keys = [k for k in KEY_BUCKETS if k <= max(max_context, KEY_BUCKETS[0])]
    return sorted((Bucket(s, r, k) for s in sessions for r in ROW_BUCKETS for k in keys if s * k <= MAX_GRAPH_KEYS),
                  key=lambda b: (b.sessions * b.keys, b.tokens), reverse=True)


def pick_bucket(buckets: list[Bucket], sessions: int, rows: int, keys: int) -> Bucket | None:
    """The smallest captured bucket that holds a pass, or None (it runs eagerly)."""
    fits = [b for b in buckets if b.sessions >= sessions and b.rows >= rows and b.keys >= keys]
    return min(fits, key=lambda b: (b.sessions * b.keys, b.tokens)) if fits else None


class CudaGraph:
    """torch.cuda.CUDAGraph around one function of fixed buffers: warmed up on a side stream, then
    captured into a shared memory pool (PyTorch's documented recipe)."""

    def __init__(self, pool):
        self.pool, self.graph = pool, None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # a warm-up: lazy initialisation (cuBLAS handles, workspaces) stays out of the graph
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """A stand-in with CudaGraph's interface that runs the function each time (CPU, and tests that
    check what is bound and replayed)."""

    def __init__(self, pool=None):
        self.fn = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        out = self.fn()
        if out.data_ptr() != self.out.data_ptr():  # a captured graph writes where it wrote when captured
            self.out.copy_(out)


@dataclass
class _Captured:
    bucket: Bucket
    inputs: torch.Tensor  # [bucket.inputs] int64: the only tensor a replay reads that a pass changes
    logits: torch.Tensor  # [bucket.tokens, vocab]: what a replay writes
    graph: object
    host: torch.Tensor  # inputs' staging copy on the host (pinned on CUDA: one asynchronous copy)
    copied: object = None  # the CUDA event after the last copy from host: host is refilled after it


class StaticForward:
    """The worker's pass over KVPages (see the module docstring): forward(ids [1, n], positions
    [1, n], RaggedCache of PagedCaches, keep_rows) -> logits [1, len(keep_rows), vocab], as
    model_forward's functions. ids, positions and keep_rows come on the CPU."""

    def __init__(self, model, pages: KVPages, *, max_sessions: int, max_context: int, graph=None):
        """graph: CudaGraph (CUDA), EagerGraph (the padded path without capture, tests) or None (every pass eager)."""
        self.model, self.inner, self.pages = model, model.model, pages
        config, attn = model.config, self.inner.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        self.group = self.heads // self.kv_heads
        self.device = pages.keys.device
        self.buckets = buckets_for(max_sessions, max_context) if graph is not None else []
        self._graph_class = graph
        self._captured: dict[Bucket, _Captured] = {}
        self._key_index = torch.arange(max(KEY_BUCKETS[-1], max_context + PAGE), device=self.device)
        d, half = self.head_dim, self.head_dim // 2
        # rotate_half(x)[j] = sign[j] * x[swap[j]]: the first half negated, the halves swapped
        self._swap = torch.cat([torch.arange(half, d), torch.arange(half)]).to(self.device)
        self._columns = torch.arange(d, device=self.device)
        self._chain_host = self._chain_inputs = self._chain_copied = None  # chain's staging (_chain_staging)
        self._rotate_sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(self.device, pages.keys.dtype)
        self.capture_s, self.capture_bytes = 0.0, 0
        self.replays = self.eager_passes = self.chained_steps = 0
        self._fused = [fuse_projections(layer) for layer in self.inner.layers]

    # ---- capture --------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket (largest first): all graphs exist before the worker serves."""
        if not self.buckets or self._captured:
            return
        cuda = self.device.type == "cuda"
        before = torch.cuda.mem_get_info(self.device)[0] if cuda else 0  # free bytes (capture empties the cache)
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if cuda else None
        # every graph writes its logits into one buffer outside the pool: outputs kept alive in the
        # pool would each hold their memory (a replay's logits are read before the next replay)
        head = self.model.lm_head
        vocab = getattr(head, "out_features", None) or head.weight.shape[0]
        self._logits = torch.empty(max(b.tokens for b in self.buckets), vocab, dtype=self.pages.keys.dtype,
                                   device=self.device)
        for bucket in self.buckets:
            inputs = torch.zeros(bucket.inputs, dtype=torch.long, device=self.device)  # all rows to scratch
            graph = self._graph_class(pool)
            logits = graph.capture(lambda b=bucket, i=inputs: self._padded(b, i))
            host = torch.zeros(bucket.inputs, dtype=torch.long, pin_memory=cuda)
            self._captured[bucket] = _Captured(bucket, inputs, logits, graph, host)
        if cuda:
            torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        self.capture_bytes = (before - torch.cuda.mem_get_info(self.device)[0]) if cuda else 0

    # ---- the pass -------------------------------------------------------------------------

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache, keep: torch.Tensor, aux: tuple[int, ...] = ()):
        """With aux (a feature head drafts for one of the pass's sessions), the pass runs eagerly and
        also returns its rows' features, as model_forward's functions do."""
        caches, new = cache.caches, cache.new
        self.pages.begin_pass()
        try:
            for c, n in zip(caches, new):
                if not c.freed:
                    c.reserve(c.length + n)
            features = dict.fromkeys(aux) if aux else None  # filled with each layer's input
            logits = self._run(ids[0].tolist(), caches, new, keep.tolist()) if not aux else \
                self._eager(ids[0].tolist(), caches, new, keep.tolist(), features)
            for c, n in zip(caches, new):
                if not c.freed:
                    c.length += n
            if aux:
                return logits.unsqueeze(0), torch.cat([features[i] for i in aux], dim=-1)
            return logits.unsqueeze(0)
        finally:
            self.pages.end_pass()

    def _run(self, ids: list[int], caches, new: list[int], keep: list[int]) -> torch.Tensor:
        """A pass in a bucket is replayed; one that is not runs eagerly, except that a pass mixing
        decoding work with longer work (a new request's prefill chunk) replays the decoding
        sessions' graph and runs only the others eagerly -> logits [len(keep), vocab]."""
        decoding = [i for i, n in enumerate(new) if n <= ROW_BUCKETS[-1]]
        bucket = pick_bucket(self.buckets, len(decoding), max((new[i] for i in decoding), default=0),
                             max((caches[i].length + new[i] for i in decoding), default=0)) if decoding else None
        if bucket is not None and len(decoding) == len(caches):
            return self._replay(bucket, ids, caches, new, keep)
        if bucket is None:
            return self._eager(ids, caches, new, keep)
        starts = np.cumsum([0] + new)
        session_of = np.repeat(np.arange(len(new)), new)
        parts = []
        for members in (decoding, [i for i in range(len(new)) if i not in set(decoding)]):
            member = set(members)
            own = [r for i in members for r in range(starts[i], starts[i + 1])]  # the pass's rows, in this part
            local = {r: j for j, r in enumerate(own)}
            rows = [k for k in range(len(keep)) if session_of[keep[k]] in member]
            parts.append((members, [ids[r] for r in own], [local[keep[k]] for k in rows], rows))
        out = None
        for part, (members, part_ids, part_keep, rows) in enumerate(parts):
            sub_caches, sub_new = [caches[i] for i in members], [new[i] for i in members]
            logits = (self._replay(bucket, part_ids, sub_caches, sub_new, part_keep) if part == 0
                      else self._eager(part_ids, sub_caches, sub_new, part_keep))
            if out is None:
                out = logits.new_empty(len(keep), logits.shape[-1])
            if rows:
                out[torch.tensor(rows, device=self.device)] = logits
        return out

    def _replay(self, bucket: Bucket, ids: list[int], caches, new: list[int], keep: list[int]) -> torch.Tensor:
        """Fills the bucket's input buffer (one copy to the device) and replays its graph."""
        captured = self._captured[bucket]
        if captured.copied is not None:
            captured.copied.synchronize()  # the last copy from this staging buffer is done
        host = captured.host.numpy()
        _fill(bucket, host, ids, caches, new, keep)
        captured.inputs.copy_(captured.host, non_blocking=True)
        if self.device.type == "cuda":
            captured.copied = torch.cuda.Event()
            captured.copied.record()
        captured.graph.replay()
        self.replays += 1
        T = bucket.tokens
        return captured.logits.index_select(0, captured.inputs[3 * T:3 * T + len(keep)])

    # ---- draft steps without the host in between ------------------------------------------

    def chain(self, caches: list[PagedCache], logits: torch.Tensor, chains: list[Chain]):
        """Draft steps on the device. logits [n, vocab]: each session's last row of the pass just
        run, whose choice (its proposal, not cached yet) comes first; session i then takes
        chains[i].steps one-row passes, each caching the last choice and choosing the next on the
        device (sampling.DeviceChoices: greedy, or coupled), replayed back to back with no
        synchronisation until the end (one, not one a step).
        -> (tokens, probabilities, rows): per session its steps + 1 choices and the draft's
        probability of each (zeros unless some chain asks for them); rows, those of the steps'
        passes. None (nothing run) where a step fits no captured bucket: the caller drafts a pass
        at a time."""
        order = sorted(range(len(caches)), key=lambda i: -chains[i].steps)  # step s runs a prefix of them
        cs, counts = [caches[i] for i in order], [chains[i].steps for i in order]
        plan = []  # per step: (bucket, sessions in it)
        for s in range(counts[0]):
            m = sum(1 for c in counts if c > s)
            bucket = pick_bucket(self.buckets, m, 1, max(c.length + s + 1 for c in cs[:m]))
            if bucket is None:
                return None
            plan.append((bucket, m))
        # a session's first choice takes the position its cache reaches (the pass cached its input)
        rules = DeviceChoices([chains[i].params for i in order], [c.length for c in cs], counts[0] + 1)
        probabilities = any(c.probabilities for c in chains)
        self.pages.begin_pass()
        try:
            for c, k in zip(cs, counts):
                if not c.freed:
                    c.reserve(c.length + k)
            words = rules.words()
            staged = self._chain_staging(sum(b.inputs for b, _ in plan) + words.size)
            host, offset, spans = staged.numpy(), 0, []
            for s, (bucket, m) in enumerate(plan):  # every step's inputs but the tokens, made now
                part = host[offset:offset + bucket.inputs]
                _fill(bucket, part, [0] * m, cs[:m], [1] * m, list(range(m)), start=[c.length + s for c in cs[:m]])
                spans.append((offset, bucket.inputs))
                offset += bucket.inputs
            host[offset:offset + words.size] = words
            device = self._chain_inputs[:offset + words.size]
            device.copy_(staged[:offset + words.size], non_blocking=True)
            if self.device.type == "cuda":
                self._chain_copied = torch.cuda.Event()
                self._chain_copied.record()
            rules.bind(device[offset:])
            tokens = torch.zeros(len(plan) + 1, len(cs), dtype=torch.long, device=self.device)
            probs = torch.zeros(len(plan) + 1, len(cs), dtype=torch.float32, device=self.device)
            # views stacked (an index tensor made on the host would be a synchronising copy)
            last = torch.stack([logits[i] for i in order]) if order != sorted(order) else logits
            for s in range(len(plan) + 1):
                m = plan[s - 1][1] if s else len(cs)
                chosen, p = rules.choose(last, s, probabilities)
                tokens[s, :m] = chosen
                if p is not None:
                    probs[s, :m] = p
                if s == len(plan):
                    break
                (bucket, m), (offset, size) = plan[s], spans[s]
                captured = self._captured[bucket]
                captured.inputs.copy_(device[offset:offset + size])
                captured.inputs[:m * bucket.rows:bucket.rows].copy_(chosen[:m])  # the tokens: the last choices
                captured.graph.replay()
                self.replays += 1
                self.chained_steps += 1
                last = captured.logits[:m * bucket.rows:bucket.rows]  # each session's one row
            for c, k in zip(cs, counts):
                if not c.freed:
                    c.length += k
            tokens, probs = tokens.t().tolist(), probs.t().tolist()  # the one synchronisation
        finally:
            self.pages.end_pass()
        out_tokens, out_probs = [None] * len(caches), [None] * len(caches)
        for j, i in enumerate(order):
            out_tokens[i], out_probs[i] = tokens[j][:counts[j] + 1], probs[j][:counts[j] + 1]
        return out_tokens, out_probs, sum(m for _, m in plan)

    def _chain_staging(self, size: int) -> torch.Tensor:
        """The host buffer a chain's inputs are made in (pinned on CUDA), grown as needed, and its
        device twin; the last chain's copy from it is done before it is refilled."""
        if self._chain_host is None or self._chain_host.numel() < size:
            cuda = self.device.type == "cuda"
            self._chain_host = torch.zeros(max(size, 4096), dtype=torch.long, pin_memory=cuda)
            self._chain_inputs = torch.zeros(self._chain_host.numel(), dtype=torch.long, device=self.device)
            self._chain_copied = None
        if self._chain_copied is not None:
            self._chain_copied.synchronize()
        return self._chain_host

    def _padded(self, bucket: Bucket, inputs: torch.Tensor) -> torch.Tensor:
        """The captured pass: every session padded to bucket.rows rows and bucket.keys keys -> logits [T, vocab]."""
        B, R, T = bucket.sessions, bucket.rows, bucket.tokens
        blocks, L = bucket.keys // PAGE, bucket.keys
        ids, pos, slot = inputs[:T], inputs[T:2 * T], inputs[2 * T:3 * T]
        table = inputs[4 * T:].view(B, blocks)
        visible = self._key_index[:L].view(1, 1, 1, L) <= pos.view(B, 1, R, 1)  # [B, 1, R, L]
        mask = _additive(visible.view(B, 1, 1, R, L).expand(B, 1, self.group, R, L).reshape(B, 1, self.group * R, L),
                         self.pages.keys.dtype)
        heads, kvh, d, g = self.heads, self.kv_heads, self.head_dim, self.group

        def attend(kv, q):  # kv: [pages, PAGE, 2, kvh, d] of one layer; q [T, heads, d]
            kv = kv[table].view(B, L, 2, kvh, d)  # one gather: each session's keys and values
            k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
            qg = q.view(B, R, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(B, kvh, g * R, d)
            o = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self._scaling)
            return o.view(B, kvh, g, R, d).permute(0, 3, 1, 2, 4).reshape(T, heads * d)

        h = self._layers(ids, pos, slot, attend)
        return _linear_into(self._logits[:T], h, self.model.lm_head)

    def _eager(self, ids: list[int], caches, new: list[int], keep: list[int], features: dict | None = None) -> torch.Tensor:
        """Any pass, unpadded: one attention call a session over exactly its keys -> logits [len(keep), vocab].
        features: {layer: None} to fill with the stream entering each of those layers ([rows, hidden])."""
        positions = torch.tensor([p for c, n in zip(caches, new) for p in range(c.length, c.length + n)],
                                 device=self.device)
        ids, keep = torch.tensor(ids, device=self.device), torch.tensor(keep, device=self.device)
        slots, spans, pages_of = [], [], []
        for c, n in zip(caches, new):
            p = np.arange(c.length, c.length + n)
            pages = _pages_of(c, c.length + n)
            slots.append(pages[p // PAGE] * PAGE + p % PAGE)
            spans.append((c.length, n))
            pages_of.append(torch.from_numpy(pages).to(self.device))
        slot = torch.from_numpy(np.concatenate(slots)).to(self.device)
        heads, kvh, d, g = self.heads, self.kv_heads, self.head_dim, self.group
        masks = []
        for past, n in spans:
            L = -(-(past + n) // PAGE) * PAGE
            rows = torch.arange(past, past + n, device=self.device)
            visible = (self._key_index[:L].view(1, L) <= rows.view(n, 1)).repeat(g, 1).view(1, 1, g * n, L)
            masks.append(_additive(visible, self.pages.keys.dtype))

        def attend(kv, q):
            out, row = [], 0
            for (past, n), pages, mask in zip(spans, pages_of, masks):
                L = pages.numel() * PAGE
                kv_s = kv[pages].view(1, L, 2, kvh, d)
                k, v = kv_s[:, :, 0].transpose(1, 2), kv_s[:, :, 1].transpose(1, 2)
                qg = q[row:row + n].view(1, n, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(1, kvh, g * n, d)
                o = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self._scaling)
                out.append(o.view(kvh, g, n, d).permute(2, 0, 1, 3).reshape(n, heads * d))
                row += n
            return out[0] if len(out) == 1 else torch.cat(out)

        h = self._layers(ids, positions, slot, attend, keep=keep, features=features)
        self.eager_passes += 1
        return self.model.lm_head(h)

    @property
    def _scaling(self) -> float:
        return self.inner.layers[0].self_attn.scaling

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, attend, keep=None,
                features: dict | None = None) -> torch.Tensor:
        """The decoder layers over T rows (lean_forward's computation in fewer kernels: a pass of a
        small model on a GPU is bound by how many it launches): each layer's new keys and values go
        to their slots (page * PAGE + offset) before attend reads them -> the final norm's rows
        (`keep` only)."""
        inner, pages = self.inner, self.pages
        T, d, heads, kvh = ids.shape[0], self.head_dim, self.heads, self.kv_heads
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h.unsqueeze(0), positions.unsqueeze(0))
        rotation = self._rotation(cos[0], sin[0])  # [T, d, d]: each row's rotary positions as one matrix
        flat = (pages.pages * PAGE, kvh, d)
        for i, (layer, (qkv_w, qkv_b, gate_up)) in enumerate(zip(inner.layers, self._fused)):
            if features is not None and i in features:
                features[i] = h.clone()  # h is added to in place below
            attn, mlp = layer.self_attn, layer.mlp
            x = self._norm(layer.input_layernorm, h)
            qkv = torch.nn.functional.linear(x, qkv_w, qkv_b)  # q, k and v in one GEMM
            qk = torch.bmm(qkv[:, :(heads + kvh) * d].view(T, heads + kvh, d), rotation)  # q and k rotated at once
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, (heads + kvh) * d:].view(T, kvh, d)
            pages.keys[i].view(flat).index_copy_(0, slot, k)
            pages.values[i].view(flat).index_copy_(0, slot, v)
            h = _add_linear(h, attend(pages.kv[i], q), attn.o_proj)
            x = self._norm(layer.post_attention_layernorm, h)
            gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)  # gate and up in one GEMM
            h = _add_linear(h, mlp.act_fn(gate) * up, mlp.down_proj)
        if keep is not None:
            h = h[keep]
        return self._norm(inner.norm, h)

    def _rotation(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """cos, sin [T, d] (rotary_emb's) -> R [T, d, d] with x @ R[t] = x * cos[t] + rotate_half(x) * sin[t]:
        cos on the diagonal, sign * sin where column j takes x[swap[j]]. Made once a pass, it rotates
        each layer's q and k in one batched GEMM (three kernels a layer otherwise)."""
        rotation = torch.diag_embed(cos)
        rotation[:, self._swap, self._columns] = sin * self._rotate_sign
        return rotation

    @staticmethod
    def _norm(norm, h: torch.Tensor) -> torch.Tensor:
        """Qwen2RMSNorm / LlamaRMSNorm: normalised in float32, then scaled. In one call (torch's
        fused kernel on CUDA) for 16- and 32-bit h, which rounds once where transformers rounds
        before it scales, in six kernels; float64 h (tests) is normalised in float32 as there."""
        if h.dtype != torch.float64:
            return torch.nn.functional.rms_norm(h, (h.shape[-1],), norm.weight, eps=norm.variance_epsilon)
        x = torch.nn.functional.rms_norm(h.to(torch.float32), (h.shape[-1],), eps=norm.variance_epsilon)
        return norm.weight * x.to(h.dtype)


def _add_linear(h: torch.Tensor, x: torch.Tensor, linear) -> torch.Tensor:
    """h + linear(x): one GEMM that adds into h in place where the linear is plain and unbiased
    (h is the pass's own residual stream: nothing else reads it)."""
    if type(linear) is torch.nn.Linear and linear.bias is None:
        return h.addmm_(x, linear.weight.t())
    return h + linear(x)


def _linear_into(out: torch.Tensor, x: torch.Tensor, linear) -> torch.Tensor:
    """linear(x) written into out (one GEMM where the linear is plain and unbiased, no copy)."""
    if type(linear) is torch.nn.Linear and linear.bias is None:
        return torch.mm(x, linear.weight.t(), out=out)
    return out.copy_(linear(x))


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as the additive one SDPA turns it into on every call (made once a
    pass rather than once a layer)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several Linears of one input, their rows stacked; each module's
    weight and bias become views of it (no second copy)."""
    weight = torch.cat([m.weight.data for m in linears])
    bias = torch.cat([m.bias.data for m in linears]) if linears[0].bias is not None else None
    rows = [m.out_features for m in linears]
    for m, w in zip(linears, weight.split(rows)):
        m.weight.data = w
    if bias is not None:
        for m, b in zip(linears, bias.split(rows)):
            m.bias.data = b
    return weight, bias


def fuse_projections(layer) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A decoder layer's q, k, v projections as one GEMM and its MLP's gate and up as one (fewer
    kernels a layer: a pass of a small model on a GPU is bound by their number). Idempotent."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv_w, qkv_b = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, _ = _fuse([mlp.gate_proj, mlp.up_proj])
    return qkv_w, qkv_b, gate_up


def static_forward_fits(model) -> bool:
    """Whether StaticForward runs this model: lean_forward's family (forward.lean_forward_fits),
    grouped heads, one attention scaling."""
    if not lean_forward_fits(model):
        return False
    config, layers = model.config, model.model.layers

    def plain(m) -> bool:  # fuse_projections stacks their weights
        return type(m) is torch.nn.Linear

    def biased(ms) -> bool:
        return len({m.bias is None for m in ms}) == 1

    projections = [(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj) for l in layers]
    return (config.num_attention_heads % config.num_key_value_heads == 0
            and len({layer.self_attn.scaling for layer in layers}) == 1
            and all(plain(m) and biased(ms) for ms in projections for m in ms)
            and all(plain(l.mlp.gate_proj) and plain(l.mlp.up_proj) and l.mlp.gate_proj.bias is None
                    and l.mlp.up_proj.bias is None for l in layers))
