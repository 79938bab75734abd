"""Ragged batches: one forward pass over the new tokens of many sessions, laid end to end.

The model thread takes all pending work of all sessions (prefill chunks, draft steps, verify
passes) and runs it as one pass over their tokens concatenated: no padding, each token with its
own position. Every session keeps its own DynamicCache; the attention of a token sees only its
own session's cache and its session's earlier new tokens:

- `RaggedCache` is the cache object the model gets for one pass. Its `update` (called by every
  attention layer) appends each session's slice of the new keys and values to that session's
  cache and hands back the per-session key/value tensors. A session's layer keeps its keys and
  values in buffers with room to grow (`grow_append`), its tensors views of their first rows: a
  step writes its new rows in place where transformers' DynamicLayer concatenates, copying the
  session's whole cache in every layer at every step (at 1000 cached tokens ~57 MB a target step).
  A rollback (`crop`) shortens the views; the next step writes over what was cut.
- `ragged_attention`, registered with transformers' AttentionInterface as "specdec_ragged", runs
  scaled-dot-product attention once per session: its queries against its own keys, causal within
  its new tokens. A session's attention is therefore computed by exactly the same call whatever
  else is in the batch; only the dense layers see more rows (which is where batching pays: their
  weights are read once per pass).

This works for any model whose attention layers call `past_key_values.update(...)` and then the
configured attention function (Llama, Qwen2 and most of the family), on CPU and CUDA. The
`Batcher` decides what goes into a pass: everything pending, up to --max-batch-tokens, a long
prefill cut into chunks so that it does not stall sessions that are decoding.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

from specdec.worker.config import FLAGS

log = logging.getLogger(__name__)

ATTENTION = "specdec_ragged"
DEFAULT_MAX_BATCH_TOKENS = FLAGS.default("max_batch_tokens")
# Decoding work reaches a worker in bursts (the target verifies while the draft drafts, and the
# other way round): between them only prefills are queued, and a pass started then would run a
# whole --max-batch-tokens chunk while the decoding sessions' next work waits behind it (seconds
# on a CPU at 512 rows). So while sessions decode, meaning decoding work is queued or a session
# still open had some in a pass within the last DECODING_WINDOW_S, a pass takes at most
# --max-prefill-tokens-while-decoding prompt rows (a lone request's prompt, its predecessor's
# sessions closed, still runs in one pass). On CPU 128 by default, chosen to shorten the longest
# waits between streamed tokens without costing throughput (docs/benchmarks/prefill-while-decoding).
CPU_MAX_PREFILL_TOKENS_WHILE_DECODING = 128
DECODING_WINDOW_S = 5.0  # longer than a pass of --max-batch-tokens rows on a CPU (a session waits behind one)
# A pass of prompt chunks alone, right after one that held decoding work, waits for that work's
# next call (a round trip away: the orchestrator samples, then sends its next step), at most this
# fraction of the last pass's time, so that each chunk rides with a decoding step instead of every
# other one. The only wait before a pass: a batched call's work arrives together (Batcher.run_all).
PREFILL_HOLD_FRACTION = 0.1
# A session with at most this many new rows in a pass (a verify of gamma + 1 tokens, a draft step
# with lookup guesses: decoding work) has its attention computed one query row at a time, each row
# by the very call a one-row step makes (its keys up to itself, no mask). SDPA over several query
# rows is not bitwise equal to that (the first difference is layer 0's attention output, ~1e-5),
# and int8 activations per row amplify such a difference into logits that differ: with this, and
# row-independent linears (fp16 weights, int8-rows: specdec/kernels.py), a k-row verify pass
# computes exactly what k single steps compute. Longer work (prefill chunks) takes one SDPA call.
# Cost (default target, 2 cores): about that of one SDPA call over the rows, up to 16 rows.
ROWWISE_MAX_ROWS = 32
# One query row over at least this many keys (on CPU, float32) is attended by one_row_attention, two batched
# matmuls around a softmax, instead of SDPA's flash kernel, which is slower there from ~150 keys on
# the default target's shapes and faster below (docs/benchmarks/huge-pages-lean-forward/). The choice
# depends on the row's key count alone, so a row computes the same bits in a k-row verify as in a
# single step.
ONE_ROW_MATMUL_MIN_KEYS = 160


@dataclass
class RaggedKV:
    """Per-session keys (or values) of one layer: tensors[i] is [1, kv_heads, past_i + new_i, head_dim]."""

    tensors: list[torch.Tensor]
    new: list[int]  # new tokens of each session in this pass, in order
    masks: list  # each session's causal mask over its past and new tokens (None for one new token),
    # built by the first layer and shared by all: they depend only on the lengths


GROW_MIN = 256  # a layer's buffers grow in multiples of this many rows, to a quarter more than needed


def grow_append(layer, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Appends [1, kv_heads, n, head_dim] keys and values to a DynamicLayer along its sequence,
    as its `update` does (the same values, so the same bits downstream), into buffers with room to
    grow: layer.keys / layer.values become views of their first rows. Buffers are (re)made when
    there are none, when the layer's tensors are not views of them (a copied cache, a layer
    transformers filled), or when full; a crop leaves the views shorter and the next append writes
    over what it cut. -> (layer.keys, layer.values)."""
    length, buffers = cache_room(layer, keys, keys.shape[-2])
    need = length + keys.shape[-2]
    buffers[0][..., length:need, :].copy_(keys)
    buffers[1][..., length:need, :].copy_(values)
    layer.keys, layer.values = buffers[0][..., :need, :], buffers[1][..., :need, :]
    return layer.keys, layer.values


