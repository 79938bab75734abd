"""A worker's sessions: each owns a token sequence and a KV cache covering a prefix of it.

Rollback is absolute and idempotent: `Session.truncate(n)` keeps the first n tokens and crops the
cache to at most n, so a retried call changes nothing and accepted tokens are never recomputed.
Every forward pass runs over the tokens past the cached prefix, so a token the orchestrator
appends (the recovered or bonus token) and a draft the draft model never ran on (its last
proposal) are simply the next uncached tokens.

`SessionTable` holds the open sessions of one worker: its limits (sessions, tokens held), who
may use each (its secret and its opener's identity), and the reaper that frees sessions an
orchestrator left idle past their TTL. What runs on the model is specdec/worker/runner.py's;
specdec/worker/engine.py ties the two together for the roles.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import DynamicCache

from specdec.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, OutOfRange, ResourceExhausted

log = logging.getLogger(__name__)

MAX_SESSION_ID_LENGTH = 128


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

    def free(self) -> None:
        """The session is gone: work still running for it stops, its KV cache (its pages) is freed."""
        self.closed = True
        free_cache(self.cache)


def free_cache(cache) -> None:
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


class SessionTable:
    """The open sessions of one worker by id, within its limits; thread-safe."""

    def __init__(self, max_sessions: int, max_cached_tokens: int, ttl_s: float,
                 on_expired: Callable[[Session], None] = lambda session: None):
        """ttl_s: sessions idle this long are freed (an orchestrator that died cannot close its own);
        on_expired(session) after each."""
        self.max_sessions, self.max_cached_tokens, self.ttl_s = max_sessions, max_cached_tokens, ttl_s
        self._on_expired = on_expired
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._expire_idle, name="session-reaper", daemon=True)
        self._reaper.start()

    def __len__(self) -> int:
        return len(self._sessions)

    def close(self) -> None:
        """Stops the reaper and frees every session. Idempotent."""
        self._closed.set()
        self._reaper.join()
        self.free_all()

    def free_all(self) -> int:
        """Frees every open session; returns how many there were."""
        with self._lock:
            left = len(self._sessions)
            for s in self._sessions.values():
                s.free()
            self._sessions.clear()
        return left

    def admit(self, session: Session, tokens: int) -> None:
        """Makes a new session visible, if its id is free and the worker has room for it and its tokens."""
        with self._lock:
            if session.session_id in self._sessions:
                raise AlreadyExists(f"session {session.session_id} is already open")
            if len(self._sessions) >= self.max_sessions:
                raise ResourceExhausted(f"this worker already holds its maximum of {self.max_sessions} sessions")
            self._check_capacity(self._held(), tokens)
            self._sessions[session.session_id] = session

    def get(self, session_id: str) -> Session:
        """An open session, marked as used now."""
        check_session_id(session_id)
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"no open session {session_id!r} on this worker (never opened, closed or expired)")
        session.last_used = time.monotonic()
        return session

    def pop(self, session_id: str) -> Session:
        """Takes the session out of the table (the caller frees it)."""
        check_session_id(session_id)
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            raise NotFound(f"no open session {session_id!r} on this worker")
        return session

    def discard(self, session: Session) -> None:
        """Takes the session out, if it is in, and frees it (a prefill that failed)."""
        with self._lock:
            if self._sessions.get(session.session_id) is session:
                del self._sessions[session.session_id]
        session.free()

    def authorize(self, session_id: str, secret: bytes, owner: str = "") -> None:
        """Refuses a caller that is not the session's opener exactly as an unknown session
        (NOT_FOUND, the same message): it learns nothing and changes nothing. The secret is
        compared in constant time."""
        check_session_id(session_id)
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None or not (hmac.compare_digest(session.secret, secret)
                                   and hmac.compare_digest(session.owner.encode(), owner.encode())):
            raise NotFound(f"no open session {session_id!r} on this worker")

    def secret_of(self, session_id: str) -> bytes:
        """The secret of a session this worker just opened (for OpenSession's answer)."""
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"no open session {session_id!r} on this worker")
        return session.secret

    def held(self) -> int:
        """Tokens all sessions hold."""
        with self._lock:
            return self._held()

    def cached_tokens(self) -> int:
        with self._lock:
            sessions = list(self._sessions.values())
        return sum(s.cached for s in sessions)

    def check_capacity(self, extra: int) -> None:
        """RESOURCE_EXHAUSTED if `extra` more tokens would take the sessions past max_cached_tokens."""
        with self._lock:
            held = self._held()
        self._check_capacity(held, extra)

    def _check_capacity(self, held: int, extra: int) -> None:
        if held + extra > self.max_cached_tokens:
            raise ResourceExhausted(
                f"this worker holds {held} tokens in its sessions; {extra} more would pass its limit of "
                f"{self.max_cached_tokens} (--max-cached-tokens)"
            )

    def _held(self) -> int:
        return sum(len(s.tokens) for s in self._sessions.values())

    def _expire_idle(self) -> None:
        while not self._closed.wait(min(30.0, self.ttl_s / 4)):
            now = time.monotonic()
            with self._lock:
                idle = [s for s in self._sessions.values() if now - s.last_used > self.ttl_s and not s.lock.locked()]
                for s in idle:
                    del self._sessions[s.session_id]
                    s.free()
            for s in idle:
                self._on_expired(s)
                log.warning("freed session %s after %.0f s idle", s.session_id, now - s.last_used)
