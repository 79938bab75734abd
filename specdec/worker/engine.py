"""What the draft and the target worker have in common: a model, its sessions, and the calls on both.

A worker holds sessions (specdec/worker/sessions.py: each a token sequence and a KV cache over a
prefix of it, in a table with the worker's limits) and runs their work on its model
(specdec/worker/runner.py: the forward path, the batcher, the one thread passes run on).
`WorkerEngine` ties them together: opening, forking and closing sessions (with the prefix
cache of specdec/worker/prefixes.py), the checks every call makes, the work a call puts on the
model, and structured output's grammar state.

The role-specific work (proposing, verifying) lives in draft_service/engine.py and
target_service/engine.py, as programs run by `run_calls`; gRPC lives in specdec/worker/server.py
and the roles' servicers.
"""

from __future__ import annotations

import copy
import logging
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from opentelemetry import metrics, trace

from specdec import hardware
from specdec import telemetry as t
from specdec.errors import FailedPrecondition, InvalidArgument, OutOfRange, ServiceError, Unavailable
from specdec.modeling import LoadedModel, eos_token_ids, vocab_fingerprint
from specdec.wire import ModelInfo
from specdec.worker.batching import DEFAULT_MAX_BATCH_TOKENS, Chain, Work
from specdec.worker.prefixes import MIN_PREFIX, PrefixStore
from specdec.worker.runner import ModelRunner, Program, kernels_in_use
from specdec.worker.sessions import (Session, SessionGrammar, SessionTable, check_session_id, free_cache,
                                     take_features)

log = logging.getLogger(__name__)


