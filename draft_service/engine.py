"""Proposes gamma draft tokens for a session, one forward pass of one token each.

Each proposal carries q, the draft's processed distribution at that position, which the
orchestrator needs for the rejection test (none in greedy mode). The proposal is drawn from
exactly the q that is returned, by a draw that is a function of the request's seed and the
proposal's context alone (seeded_choice): the same request gets the same proposals whichever call
or job drafted them, and whenever.

A session keeps the proposals it made past its accepted tokens, each with its q (`Drafted`):
a call whose new tokens agree with the session takes the proposals already there before it
drafts more. That makes a retried call give the same proposals, and it is how drafting ahead
works (DraftOptions.ahead): after a call's last proposal the worker keeps drafting on its own,
its first token a guess of the target's bonus token, while the orchestrator verifies. When the
round kept every draft and the bonus is that guess, the next call finds its proposals made.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from opentelemetry import metrics

from specdec.errors import Aborted, FailedPrecondition, InvalidArgument, ServiceError
from specdec import ngram
from specdec import telemetry as t
from specdec.protocol import MAX_GAMMA, SamplingParams
from specdec.sampling import apply_controls, coupled_choice, process_logits, seeded_choice
from specdec.wire import CompactProbs, DraftOptions, Features, Proposal, ProposeCall
from specdec.worker.batching import Chain
from specdec.worker.engine import WorkerEngine
from specdec.worker.runner import Program
from specdec.worker.sessions import Session, grow_hidden

log = logging.getLogger(__name__)


@dataclass
class Drafted:
    """The draft tokens a session holds from `start` on, each drawn from the q kept with it:
    tokens[start + i] ~ probs[i] (None: greedy), with the draft's probability of it."""

    start: int
    params: SamplingParams
    options: DraftOptions
    seed: int  # the request's: each draw is seeded_choice(q, seed, its context)
    probs: list[CompactProbs | None] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.probs)

    def cut(self, length: int) -> None:
        """The session keeps `length` tokens: proposals past it are gone."""
        keep = max(0, length - self.start)
        del self.probs[keep:], self.confidence[keep:]

    def accept_before(self, position: int) -> None:
        """The tokens before `position` are the request's now: no longer proposals."""
        drop = min(max(0, position - self.start), len(self.probs))
        del self.probs[:drop], self.confidence[:drop]
        self.start += drop

    def agrees(self, session: Session, start: int, token_ids: list[int], params: SamplingParams, seed: int,
               options: DraftOptions) -> bool:
        """A call that puts token_ids at `start` can take the proposals after them: the session
        already holds those tokens there, and they reach into (or just up to) the proposals."""
        end = start + len(token_ids)
        # how far to draft ahead changes no proposal's distribution (the orchestrator sets it per round)
        same = options == self.options or dataclasses.replace(options, ahead=self.options.ahead) == self.options
        return (params == self.params and seed == self.seed and same and self.start <= end <= self.end
                and end <= len(session.tokens) and session.tokens[start:end] == token_ids)


