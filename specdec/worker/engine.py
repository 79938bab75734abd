"""What the draft and the target worker have in common: sessions that each own a KV cache.

A session holds the token sequence a worker knows and a KV cache covering a prefix of it.
Rollback is absolute and idempotent: `truncate(n)` keeps the first n tokens and crops the cache
to at most n, so a retried call changes nothing and accepted tokens are never recomputed.
Every forward pass runs over the tokens past the cached prefix, so a token the orchestrator
appends (the recovered or bonus token) and a draft the draft model never ran on (its last
proposal) are simply the next uncached tokens.

The role-specific work (proposing, verifying) lives in draft_service/engine.py and
target_service/engine.py; gRPC lives in specdec/worker/server.py and the roles' servicers.
"""

from __future__ import annotations

import copy
import hmac
import logging
import secrets
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator

import torch
from opentelemetry import metrics, trace
from transformers import DynamicCache

from specdec.eagle3 import Eagle3Head, HeadForward
from specdec.errors import (AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, OutOfRange,
                            ResourceExhausted, ServiceError, Unavailable)
from specdec.modeling import LoadedModel, eos_token_ids, vocab_fingerprint
from specdec import telemetry as t
from specdec.threads import PassLock
from specdec.wire import Features, ModelInfo
from specdec.worker.batching import (CPU_MAX_PREFILL_TOKENS_WHILE_DECODING, DEFAULT_MAX_BATCH_TOKENS, Batcher,
                                     Chain, Pass, RaggedCache, Work, grow_append,
                                     use_ragged_attention)
from specdec.worker.forward import NativeForward, model_forward
from specdec.worker.paged import PAGE, CudaGraph, KVPages, StaticForward, static_forward_fits
from specdec.worker.prefixes import MIN_PREFIX, PrefixStore

log = logging.getLogger(__name__)

# a call's work on the model (a Propose's draft steps, a Verify's pass): a generator that yields each
# Work it needs and is sent back its result, and returns the call's result (WorkerEngine.run_calls)
Program = Generator[Work, Any, Any]

MAX_SESSION_ID_LENGTH = 128


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


def check_session_id(session_id: str) -> None:
    """Every session RPC: an id no session can have is refused before it is looked up (or
    quoted in a message: a huge one would not fit gRPC's status header)."""
    if not session_id or len(session_id) > MAX_SESSION_ID_LENGTH:
        raise InvalidArgument(f"session_id must be 1..{MAX_SESSION_ID_LENGTH} characters, got {len(session_id)}")


@dataclass
class SessionGrammar:
    """A session's place in its request's grammar: the matcher has consumed exactly `tokens`, the
    session's tokens from output_start on up to some position."""

    spec: Any  # specdec.protocol.GrammarSpec
    output_start: int
    matcher: Any  # specdec.grammar.Matcher
    tokens: list[int] = field(default_factory=list)

    def sync(self, output: list[int]) -> None:
        """Brings the matcher to exactly `output` (the session's output before the position to
        score): rolls back to the longest common prefix with what it followed, consumes the rest."""
        common = len(self.tokens)
        if self.tokens != output[:common]:  # the first difference, or the end of the shorter
            common = next((i for i, (a, b) in enumerate(zip(self.tokens, output)) if a != b),
                          min(common, len(output)))
        if common < len(self.tokens):
            self.matcher.truncate(common)
            del self.tokens[common:]
        rest = output[common:]
        if rest:
            self.matcher.consume(rest)  # GrammarViolation (FAILED_PRECONDITION): output the grammar forbids
            self.tokens.extend(rest)


