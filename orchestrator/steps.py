"""The step loop: one per target worker, running the rounds of every request placed there together.

Each step (vLLM v1's scheduler step, with the draft and the target on workers of their own):

  plan    each request's gamma for this step (orchestrator/gamma.py, GammaPolicy.choose_step: all
          drafting requests share the draft passes and the target's pass); its cap stays its bound
  draft   one ProposeBatch per draft worker: draft step i of every drafting request in one pass
  verify  one VerifyBatch: every request's unsynced tokens and drafts in one target pass
  finish  per request, the steps of orchestrator/rounds.py: accept (rejection sampling with the
          request's own generator), commit, learn, emit its chunk

So a step costs two RPCs (one with no drafting) whatever the number of requests, and a request's
round is computed exactly as on its own: its seed stream, rejection sampling, stop strings,
logprobs, rollback and failover are the per-request code of rounds.py. A request joins between
steps, after its prefill (which the workers cut into chunks that ride along with the decoding
passes: specdec/worker/batching.py), and leaves between steps: finished, failed, cancelled (its
consumer stops reading: a deadline, a client gone), or moved to another target by failover (its
ticket goes to that target's loop). A worker fault is one request's: the others' calls in the
same batch go on.

Spans: each request keeps its `round` span per step, with draft, verify, rejection_sampling and
rollback under it, as on its own. A batched call serves many rounds but is one RPC: its client
span (and the worker's spans under it) sits under the draft or verify span of the step's first
request, which records the step's size; the other requests' draft and verify spans link to it
(OpenTelemetry's way for a batch).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry import trace

from orchestrator.arms import EXPLORE_MAX_LAG
from orchestrator.gamma import CATCH_UP_LAG, GammaPolicy, StepRequest
from orchestrator.metrics import DecodingMetrics
from orchestrator.rounds import (RequestState, Round, draft_call, draft_failed, finish, gamma_cap, new_round,
                                 take_suffix, take_proposals, target_failed, verify, verify_call)
from orchestrator.proposers.suffix import SuffixIndex
from specdec import telemetry as t
from specdec.errors import ServiceError
from specdec.protocol import MAX_GAMMA, GenerationChunk

log = logging.getLogger(__name__)

LOAD_MEMORY_S = 2.0  # a step's load level: the most requests on its loop in the last this many seconds


class Ticket:
    """A request's place in a step loop: the loop puts its chunks (or its error) here and the
    request's own thread reads them. Leaving (the reader stops, for any reason) waits until no
    step holds the request any more, so its sessions can then be closed safely."""

    def __init__(self, state: RequestState, ctx):
        self.state, self.ctx = state, ctx
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False
        self._gone = threading.Event()

    def put(self, chunk: GenerationChunk) -> None:
        self._out.put(chunk)

    def fail(self, exc: BaseException) -> None:
        self._out.put(exc)
        self.release()

    def release(self) -> None:
        """The loop holds the request no more."""
        self._gone.set()

    def leave(self) -> None:
        self.cancelled = True
        self._gone.wait()

    def __iter__(self):
        try:
            while True:
                item = self._out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self.leave()


class StepLoops:
    """The step loops of one decoder, one per target address, made on first use."""

    def __init__(self, policy: GammaPolicy, tracer, metrics: DecodingMetrics, suffix: SuffixIndex | None = None):
        self.policy, self.tracer, self.metrics = policy, tracer, metrics
        # suffix drafts (orchestrator/proposers/suffix.py): ended requests' tokens, fed by each request's own thread
        self.suffix = suffix if suffix is not None else SuffixIndex(0)
        self._loops: dict[str, StepLoop] = {}
        self._lock = threading.Lock()
        self.drafts = ThreadPoolExecutor(max_workers=8, thread_name_prefix="step-draft")  # several drafts at once
        # prefills run outside the steps (a request joins once its prefill is done) but share the
        # workers' passes with them: a step they overlapped measures nothing of its own arm
        self.prefilling = 0  # prefills in flight
        self.prefills_begun = 0  # and ever begun: a step that saw this change overlapped one

    @contextlib.contextmanager
    def prefill(self):
        """Marks a request's prefill (decoder.generate_stream) for the steps' measurements."""
        with self._lock:
            self.prefilling += 1
            self.prefills_begun += 1
        try:
            yield
        finally:
            with self._lock:
                self.prefilling -= 1

    def quiet_since(self) -> int | None:
        """A mark of the prefills so far, or None while one runs (see StepLoop.step)."""
        with self._lock:
            return None if self.prefilling else self.prefills_begun

    def join(self, state: RequestState, ctx) -> Ticket:
        ticket = Ticket(state, ctx)
        self.loop(state.placement.target.address).add(ticket)
        return ticket

    def loop(self, address: str) -> "StepLoop":
        with self._lock:
            loop = self._loops.get(address)
            if loop is None:
                loop = self._loops[address] = StepLoop(address, self)
            return loop

    def close(self) -> None:
        with self._lock:
            loops = list(self._loops.values())
        for loop in loops:
            loop.close()
        self.drafts.shutdown(wait=False)


class StepLoop:
    """Runs the steps of the requests on one target worker, on a thread of its own."""

    def __init__(self, address: str, loops: StepLoops):
        self.address, self.loops = address, loops
        self._joining: list[Ticket] = []
        self._wake = threading.Condition()
        self._closed = False
        self.steps = 0
        self._faulted = False
        self._loads: collections.deque[tuple[float, int]] = collections.deque()  # (time, requests) of recent steps
        self._thread = threading.Thread(target=self._run, name=f"steps-{address}", daemon=True)
        self._thread.start()

    def add(self, ticket: Ticket) -> None:
        with self._wake:
            if self._closed:
                ticket.fail(ServiceError("the orchestrator is shutting down", grpc.StatusCode.UNAVAILABLE))
                return
            self._joining.append(ticket)
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        running: list[Ticket] = []
        while True:
            with self._wake:
                while not self._joining and not running and not self._closed:
                    self._wake.wait()
                if self._closed:
                    for ticket in running + self._joining:
                        ticket.fail(ServiceError("the orchestrator is shutting down", grpc.StatusCode.UNAVAILABLE))
                    return
                running += self._joining
                self._joining = []
            for ticket in [tk for tk in running if tk.cancelled]:
                ticket.release()
            running = [tk for tk in running if not tk.cancelled]
            if not running:
                continue
            try:
                running = self.step(running)
            except BaseException as exc:  # noqa: BLE001 - a bug must fail its requests, not hang them
                log.exception("a step on %s failed", self.address)
                error = ServiceError(f"internal error: {type(exc).__name__}: {exc}", grpc.StatusCode.INTERNAL)
                for ticket in running:
                    ticket.fail(error)
                running = []

    # ---- one step --------------------------------------------------------------------------

    def step(self, tickets: list[Ticket]) -> list[Ticket]:
        """One step of all the requests; returns those that stay on this loop."""
        started = time.perf_counter()
        quiet = self.loops.quiet_since()
        self.steps += 1
        self._faulted = False  # a worker call of the step failed (_draft, _verify): its time is no arm's rate
        states = [tk.state for tk in tickets]
        caps = [gamma_cap(s) for s in states]
        # a draft session's catch-up (a whole prompt, when it opened lazily) waits: for a step without
        # prefills (it would take turns on the cores with the target's prefills, and this step, which
        # joining requests wait for, would wait for both), and until its request's first token
        # (which it would delay by the catch-up: ~0.3 s for a 100-token prompt here)
        caps = [0 if len(s.tokens) - s.draft_synced > CATCH_UP_LAG and (self.loops.prefilling or not s.generated)
                else cap for cap, s in zip(caps, states)]
        requests = [StepRequest(cap, s.placement.draft.address if s.placement.draft is not None else None,
                                len(s.tokens) - s.draft_synced, s.acceptance, s.max_new_tokens - s.generated,
                                explorable=len(s.tokens) - s.draft_synced <= EXPLORE_MAX_LAG and
                                s.draft_synced >= s.prompt_len)
                    for cap, s in zip(caps, states)]
        load = self._load(started, len(states) + self.loops.prefilling)  # those joining soon too
        gammas = self.loops.policy.choose_step(self.address, requests, load=load)
        free = self._suffix_drafts(states, requests, gammas, load)
        rounds = [new_round(s, g) for s, g in zip(states, gammas)]
        spans = [self.loops.tracer.start_span("round", context=tk.ctx) for tk in tickets]
        errors: list[BaseException | None] = [None] * len(tickets)
        drafts = self._draft(states, rounds, spans, errors)
        for j, (tokens, probs) in free.items():  # after the draft phase: they make no draft call
            take_suffix(rounds[j], tokens, probs)
        draft_end = time.perf_counter()
        target_pass = self._verify(states, rounds, spans, errors)
        staying, tokens = [], 0
        for ticket, state, rnd, span, error in zip(tickets, states, rounds, spans, errors):
            try:
                if error is not None:
                    raise error
                with trace.use_span(span, end_on_exit=False):
                    finish(state, rnd, span)
                self.loops.metrics.record_round(rnd.gamma, rnd.num_accepted, rnd.draft_s, rnd.verify_s,
                                                rnd.sampling_s, rnd.wire_bytes)
            except BaseException as exc:  # noqa: BLE001 - this request's failure only
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
                span.end()
                ticket.fail(exc)
                continue
            span.end()
            tokens += len(rnd.result.token_ids)  # what the step gave the request (before a stop cuts it)
            ticket.put(rnd.chunk)
            if state.finish is not None:
                ticket.release()
            elif state.placement.target.address != self.address:  # failover moved it
                self.loops.loop(state.placement.target.address).add(ticket)
            else:
                staying.append(ticket)
        unshared = quiet is not None and self.loops.quiet_since() == quiet  # no prefill overlapped the step
        self._learn(started, draft_end, target_pass, drafts, unshared and not self._faulted)
        seconds = time.perf_counter() - started
        # a target pass that also ran other work (prefill chunks of joining requests, another
        # orchestrator's sessions) says nothing of this step's arm: its time counts, its rate not
        rows, _, own_rows = target_pass
        outcome = self.loops.policy.observe_outcome(self.address, tokens, seconds,
                                                    measured=unshared and 0 < rows <= own_rows and not self._faulted)
        if outcome is not None:
            self.loops.metrics.record_step(*outcome[:2], seconds, outcome[2])
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step on %s: %d requests (%d prefilling), gammas %s, suffix %s, %d rows in the target's pass "
                      "(%d its own), %d tokens in %.1f ms (target %.1f ms, draft phase %.1f ms)%s", self.address,
                      len(states), self.loops.prefilling, gammas, [len(f[0]) for f in free.values()], rows, own_rows,
                      tokens, seconds * 1e3, target_pass[1] * 1e3, (draft_end - started) * 1e3,
                      "" if unshared else ", a prefill overlapped")
        return staying

    def _load(self, now: float, requests: int) -> int:
        """The load whose level's measured arms decide this step: the most requests (those
        prefilling included) on this loop in the last LOAD_MEMORY_S seconds. Where one wave of
        requests ends and the next joins, the first to join runs alone for a step or two; taken as a
        light load, it drafted (a lazily opened draft taking its prompt in) while the others'
        prefills held the cores, and the step everyone joins at waited seconds for it."""
        loads = self._loads
        while loads and loads[0][0] < now - LOAD_MEMORY_S:
            loads.popleft()
        loads.append((now, requests))
        return max(n for _, n in loads)

    def _suffix_drafts(self, states: list[RequestState], requests: list[StepRequest],
                     gammas: list[int], load: int) -> dict[int, tuple[list[int], list[float]]]:
        """Suffix drafts (orchestrator/proposers/suffix.py) in a step that drafts nothing with the model, as
        many tokens of each as the gamma policy finds worth their rows in the target's pass (and
        none where its measured arms say they do not pay: GammaPolicy.choose_suffix). Not for a
        request that asked for gamma 0 (the baseline stays plain), one with a grammar (the draft's
        tokens could leave it), or a benchmark's synthetic acceptance."""
        policy = self.loops.policy
        if not policy.adaptive or any(gammas):  # a step that drafts with the model carries none (choose_suffix)
            return {}
        found = {}
        for j, s in enumerate(states):
            k = min(MAX_GAMMA, s.max_new_tokens - s.generated - 1)
            if k <= 0 or s.gamma <= 0 or s.synthetic_acceptance or s.params.grammar is not None:
                continue
            tokens, probs = self.loops.suffix.draft(s.placement.scope, s.tokens, s.own_index, k)
            if tokens:
                found[j] = (tokens, probs)
        if not found:
            return {}
        lengths = policy.choose_suffix(self.address, requests, gammas,
                                     [found[j][1] if j in found else [] for j in range(len(states))],
                                     [s.suffix_calibration for s in states], load=load)
        return {j: (found[j][0][:k], found[j][1][:k]) for j, k in enumerate(lengths) if k}

    def _draft(self, states: list[RequestState], rounds: list[Round], spans,
               errors) -> dict[str, tuple[int, float, float]]:
        """Every drafting request's proposals: one batched call per draft worker, the calls to
        different drafts at once. Returns, per draft worker that answered, what the gamma policy
        learns: (rows, seconds) per pass as the worker reported them, and the seconds of the
        phase beyond its passes (the RPC, the orchestrator's work)."""
        started = time.perf_counter()
        # a session the draft takes in whole first (opened lazily: its first drafts), or one that fell
        # behind while drafting was off, is a one-off catch-up: a draft phase with one teaches no step's costs
        catching_up = {i for i, (s, r) in enumerate(zip(states, rounds))
                       if r.gamma > 0 and len(s.tokens) - s.draft_synced > CATCH_UP_LAG}
        groups: dict[int, tuple[object, list[int]]] = {}
        for i, (state, rnd) in enumerate(zip(states, rounds)):
            if rnd.gamma > 0:
                groups.setdefault(id(state.placement.draft), (state.placement.draft, []))[1].append(i)
        if not groups:
            return {}
        calls = {i: draft_call(states[i], rounds[i]) for _, members in groups.values() for i in members}
        work = [(member, members) for member, members in groups.values()]
        phases = self._phase("draft", [i for _, members in work for i in members], spans)
        # each draft's call runs under the draft span of its first request (the others link to it)
        run = lambda w: self._propose(trace.set_span_in_context(phases[w[1][0]]), *w, calls)  # noqa: E731
        results = [run(work[0])] if len(work) == 1 else list(self.loops.drafts.map(run, work))
        elapsed = time.perf_counter() - started
        for (member, members), outcomes in zip(work, results):
            for i, outcome in zip(members, outcomes):
                state, rnd = states[i], rounds[i]
                try:
                    with trace.use_span(phases[i], end_on_exit=True):
                        if isinstance(outcome, ServiceError):
                            self._faulted = True  # the wait for it (a stalled draft's seconds) is no step's cost
                            draft_failed(state, rnd, outcome)
                        else:
                            take_proposals(state, rnd, outcome)
                except BaseException as exc:  # noqa: BLE001 - not a worker fault, or failover failed
                    errors[i] = exc
        for rnd in rounds:
            rnd.draft_s = elapsed
        learned = {}
        for member, members in work:
            ran = [rounds[i] for i in members if rounds[i].draft_rows]  # reported by the last proposal
            if ran and not catching_up.intersection(members):
                widest = max(ran, key=lambda r: r.draft_rows)  # the sessions shared passes: the widest saw them all
                model_s = max(r.draft_pass_s * r.gamma for r in ran)
                learned[member.address] = (widest.draft_rows, widest.draft_pass_s, max(elapsed - model_s, 0.0))
        return learned

    def _phase(self, name: str, members: list[int], spans) -> dict:
        """A `name` span under the round of each member, begun now: the first member's carries
        the batched call (its RPC spans go under it, with the step's size), the others link to it."""
        tracer = self.loops.tracer
        first = tracer.start_span(name, context=trace.set_span_in_context(spans[members[0]]),
                                  attributes={t.BATCH_SESSIONS: len(members), t.TARGET_ADDRESS: self.address})
        links = [trace.Link(first.get_span_context())] if first.is_recording() else None
        phases = {members[0]: first}
        for i in members[1:]:
            phases[i] = tracer.start_span(name, context=trace.set_span_in_context(spans[i]), links=links)
        return phases

    def _propose(self, ctx, member, members: list[int], calls: dict) -> list:
        """One draft worker's share of the step: its calls' proposals (or errors), in order."""
        return t.run_in_context(ctx, member.worker.propose_batch, [calls[i] for i in members])

    def _verify(self, states: list[RequestState], rounds: list[Round], spans, errors) -> tuple[int, float, int]:
        """Every request's verification in one batched call (a request whose target failed is
        moved and verified again on its own); returns the (rows, seconds) of the target's pass and
        the rows the call brought to it."""
        started = time.perf_counter()
        live = [i for i in range(len(states)) if errors[i] is None]
        if not live:
            return 0, 0.0, 0
        calls = [verify_call(states[i], rounds[i]) for i in live]
        own_rows = sum(len(c.token_ids) + len(c.draft_token_ids) for c in calls)
        worker = states[live[0]].placement.target.worker
        phases = self._phase("verify", live, spans)
        ctx = trace.set_span_in_context(phases[live[0]])
        outcomes = t.run_in_context(ctx, worker.verify_batch, calls)
        elapsed = time.perf_counter() - started
        pass_rows, pass_s = 0, 0.0
        for i, outcome in zip(live, outcomes):
            state, rnd = states[i], rounds[i]
            try:
                if isinstance(outcome, ServiceError):
                    self._faulted = True
                    phases[i].set_status(trace.Status(trace.StatusCode.ERROR, str(outcome)))
                    phases[i].end()
                    target_failed(state, outcome)  # moves the session (or raises)
                    with trace.use_span(spans[i], end_on_exit=False):
                        verify(state, rnd)  # the same drafts, on the new target, on their own
                else:
                    phases[i].end()
                    rnd.verification = outcome
                    rnd.verify_s = elapsed
                    pass_rows, pass_s = max(pass_rows, outcome.batch_rows), max(pass_s, outcome.pass_s)
            except BaseException as exc:  # noqa: BLE001 - not a worker fault, or failover failed
                errors[i] = exc
        return pass_rows, pass_s, own_rows

    def _learn(self, started: float, draft_end: float, target_pass: tuple[int, float, int],
               drafts: dict[str, tuple[int, float, float]], unshared: bool) -> None:
        """The step's costs go to the gamma policy once: the target's pass (rows, seconds) when it
        ran this step's rows alone, each draft's passes and the rest of its phase, and the rest of
        the step when no prefill overlapped it (unshared: "alone" is a request alone on its target)."""
        policy = self.loops.policy
        rows, pass_s, own_rows = target_pass
        if 0 < rows <= own_rows:  # a pass that also ran prefill chunks (or others' rows) is no step's cost
            policy.observe_pass(self.address, rows, pass_s)
        # the rest of a step that a prefill overlapped holds its waits for the prefill's passes (a
        # second, where a step's own rest is ~5 ms): learnt, they made plain steps look ~10x dearer
        # beside their passes, and drafting, whose passes add more tokens per step, look better
        own = unshared and 0 < rows <= own_rows
        overhead = max(time.perf_counter() - draft_end - pass_s, 0.0) if own else None
        if not unshared:  # so do a draft phase's waits beyond its passes (the worker times its passes alone)
            drafts = {address: (n, s, None) for address, (n, s, _) in drafts.items()}
        policy.observe_step(self.address, overhead, drafts)
