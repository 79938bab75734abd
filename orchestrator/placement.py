"""Where one request's sessions live, and moving them when a worker fails.

The orchestrator holds every validated token of a request, so a session can be rebuilt on any
worker by one prefill. A target that fails (gone, stalled past its deadline, restarted and
lost the session) is replaced by another serving target, or the request fails UNAVAILABLE with
the reason; a draft that fails is replaced by another draft, or dropped, and the request goes on
target-only. Either way the tokens are the ones the undisturbed run would give: greedily the
same, sampled from the same distribution, since every token is still the target's verdict.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from orchestrator.pool import Member, WorkerPool
from specdec import hardware
from specdec import telemetry as t
from specdec.errors import WORKER_FAULTS, ServiceError, Unavailable
from specdec.telemetry import current_context, run_in_context

log = logging.getLogger(__name__)

MAX_FAILOVERS = 4  # per role and request: beyond this, the fault is not one worker's


def is_worker_fault(exc: BaseException) -> bool:
    """A status that says "this worker, not this request" (specdec/errors.py, STATUSES): another
    worker may well succeed."""
    return isinstance(exc, ServiceError) and exc.code in WORKER_FAULTS


class Placement:
    """A request's target and (optional) draft session, pinned until one fails."""

    def __init__(self, session_id: str, targets: WorkerPool, drafts: WorkerPool | None, tracer,
                 prefill_pool: ThreadPoolExecutor | None = None, scope: str = "", prefill: str = "parallel"):
        """scope: the request's tenant, which the workers' prefix caches match within. prefill:
        with a prefill_pool, "parallel" prefills both workers at once, "auto" only where they are
        apart (on different hardware)."""
        self.session_id = session_id
        self.scope = scope
        self.cached_tokens = 0  # prompt tokens the target did not prefill (a cached prefix, a fork)
        self.targets, self.drafts = targets, drafts
        self.tracer = tracer
        self._prefill_pool = prefill_pool
        self._prefill = prefill
        self.target: Member | None = None
        self.draft: Member | None = None
        self._held: list[tuple[WorkerPool, Member]] = []  # acquired members, released at close
        self._open: list[Member] = []  # members holding our session
        self.failovers = {"target": 0, "draft": 0}
        self._failed: set[str] = set()  # addresses that failed this request: not tried again
        self.draft_dropped: str | None = None  # why the request went on without a draft
        # With the prefills in sequence (workers sharing cores), the draft's session opens on the
        # first token only: its prefill waits for the first round that drafts, as that round's
        # catch-up, and never happens for a request that a loaded target serves at gamma 0.
        # Decided once the workers are placed (_note_draft).
        self.lazy_draft = True
        self.draft_synced = 0  # tokens the draft's session holds validly, set when it opens
        self.draft_prefilled = 0  # of them, those its model took in (not lazily opened, not a fork's copy)
        # a feature head drafts (specdec/eagle3.py): the target layers its features come from; the
        # target's session returns them, and the head's opens on one token (its catch-up brings them)
        self.feature_layers: tuple[int, ...] = ()
        self.opened_features = None  # the target prefill's features (specdec.wire.Features), for the request

    # ---- opening ---------------------------------------------------------------------------

    def open(self, prompt: list[int]) -> None:
        """Places and prefills the target (and the draft, when there is a draft pool)."""
        self.target = self._acquire(self.targets)
        if self.drafts is not None:
            try:
                self.draft = self._acquire(self.drafts)
            except Unavailable as exc:
                self._drop_draft(exc)
        self._note_draft()
        pending = [m for m in (self.target, self.draft) if m is not None]
        if self.lazy_draft:
            results = [self._try_open(m, prompt) for m in pending]
        else:
            ctx = current_context()  # the pool's threads need it for the RPCs' spans
            futures = [self._prefill_pool.submit(run_in_context, ctx, self._try_open, m, prompt) for m in pending]
            results = [f.result() for f in futures]
        for member, error in zip(pending, results):
            if error is None:
                continue
            if member is self.target:
                self.target_failed(error, prompt)
            else:
                self.draft_failed(error, prompt)

    def fork(self, parent: "Placement", prompt: list[int]) -> None:
        """Places this request's sessions (another choice of the same prompt) on the parent's
        workers as copies of its sessions, with no prefill; where a parent's worker no longer takes
        sessions, elsewhere by a prefill as `open` does."""
        self.target = self._acquire(self.targets, prefer=parent.target)
        if self.drafts is not None:
            try:
                self.draft = self._acquire(self.drafts, prefer=parent.draft)
            except Unavailable as exc:
                self._drop_draft(exc)
        self._note_draft()
        self.opened_features = parent.opened_features  # a forked target session ran no prefill
        for member in [m for m in (self.target, self.draft) if m is not None]:
            same = member is (parent.target if member is self.target else parent.draft) and member in parent._open
            error = self._try_open(member, prompt, parent.session_id if same else None)
            if error is not None:
                (self.target_failed if member is self.target else self.draft_failed)(error, prompt)

    def _try_open(self, member: Member, tokens: list[int], fork_of: str | None = None) -> ServiceError | None:
        """Opens our session there (a copy of session fork_of, which it holds); a worker fault is
        returned (for failover), others raised."""
        if member is self.draft and (self.lazy_draft or self.feature_layers):
            tokens = tokens[:1]  # no pass: the first Propose catches up from here
        try:
            if fork_of is not None:
                _, _, cached = member.worker.fork_session(self.session_id, fork_of, tokens)
            elif member is self.target and self.feature_layers:
                _, _, cached = member.worker.open_session(self.session_id, tokens, scope=self.scope,
                                                          feature_layers=self.feature_layers)
                self.opened_features = member.worker.opened_features(self.session_id)
            else:
                _, _, cached = member.worker.open_session(self.session_id, tokens, scope=self.scope)
        except ServiceError as exc:
            if not is_worker_fault(exc):
                raise
            return exc
        self._open.append(member)
        if member is self.draft:
            self.draft_synced = len(tokens)
            self.draft_prefilled = len(tokens) if fork_of is None and len(tokens) > 1 else 0
        else:
            self.cached_tokens = cached
        return None

    def _note_draft(self) -> None:
        """What the placed draft decides: a feature head's layers, and whether the prefills run at
        once (not lazily) or the draft's waits for its first round."""
        info = self.draft.info if self.draft is not None else None
        self.feature_layers = tuple(info.feature_layers) if info is not None else ()
        self.lazy_draft = self._prefill_pool is None or self._prefill == "auto" and not self.apart

    @property
    def apart(self) -> bool:
        """Whether the draft and the target run on different hardware, as their Describe says
        (specdec/hardware.py): the draft may then work while the target does (prefills at once,
        drafting ahead). False where unknown, or without a draft."""
        if self.target is None or self.draft is None:
            return False
        return hardware.share(self.target.info, self.draft.info) is False

    def _acquire(self, pool: WorkerPool, exclude=(), prefer: Member | None = None) -> Member:
        member = pool.acquire(exclude, prefer)
        self._held.append((pool, member))
        return member

    # ---- failover --------------------------------------------------------------------------

    def target_failed(self, exc: ServiceError, tokens: list[int]) -> None:
        """Moves the session to another target holding `tokens`; raises Unavailable if none can."""
        def give_up(exc: ServiceError, failed: Member, none_left: Unavailable | None) -> None:
            if none_left is None:
                raise Unavailable(f"target workers keep failing ({exc.message}); giving up on this request")
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise exc from None  # full, not broken: the client should back off
            raise Unavailable(f"target worker {failed.address} failed ({exc.code.name}: {exc.message}) "
                              f"and no other target is serving") from None

        self._fail_over("target", exc, tokens, give_up)

    def draft_failed(self, exc: ServiceError, tokens: list[int]) -> None:
        """Moves the draft session to another draft holding `tokens` (draft_synced of them), or drops
        speculation. A feature head is dropped: a new one would need the target's features of
        every position, which the request no longer keeps."""
        if self.feature_layers:
            self._forget(self.draft, exc)
            self.failovers["draft"] += 1
            return self._drop_draft(exc)
        self._fail_over("draft", exc, tokens, lambda exc, failed, none_left: self._drop_draft(none_left or exc))

    def _fail_over(self, role: str, exc: ServiceError, tokens: list[int], give_up) -> None:
        """Replaces the failed `role` member with another that opens the session on `tokens`, retrying
        while new ones fail; give_up(exc, failed, none_left) ends it after MAX_FAILOVERS
        (none_left None) or when the pool has no other member (the pool's Unavailable)."""
        pool = self.targets if role == "target" else self.drafts
        while True:
            failed = getattr(self, role)
            self._forget(failed, exc)
            self.failovers[role] += 1
            address = t.TARGET_ADDRESS if role == "target" else t.DRAFT_ADDRESS
            with self.tracer.start_as_current_span("failover", attributes={
                    t.ROLE: role, address: failed.address, t.STATUS: exc.code.value[0]}) as span:
                if self.failovers[role] > MAX_FAILOVERS:
                    return give_up(exc, failed, None)
                try:
                    member = self._acquire(pool, exclude=self._failed)
                except Unavailable as none_left:
                    return give_up(exc, failed, none_left)
                setattr(self, role, member)
                span.set_attribute("specdec.failover.to", member.address)
                log.warning("session %s: %s %s failed (%s); moving to %s", self.session_id, role, failed.address,
                            exc.code.name, member.address)
                error = self._try_open(member, tokens)
            if error is None:
                return
            exc = error

    def _forget(self, member: Member, exc: ServiceError) -> None:
        """The member failed us: it gets no new sessions until it answers a poll again."""
        if member in self._open:
            self._open.remove(member)
        if exc.code != grpc.StatusCode.NOT_FOUND:  # a worker that only lost the session may take it again
            self._failed.add(member.address)
        pool = next(p for p, m in self._held if m is member)
        # NOT_FOUND: it answers, it only lost our session; RESOURCE_EXHAUSTED: full, not broken
        if exc.code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED):
            pool.report_failure(member, exc)

    def _drop_draft(self, reason: Exception) -> None:
        self.draft = None
        self.draft_dropped = str(reason)
        log.warning("session %s goes on without speculation: %s", self.session_id, reason)

    # ---- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Closes our session where it is open and gives every member back to its pool."""
        for member in self._open:
            try:
                member.worker.close_session(self.session_id)
            except Exception:  # noqa: BLE001 - the request's own outcome matters more (the TTL frees it)
                log.warning("could not close session %s on %s", self.session_id, member.address, exc_info=True)
        self._open.clear()
        for pool, member in self._held:
            pool.release(member)
        self._held.clear()