@dataclass
class Session:
    session_id: str
    tokens: list[int]
    cache: DynamicCache
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    # bumped by every call that changes the session; a Propose, which releases the lock between its
    # passes (and a job drafting ahead), checks it did not change in between
    version: int = 0
    last_pass_rows: int = 0  # tokens of all sessions in the last pass it took part in
    last_pass_s: float = 0.0  # and the seconds that pass took
    # a draft's proposals past its accepted tokens, with the q of each (draft_service.engine.Drafted)
    drafted: Any = None
    grammar: Any = None  # structured output: the SessionGrammar following its output (WorkerEngine.grammar_at)
    closed: bool = False  # set once the session is freed: work still running for it stops
    # who may use it (worker servicers check both: specdec/worker/server.py): the secret
    # OpenSession returned, and the opener's certificate identity ("" without mutual TLS)
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(16), repr=False)
    owner: str = ""
    scope: str = ""  # the orchestrator's name for the request's tenant: prefix caching stays within it
    # a target session a feature head drafts for: the layers whose input stream each pass returns
    # (OpenSession's feature_layers), and the features of its passes not yet handed out
    feature_layers: tuple[int, ...] = ()
    features: list = field(default_factory=list)  # [specdec.wire.Features], in pass order
    # a feature head's session (specdec/eagle3.py): row j is token j's input state (fc of the
    # target's features at position j - 1, or the head's own state there); rows past the tokens unused
    hidden: Any = None

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length()

    def truncate(self, length: int) -> None:
        """Keeps the first `length` tokens; crops the cache only if it reaches past them."""
        if length > len(self.tokens):
            raise OutOfRange(f"session {self.session_id} holds {len(self.tokens)} tokens; cannot truncate to {length}")
        self.version += 1
        del self.tokens[length:]
        if self.drafted is not None:
            self.drafted.cut(length)
        if self.cached > length:
            self.cache.crop(length - self.cached)  # transformers 5: a negative count removes tokens

    def check_start(self, start: int, new_tokens: int) -> None:
        """A Propose/Verify puts its new tokens at absolute position `start`; there must be no gap
        and at least one token to score."""
        if start > len(self.tokens):
            raise FailedPrecondition(
                f"session {self.session_id} holds {len(self.tokens)} tokens; a call cannot start at position {start}"
            )
        if start + new_tokens == 0:
            raise FailedPrecondition(f"session {self.session_id} is empty: send at least one token to score")

    def uncache_last(self) -> None:
        """Makes sure the last token is uncached, so the next pass yields its logits."""
        if self.cached >= len(self.tokens):
            self.cache.crop(len(self.tokens) - 1 - self.cached)


def _free_cache(cache) -> None:
    """Gives a PagedCache's pages back (a DynamicCache is simply dropped)."""
    free = getattr(cache, "free", None)
    if free is not None:
        free()


def take_features(session: Session):
    """The session's features not handed out yet, as one Features (later passes over a position
    replace earlier ones); None where there are none. Call holding session.lock."""
    out = None
    for f in session.features:
        out = f if out is None else out.joined(f)
    session.features.clear()
    return out


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