class WorkerEngine:
    """A model plus its sessions. Thread-safe: sessions are independent, forwards serialised."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_sessions: int = 64,
        max_cached_tokens: int = 131072,
        max_context: int | None = None,
        model_thread: ThreadPoolExecutor | None = None,
        session_ttl_s: float = 600.0,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_prefill_tokens_while_decoding: int | None = None,
        pass_lock: str | None = None,
        grammar_limits=None,
        kv_pages: bool | None = None,
        cuda_graphs: bool = True,
        graph_class=None,
        prefix_cache_tokens: int = 0,
    ):
        """model_thread, max_batch_tokens, max_prefill_tokens_while_decoding, pass_lock, kv_pages,
        cuda_graphs, graph_class: the runner's (specdec/worker/runner.py). session_ttl_s: sessions
        idle this long are freed (an orchestrator that died cannot close its own).
        prefix_cache_tokens: tokens of ended sessions' KV caches kept for new sessions whose prompts
        begin with them (specdec/worker/prefixes.py); 0: none."""
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.loaded = loaded
        config = self.model.config.get_text_config(decoder=True)
        # the vocabulary the model and its tokenizer share; a draft with a restricted head
        # (loaded.head_rows) scores only the first ids of it
        self.vocab_size = int(config.vocab_size)
        self.max_context = int(max_context or getattr(config, "max_position_embeddings", 0) or 2048)
        self.max_sessions = max_sessions
        self.max_cached_tokens = max_cached_tokens
        self.draining = False
        self.runner = ModelRunner(self.model, max_sessions=max_sessions,
                                  kv_tokens=max_cached_tokens + prefix_cache_tokens, max_context=self.max_context,
                                  model_thread=model_thread, max_batch_tokens=max_batch_tokens,
                                  max_prefill_tokens_while_decoding=max_prefill_tokens_while_decoding,
                                  pass_lock=pass_lock, kv_pages=kv_pages, cuda_graphs=cuda_graphs,
                                  graph_class=graph_class)
        self.head = self.runner.head  # a feature head drafts (specdec/eagle3.py)
        if self.head:
            prefix_cache_tokens = 0  # a head's cached states hold its own guesses past the target's: not kept
        self.input_device = self.runner.input_device
        tok = self.tokenizer
        self.info = ModelInfo(
            model_name=loaded.name,
            vocab_size=self.vocab_size,
            vocab_fingerprint=vocab_fingerprint(tok),
            eos_token_ids=tuple(eos_token_ids(self.model, tok)),
            bos_token_id=tok.bos_token_id if tok.bos_token_id is not None else -1,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else -1,
            max_context=self.max_context,
            device=str(self.input_device),
            dtype=str(loaded.dtype).removeprefix("torch.")
            + ("" if loaded.quantization == "none" else f"+{loaded.quantization}-weights"),
            kernels=kernels_in_use(loaded.quantization, self.runner.forward, self.runner.graphs),
            feature_layers=self.model.feature_layers if self.head else (),
            feature_size=self.model.feature_size if self.head else 0,
            num_layers=0 if self.head else int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            host_id=hardware.host_id(),
            cpus=() if self.input_device.type == "cuda" else hardware.cpus(),
            device_uuid=str(torch.cuda.get_device_properties(self.input_device).uuid)
            if self.input_device.type == "cuda" else "",
        )
        log.info("passes run on %s kernels, weights %s", self.info.kernels, self.info.dtype)
        self._tokenizer_files: dict[str, bytes] | None = None
        self._prefixes = PrefixStore(prefix_cache_tokens, self.runner.copy_prefix, free_cache) \
            if prefix_cache_tokens else None
        self.grammar_limits = grammar_limits  # specdec.grammar.GrammarLimits; None: its defaults
        self._grammars = None  # the GrammarCompiler (wrapping a 150k vocabulary takes ~1 s) ...
        self._grammars_lock = threading.Lock()
        # ... made now, off the request path: a first grammar request would wait for it, and its
        # round's time would tell the gamma policy that drafting is slow
        threading.Thread(target=self.grammar_compiler, name="grammar-compiler", daemon=True).start()
        self.instrument(None, "worker")
        self.sessions = SessionTable(max_sessions, max_cached_tokens, session_ttl_s,
                                     on_expired=lambda session: self._expired.add(1, {t.ROLE: self._role}))

    def close(self) -> None:
        """Stops the runner (its batcher, its model thread when it made it) and the session
        reaper; frees every session. Idempotent."""
        self.runner.close()
        self.sessions.close()
        if self._prefixes is not None:
            self._prefixes.clear()

    def instrument(self, telemetry, role: str) -> None:
        """Spans for prefill, truncate and every forward pass; gauges of sessions and cached
        tokens. With telemetry None (or off): the API's no-op tracer and meter."""
        self.tracer = telemetry.tracer if telemetry is not None else trace.NoOpTracer()
        meter = telemetry.meter if telemetry is not None else metrics.NoOpMeter(t.INSTRUMENTATION_SCOPE)
        attributes = {t.ROLE: role}
        meter.create_observable_gauge(
            "specdec.worker.sessions", unit="{session}", description="Sessions open on this worker",
            callbacks=[lambda options: [metrics.Observation(len(self.sessions), attributes)]])
        meter.create_observable_gauge(
            "specdec.worker.cached_tokens", unit="{token}", description="Tokens held in KV caches",
            callbacks=[lambda options: [metrics.Observation(self.cached_tokens(), attributes)]])
        self._expired = meter.create_counter(
            "specdec.worker.sessions_expired", unit="{session}", description="Sessions freed after idling")
        self._role = role
        self.runner.instrument(self.tracer, meter, role)

    def cached_tokens(self) -> int:
        return self.sessions.cached_tokens()

    # ---- session lifecycle -------------------------------------------------------------

    def describe(self) -> ModelInfo:
        return ModelInfo(**{**self.info.__dict__, "open_sessions": len(self.sessions), "draining": self.draining,
                            "held_tokens": self.sessions.held()})

    def drain(self, timeout_s: float) -> int:
        """Takes no new session, waits up to timeout_s for the open ones to close; returns how
        many were still open (their orchestrators move them elsewhere on their next call)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not len(self.sessions):
                return 0
            time.sleep(0.1)
        return self.sessions.free_all()

    def open_session(self, session_id: str, token_ids: list[int], owner: str = "",
                     scope: str = "", *, feature_layers: tuple[int, ...] = ()) -> tuple[int, float, int]:
        """Prefills all but the last token (from a copy of a cached prefix, where one of the
        caller's scope matches); returns (tokens held, seconds spent, prompt tokens not prefilled).
        owner: the caller's certificate identity, bound to the session (see authorize); scope: the
        orchestrator's name for the request's tenant (prefix caching matches within it).
        feature_layers (a target a feature head drafts for): the prefill and every pass after it
        also give the residual stream entering these layers at each position they run (the
        prefill's: opened_features; a Verify's: Verification.features); such a session prefills
        its whole prompt, its features were never cached.
        A feature head's session opens on the prompt's first token only: the target's features of
        the rest come with its first Propose."""
        check_session_id(session_id)
        if not token_ids:
            raise InvalidArgument("cannot open a session with an empty prompt")
        if self.draining:
            raise Unavailable("this worker is shutting down; open the session on another worker")
        self.check_tokens(token_ids, already=0)
        feature_layers = self.check_feature_layers(feature_layers)
        if self.head and len(token_ids) > 1:
            raise FailedPrecondition(f"a feature head's session opens on one token (got {len(token_ids)}): the "
                                     f"target's features of the prompt come with the first Propose")
        session = Session(session_id, list(token_ids[:-1]), self.runner.new_cache(), owner=owner, scope=scope,
                          feature_layers=feature_layers)
        session.lock.acquire()  # held from before the session is visible until its prefill is done
        try:
            self.sessions.admit(session, len(token_ids))
            t0 = time.perf_counter()
            reused = 0
            try:
                if self._prefixes is not None and session.tokens and not feature_layers:
                    cache, reused = self._prefixes.copy_longest((owner, scope), session.tokens)
                    if cache is not None:
                        free_cache(session.cache)
                        session.cache = cache
                if len(session.tokens) > session.cached:
                    with self.tracer.start_as_current_span("prefill", attributes={
                            t.SESSION_ID: session_id, t.PREFIX_CACHED: reused}):
                        self.run(session, 1, "prefill")  # fills the cache
                session.tokens.append(int(token_ids[-1]))
            except BaseException:
                self.sessions.discard(session)
                raise
        finally:
            session.lock.release()
        return len(session.tokens), time.perf_counter() - t0, reused

    def check_feature_layers(self, layers) -> tuple[int, ...]:
        """OpenSession's feature_layers, checked: layers of this model, on a forward that gives them."""
        layers = tuple(int(i) for i in layers)
        if not layers:
            return ()
        num_layers = self.info.num_layers
        if self.head or not num_layers or any(not 0 <= i < num_layers for i in layers):
            raise InvalidArgument(f"feature_layers {list(layers)} must name layers of this model's {num_layers}")
        return layers

    def opened_features(self, session_id: str):
        """The features a session opened with feature_layers has not handed out yet (its
        prefill's), as one specdec.wire.Features; None where it has none."""
        session = self.session(session_id)
        with session.lock:
            return take_features(session)

    def fork_session(self, session_id: str, parent_id: str, token_ids: list[int], owner: str = "",
                     secret: bytes | None = None) -> tuple[int, float, int]:
        """Opens session_id as a copy of parent_id (its tokens and KV cache): one prefill serves a
        request's n choices. token_ids must be the parent's tokens (FAILED_PRECONDITION otherwise).
        secret: the parent's (a gRPC caller must know it and be its owner); None in-process."""
        check_session_id(session_id)
        if self.draining:
            raise Unavailable("this worker is shutting down; open the session on another worker")
        if secret is not None:
            self.authorize(parent_id, secret, owner)
        parent = self.session(parent_id)
        t0 = time.perf_counter()
        with parent.lock:
            if parent.tokens != list(token_ids):
                raise FailedPrecondition(f"session {parent_id} holds other tokens than the fork asks for")
            with torch.inference_mode():
                cache = copy.deepcopy(parent.cache)
                hidden = None if parent.hidden is None else parent.hidden.clone()
            session = Session(session_id, list(parent.tokens), cache, owner=owner, scope=parent.scope,
                              feature_layers=parent.feature_layers, hidden=hidden)
        try:
            self.sessions.admit(session, len(session.tokens))
        except ServiceError:
            session.free()
            raise
        return len(session.tokens), time.perf_counter() - t0, len(session.tokens)

    def truncate(self, session_id: str, length: int) -> int:
        session = self.session(session_id)
        with session.lock:
            self.truncate_to(session, length)
            return len(session.tokens)

    def truncate_to(self, session: Session, length: int) -> None:
        """session.truncate, with a span when it drops tokens (a rollback)."""
        if length >= len(session.tokens):
            session.truncate(length)  # nothing to drop (or OutOfRange)
            return
        with self.tracer.start_as_current_span("truncate", attributes={
                t.SESSION_ID: session.session_id, t.TRUNCATE_FROM: len(session.tokens), t.TRUNCATE_TO: length}):
            session.truncate(length)

    def authorize(self, session_id: str, secret: bytes, owner: str = "") -> None:
        """NOT_FOUND unless the caller opened the session (SessionTable.authorize)."""
        self.sessions.authorize(session_id, secret, owner)

    def secret_of(self, session_id: str) -> bytes:
        return self.sessions.secret_of(session_id)

    def close_session(self, session_id: str) -> None:
        session = self.sessions.pop(session_id)
        self._retain(session)
        session.free()

    def _retain(self, session: Session) -> None:
        """A session that ended normally leaves its cache to the prefix store (none of its work is
        running: a cache a pass may still be writing is not kept)."""
        if self._prefixes is None or not session.lock.acquire(blocking=False):
            return
        try:
            cache, held = session.cache, min(session.cached, len(session.tokens))
            if held:
                session.cache = self.runner.new_cache()
                self._prefixes.retain((session.owner, session.scope), session.tokens[:held], cache)
        finally:
            session.lock.release()

    def session(self, session_id: str) -> Session:
        return self.sessions.get(session_id)

    # ---- calls on the model --------------------------------------------------------------

    def run_calls(self, calls: list, program: Callable[[Any], Program]) -> list:
        """The calls of one batched RPC, each program(call), run side by side
        (ModelRunner.run_calls): per call, its result or its ServiceError."""
        return self.runner.run_calls(calls, program, self.session)

    def drive(self, program: Program):
        """Runs one call's program alone -> its return value."""
        return self.runner.drive(program)

    def grow(self, session: Session, new_length: int) -> None:
        """Checks that the session may grow to new_length tokens (a Propose or Verify about to run)."""
        if new_length > len(session.tokens):
            self.sessions.check_capacity(new_length - len(session.tokens))

    def check_tokens(self, token_ids: list[int], *, already: int) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if already + len(token_ids) > self.max_context:
            raise OutOfRange(
                f"{already + len(token_ids)} tokens would exceed this model's context of {self.max_context}"
            )

    def work(self, session: Session, keep: int, kind: str, post: Callable[..., Any] = lambda x: x,
             chain: Chain | None = None) -> Work:
        """The session's uncached tokens as work for a ragged pass, whose result is post(logits
        [keep, vocab]) (run on the model thread: sampling math there keeps to one OpenMP team).
        kind: prefill, propose or verify. chain (keep 1, where self.chains): draft steps follow on
        the device, and post gets (logits, the (tokens, probabilities) chosen on the device, the
        pass's own first, or None). Make and run it holding session.lock: one pass at a time per
        session. A call's program yields it (run_calls); `run` runs it alone."""
        assert len(session.tokens) - session.cached >= keep >= 1, (len(session.tokens), session.cached, keep)
        if self._prefixes is not None and len(session.tokens) - keep - session.cached >= MIN_PREFIX \
                and not session.feature_layers:
            self._adopt_prefix(session, keep)  # a draft's catch-up (its session opened on one token)
        return Work(session, keep, kind, post, t.current_context(), chain=chain)

    def run(self, session: Session, keep: int, kind: str, post: Callable[..., Any] = lambda x: x,
            chain: Chain | None = None):
        """`work`'s result, run now (in a pass with whatever other sessions have pending)."""
        return self.runner.submit(self.work(session, keep, kind, post, chain))

    @property
    def chains(self) -> bool:
        """Whether passes can chain draft steps on the device (captured passes over KV pages)."""
        return self.runner.chains

    def _adopt_prefix(self, session: Session, keep: int) -> None:
        """Starts the session's uncached tokens from a cached prefix longer than what it holds
        (the last `keep` stay uncached: their logits are wanted)."""
        cache, _ = self._prefixes.copy_longest((session.owner, session.scope),
                                               session.tokens[:len(session.tokens) - keep], longer_than=session.cached)
        if cache is not None:
            free_cache(session.cache)
            session.cache = cache

    # ---- structured output -------------------------------------------------------------

    def grammar_at(self, session: Session, params, position: int):
        """The session's grammar matcher at `position` (its output before it consumed), or None
        without a grammar. Compiled once per spec (the compiler's cache); a session keeps one
        matcher and rolls it back with its tokens. Call holding session.lock."""
        if params.grammar is None:
            session.grammar = None
            return None
        g = session.grammar
        if g is None or g.spec != params.grammar or g.output_start != params.output_start:
            g = session.grammar = SessionGrammar(params.grammar, params.output_start,
                                                 self.grammar_compiler().matcher(params.grammar))
        g.sync(session.tokens[params.output_start:position])
        return g.matcher

    def grammar_compiler(self):
        """The GrammarCompiler for this worker's tokenizer (made once, at start-up)."""
        with self._grammars_lock:
            if self._grammars is None:
                from specdec.grammar import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.info.eos_token_ids,
                                                 self.grammar_limits)
            return self._grammars

    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer as files, so an orchestrator can load it without the model."""
        if self._tokenizer_files is None:
            with tempfile.TemporaryDirectory() as tmp:
                self.tokenizer.save_pretrained(tmp)
                self._tokenizer_files = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
        return self._tokenizer_files
