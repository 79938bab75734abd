"""A worker's forward passes: the model, the path a pass takes through it, and the thread that runs them.

`ModelRunner` picks the forward path for its model and device: a feature head's
(specdec/eagle3.py), static passes over KV pages with CUDA graphs (specdec/worker/paged.py), or
the native, lean or eager CPU path (specdec/worker/forward.py). Sessions' work on the model
(`Work`: a session's uncached tokens, and what to make of their logits) goes to its batcher
(specdec/worker/batching.py), which lays the work pending at one time end to end in one ragged
pass. A batched RPC's calls are programs (generators that yield the Work they need) advanced
side by side (`run_calls`): draft step i of every Propose in a batch, and every Verify, is one
pass. Sessions are specdec/worker/sessions.py's; specdec/worker/engine.py ties the two together.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Generator

import torch
from opentelemetry import metrics, trace
from transformers import DynamicCache

from specdec import telemetry as t
from specdec.eagle3 import Eagle3Head, HeadForward
from specdec.errors import InvalidArgument, ServiceError
from specdec.hardware import PassLock
from specdec.wire import Features
from specdec.worker.batching import (CPU_MAX_PREFILL_TOKENS_WHILE_DECODING, DEFAULT_MAX_BATCH_TOKENS, Batcher,
                                     Pass, RaggedCache, Work, grow_append, use_ragged_attention)
from specdec.worker.forward import NativeForward, model_forward
from specdec.worker.paged import PAGE, CudaGraph, KVPages, StaticForward, static_forward_fits
from specdec.worker.sessions import free_cache, grow_hidden

log = logging.getLogger(__name__)

# a call's work on the model (a Propose's draft steps, a Verify's pass): a generator that yields each
# Work it needs and is sent back its result, and returns the call's result (ModelRunner.run_calls)
Program = Generator[Work, Any, Any]


def kernels_in_use(quantization: str, forward, graphs: bool) -> str:
    """ModelInfo.kernels: "native <isa>" where this project's C kernels run the decoder layers
    (forward.NativeForward) or the quantized linears, "fbgemm" for torch's int8 / fp16 linears,
    else "torch"; ", CUDA graphs" where passes replay captured graphs."""
    from specdec.kernels import native_available, native_library

    if isinstance(forward, NativeForward) or quantization in ("int8-rows", "int4-rows", "q4k-rows") \
            and native_available():
        name = f"native {native_library().isa}"
    elif quantization in ("int8", "int8-rows", "fp16"):
        name = "fbgemm"
    else:
        name = "torch"
    return name + (", CUDA graphs" if graphs else "")


def new_model_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")


def hand_out_features(items, starts: list[int], features: torch.Tensor, aux: tuple[int, ...]) -> None:
    """A pass's features [rows, len(aux) * hidden] to the sessions that asked for them: each its
    rows (from position starts[i]), its layers' columns. On the model thread, before the pass's
    callers go on. The rows are views of the pass's features, handed out whole by the next take."""
    width = features.shape[1] // len(aux)
    row = 0
    for (work, n), start in zip(items, starts):
        session = work.session
        if session.feature_layers:
            mine = features[row:row + n].view(n, len(aux), width)
            if session.feature_layers != aux:
                mine = mine[:, [aux.index(layer) for layer in session.feature_layers]]
            session.features.append(Features(start, mine.reshape(n, -1)))
        row += n


def set_next_states(done: list, states: torch.Tensor) -> None:
    """A feature head's pass: each finished work's last state feeds the token its caller appends
    next (its proposal), at the position after the session's tokens."""
    row = 0
    for work in done:
        row += work.keep
        session = work.session
        grow_hidden(session, len(session.tokens) + 1)
        session.hidden[len(session.tokens)] = states[row - 1]