def grow_hidden(session: Session, rows: int, like: torch.Tensor | None = None) -> None:
    """Room for `rows` input states in a feature head's session (a quarter more when it grows)."""
    have = session.hidden
    if have is not None and have.shape[0] >= rows:
        return
    like = have if have is not None else like
    grown = like.new_zeros(rows + rows // 4 + 16, like.shape[-1])
    if have is not None:
        grown[: have.shape[0]] = have
    session.hidden = grown


def new_model_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")


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
        """kv_pages: keep the KV cache in pages allocated at start-up and run passes through
        StaticForward (specdec/worker/paged.py); None: on CUDA where the model fits it. cuda_graphs:
        replay captured graphs for decoding passes there (off: every pass eager). graph_class: what
        captures them (default CudaGraph; tests on CPU: paged.EagerGraph, the padded passes uncaptured).
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
        self.input_device = self.model.get_input_embeddings().weight.device
        self._sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()
        # Every forward runs on one thread: the batcher's where the engine has the process to
        # itself, else this model thread (see _run_pass). torch's OpenMP keeps a team of threads
        # per calling thread; forwards from gRPC's many handler threads would wake several teams
        # that spin against each other and slow the passes. One thread also
        # serialises the forwards, which on a shared device would only contend anyway. Engines in
        # one process (the in-process path) should share one: pass model_thread=new_model_thread().
        self._owns_model_thread = model_thread is None
        self._model_thread = model_thread or new_model_thread()
        self.head = isinstance(self.model, Eagle3Head)  # a feature head drafts (specdec/eagle3.py)
        if self.head:
            prefix_cache_tokens = 0  # a head's cached states hold its own guesses past the target's: not kept
        else:
            use_ragged_attention(self.model)
        cuda = self.input_device.type == "cuda"
        if cuda:
            # the model thread only launches kernels: OpenMP teams of every core would spin against
            # the Python threads that launch them (vLLM's default for GPU workers too)
            torch.set_num_threads(1)
        self._pages: KVPages | None = None
        if kv_pages and (self.head or not static_forward_fits(self.model)):
            raise ValueError(f"{type(self.model).__name__} does not fit the static pass over KV pages")
        if self.head:
            graph = None
            self._forward = HeadForward(self.model)
            self._forward_device = self.input_device
        elif kv_pages if kv_pages is not None else cuda and static_forward_fits(self.model):
            self._pages = KVPages.for_model(self.model, tokens=max_cached_tokens + prefix_cache_tokens,
                                            sessions=max_sessions)
            graph = graph_class or (CudaGraph if cuda and cuda_graphs else None)
            self._forward = StaticForward(self.model, self._pages, max_sessions=max_sessions,
                                          max_context=self.max_context, graph=graph)
            self._forward_device = torch.device("cpu")  # it copies what a pass needs in one go
            self._model_thread.submit(self._forward.capture).result()
            log.info("KV cache: %d pages of %d tokens, %.2f GiB; %d CUDA graphs captured in %.1f s (%.2f GiB)",
                     self._pages.pages, PAGE, self._pages.nbytes / 2**30, len(self._forward.buckets),
                     self._forward.capture_s, self._forward.capture_bytes / 2**30)
        else:
            graph = None
            self._forward = model_forward(self.model)  # specdec/worker/forward.py: native or lean for Llama/Qwen2
            self._forward_device = self.input_device
        if max_prefill_tokens_while_decoding is None:  # on a GPU an eager prefill pass costs about the same at any size
            max_prefill_tokens_while_decoding = max_batch_tokens if cuda else CPU_MAX_PREFILL_TOKENS_WHILE_DECODING
        self._batcher = Batcher(self._run_pass, max_batch_tokens, max_prefill_tokens_while_decoding)
        self._pass_lock = PassLock(pass_lock)  # specdec/threads.py: passes of co-located workers take turns
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
            kernels=kernels_in_use(loaded.quantization, self._forward, graph is not None),
            feature_layers=self.model.feature_layers if self.head else (),
            feature_size=self.model.feature_size if self.head else 0,
            num_layers=0 if self.head else int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
        )
        log.info("passes run on %s kernels, weights %s", self.info.kernels, self.info.dtype)
        self._tokenizer_files: dict[str, bytes] | None = None
        self._prefixes = PrefixStore(prefix_cache_tokens, self._copy_prefix, _free_cache) if prefix_cache_tokens else None
        self.grammar_limits = grammar_limits  # specdec.grammar.GrammarLimits; None: its defaults
        self._grammars = None  # the GrammarCompiler (wrapping a 150k vocabulary takes ~1 s) ...
        self._grammars_lock = threading.Lock()
        # ... made now, off the request path: a first grammar request would wait for it, and its
        # round's time would tell the gamma policy that drafting is slow
        threading.Thread(target=self.grammar_compiler, name="grammar-compiler", daemon=True).start()
        self.instrument(None, "worker")
        # sessions idle this long are freed: an orchestrator that died cannot close its own
        self.session_ttl_s = session_ttl_s
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._expire_idle_sessions, name="session-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        """Stops the session reaper and (when this engine made it) the model thread; frees every
        session. Idempotent."""
        self._closed.set()
        self._reaper.join()
        self._batcher.close()
        if self._owns_model_thread:
            self._model_thread.shutdown(wait=True)
        self._pass_lock.close()
        with self._sessions_lock:
            for s in self._sessions.values():
                self._forget(s)
            self._sessions.clear()
        if self._prefixes is not None:
            self._prefixes.clear()

    def _new_cache(self):
        """A new session's KV cache: pages of the worker's KVPages, else a DynamicCache."""
        return self._pages.new_cache() if self._pages is not None else DynamicCache(config=self.model.config)

    def _copy_prefix(self, cache, tokens: int):
        """A new cache holding the first `tokens` tokens of `cache` (a PagedCache copies pages)."""
        if hasattr(cache, "copy_prefix"):
            return cache.copy_prefix(tokens)
        copy = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            for src, dst in zip(cache.layers, copy.layers):
                grow_append(dst, src.keys[..., :tokens, :], src.values[..., :tokens, :])
        return copy

    @staticmethod
    def _forget(session: "Session") -> None:
        """The session is gone: work still running for it stops, its KV pages go back."""
        session.closed = True
        _free_cache(session.cache)

    def instrument(self, telemetry, role: str) -> None:
        """Spans for prefill, truncate and every forward pass; gauges of sessions and cached
        tokens. With telemetry None (or off): the API's no-op tracer and meter."""
        self.tracer = telemetry.tracer if telemetry is not None else trace.NoOpTracer()
        meter = telemetry.meter if telemetry is not None else metrics.NoOpMeter(t.INSTRUMENTATION_SCOPE)
        attributes = {t.ROLE: role}
        meter.create_observable_gauge(
            "specdec.worker.sessions", unit="{session}", description="Sessions open on this worker",
            callbacks=[lambda options: [metrics.Observation(len(self._sessions), attributes)]])
        meter.create_observable_gauge(
            "specdec.worker.cached_tokens", unit="{token}", description="Tokens held in KV caches",
            callbacks=[lambda options: [metrics.Observation(self.cached_tokens(), attributes)]])
        self._forward_duration = meter.create_histogram(
            "specdec.worker.forward.duration", unit="s", description="One forward pass, by kind",
            explicit_bucket_boundaries_advisory=t.SECONDS_BUCKETS)
        self._batch_rows = meter.create_histogram(
            "specdec.worker.batch.rows", unit="{token}", description="Tokens (rows) in one forward pass",
            explicit_bucket_boundaries_advisory=t.ROWS_BUCKETS)
        self._batch_sessions = meter.create_histogram(
            "specdec.worker.batch.sessions", unit="{session}", description="Sessions in one forward pass",
            explicit_bucket_boundaries_advisory=t.ROWS_BUCKETS)
        self._expired = meter.create_counter(
            "specdec.worker.sessions_expired", unit="{session}", description="Sessions freed after idling")
        self._role = role

    def cached_tokens(self) -> int:
        with self._sessions_lock:
            sessions = list(self._sessions.values())
        return sum(s.cached for s in sessions)

    # ---- session lifecycle -------------------------------------------------------------

    def describe(self) -> ModelInfo:
        with self._sessions_lock:
            n, held = len(self._sessions), self._held_locked()
        return ModelInfo(**{**self.info.__dict__, "open_sessions": n, "draining": self.draining, "held_tokens": held})

    def drain(self, timeout_s: float) -> int:
        """Takes no new session, waits up to timeout_s for the open ones to close; returns how
        many were still open (their orchestrators move them elsewhere on their next call)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._sessions_lock:
                if not self._sessions:
                    return 0
            time.sleep(0.1)
        with self._sessions_lock:
            left = len(self._sessions)
            for s in self._sessions.values():
                self._forget(s)
            self._sessions.clear()
        return left

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
        session = Session(session_id, list(token_ids[:-1]), self._new_cache(), owner=owner, scope=scope,
                          feature_layers=feature_layers)
        session.lock.acquire()  # held from before the session is visible until its prefill is done
        try:
            self._admit(session, len(token_ids))
            t0 = time.perf_counter()
            reused = 0
            try:
                if self._prefixes is not None and session.tokens and not feature_layers:
                    cache, reused = self._prefixes.copy_longest((owner, scope), session.tokens)
                    if cache is not None:
                        _free_cache(session.cache)
                        session.cache = cache
                if len(session.tokens) > session.cached:
                    with self.tracer.start_as_current_span("prefill", attributes={
                            t.SESSION_ID: session_id, t.PREFIX_CACHED: reused}):
                        self.run(session, 1, "prefill")  # fills the cache
                session.tokens.append(int(token_ids[-1]))
            except BaseException:
                with self._sessions_lock:
                    self._sessions.pop(session_id, None)
                self._forget(session)
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
            self._admit(session, len(session.tokens))
        except ServiceError:
            self._forget(session)
            raise
        return len(session.tokens), time.perf_counter() - t0, len(session.tokens)

    def _admit(self, session: Session, tokens: int) -> None:
        """Makes a new session visible, if its id is free and the worker has room for it and its tokens."""
        with self._sessions_lock:
            if session.session_id in self._sessions:
                raise AlreadyExists(f"session {session.session_id} is already open")
            if len(self._sessions) >= self.max_sessions:
                raise ResourceExhausted(f"this worker already holds its maximum of {self.max_sessions} sessions")
            self._check_capacity(tokens, locked=True)
            self._sessions[session.session_id] = session

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
        """Refuses a caller that is not the session's opener exactly as an unknown session
        (NOT_FOUND, the same message): it learns nothing and changes nothing. The secret is
        compared in constant time."""
        check_session_id(session_id)
        with self._sessions_lock:
            session = self._sessions.get(session_id)
        if session is None or not (hmac.compare_digest(session.secret, secret)
                                   and hmac.compare_digest(session.owner.encode(), owner.encode())):
            raise NotFound(f"no open session {session_id!r} on this worker")

    def secret_of(self, session_id: str) -> bytes:
        """The secret of a session this worker just opened (for OpenSession's answer)."""
        with self._sessions_lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"no open session {session_id!r} on this worker")
        return session.secret

    def close_session(self, session_id: str) -> None:
        check_session_id(session_id)
        with self._sessions_lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                raise NotFound(f"no open session {session_id!r} on this worker")
        self._retain(session)
        self._forget(session)

    def _retain(self, session: Session) -> None:
        """A session that ended normally leaves its cache to the prefix store (none of its work is
        running: a cache a pass may still be writing is not kept)."""
        if self._prefixes is None or not session.lock.acquire(blocking=False):
            return
        try:
            cache, held = session.cache, min(session.cached, len(session.tokens))
            if held:
                session.cache = self._new_cache()
                self._prefixes.retain((session.owner, session.scope), session.tokens[:held], cache)
        finally:
            session.lock.release()

    def _expire_idle_sessions(self) -> None:
        while not self._closed.wait(min(30.0, self.session_ttl_s / 4)):
            now = time.monotonic()
            with self._sessions_lock:
                idle = [s for s in self._sessions.values()
                        if now - s.last_used > self.session_ttl_s and not s.lock.locked()]
                for s in idle:
                    del self._sessions[s.session_id]
                    self._forget(s)
            for s in idle:
                self._expired.add(1, {t.ROLE: self._role})
                log.warning("freed session %s after %.0f s idle", s.session_id, now - s.last_used)

    def session(self, session_id: str) -> Session:
        check_session_id(session_id)
        with self._sessions_lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"no open session {session_id!r} on this worker (never opened, closed or expired)")
        session.last_used = time.monotonic()
        return session

    # ---- batched calls -----------------------------------------------------------------

    def run_calls(self, calls: list, program: Callable[[Any], Program]) -> list:
        """The calls of one batched RPC (an orchestrator's step), run side by side on this thread:
        program(call) is the call's work as a generator that yields each Work it needs (see
        `work`) and gets back its result; the Works the calls yield at one time go to the batcher
        together and share a pass (draft step i of every Propose, every Verify). Returns, per call
        in order, the program's return value or the ServiceError it raised: each call succeeds or
        fails on its own. A second call on the same session is refused (INVALID_ARGUMENT): a
        session takes one call at a time."""
        seen: set[str] = set()
        results: list = [None] * len(calls)
        running: dict[int, Program] = {}
        for i, call in enumerate(calls):
            if call.session_id in seen:
                results[i] = InvalidArgument(f"session {call.session_id} appears twice in one batch")
                continue
            seen.add(call.session_id)
            try:
                self.session(call.session_id)
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
                    replies = dict(zip(works, self._batcher.run_all(list(works.values()))))
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
            reply, = self._batcher.run_all([work])

    # ---- shared model work -------------------------------------------------------------

    def _held_locked(self) -> int:
        """Tokens all sessions hold; call with _sessions_lock held."""
        return sum(len(s.tokens) for s in self._sessions.values())

    def _check_capacity(self, extra: int, *, locked: bool = False) -> None:
        """RESOURCE_EXHAUSTED if `extra` more tokens would take the sessions past max_cached_tokens."""
        if locked:
            held = self._held_locked()
        else:
            with self._sessions_lock:
                held = self._held_locked()
        if held + extra > self.max_cached_tokens:
            raise ResourceExhausted(
                f"this worker holds {held} tokens in its sessions; {extra} more would pass its limit of "
                f"{self.max_cached_tokens} (--max-cached-tokens)"
            )

    def grow(self, session: Session, new_length: int) -> None:
        """Checks that the session may grow to new_length tokens (a Propose or Verify about to run)."""
        if new_length > len(session.tokens):
            self._check_capacity(new_length - len(session.tokens))

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
        return self._batcher.submit(self.work(session, keep, kind, post, chain))

    @property
    def chains(self) -> bool:
        """Whether passes can chain draft steps on the device (captured passes over KV pages)."""
        return bool(getattr(self._forward, "buckets", None))

    def _adopt_prefix(self, session: Session, keep: int) -> None:
        """Starts the session's uncached tokens from a cached prefix longer than what it holds
        (the last `keep` stay uncached: their logits are wanted)."""
        cache, _ = self._prefixes.copy_longest((session.owner, session.scope),
                                               session.tokens[:len(session.tokens) - keep], longer_than=session.cached)
        if cache is not None:
            _free_cache(session.cache)
            session.cache = cache

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
            with self._pass_lock:
                t0 = time.perf_counter()  # the pass itself: not the wait for the other worker's
                args = (torch.tensor([ids], device=self._forward_device),
                        torch.tensor([positions], device=self._forward_device),
                        RaggedCache([s.cache for s in sessions], [n for _, n in batch.items]),
                        torch.tensor(keep_rows, dtype=torch.long))
                if self.head:  # each row's input state beside its token (specdec/eagle3.py)
                    logits, states = self._forward(*args, torch.cat([
                        work.session.hidden[work.session.cached:][:n] for work, n in batch.items]))
                    set_next_states(done, states)
                elif aux:
                    logits, features = self._forward(*args, aux=aux)
                    hand_out_features(batch.items, starts, features, aux)
                else:
                    logits = self._forward(*args)
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
                _free_cache(session.cache)
                session.cache = self._new_cache()
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
        out = self._forward.chain([w.session.cache for w in works], last, [w.chain for w in works])
        if out is None:
            return 0, {}
        tokens, probs, steps_rows = out
        return steps_rows, {id(w): (tk, pr) for w, tk, pr in zip(works, tokens, probs)}

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