class DraftEngine(WorkerEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # drafting ahead: one job per session at most, each mostly waiting for its passes
        self._ahead = ThreadPoolExecutor(max_workers=max(1, self.max_sessions), thread_name_prefix="ahead")
        self.forced_made = 0  # structured output: tokens proposed with no pass (the grammar forced them)
        self.ahead_made = self.ahead_taken = 0  # tokens drafted ahead, and those a later call took
        self.info = dataclasses.replace(self.info, draft_kind="eagle3" if self.head else "model")

    def instrument(self, telemetry, role: str) -> None:
        super().instrument(telemetry, role)
        meter = telemetry.meter if telemetry is not None else metrics.NoOpMeter(t.INSTRUMENTATION_SCOPE)
        self._ahead_counter = meter.create_counter(
            "specdec.draft.ahead_tokens", unit="{token}",
            description="Tokens drafted ahead while the target verified, by outcome (made, taken)")

    def close(self) -> None:
        super().close()  # marks every session closed: their jobs stop at their next pass
        self._ahead.shutdown(wait=True)

    def propose(
        self,
        session_id: str,
        start: int,
        token_ids: list[int],
        gamma: int,
        params: SamplingParams,
        seed: int,
        options: DraftOptions = DraftOptions(),
        features: Features | None = None,
    ) -> list[Proposal]:
        """Truncates to `start`, appends token_ids, then makes up to gamma proposals (`_propose`,
        this call's program, run alone)."""
        return self.drive(self._propose(ProposeCall(session_id, start, token_ids, gamma, params, seed, options,
                                                        features)))

    def propose_batch(self, calls: list[ProposeCall]) -> list[list[Proposal] | ServiceError]:
        """The proposals of many sessions' calls (one orchestrator step): draft step i of every
        call runs in the same forward pass. Per call, its proposals or the error it raised."""
        return self.run_calls(calls, self._propose)

    def _propose(self, call: ProposeCall) -> Program:
        """A Propose's program (WorkerEngine.run_calls): truncates to `start`, appends token_ids,
        then makes up to gamma proposals, a pass (a Work yielded) at a time -> [Proposal].

        The session lock is held for each pass and released between them; a call that changes the
        session in between aborts this one.

        With options.lookup, a pass also runs the tokens that followed the sequence's last n-gram
        where it occurred before (specdec/ngram.py), so that one pass yields the draft's
        distribution at every guessed position: proposal i is drawn from q_i as always, and while
        it equals the guess, q_{i+1} is already computed. The proposals are those of plain
        drafting; only fewer passes make them.

        With options.p_min, the call stops after a proposal the draft gave less than p_min (once
        min_drafts are made). Both, and drafting ahead, depend on the draft's side alone (its
        tokens, its q, its own draws), never on the target: whatever the draft proposes, each
        proposal is a draw from the q sent with it, and the rejection test keeps the output
        exactly the target's. A proposal drafted ahead is taken only where the session's tokens
        before it are the request's: it is then a draw from q given exactly the request's
        context, made with randomness the target's decisions never saw.

        A feature head (self.head, specdec/eagle3.py) takes the target's features of the positions
        before each of token_ids (`features`) and drafts one token a pass, each step fed the
        state of the one before; it neither looks up n-grams, drafts ahead nor skips forced
        tokens, and a call always recomputes from `start` (the states there are the target's)."""
        session_id, start, token_ids, gamma, params = call.session_id, call.start, call.token_ids, call.gamma, call.params
        seed, options, features = call.seed, call.options, call.features
        if not 1 <= gamma <= MAX_GAMMA:
            raise InvalidArgument(f"gamma must lie in [1, {MAX_GAMMA}] for a proposal, got {gamma}")
        params.validate().check_vocabulary(self.vocab_size)
        options.validate()
        if self.head:
            options = dataclasses.replace(options, lookup=0, ahead=0)
        elif features is not None:
            raise InvalidArgument("features are for a feature head; this draft is a model")
        session = self.session(session_id)
        end = start + len(token_ids)  # where this call's proposals begin
        with session.lock:
            session.check_start(start, len(token_ids))
            self.check_tokens(token_ids, already=start)
            self.check_tokens([], already=end + gamma)
            self.grow(session, end + gamma)
            drafted = session.drafted
            if self.head:
                self._check_features(features, start, end)
                self.truncate_to(session, start)
                session.tokens.extend(token_ids)
                self._take_features(session, start, end, features)
                drafted = session.drafted = Drafted(end, params, options, seed)
            elif drafted is not None and drafted.agrees(session, start, token_ids, params, seed, options):
                taken = min(gamma, drafted.end - end) if drafted.start < end else 0  # made ahead, not by a call
                if taken:
                    self.ahead_taken += taken
                    self._ahead_counter.add(taken, {"outcome": "taken"})
                session.version += 1  # a job drafting ahead stops; this call goes on from what it made
                drafted.accept_before(end)
            else:
                self.truncate_to(session, start)
                session.tokens.extend(token_ids)
                drafted = session.drafted = Drafted(end, params, options, seed)
            session.uncache_last()
            version = session.version
        made, rows, seconds = 0, 0, 0.0  # proposals; rows and seconds of this call's passes, summed
        proposals: list[Proposal] = []
        while made < gamma:
            t0 = time.perf_counter()
            with session.lock:
                if session.version != version:
                    raise Aborted(f"session {session_id} was changed by another call during this Propose")
                if drafted.end <= end + made:  # none held: one pass makes one or more
                    yield from self._draft_pass(session, drafted, gamma - made, made, "propose")
                    version = session.version
                    rows += session.last_pass_rows
                    seconds += session.last_pass_s
                first = end + made - drafted.start
                picks = [(session.tokens[drafted.start + i], drafted.probs[i], drafted.confidence[i])
                         for i in range(first, min(drafted.end - drafted.start, first + gamma - made))]
            if not picks:  # nothing the draft could propose (a grammar beyond its head): the call ends
                return proposals
            elapsed = (time.perf_counter() - t0) / len(picks)
            for token, probs, confidence in picks:
                made += 1
                # nothing after an EOS is worth drafting: the request ends there (unless it ignores EOS)
                last = (made == gamma or confidence < options.p_min and made >= options.min_drafts
                        or token in self.info.eos_token_ids)
                if last:
                    if options.ahead:  # drafts on while the caller verifies
                        self._ahead.submit(self._draft_ahead, session, version, drafted, end + made + options.ahead)
                    # the last proposal reports the passes' rows and seconds per proposal (what one
                    # draft cost): the gamma policy fits them. None ran: nothing to report
                    proposals.append(Proposal(made - 1, token, probs, elapsed, round(rows / made) if rows else 0,
                                              seconds / made if rows else 0.0))
                    return proposals
                proposals.append(Proposal(made - 1, token, probs, elapsed))
        return proposals

    def _check_features(self, features: Features | None, start: int, end: int) -> None:
        """A feature head's Propose must bring the target's features of positions max(start, 1) - 1
        .. end - 2, of the head's width."""
        first = max(start, 1) - 1
        if features is None:
            if end - 1 > first:
                raise FailedPrecondition("this draft is a feature head: a Propose must bring the target's features "
                                         "(open the target session with the head's feature_layers)")
            return
        width = self.model.feature_size
        if features.start != first or features.end != max(end - 1, first) or features.rows.shape[1] != width:
            raise InvalidArgument(f"a Propose of tokens {start}..{end - 1} needs features of positions {first}.."
                                  f"{end - 2}, {width} wide; got positions {features.start}..{features.end - 1}, "
                                  f"{features.rows.shape[1]} wide")

    @torch.inference_mode()
    def _take_features(self, session: Session, start: int, end: int, features: Features | None) -> None:
        """Token j's input state, for the call's tokens: fc of the target's features at j - 1 (token 0
        has none: zeros, and no later position attends to it)."""
        head = self.model
        like = head.norm.weight  # the head's dtype and device (its Linears may be quantized)
        grow_hidden(session, end + 1, like.new_empty(0, head.head_config.hidden_size))
        if start == 0:
            session.hidden[0].zero_()
        if features is not None and features.rows.shape[0]:
            rows = features.rows.to(like.device, like.dtype)
            session.hidden[features.start + 1: features.end + 1] = head.fc(rows)

    def _draft_pass(self, session: Session, drafted: Drafted, left: int, made: int, kind: str) -> Program:
        """One pass (a Work yielded; none where the grammar forces the tokens), holding
        session.lock: appends the next proposals (at most `left`) to the session and to `drafted`;
        returns how many. `made`: proposals of the call so far."""
        base = len(session.tokens)
        grammar = self.grammar_at(session, drafted.params, base)
        forced = self._forced(grammar, left) if not self.head else []  # a head computes a state at every token
        if forced:  # the grammar allows one token at each: q is a point mass there, no pass needed
            session.tokens.extend(forced)
            drafted.probs.extend([None] * len(forced))
            drafted.confidence.extend([1.0] * len(forced))
            self.forced_made += len(forced)
            return len(forced)
        guess = ngram.lookup(session.tokens, left - 1, drafted.options.lookup) if drafted.options.lookup else []
        session.tokens.extend(guess)
        params = drafted.params
        # the next steps on the device, no host in between (captured passes only): each choice a
        # fixed function of the logits (greedy, or coupled), made there
        chain = Chain(left - 1, params, drafted.options.p_min > 0) if (
            left > 1 and self.chains and not guess and grammar is None and params.deterministic
            and not params.controlled) else None

        def post(logits, chained=None):
            if chained is not None:  # the pass's choice and the steps': each cached by the next, the last not
                return [(token, None, prob if drafted.options.p_min > 0 else 1.0, False)
                        for token, prob in zip(*chained)]
            return self._picks(logits, guess, params, drafted.seed, drafted.options, made, base, session.tokens,
                               grammar)

        picks = yield self.work(session, len(guess) + 1, kind, post, chain=chain)
        # the tokens are the prefix, the guesses the draft took (or its chained choices), and its
        # last proposal, which stays uncached until the next pass; the cache holds no guess it refused
        if not picks:  # the grammar allows nothing the draft's head scores here: no proposal
            session.truncate(base)
            return 0
        if guess:
            session.truncate(base + len(picks) - 1)
        if chain:  # no guesses: every pick is the session's, all but the last cached
            session.tokens.extend(pick[0] for pick in picks)
        else:
            session.tokens.append(picks[-1][0])
        for _, probs, confidence, _ in picks:
            drafted.probs.append(probs)
            drafted.confidence.append(confidence)
        return len(picks)

    def _draft_ahead(self, session: Session, version: int, drafted: Drafted, horizon: int) -> None:
        """Drafts on until the session holds `horizon` tokens, while no call changes it (a job of
        DraftOptions.ahead; it runs on its own thread, one pass at a time like any call)."""
        try:
            while True:
                with session.lock:
                    if (session.closed or session.version != version or session.drafted is not drafted
                            or len(session.tokens) >= min(horizon, self.max_context)):
                        return
                    self.grow(session, len(session.tokens) + 1)
                    n = self.drive(self._draft_pass(session, drafted, horizon - len(session.tokens), MAX_GAMMA,
                                                    "ahead"))
                    if not n:
                        return
                    version = session.version
                    self.ahead_made += n
                    self._ahead_counter.add(n, {"outcome": "made"})
                    if drafted.confidence[-1] < drafted.options.p_min:  # unsure: what follows is likely wasted
                        return
        except ServiceError as exc:  # e.g. the cache limit: drafting ahead is only ever a bonus
            log.debug("stopped drafting ahead for session %s: %s", session.session_id, exc)
        except Exception:  # noqa: BLE001 - the next call drafts as usual
            log.exception("drafting ahead for session %s failed", session.session_id)

    def _forced(self, grammar, left: int) -> list[int]:
        """The tokens the grammar forces next (at most `left`, ending at an EOS): proposed without
        a forward pass."""
        if grammar is None:
            return []
        forced = grammar.forced_tokens()[:left]
        eos = next((i for i, t in enumerate(forced) if t in self.info.eos_token_ids), None)
        return forced if eos is None else forced[: eos + 1]

    def _picks(self, logits: torch.Tensor, guess: list[int], params: SamplingParams, seed: int,
               options: DraftOptions, made: int, first: int, tokens: list[int],
               grammar=None) -> list[tuple[int, CompactProbs | None, float, bool]]:
        """logits: [len(guess) + 1, vocab], row j predicting position first + j, whose prefix is
        tokens[:first + j] (the guesses included) -> [(proposal, q, the draft's probability of it,
        stop)], one per row while the proposals equal the guesses, ending at the first that does
        not, or at a stop. q is after the request's decoding controls (and grammar), as the
        target's p is.
        A sampled proposal is seeded_choice(q, seed, its context). Coupled sampling proposes the
        seeded Gumbel-max choice of q, which it does not send (the target decides by its own
        choice)."""
        if params.controlled:
            logits = apply_controls(logits.float(), params, tokens, first, grammar)
        picks = []
        for j in range(logits.shape[0]):
            row = logits[j]
            if grammar is not None and not bool(torch.isfinite(row).any()):
                return picks  # every token the grammar allows lies past the draft's head (--draft-vocab)
            if params.greedy:
                token, probs = int(row.argmax()), None
                confidence = float(torch.softmax(row, -1)[token]) if options.p_min > 0 else 1.0
            elif params.coupled:
                q = process_logits(row, params, self.vocab_size)
                token, probs = coupled_choice(q, params.coupling_seed, first + j), None
                confidence = q.prob_of(token)
            else:
                probs = process_logits(row, params, self.vocab_size)
                token = seeded_choice(probs, seed, tokens, first + j)
                confidence = probs.prob_of(token)
            stop = confidence < options.p_min and made + j + 1 >= options.min_drafts
            picks.append((token, probs, confidence, stop))
            if stop or j == len(guess) or token != guess[j]:
                return picks
        return picks
