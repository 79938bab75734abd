"""One speculative round of a request: num_accepted + 1 tokens for one target forward pass.

A round, in named steps on a Round (gpt-fast's `speculative_decode`, spread over two workers).
The step loop (orchestrator/steps.py) runs the rounds of all the requests on a target at once,
the draft and verify steps as one batched call per worker. What it calls here, per request, in order:

  plan     the round for the gamma the policy chose (step_request: what the policy knows of the
           request), with its Propose call (or its suffix draft)
  drafted  the draft's answer (or fault) taken in; then verify_call: the round's Verify
  finish   the target's answer (or fault) taken in, and the rest of the round: its chunk

The round's named steps:

  draft   the draft proposes x_0..x_{gamma-1}, each x_i ~ q_i (draft_call, take_proposals: the
          request's proposer, orchestrator/proposers/: a draft model's or a feature head's); or,
          with no draft pass, a suffix draft does (take_suffix: orchestrator/proposers/suffix.py)
  verify  the target scores the unsynced tokens and the drafts in one pass: p_0..p_gamma (verify_call)
  accept  keep x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw the
          recovered token from norm(max(0, p_i - q_i)); if all gamma pass, the bonus token ~ p_gamma
          (greedy: keep x_i while it equals argmax p_i, then that argmax)
  commit  the round's numbers go into the stats; rollback: both caches keep the accepted prefix.
          No call is made: the next round's Propose and Verify start at that absolute position,
          which truncates both caches there
  emit    the new tokens up to EOS, a stop string or max_new_tokens, as the round's chunk

gamma = 0 (no draft, a dropped one, or one token left) skips the draft: plain target decoding
through the same path, the baseline. Spans: `round`, holding `draft`, `verify`,
`rejection_sampling` and `rollback`.

A round reacts to a worker fault where it meets one: a draft fault lets the round go on without
drafts (draft_failed: placement.draft_failed moves the draft or drops it); a target fault moves the
session (target_failed) and the same drafts are verified on the new target (verify). Not owned here:
the request's lifecycle (encoding, validation, the request span, prefill, close, metrics:
orchestrator/decoder.py) and where its sessions live (orchestrator/placement.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch

from orchestrator.detokenizer import TextAssembler
from orchestrator.gamma import CATCH_UP_LAG, Calibration, GammaPolicy, StepRequest
from orchestrator.placement import Placement, is_worker_fault
from orchestrator.rejection_sampler import SampleResult, greedy_verify, rejection_sample
from orchestrator.proposers import DraftWorkerProposer, proposer_for
from orchestrator.proposers.suffix import RequestIndex
from specdec import telemetry as t
from specdec.errors import ServiceError
from specdec.protocol import MAX_GAMMA, GenerationChunk, GenerationStats, SamplingParams, TokenLogprob
from specdec.wire import CompactProbs, DraftOptions, Proposal, ProposeCall, Verification, VerifyCall


@dataclass
class NextCall:
    """The next round's Propose, sent while the target verifies a round (next_call): its answer
    (list[Proposal] | ServiceError, from the batch's future at `index`) holds the draft's guess of
    the bonus token, then the next round's proposals after it."""

    future: Future  # -> the batch's answers
    index: int
    base: int  # len(req.tokens) when it was sent: the round's tokens come after
    drafts: list[int]  # the round's drafts, which it assumed kept


@dataclass
class RequestState:
    """What a request carries from round to round; the decoder builds it once prefill is done."""

    placement: Placement
    params: SamplingParams
    generator: torch.Generator  # draws, in order: each round's rejection sampling
    tracer: object
    eos: frozenset[int]
    gamma: int  # as requested; a round drafts fewer near the end, none without a draft
    max_new_tokens: int
    tokens: list[int]  # the prompt, then every emitted token: the orchestrator's copy of the request
    stats: GenerationStats
    assembler: TextAssembler
    started: float  # perf_counter at the request's start, for stats.total_s
    policy: GammaPolicy  # how many of `gamma` a round drafts (the decoder's)
    draft_options: DraftOptions = DraftOptions()  # how the draft proposes (the decoder's)
    draft_ahead: int | None = 0  # tokens drafted ahead (None: auto, see `ahead`)
    ahead_asked: bool = False  # its last Propose asked the draft to draft on while the target verified
    kept_all: bool = False  # its last round drafted with the model and kept every draft
    next_call: "NextCall | None" = None  # the next round's Propose, sent while the target verified this one
    top_logprobs: int | None = None  # None: no logprobs; else each token's, and this many alternatives
    prompt_len: int = field(init=False)
    target_synced: int = field(init=False)  # how many of `tokens` the target's cache holds validly
    draft_synced: int = field(init=False)  # the same for the draft's
    finish: str | None = None  # "eos", "stop_token", "stop_string" or "length" once the request is done
    stop_token_ids: frozenset[int] = frozenset()  # the request's own: generation ends after one
    suffix_calibration: Calibration = field(init=False, default_factory=Calibration)  # its suffix drafts'
    own_index: RequestIndex = field(init=False, default_factory=RequestIndex)  # its tokens' n-grams (suffix drafts)
    # how its drafts are made (orchestrator/proposers/): a draft worker's, or a feature head's
    proposer: DraftWorkerProposer = field(init=False)
    draft_seed: int = field(init=False)  # every Propose's: the draft's draws are a function of it and their context

    def __post_init__(self) -> None:
        self.prompt_len = self.target_synced = len(self.tokens)
        self.draft_synced = self.placement.draft_synced if self.placement.draft is not None else 0
        if self.placement.draft is not None:  # the prompt taken in at the start (else lazily: draft_call)
            self.stats.draft_prefill_tokens += self.placement.draft_prefilled
        self.proposer = proposer_for(self.placement)
        self.draft_seed = (self.generator.initial_seed() * 0x9E3779B97F4A7C15 + 1) % 2**63  # not a draw: none taken

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def ahead(self, gamma: int) -> int:
        """Tokens the draft keeps drafting past a round of gamma drafts while the target verifies
        it (DraftOptions.ahead). Auto: where the draft has hardware of its own, the bonus token's
        guess and the drafts of the next round if this one keeps every draft (as many as this
        one's, or as the request asks where this one drafts fewer: the policy drafts more where the
        drafts are likely made); where it shares the target's, none (it would slow the verify). A
        feature head drafts none ahead (it needs the target's features of every token)."""
        if self.placement.feature_layers:
            return 0
        if self.draft_ahead is not None:
            return self.draft_ahead
        return min(max(gamma, self.gamma), MAX_GAMMA) + 1 if self.placement.apart else 0


@dataclass
class Round:
    """One round's values, filled in by its steps in order."""

    gamma: int  # drafts asked for, then drafts made (a draft may stop early: DraftOptions); 0 after a draft fault
    remaining: int  # tokens max_new_tokens still allows
    wire_before: int
    propose: ProposeCall | None = None  # the round's call to its draft worker (None: no draft pass)
    drafts: list[int] = field(default_factory=list)  # x_i
    draft_probs: list[CompactProbs | None] = field(default_factory=list)  # q_i (None when greedy)
    draft_rows: int = 0  # rows of the draft's passes, mean over this round's steps (0: not reported)
    draft_pass_s: float = 0.0  # and their seconds
    suffix_probs: list[float] = field(default_factory=list)  # a suffix draft's path probabilities (no draft pass)
    verification: Verification | None = None  # p_i (or argmax p_i) for i = 0..gamma
    result: SampleResult | None = None
    emitted: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    sampling_s: float = 0.0
    wire_bytes: int = 0  # this round's, both workers

    @property
    def num_accepted(self) -> int:
        return self.result.num_accepted


def gamma_cap(req: RequestState) -> int:
    """The most drafts the request's next round may make: its gamma, fewer near the end (the
    bonus token needs one of the tokens left), none without a draft."""
    remaining = req.max_new_tokens - req.generated
    return min(req.gamma, remaining - 1) if req.placement.draft is not None else 0


def step_request(req: RequestState, prefilling: bool) -> StepRequest:
    """What the gamma policy knows of the request for the next step. A draft session's catch-up
    (a whole prompt, when it opened lazily) waits: for a step without prefills (it would take
    turns on the cores with the target's prefills, and this step, which joining requests wait for,
    would wait for both), and until the request's first token (which it would delay by the
    catch-up: ~0.3 s for a 100-token prompt here)."""
    lag = len(req.tokens) - req.draft_synced
    cap = 0 if lag > CATCH_UP_LAG and (prefilling or not req.generated) else gamma_cap(req)
    return StepRequest(cap, req.placement.draft.address if req.placement.draft is not None else None, lag,
                       req.max_new_tokens - req.generated,
                       holds_prompt=req.draft_synced >= req.prompt_len,
                       made_ahead=req.ahead_asked and req.kept_all, calibration=req.suffix_calibration)


def suffix_eligible(req: RequestState) -> int:
    """How many suffix-draft tokens (orchestrator/proposers/suffix.py) the next round may carry: none
    for a request that asked for gamma 0 (the baseline stays plain), one with a grammar (the
    draft's tokens could leave it)."""
    if req.gamma <= 0 or req.params.grammar is not None:
        return 0
    return max(min(MAX_GAMMA, req.max_new_tokens - req.generated - 1), 0)


def plan(req: RequestState, gamma: int, suffix: tuple[list[int], list[float]] | None = None) -> Round:
    """The round of a step whose policy gave the request `gamma` model drafts (with its Propose
    call: draft_call), or, with none, the suffix draft it chose (take_suffix)."""
    rnd = Round(gamma, req.max_new_tokens - req.generated, req.stats.wire_bytes)
    if gamma > 0:
        rnd.propose = draft_call(req, rnd)
    elif suffix is not None:
        take_suffix(rnd, *suffix)
    return rnd


def drafted(req: RequestState, rnd: Round, answer: "list[Proposal] | ServiceError") -> None:
    """The draft worker's answer to the round's Propose: its proposals, or a fault (the round goes
    on without drafts)."""
    if isinstance(answer, ServiceError):
        draft_failed(req, rnd, answer)
    else:
        take_proposals(req, rnd, answer)


def finish(req: RequestState, rnd: Round, answer: "Verification | ServiceError", span) -> GenerationChunk:
    """The round's steps after the target's answer to its Verify: a fault moves the session and
    the same drafts are verified on the new target (target_failed, verify); then accept, commit,
    emit (what it teaches the gamma policy goes in the step's record). Returns the round's chunk."""
    if isinstance(answer, ServiceError):
        target_failed(req, answer)
        verify(req, rnd)
    else:
        rnd.verification = answer
    accept(req, rnd)
    commit(req, rnd)
    # what the draft drafted ahead during this verify is what the next round needs only if this
    # one kept every draft of the model's (a round without its drafts leaves nothing made ahead)
    req.kept_all = rnd.propose is not None and 0 < rnd.gamma == rnd.num_accepted
    req.ahead_asked = req.ahead_asked and rnd.propose is not None
    chunk = emit(req, rnd)
    if span.is_recording():  # tracing off: build no attributes per round
        span.set_attributes({
            t.ROUND: req.stats.rounds - 1, t.GAMMA: rnd.gamma, t.DRAFTED: rnd.gamma,
            t.ACCEPTED: rnd.num_accepted, t.EMITTED: len(rnd.emitted), t.WIRE_BYTES: rnd.wire_bytes,
            t.ACCEPTED_BY_POSITION: [1] * rnd.num_accepted + [0] * (rnd.gamma - rnd.num_accepted),
        })
    return chunk


def draft_call(req: RequestState, rnd: Round) -> ProposeCall:
    """The round's Propose (its proposer's), with the request's draft seed."""
    req.stats.draft_prefill_tokens += max(len(req.tokens) - req.draft_synced - 1, 0)  # a catch-up
    return req.proposer.call(req, rnd, req.draft_seed)


def take_proposals(req: RequestState, rnd: Round, proposals: list[Proposal]) -> None:
    """x_i and q_i from the draft's answer; gamma becomes the drafts made (a draft may stop early)."""
    req.proposer.take(req, rnd, proposals)


def take_suffix(rnd: Round, tokens: list[int], probs: list[float]) -> None:
    """A suffix draft (orchestrator/proposers/suffix.py) as the round's drafts: x_i with q_i a point mass on
    x_i (no draft pass; rejection_sample then keeps x_i w.p. p_i(x_i)), each x_i's path probability kept
    for the step's record."""
    rnd.drafts, rnd.draft_probs, rnd.suffix_probs = list(tokens), [None] * len(tokens), list(probs)
    rnd.gamma = len(tokens)


def next_call(req: RequestState, rnd: Round) -> ProposeCall | None:
    """Where the draft drafts ahead (RequestState.ahead), the next round's Propose, sent while the
    target verifies this round: it assumes every draft kept and asks for the draft's guess of the
    bonus token, then as many drafts as this round made (fewer near the end). The draft session
    holds those tokens already (drafted ahead), so it answers from what it made, or drafts the rest
    while the target verifies. A draft's draws depend on the request's seed and their context
    alone, so a request's proposals are the same whether it is taken or not."""
    if rnd.propose is None or rnd.suffix_probs or not rnd.drafts or not req.ahead(rnd.gamma):
        return None
    left = req.max_new_tokens - req.generated - len(rnd.drafts) - 1  # tokens still allowed if all are kept
    gamma = min(len(rnd.drafts), req.gamma, left - 1)
    if gamma < 1:
        return None
    # it drafts nothing further itself: a round that takes its answer sends the next one at its verify
    return replace(rnd.propose, token_ids=rnd.propose.token_ids + rnd.drafts, gamma=gamma + 1,
                   options=replace(rnd.propose.options, ahead=0))


def take_next(req: RequestState, rnd: Round) -> bool:
    """The round's proposals from the Propose sent while the target verified the last round
    (next_call), where that round kept every draft and its bonus token is the draft's guess: no
    call then. Returns whether it took them."""
    call, req.next_call = req.next_call, None
    if call is None:
        return False
    try:  # waited for even where it cannot be taken: a call of this round's own would collide with it
        answer = call.future.result()[call.index]
    except Exception:  # noqa: BLE001 - a fault of that call: this round proposes as usual
        return False
    if (isinstance(answer, ServiceError) or len(answer) < 2 or len(req.tokens) != call.base + len(call.drafts) + 1
            or req.tokens[call.base:-1] != call.drafts or answer[0].token_id != req.tokens[-1]):
        return False  # a draft was rejected, or the bonus token was not the draft's guess
    take_proposals(req, rnd, answer[1:1 + rnd.gamma])
    rnd.draft_rows, rnd.draft_pass_s = 0, 0.0  # its passes ran while the target verified
    return True


def draft_failed(req: RequestState, rnd: Round, exc: ServiceError) -> None:
    """A worker fault: this round goes on without drafts; the next uses the new draft, or none."""
    if not is_worker_fault(exc):
        raise exc
    rnd.drafts, rnd.draft_probs, rnd.gamma = [], [], 0
    req.placement.draft_failed(exc, req.tokens)
    req.draft_synced = req.placement.draft_synced


def verify_call(req: RequestState, rnd: Round) -> VerifyCall:
    return VerifyCall(req.placement.session_id, req.target_synced, req.tokens[req.target_synced:], rnd.drafts,
                      req.params, req.top_logprobs)


def target_failed(req: RequestState, exc: ServiceError) -> None:
    """A worker fault moves the session (the new target holds every validated token); else raise."""
    if not is_worker_fault(exc):
        raise exc
    req.placement.target_failed(exc, req.tokens)
    req.target_synced = len(req.tokens)
    req.proposer.target_moved(req)


def verify(req: RequestState, rnd: Round) -> None:
    """p_0..p_gamma in one target pass; a target fault moves the session and verifies the same drafts."""
    started = time.perf_counter()
    while rnd.verification is None:
        c = verify_call(req, rnd)
        try:
            with req.tracer.start_as_current_span("verify"):
                rnd.verification = req.placement.target.worker.verify(
                    c.session_id, c.start, c.token_ids, c.draft_token_ids, c.params, c.top_logprobs)
        except ServiceError as exc:
            target_failed(req, exc)
    rnd.verify_s = time.perf_counter() - started


def accept(req: RequestState, rnd: Round) -> None:
    """num_accepted drafts, then the recovered or bonus token: the target's distribution, exactly."""
    started = time.perf_counter()
    v = rnd.verification
    with req.tracer.start_as_current_span("rejection_sampling"):
        if req.params.deterministic:
            # keep x_i while it equals the target's token y_i (greedy: argmax p_i; coupled: the
            # seeded Gumbel-max draw from p_i); then y_i at the first mismatch (or y_gamma)
            rnd.result = greedy_verify(rnd.drafts, v.argmax)
        else:
            # keep x_i w.p. min(1, p_i(x_i)/q_i(x_i)); rejected: ~ norm(max(0, p_i - q_i)); all kept: ~ p_gamma
            rnd.result = rejection_sample(rnd.drafts, rnd.draft_probs, v.probs, req.generator)
    rnd.sampling_s = time.perf_counter() - started


def commit(req: RequestState, rnd: Round) -> None:
    """Tallies the round, then rolls back: both caches keep the accepted prefix and drop the rest."""
    stats, v = req.stats, rnd.verification
    stats.draft_s += rnd.draft_s
    stats.verify_s += rnd.verify_s
    stats.sampling_s += rnd.sampling_s
    stats.verify_compute_s += v.compute_s
    stats.wire_bytes += v.wire_bytes
    stats.record_round(rnd.gamma, rnd.num_accepted, suffix=bool(rnd.suffix_probs))
    rnd.wire_bytes = stats.wire_bytes - rnd.wire_before
    # no call is made: the next round's Propose and Verify start at target_synced, truncating there
    with req.tracer.start_as_current_span("rollback") as span:
        req.target_synced = len(req.tokens) + rnd.num_accepted  # tokens + x_0..x_{n-1}
        if rnd.gamma > 0 and not rnd.suffix_probs:  # a suffix draft never reached the draft's session
            req.draft_synced = req.proposer.synced_after(req)
        req.proposer.verified(req, v)
        if span.is_recording():
            span.set_attributes({t.TARGET_LENGTH: req.target_synced, t.DRAFT_LENGTH: req.draft_synced,
                                 t.DISCARDED: rnd.gamma - rnd.num_accepted})


def emit(req: RequestState, rnd: Round) -> GenerationChunk:
    """Appends the round's tokens up to EOS, a stop token, a stop string or max_new_tokens; the
    last chunk has the stats."""
    new = rnd.result.token_ids[:rnd.remaining]
    for i, tok in enumerate(new):
        if tok in req.stop_token_ids or tok in req.eos:
            new, req.finish = new[: i + 1], "stop_token" if tok in req.stop_token_ids else "eos"
            break
    delta, keep = req.assembler.add(new)
    if keep is not None:  # a stop string ends at `keep` generated tokens
        new, req.finish = new[: keep - req.generated], "stop_string"
    req.tokens.extend(new)
    rnd.emitted = new
    logprobs = token_logprobs(req, rnd) if req.top_logprobs is not None else None
    if req.finish is None and req.generated >= req.max_new_tokens:
        req.finish = "length"
    if req.finish is None:
        return GenerationChunk(delta, new, logprobs=logprobs)
    if req.finish != "stop_string":
        delta += req.assembler.finish()
    failovers = req.placement.failovers
    req.stats.target_failovers, req.stats.draft_failovers = failovers["target"], failovers["draft"]
    req.stats.finalize(req.generated, time.perf_counter() - req.started)
    return GenerationChunk(delta, new, req.finish, req.stats, logprobs)


def token_logprobs(req: RequestState, rnd: Round) -> list[TokenLogprob]:
    """The emitted tokens' log-probabilities under the target: token i of the round sits at
    position i of the verification (the accepted drafts, then the recovered or bonus token)."""
    v, before = rnd.verification, len(req.tokens) - len(rnd.emitted)  # emitted: already in req.tokens
    prefix = (lambda i: req.tokens[: before + i]) if v.raw_log_norms else (lambda i: ())  # to undo controls
    return [TokenLogprob(tok, v.logprob(i, tok, req.params, prefix(i)),
                         tuple(zip(*v.top_logprobs[i])) if v.top_logprobs else ())
            for i, tok in enumerate(rnd.emitted)]
