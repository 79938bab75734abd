"""The step loop: one per target worker, running the rounds of every request placed there together.

Each step is four calls (vLLM v1's schedule -> execute -> update, with the draft and the target
on workers of their own; StepLoop.step):

  _plan    each request's gamma (orchestrator/gamma.py, GammaPolicy.choose_step: all drafting
           requests share the draft passes and the target's pass), or its suffix draft; its round
           for it (rounds.plan: the round's Propose call)
  _draft   one ProposeBatch per draft worker: draft step i of every drafting request in one pass;
           each answer to its round (rounds.drafted)
  _verify  one VerifyBatch: every request's unsynced tokens and drafts in one target pass
  _finish  per request, the rest of its round (rounds.finish: accept with the request's own
           generator, commit, learn, emit) and its chunk to its reader; then the step's record,
           all the gamma policy learns from the step, to the policy (GammaPolicy.observe)

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

import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from orchestrator.gamma import GammaPolicy, StepRecord
from orchestrator.metrics import DecodingMetrics
from orchestrator.rounds import (NextCall, RequestState, Round, drafted, finish, next_call, plan, step_request,
                                 suffix_eligible, take_next, verify_call)
from orchestrator.proposers.suffix import SuffixIndex
from specdec import telemetry as t
from specdec.errors import ServiceError
from specdec.protocol import GenerationChunk

log = logging.getLogger(__name__)


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
        # suffix drafts (orchestrator/proposers/suffix.py): ended requests' tokens, fed by each request's own
        # thread (None: no suffix drafts)
        self.suffix = suffix
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

    # ---- one step ----------------------------------------------------------------------------

    def step(self, tickets: list[Ticket]) -> list[Ticket]:
        """One step of all the requests; returns those that stay on this loop."""
        step = self._plan(tickets)
        self._draft(step)
        self._verify(step)
        return self._finish(step)

    def _plan(self, tickets: list[Ticket]) -> "Step":
        """The gamma policy's choice for every request (drafts of the model, or suffix drafts) and
        each request's round for it (rounds.plan: its Propose call)."""
        self.steps += 1
        loops, started = self.loops, time.perf_counter()
        quiet = loops.quiet_since()
        states = [tk.state for tk in tickets]
        requests = [step_request(s, loops.prefilling > 0) for s in states]
        load = len(states) + loops.prefilling  # those joining soon too
        found: dict[int, tuple[list[int], list[float]]] = {}
        gammas, lengths = loops.policy.choose_step(self.address, requests, load=load,
                                                   suffix=self._suffix_drafts(states, found))
        suffix = {j: (found[j][0][:k], found[j][1][:k]) for j, k in enumerate(lengths) if k}
        return Step(tickets, states, [plan(s, g, suffix.get(j)) for j, (s, g) in enumerate(zip(states, gammas))],
                    [loops.tracer.start_span("round", context=tk.ctx) for tk in tickets],
                    StepRecord(self.address, requests, gammas, load, started), quiet, [None] * len(tickets))

    def _suffix_drafts(self, states: list[RequestState], found: dict):
        """What the gamma policy calls for the suffix drafts (orchestrator/proposers/suffix.py) of
        a step that drafts nothing with the model: each request's path probabilities ([] for
        none), the drafts themselves kept in `found`. None where suffix drafts are off."""
        if self.loops.suffix is None:
            return None

        def candidates() -> list[list[float]]:
            for j, s in enumerate(states):
                k = suffix_eligible(s)
                tokens, probs = self.loops.suffix.draft(s.placement.scope, s.tokens, s.own_index, k) if k else ([], [])
                if tokens:
                    found[j] = (tokens, probs)
            return [found[j][1] if j in found else [] for j in range(len(states))]
        return candidates

    def _draft(self, step: "Step") -> None:
        """Every drafting request's proposals: one batched call per draft worker, the calls to
        different drafts at once; each answer goes to its round (rounds.drafted). The step's
        record gets, per draft worker that answered, the rows and seconds of a pass as the worker
        reported them, and the seconds of the phase beyond its passes (the RPC, the orchestrator's work)."""
        started = time.perf_counter()
        states, rounds = step.states, step.rounds
        calling = []
        for i, (state, rnd) in enumerate(zip(states, rounds)):
            if rnd.propose is None:
                continue  # (a next call still out is waited for by the request's next Propose: take_next)
            if take_next(state, rnd):  # made while the target verified the last round: no call
                self._ahead_outcome(step, i, failed=False, hit=True)
            else:
                calling.append(i)
        groups = by_draft(states, calling)
        if groups:
            work = list(groups.values())
            phases = self._phase("draft", [i for _, members in work for i in members], step.spans)
            # each draft's call runs under the draft span of its first request (the others link to it)
            run = lambda w: t.run_in_context(trace.set_span_in_context(phases[w[1][0]]),  # noqa: E731
                                             w[0].worker.propose_batch, [rounds[i].propose for i in w[1]])
            results = [run(work[0])] if len(work) == 1 else list(self.loops.drafts.map(run, work))
            elapsed = time.perf_counter() - started
            for (member, members), answers in zip(work, results):
                for i, answer in zip(members, answers):
                    step.record.faulted |= isinstance(answer, ServiceError)  # a stalled draft's wait is no cost
                    try:
                        with trace.use_span(phases[i], end_on_exit=True):
                            drafted(states[i], rounds[i], answer)
                    except BaseException as exc:  # noqa: BLE001 - not a worker fault, or failover failed
                        step.errors[i] = exc
                    failed = isinstance(answer, ServiceError)
                    self._ahead_outcome(step, i, failed, hit=not failed and not rounds[i].draft_rows)
                ran = [rounds[i] for i in members if rounds[i].draft_rows]  # reported by the last proposal
                if ran:
                    widest = max(ran, key=lambda r: r.draft_rows)  # the sessions shared passes: the widest saw them all
                    model_s = max(r.draft_pass_s * r.gamma for r in ran)
                    step.record.drafts[member.address] = (widest.draft_rows, widest.draft_pass_s,
                                                          max(elapsed - model_s, 0.0))
            for rnd in rounds:  # every request waited for the draft phase
                rnd.draft_s = elapsed
        step.record.draft_end = time.perf_counter()

    def _ahead_outcome(self, step: "Step", i: int, failed: bool, hit: bool) -> None:
        """Counts a round whose drafts the last Propose asked the draft to make ahead: a hit where
        they were all made in time (no pass ran for this round's call, or none was needed), else a
        miss (the round before did not keep every draft, or the bonus token was not the draft's
        guess, or the draft fell behind). The step's record gets the outcome of each request the
        policy expected to find them made."""
        state, rnd = step.states[i], step.rounds[i]
        if state.ahead_asked and not failed:
            state.stats.ahead_rounds += 1
            state.stats.ahead_hits += hit
            self.loops.metrics.record_ahead(hit)
            if step.record.requests[i].made_ahead:
                step.record.found_made[i] = hit
        state.ahead_asked = bool(rnd.propose.options.ahead) and not failed

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

    def _verify(self, step: "Step") -> None:
        """Every request's verification in one batched call; the answers wait in step.answers for
        their rounds' finish. The step's record gets the (rows, seconds) of the target's pass and
        the rows the call brought to it."""
        started = time.perf_counter()
        live = [i for i, error in enumerate(step.errors) if error is None]
        if not live:
            return
        calls = [verify_call(step.states[i], step.rounds[i]) for i in live]
        self._send_next(step, live)
        record = step.record
        record.own_rows = sum(len(c.token_ids) + len(c.draft_token_ids) for c in calls)
        phases = self._phase("verify", live, step.spans)
        answers = t.run_in_context(trace.set_span_in_context(phases[live[0]]),
                                   step.states[live[0]].placement.target.worker.verify_batch, calls)
        elapsed = time.perf_counter() - started
        for i, answer in zip(live, answers):
            step.rounds[i].verify_s = elapsed
            step.answers[i] = answer
            if isinstance(answer, ServiceError):
                record.faulted = True
                phases[i].set_status(trace.Status(trace.StatusCode.ERROR, str(answer)))
            else:
                record.target_rows = max(record.target_rows, answer.batch_rows)
                record.target_pass_s = max(record.target_pass_s, answer.pass_s)
            phases[i].end()

    def _send_next(self, step: "Step", live: list[int]) -> None:
        """Where drafts are made ahead, each request's next Propose goes out now, one batch per
        draft worker, beside the verify (rounds.next_call): the draft works while the target
        verifies, and a round that keeps every draft finds its next proposals here (take_next)
        instead of waiting a call. Its `draft_ahead` span, under the round's, shows the overlap."""
        calls = {i: call for i in live if (call := next_call(step.states[i], step.rounds[i])) is not None}
        for member, members in by_draft(step.states, list(calls)).values():
            phases = self._phase("draft_ahead", members, step.spans)
            ctx = trace.set_span_in_context(phases[members[0]])
            try:
                future = self.loops.drafts.submit(t.run_in_context, ctx, member.worker.propose_batch,
                                                  [calls[i] for i in members])
            except RuntimeError:  # shutting down: no next call
                for span in phases.values():
                    span.end()
                return
            future.add_done_callback(lambda _, spans=list(phases.values()): [span.end() for span in spans])
            for index, i in enumerate(members):
                state = step.states[i]
                state.next_call = NextCall(future, index, len(state.tokens), step.rounds[i].drafts)

    def _finish(self, step: "Step") -> list[Ticket]:
        """Each request's round to its end (rounds.finish: a faulted target's session moved and
        verified again on its own) and its chunk to its ticket; the step's record to the gamma
        policy. Returns the tickets that stay on this loop."""
        staying, record = [], step.record
        for i, (ticket, state, rnd, span) in enumerate(zip(step.tickets, step.states, step.rounds, step.spans)):
            try:
                if step.errors[i] is not None:
                    raise step.errors[i]
                with trace.use_span(span, end_on_exit=False):
                    chunk = finish(state, rnd, step.answers[i], span)
                self.loops.metrics.record_round(rnd.gamma, rnd.num_accepted, rnd.draft_s, rnd.verify_s,
                                                rnd.sampling_s, rnd.wire_bytes)
            except BaseException as exc:  # noqa: BLE001 - this request's failure only
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
                span.end()
                ticket.fail(exc)
                continue
            span.end()
            record.tokens += len(rnd.result.token_ids)  # what the step gave the request (before a stop cuts it)
            if rnd.gamma > 0:  # its drafts' fate, for the policy's acceptance
                record.judged[i] = (rnd.gamma, rnd.num_accepted, sum(rnd.suffix_probs))
            ticket.put(chunk)
            if state.finish is not None:
                ticket.release()
            elif state.placement.target.address != self.address:  # failover moved it
                self.loops.loop(state.placement.target.address).add(ticket)
            else:
                staying.append(ticket)
        record.overlapped = step.quiet is None or self.loops.quiet_since() != step.quiet  # a prefill ran meanwhile
        record.ended = time.perf_counter()
        outcome = self.loops.policy.observe(record)
        if outcome is not None:
            self.loops.metrics.record_step(*outcome[:2], record.seconds, outcome[2])
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step on %s: %d requests (%d prefilling), gammas %s, suffix %s, %d rows in the target's pass "
                      "(%d its own), %d tokens in %.1f ms (target %.1f ms, draft phase %.1f ms)%s", self.address,
                      len(step.states), self.loops.prefilling, record.gammas,
                      [len(r.drafts) for r in step.rounds if r.suffix_probs], record.target_rows, record.own_rows,
                      record.tokens, record.seconds * 1e3, record.target_pass_s * 1e3,
                      (record.draft_end - record.started) * 1e3, ", a prefill overlapped" if record.overlapped else "")
        return staying


def by_draft(states: list[RequestState], indices: list[int]) -> dict[int, tuple[object, list[int]]]:
    """The requests (by index) grouped by their draft worker: one batched call each."""
    groups: dict[int, tuple[object, list[int]]] = {}
    for i in indices:
        draft = states[i].placement.draft
        groups.setdefault(id(draft), (draft, []))[1].append(i)
    return groups


@dataclass
class Step:
    """One step of a loop on its way: its requests' tickets, states, rounds and round spans (in
    the same order), what the workers answered, and its record for the gamma policy."""

    tickets: list[Ticket]
    states: list[RequestState]
    rounds: list[Round]
    spans: list
    record: StepRecord
    quiet: int | None  # StepLoops.quiet_since() when it began: a prefill that ran meanwhile changes it
    errors: list[BaseException | None]  # a request's failure before finish, by request
    answers: dict[int, object] = field(default_factory=dict)  # the target's answers (or faults), by request