def cache_room(layer, like: torch.Tensor, new: int) -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
    """grow_append's buffers of a DynamicLayer, with room for `new` more rows after its current
    ones (made, or moved into larger ones, as grow_append describes; `like`: a [1, kv_heads, *,
    head_dim] tensor of the cache's dtype and device) -> (rows cached, (key buffer, value buffer))."""
    if not layer.is_initialized:
        layer.lazy_initialization(like, like)
    old_k, old_v = layer.keys, layer.values
    length = old_k.shape[-2] if old_k.numel() else 0
    need = length + new
    buffers = getattr(layer, "specdec_buffers", None)
    if (buffers is None or buffers[0].shape[-2] < need or length and (
            old_k.data_ptr() != buffers[0].data_ptr() or old_v.data_ptr() != buffers[1].data_ptr()
            or old_k.stride() != buffers[0].stride())):
        rows = -(-(need + need // 4) // GROW_MIN) * GROW_MIN  # at most a quarter and GROW_MIN rows unused
        shape = (*like.shape[:-2], rows, like.shape[-1])
        buffers = like.new_empty(shape), like.new_empty(shape)
        if length:
            buffers[0][..., :length, :].copy_(old_k)
            buffers[1][..., :length, :].copy_(old_v)
        layer.specdec_buffers = buffers
    return length, buffers


class RaggedCache:
    """The past_key_values of one ragged pass: caches[i] gets the keys/values of new[i] tokens."""

    is_compileable = False

    def __init__(self, caches: list, new: list[int], append=grow_append):
        """append(layer, keys, values) -> the layer's whole keys and values: grow_append, or (a
        test's reference) transformers' own DynamicLayer.update."""
        assert len(caches) == len(new) and all(n >= 1 for n in new), new
        self.caches, self.new, self.append = caches, new, append
        self.masks: list = []  # filled by ragged_attention in the first layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs=None):
        """key_states, value_states: [1, kv_heads, sum(new), head_dim] -> (RaggedKV, RaggedKV)."""
        assert key_states.shape[2] == sum(self.new), (key_states.shape, self.new)
        keys, values = [], []
        for cache, k, v in zip(self.caches, key_states.split(self.new, dim=2), value_states.split(self.new, dim=2)):
            full_k, full_v = self.append(cache.layers[layer_idx], k, v)
            keys.append(full_k)
            values.append(full_v)
        return RaggedKV(keys, self.new, self.masks), RaggedKV(values, self.new, self.masks)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from position_ids; nothing asks otherwise


def one_row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row: q [1, heads, 1, head_dim] against k, v [1, kv_heads, keys, head_dim] (query
    head j reads kv head j // (heads / kv_heads), as SDPA's enable_gqa) -> [1, heads, 1, head_dim]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    grouped = q.reshape(kv_heads, heads // kv_heads, q.shape[-1])
    weights = torch.softmax(torch.bmm(grouped, k[0].transpose(1, 2)) * scale, dim=-1)
    return torch.bmm(weights, v[0]).reshape(1, heads, 1, -1)


def _row_attention(q, k, v, scale, gqa):
    """One query row against its keys: one_row_attention from ONE_ROW_MATMUL_MIN_KEYS keys on CPU in
    float32 (other dtypes keep SDPA's internal upcasts), else SDPA."""
    if k.device.type == "cpu" and k.dtype == torch.float32 and k.shape[2] >= ONE_ROW_MATMUL_MIN_KEYS:
        return one_row_attention(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)


def ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [1, heads, sum(new), head_dim]; key/value: RaggedKV -> ([1, sum(new), heads, head_dim], None).

    A plain pass (no RaggedCache: e.g. a test calling the model directly) goes to SDPA as usual."""
    if not isinstance(key, RaggedKV):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if not key.masks:
        for k, n in zip(key.tensors, key.new):
            past = k.shape[2] - n
            # token i of the new ones (absolute position past + i) sees keys 0 .. past + i
            key.masks.append(None if n <= ROWWISE_MAX_ROWS else  # decoding work goes row by row
                             torch.ones(n, past + n, dtype=torch.bool, device=k.device).tril(diagonal=past))
    # grouped-query heads share their key/value head inside SDPA: no repeat_kv copy of the whole
    # cache per layer
    gqa = query.shape[1] != key.tensors[0].shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    outputs = []
    for q, k, v, mask, n in zip(query.split(key.new, dim=2), key.tensors, value.tensors, key.masks, key.new):
        if n <= ROWWISE_MAX_ROWS:  # decoding work: each row exactly as a one-row step computes it
            past = k.shape[2] - n
            outputs.extend(_row_attention(q[:, :, i:i + 1], k[:, :, :past + i + 1], v[:, :, :past + i + 1], scaling,
                                          gqa) for i in range(n))
        else:
            outputs.append(sdpa(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, ragged_attention)
# a plain pass builds its mask as SDPA's would; a ragged pass hands the model a placeholder 4D mask,
# which transformers passes through untouched (ragged_attention makes its own, per session)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
NO_MASK = torch.zeros(1, 1, 0, 0, dtype=torch.bool)
assert ATTENTION in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


def use_ragged_attention(model) -> None:
    """Switches a loaded model's attention layers to ragged_attention (a plain pass still uses SDPA)."""
    model.set_attn_implementation(ATTENTION)


@dataclass
class Work:
    """One session's share of a pass: its uncached tokens, then post(logits of the last `keep`)."""

    session: Any  # specdec.worker.engine.Session
    keep: int  # logits wanted for the last `keep` new tokens
    kind: str  # prefill, propose or verify
    post: Callable[..., Any]  # [keep, vocab] (and with chain, the chained steps' choices) -> the caller's result
    context: Any  # the caller's trace context: its forward spans nest under the caller's RPC
    future: Future = field(default_factory=Future)
    # draft steps to chain on the device after this pass (StaticForward.chain): post then gets
    # (logits, (tokens, probabilities)) of the pass's choice and theirs, or (logits, None) where
    # they could not chain
    chain: Chain | None = None


@dataclass(frozen=True)
class Chain:
    """A draft's steps after its pass, each token chosen on the device (sampling.DeviceChoices)."""

    steps: int  # one-row passes after the pass's own
    params: Any  # specdec.protocol.SamplingParams: greedy, or coupled without decoding controls
    probabilities: bool  # whether the caller reads the draft's probability of each choice (p_min)


@dataclass
class Pass:
    """What one forward pass runs: work items and how many of each one's tokens."""

    items: list[tuple[Work, int]]  # (work, tokens of it in this pass)

    @property
    def rows(self) -> int:
        return sum(n for _, n in self.items)


def plan_pass(pending: deque, max_tokens: int, max_prefill: int | None = None) -> Pass:
    """Takes work from the front of `pending` for one pass of at most max_tokens rows, of them at
    most max_prefill (default: max_tokens) prefill rows.

    A work item whose tokens do not fit is cut (a prefill chunk), as long as the logits it needs
    come from its last part; the rest stays at the front of the queue for the next pass. The
    first item always runs, even alone past the limit, so nothing waits forever.

    Decoding work (draft steps, verify passes) goes first and prefills take the rows left over, as
    vLLM's scheduler does: a long prompt arriving is cut into chunks that ride along with the
    decoding sessions' passes instead of stalling them for a whole prefill. The Batcher passes a
    smaller max_prefill while sessions decode (DECODING_WINDOW_S), since their work may arrive
    just after a pass of only prefills has begun."""
    if any(w.kind == "prefill" for w in pending):
        ordered = sorted(pending, key=lambda w: w.kind == "prefill")  # stable: arrival order within each
        pending.clear()
        pending.extend(ordered)
    items, budget, deferred = [], max_tokens, []
    prefill = max_tokens if max_prefill is None else min(max_prefill, max_tokens)
    while pending:
        work = pending.popleft()
        new = len(work.session.tokens) - work.session.cached
        room = min(budget, prefill) if work.kind == "prefill" else budget
        if new <= room or not items and new - work.keep < 1:
            taken = new
            items.append((work, new))
        elif room >= 1 and new - work.keep >= 1:
            taken = min(room, new - work.keep)
            items.append((work, taken))  # a chunk; the item stays queued
            deferred.append(work)
        else:
            taken = 0
            deferred.append(work)
        budget -= taken
        if work.kind == "prefill":
            prefill -= taken
        if budget <= 0:
            break
    pending.extendleft(reversed(deferred))
    return Pass(items)


class Batcher:
    """Collects forward work from any thread and runs it in ragged passes on the model thread.

    A pass starts as soon as the model thread is free: the work that arrived while the previous
    pass ran goes into the next one together. A batched call (an orchestrator's step) hands in its
    sessions' work at once (run_all), so it shares one pass as given; work of other callers (prompt
    chunks, other orchestrators' steps) merges with it where it is queued at the same time."""

    def __init__(self, run_pass: Callable[[Pass], None], max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 max_prefill_tokens_while_decoding: int | None = None):
        """max_prefill_tokens_while_decoding: prompt rows a pass takes while sessions decode
        (None or 0: max_batch_tokens, no cap)."""
        self.max_batch_tokens = max_batch_tokens
        self.max_prefill_tokens_while_decoding = max_prefill_tokens_while_decoding or max_batch_tokens
        # id(session) -> (session, when a pass last held its decoding work): _sessions_decode
        self._decoding: dict[int, tuple[Any, float]] = {}
        self._last_pass_decoded = False  # the last pass held decoding work (_hold_prompt_chunks)
        self._run_pass = run_pass
        self._pending: deque[Work] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self.passes = 0  # passes run, and how many held more than one session
        self.shared_passes = 0
        self._last_pass_s = 0.0
        self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
        self._thread.start()

    def submit(self, work: Work) -> Any:
        """Queues work and waits for its result (or its exception)."""
        self._queue([work])
        return work.future.result()

    def run_all(self, works: list[Work]) -> list:
        """Queues the works together (they go into the next pass as one, as far as
        --max-batch-tokens allows) and waits for them all -> per work, its result or its exception."""
        self._queue(works)
        return [work.future.exception() or work.future.result() for work in works]

    def _queue(self, works: list[Work]) -> None:
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._pending.extend(works)
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
        for work in self._pending:
            work.future.set_exception(RuntimeError("the engine closed before this pass ran"))
        self._pending.clear()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                self._hold_prompt_chunks()
                batch = plan_pass(self._pending, self.max_batch_tokens,
                                  self.max_prefill_tokens_while_decoding if self._sessions_decode() else None)
            self.passes += 1
            self.shared_passes += len(batch.items) > 1
            t0 = time.perf_counter()
            try:
                self._run_pass(batch)
            except BaseException as exc:  # noqa: BLE001 - every caller in the pass gets the error
                log.exception("a forward pass of %d rows failed", batch.rows)
                for work, _ in batch.items:
                    with self._wake:
                        if work in self._pending:
                            self._pending.remove(work)
                    if not work.future.done():
                        work.future.set_exception(exc)
            self._last_pass_s = time.perf_counter() - t0
            now = time.monotonic()
            decoded = [work.session for work, _ in batch.items if work.kind != "prefill"]
            self._decoding.update((id(session), (session, now)) for session in decoded)
            self._last_pass_decoded = bool(decoded)
            log.debug("pass: %d sessions, %d rows, %.1f ms", len(batch.items), batch.rows, self._last_pass_s * 1e3)

    def _sessions_decode(self) -> bool:
        """With the lock held: whether decoding work is queued, or a session still open had some
        in a pass within DECODING_WINDOW_S (forgets the others)."""
        now = time.monotonic()
        for key, (session, at) in list(self._decoding.items()):
            if getattr(session, "closed", False) or now - at >= DECODING_WINDOW_S:
                del self._decoding[key]
        return bool(self._decoding) or self._decoding_queued()

    def _decoding_queued(self) -> bool:
        return any(work.kind != "prefill" for work in self._pending)

    def _hold_prompt_chunks(self) -> None:
        """With the lock held: a pass of prompt chunks alone right after one that held decoding work
        waits for decoding work, at most PREFILL_HOLD_FRACTION of the last pass (on a CPU a chunk
        would otherwise keep the decoding sessions' next step waiting a whole pass)."""
        if not self._last_pass_decoded:
            return
        until = time.monotonic() + PREFILL_HOLD_FRACTION * self._last_pass_s
        while not self._closed and not self._decoding_queued():
            left = until - time.monotonic()
            if left <= 0:
                return
            self._wake.wait(left)