class ModelRunner:
    """The forward passes of one worker's model. Thread-safe: passes run one at a time, on one thread."""

    def __init__(self, model, *, max_sessions: int, kv_tokens: int, max_context: int,
                 model_thread: ThreadPoolExecutor | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 max_prefill_tokens_while_decoding: int | None = None, pass_lock: str | None = None,
                 kv_pages: bool | None = None, cuda_graphs: bool = True, graph_class=None):
        """kv_tokens: the KV cache's size where it lives in pages (the sessions' and the prefix
        cache's tokens). kv_pages: keep the KV cache in pages allocated at start-up and run passes
        through StaticForward (specdec/worker/paged.py); None: on CUDA where the model fits it.
        cuda_graphs: replay captured graphs for decoding passes there (off: every pass eager).
        graph_class: what captures them (default CudaGraph; tests on CPU: paged.EagerGraph, the
        padded passes uncaptured)."""
        self.model = model
        self.head = isinstance(model, Eagle3Head)  # a feature head drafts (specdec/eagle3.py)
        self.input_device = model.get_input_embeddings().weight.device
        # Every forward runs on one thread: the batcher's where the engine has the process to
        # itself, else this model thread (see _run_pass). torch's OpenMP keeps a team of threads
        # per calling thread; forwards from gRPC's many handler threads would wake several teams
        # that spin against each other and slow the passes. One thread also
        # serialises the forwards, which on a shared device would only contend anyway. Engines in
        # one process (the in-process path) should share one: pass model_thread=new_model_thread().
        self._owns_model_thread = model_thread is None
        self._model_thread = model_thread or new_model_thread()
        if not self.head:
            use_ragged_attention(model)
        cuda = self.input_device.type == "cuda"
        if cuda:
            # the model thread only launches kernels: OpenMP teams of every core would spin against
            # the Python threads that launch them (vLLM's default for GPU workers too)
            torch.set_num_threads(1)
        self._pages: KVPages | None = None
        if kv_pages and (self.head or not static_forward_fits(model)):
            raise ValueError(f"{type(model).__name__} does not fit the static pass over KV pages")
        graph = None
        if self.head:
            self.forward = HeadForward(model)
            self._forward_device = self.input_device
        elif kv_pages if kv_pages is not None else cuda and static_forward_fits(model):
            self._pages = KVPages.for_model(model, tokens=kv_tokens, sessions=max_sessions)
            graph = graph_class or (CudaGraph if cuda and cuda_graphs else None)
            self.forward = StaticForward(model, self._pages, max_sessions=max_sessions, max_context=max_context,
                                         graph=graph)
            self._forward_device = torch.device("cpu")  # it copies what a pass needs in one go
            self._model_thread.submit(self.forward.capture).result()
            log.info("KV cache: %d pages of %d tokens, %.2f GiB; %d CUDA graphs captured in %.1f s (%.2f GiB)",
                     self._pages.pages, PAGE, self._pages.nbytes / 2**30, len(self.forward.buckets),
                     self.forward.capture_s, self.forward.capture_bytes / 2**30)
        else:
            self.forward = model_forward(model)  # specdec/worker/forward.py: native or lean for Llama/Qwen2
            self._forward_device = self.input_device
        self.graphs = graph is not None
        if max_prefill_tokens_while_decoding is None:  # on a GPU an eager prefill pass costs about the same at any size
            max_prefill_tokens_while_decoding = max_batch_tokens if cuda else CPU_MAX_PREFILL_TOKENS_WHILE_DECODING
        self.batcher = Batcher(self._run_pass, max_batch_tokens, max_prefill_tokens_while_decoding)
        # passes of workers that share CPUs take turns (specdec/hardware.py); a GPU's need no lock
        self.pass_lock = PassLock.from_flag(pass_lock, on_cpu=not cuda)
        self.instrument(None, None, "worker")

    def instrument(self, tracer, meter, role: str) -> None:
        """A span for every forward pass; histograms of their seconds, rows and sessions. With
        None: the API's no-op tracer and meter."""
        self.tracer = tracer or trace.NoOpTracer()
        meter = meter or metrics.NoOpMeter(t.INSTRUMENTATION_SCOPE)
        self._forward_duration = meter.create_histogram(
            "specdec.worker.forward.duration", unit="s", description="One forward pass, by kind",
            explicit_bucket_boundaries_advisory=t.SECONDS_BUCKETS)
        self._batch_rows = meter.create_histogram(
            "specdec.worker.batch.rows", unit="{token}", description="Tokens (rows) in one forward pass",
            explicit_bucket_boundaries_advisory=t.ROWS_BUCKETS)
        self._batch_sessions = meter.create_histogram(
            "specdec.worker.batch.sessions", unit="{session}", description="Sessions in one forward pass",
            explicit_bucket_boundaries_advisory=t.ROWS_BUCKETS)
        self._role = role

    def close(self) -> None:
        """Stops the batcher and (when this runner made it) the model thread."""
        self.batcher.close()
        if self._owns_model_thread:
            self._model_thread.shutdown(wait=True)
        self.pass_lock.close()

    def new_cache(self):
        """A new session's KV cache: pages of the worker's KVPages, else a DynamicCache."""
        return self._pages.new_cache() if self._pages is not None else DynamicCache(config=self.model.config)

    def copy_prefix(self, cache, tokens: int):
        """A new cache holding the first `tokens` tokens of `cache` (a PagedCache copies pages)."""
        if hasattr(cache, "copy_prefix"):
            return cache.copy_prefix(tokens)
        copy = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            for src, dst in zip(cache.layers, copy.layers):
                grow_append(dst, src.keys[..., :tokens, :], src.values[..., :tokens, :])
        return copy

    def submit(self, work: Work):
        """The work's result, run now (in a pass with whatever other sessions have pending)."""
        return self.batcher.submit(work)

    def run_calls(self, calls: list, program: Callable[[Any], Program], check: Callable[[str], Any]) -> list:
        """The calls of one batched RPC (an orchestrator's step), run side by side on this thread:
        program(call) is the call's work as a generator that yields each Work it needs
        (WorkerEngine.work) and gets back its result; the Works the calls yield at one time go to the batcher
        together and share a pass (draft step i of every Propose, every Verify). Returns, per call
        in order, the program's return value or the ServiceError it raised: each call succeeds or
        fails on its own. A second call on the same session is refused (INVALID_ARGUMENT): a
        session takes one call at a time; check(session_id) refuses one that is not open."""
        seen: set[str] = set()
        results: list = [None] * len(calls)
        running: dict[int, Program] = {}
        for i, call in enumerate(calls):
            if call.session_id in seen:
                results[i] = InvalidArgument(f"session {call.session_id} appears twice in one batch")
                continue
            seen.add(call.session_id)
            try:
                check(call.session_id)
                running[i] = program(call)
            except ServiceError as exc:
                results[i] = exc
        replies: dict[int, Any] = dict.fromkeys(running)
        try:
            while running:
                works: dict[int, Work] = {}
                for i, gen in list(running.items()):
                    try:
                        reply = replies[i]
                        works[i] = gen.throw(reply) if isinstance(reply, BaseException) else gen.send(reply)
                    except StopIteration as end:
                        results[i] = end.value
                    except ServiceError as exc:
                        results[i] = exc
                    except Exception as exc:  # noqa: BLE001 - this call's failure, not the batch's
                        log.exception("a batched call on session %s failed", calls[i].session_id)
                        results[i] = ServiceError(f"internal error: {type(exc).__name__}: {exc}")
                    if i not in works:
                        del running[i]
                if works:
                    replies = dict(zip(works, self.batcher.run_all(list(works.values()))))
        finally:  # the batch itself failed (the engine closing): the calls still running let go of their sessions
            for gen in running.values():
                gen.close()
        return results

    def drive(self, program: Program):
        """Runs one call's program (see run_calls) alone -> its return value."""
        reply = None
        while True:
            try:
                work = program.throw(reply) if isinstance(reply, BaseException) else program.send(reply)
            except StopIteration as end:
                return end.value
            reply, = self.batcher.run_all([work])

    @property
    def chains(self) -> bool:
        """Whether passes can chain draft steps on the device (captured passes over KV pages)."""
        return bool(getattr(self.forward, "buckets", None))

    def _run_pass(self, batch: Pass) -> None:
        """On the batcher's thread. An engine with a model thread of its own (a worker process)
        runs the pass right there, the batcher's being the one thread that runs passes; engines
        sharing one (in-process) hand it the pass."""
        if self._owns_model_thread:
            self._pass(batch)
        else:
            self._model_thread.submit(self._pass, batch).result()

    @torch.inference_mode()
    def _pass(self, batch: Pass) -> None:
        """One forward pass over the batch's tokens, laid end to end (specdec/worker/batching.py)."""
        ids, positions, keep_rows, done = [], [], [], []
        for work, n in batch.items:
            start, row = work.session.cached, len(ids)
            ids += work.session.tokens[start : start + n]
            positions += range(start, start + n)
            if start + n == len(work.session.tokens):  # its last tokens: its logits come from this pass
                keep_rows += range(row + n - work.keep, row + n)
                done.append(work)
        sessions = [work.session for work, _ in batch.items]
        # a target's sessions that a feature head drafts for: the layers their features come from
        aux = tuple(dict.fromkeys(layer for s in sessions for layer in s.feature_layers))
        starts = [s.cached for s in sessions] if aux else None
        attributes = {t.BATCH_ROWS: len(ids), t.BATCH_SESSIONS: len(sessions)}
        spans = [self.tracer.start_span("forward", context=work.context, attributes={
            t.FORWARD_TOKENS: n, t.FORWARD_KIND: work.kind, **attributes}) for work, n in batch.items]
        try:
            with self.pass_lock:
                t0 = time.perf_counter()  # the pass itself: not the wait for the other worker's
                args = (torch.tensor([ids], device=self._forward_device),
                        torch.tensor([positions], device=self._forward_device),
                        RaggedCache([s.cache for s in sessions], [n for _, n in batch.items]),
                        torch.tensor(keep_rows, dtype=torch.long))
                if self.head:  # each row's input state beside its token (specdec/eagle3.py)
                    logits, states = self.forward(*args, torch.cat([
                        work.session.hidden[work.session.cached:][:n] for work, n in batch.items]))
                    set_next_states(done, states)
                elif aux:
                    logits, features = self.forward(*args, aux=aux)
                    hand_out_features(batch.items, starts, features, aux)
                else:
                    logits = self.forward(*args)
                chain_rows, chained = self._chain(done, logits[0]) if any(work.chain for work in done) else (0, {})
                if logits.device.type == "cuda":
                    # kernels run after their launch: the pass's seconds (the gamma policy's costs)
                    # and the lock's turn end when the GPU is done, not when Python is
                    torch.cuda.synchronize(logits.device)
                elapsed = time.perf_counter() - t0
        except BaseException:
            # a pass that failed half-way leaves layers of different lengths; start those caches
            # over (the tokens are kept, so the next call recomputes them) rather than trust them
            for session in sessions:
                free_cache(session.cache)
                session.cache = self.new_cache()
            raise
        finally:
            for span in spans:
                span.end()
        self._batch_rows.record(len(ids), {t.ROLE: self._role})
        self._batch_sessions.record(len(sessions), {t.ROLE: self._role})
        for work, _ in batch.items:
            self._forward_duration.record(elapsed, {t.FORWARD_KIND: work.kind})
        for session in sessions:
            session.last_pass_rows, session.last_pass_s = len(ids) + chain_rows, elapsed
        logits, row = logits[0], 0
        for work in done:
            try:
                rows = logits[row : row + work.keep]
                work.future.set_result(work.post(rows, chained.get(id(work))) if work.chain else work.post(rows))
            except BaseException as exc:  # noqa: BLE001 - this caller's error, not the pass's
                work.future.set_exception(exc)
            row += work.keep

    def _chain(self, done: list[Work], logits: torch.Tensor) -> tuple[int, dict]:
        """The chained draft steps of this pass's works that asked for them (Work.chain), all in one
        StaticForward.chain -> (the steps' rows, {id(work): (tokens, probabilities)}, the pass's
        choice first); (0, {}) where they could not chain."""
        works, rows, row = [], [], 0
        for work in done:
            if work.chain and not work.session.closed:
                works.append(work)
                rows.append(row + work.keep - 1)
            row += work.keep
        if not works or not self.chains:
            return 0, {}
        last = torch.stack([logits[r] for r in rows])  # views: no index copied to the device
        out = self.forward.chain([w.session.cache for w in works], last, [w.chain for w in works])
        if out is None:
            return 0, {}
        tokens, probs, steps_rows = out
        return steps_rows, {id(w): (tk, pr) for w, tk, pr in zip(works, tokens, probs)}
