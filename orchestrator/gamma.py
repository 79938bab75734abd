"""How many drafts a round asks for: the gamma that maximizes goodput, from live measurements.

For every target worker the orchestrator keeps running estimates of
  T(r)  the seconds of the target pass a verify ran in (the worker times the model alone), against
        its rows (tokens of all sessions),
  D(r)  the seconds of a draft step's pass, the same way,
  a_i   the probability that draft i is accepted given that drafts 0..i-1 were,
and each round takes, up to the request's gamma,

    g* = argmax_g  B * E(g) / (g * D(B) + T(B * (g + 1))),   E(g) = 1 + a_0 + a_0 a_1 + ... (g terms)

where B is the number of sessions on that target (they share its passes, each with g + 1 rows)
and E(g) the expected tokens per round (Leviathan et al. 2023, with acceptance by position). The
denominator is one cycle of all B sessions in step: g batched draft passes, then one target
pass. It adds the draft's and the target's times, which is right where they share cores and
their passes take turns (--pass-lock). A draft with hardware of its own drafts the next round
while the target verifies (DraftOptions.ahead): where the round kept every draft and the bonus
token is the draft's guess, the next Propose finds its proposals made and its passes cost the
step nothing; after a round that rejected a draft they are never made. So a request whose last
round kept every draft is expected to find them made with H, the rate at which such requests of
its draft did (learnt from the steps' records), and the draft's passes are charged in a step at
1 - (the product of its drafting requests' chances): all of them must find theirs made for the
step to skip the passes. After a rejection the passes are charged in full, so the policy drafts
less there, and more where the next round's drafts are likely made already. Times as a request sees them are no good here: under load they are mostly waiting for
other sessions' passes, which does not grow with a pass's own rows, so drafts looked free
(measured: gamma ~2 chosen at 4 and 8 clients, 0.6x the throughput of gamma 0).

That is how the requests on a target run in its step loop (orchestrator/steps.py): each step
drafts for all of them in the same draft passes and verifies all of them in one target pass, so
`choose_step` evaluates the formula for the step as it will run
(`step_goodput`: each request's own cap and acceptance, the draft's pass line at the number of
requests drafting, the time a draft phase takes beyond its passes, and the step's other time).
On this CPU a pass of 40 rows costs ~6 one-row passes, so as B grows the drafts' extra rows weigh
more and g* falls, down to 0: plain batched decoding. On hardware whose passes cost about the
same for 1 and 40 rows (a GPU), g* stays high.

Drafting must promise MARGIN more goodput than gamma 0 to be chosen. Before the rows in passes
have varied enough to tell the slope, a prior slope (PRIOR_SLOPE, the CPU's) stands in; it fades
as the rows observed spread.

The choice depends only on the past (earlier rounds' timings and acceptance), never on the draws
of the round it is made for, so every round's tokens still follow the target's distribution
exactly. A coupled request (the default) gives its seed's tokens under either policy; a
rejection-sampled one with a seed is reproducible under the fixed policy, while under this one its
gammas, and so which random draws it makes, depend on timing.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field, replace

from orchestrator.arms import DRAFT, PLAIN, Arms, Level

log = logging.getLogger(__name__)

PRIOR_SLOPE = 0.15  # extra cost of a row, as a fraction of a 1-row pass (CPU, fp16 weights: ~0.14)
PRIOR_WEIGHT = 1.0  # the prior slope counts as this many observations at each of its two points
PRIOR_DRAFT_COST = 0.25  # a draft's 1-row pass before it ran one, as a share of the target's (this CPU: 0.4; a
# launch-bound GPU ~0.9): low, so that a lone request starts drafting and the measured arms decide
DECAY = 0.97  # per observation: the last ~30 passes dominate
PRIOR_ACCEPTANCE = 0.7  # a_i before any draft was judged at position i ...
PRIOR_DRAFTS = 8.0  # ... counted as this many drafts: one bad round does not condemn the draft
CATCH_UP_LAG = 16  # a draft phase with a request whose draft lagged more than this is a catch-up: no step costs
MARGIN = 0.10  # drafts must promise 10% more goodput than none: a model's error should not cost
# Acceptance judged from few drafts is taken optimistically (an upper confidence bound: + 0.2 after
# one draft, + 0.09 at steady state): a bad first impression (a short warm-up request) must not
# keep a request from ever drafting again, for then acceptance would never be measured again
OPTIMISM = 0.6
LOAD_MEMORY_S = 2.0  # a step's load level: the most requests on its target in the last this many seconds
FREE_PRIOR = 0.5  # a suffix draft's tokens before any was judged: half as likely as their match counts say
FREE_PRIOR_TOKENS = 8.0  # ... counted as this many promised tokens


@dataclass
class LinearCost:
    """seconds(rows) = alpha + beta * rows, fitted online by weighted least squares with decay."""

    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # sum w, w r, w r^2, w y, w r y

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        s = self.sums
        for i in range(5):
            s[i] *= DECAY
        s[0] += 1
        s[1] += rows
        s[2] += rows * rows
        s[3] += seconds
        s[4] += rows * seconds

    @property
    def known(self) -> bool:
        return self.sums[0] > 0

    def fit(self) -> tuple[float, float]:
        """(alpha, beta), with the prior's two points (1 and 33 rows, on a line of slope
        PRIOR_SLOPE through the data's mean) added, weighing less the more the rows varied."""
        w, wr, wrr, wy, wry = self.sums
        mean_r, mean_y = wr / w, wy / w
        base = mean_y / (1 + PRIOR_SLOPE * (mean_r - 1))  # the prior line's 1-row cost
        # the prior fades as the observed rows spread: then the data tell the slope themselves
        prior = PRIOR_WEIGHT / (1 + max(wrr / w - mean_r * mean_r, 0.0))
        for r in (1.0, 33.0):
            y = base * (1 + PRIOR_SLOPE * (r - 1))
            w, wr, wrr, wy, wry = w + prior, wr + prior * r, wrr + prior * r * r, wy + prior * y, wry + prior * r * y
        beta = (w * wry - wr * wy) / (w * wrr - wr * wr)
        beta = max(beta, 0.0)  # more rows never make a pass cheaper
        return (wy - beta * wr) / w, beta

    def __call__(self, rows: float) -> float:
        alpha, beta = self.fit()
        return max(alpha + beta * rows, 1e-6)


@dataclass
class Acceptance:
    """a_i: of the drafts judged at position i (given 0..i-1 accepted), the share accepted."""

    drafted: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def observe(self, gamma: int, num_accepted: int) -> None:
        # position i is judged only when drafts 0..i-1 passed: positions 0..num_accepted
        judged = min(gamma, num_accepted + 1)
        while len(self.drafted) < judged:
            self.drafted.append(0.0)
            self.accepted.append(0.0)
        for i in range(judged):
            self.drafted[i] = self.drafted[i] * DECAY + 1
            self.accepted[i] = self.accepted[i] * DECAY + (i < num_accepted)

    def rate(self, i: int, optimism: float = 0.0, prior: "Acceptance | None" = None) -> float:
        """a_i, plus optimism / sqrt(drafts judged there, prior included) when asked for: an
        upper confidence bound that shrinks as the position is judged more often. With a prior
        (a request's own acceptance over its draft's pooled one): the prior's rate, optimism
        included, counted as PRIOR_DRAFTS drafts, then this one's own evidence."""
        if prior is not None:
            drafted = self.drafted[i] if i < len(self.drafted) else 0.0
            accepted = self.accepted[i] if i < len(self.accepted) else 0.0
            return (accepted + PRIOR_DRAFTS * prior.rate(i, optimism)) / (drafted + PRIOR_DRAFTS)
        if i >= len(self.drafted):  # never judged: as likely as the last position that was
            return self.rate(len(self.drafted) - 1, optimism) if self.drafted else \
                min(1.0, PRIOR_ACCEPTANCE + optimism / PRIOR_DRAFTS ** 0.5)
        judged = self.drafted[i] + PRIOR_DRAFTS
        return min(1.0, (self.accepted[i] + PRIOR_DRAFTS * PRIOR_ACCEPTANCE) / judged + optimism / judged ** 0.5)

    def expected_tokens(self, gamma: int, optimism: float = 0.0, prior: "Acceptance | None" = None) -> float:
        """E(g) = 1 + a_0 + a_0 a_1 + ...: the accepted drafts plus the recovered or bonus token."""
        total, passed = 1.0, 1.0
        for i in range(gamma):
            passed *= self.rate(i, optimism, prior)
            total += passed
        return total


@dataclass(frozen=True)
class StepRequest:
    """What the step policy knows of one request on the target: its cap, its draft, its lag."""

    cap: int  # the most drafts its round may make (its gamma, fewer near the end, 0 without a draft)
    draft: str | None  # its draft worker's address
    lag: int = 1  # tokens its draft session must take in before drafting (the whole context when opened lazily)
    acceptance: Acceptance | None = None  # its own drafts' acceptance (None: its draft's pooled one alone)
    remaining: int = 0  # tokens it may still generate: its draft's catch-up is spread over them (0: unknown, or
    # the catch-up charged whole to the step: GammaPolicy._catch_ups_charged)
    explorable: bool = True  # may draft in a step that explores drafting: its draft holds its prompt and
    # lags by at most EXPLORE_MAX_LAG (exploring prefills a draft session only for a request alone on its target)
    made_ahead: bool = False  # its draft drafted this step's proposals ahead from the last round's outcome,
    # which kept every draft: they are there unless the bonus token was not the draft's guess


@dataclass
class StepRecord:
    """One step of a target's step loop (orchestrator/steps.py) as it ran: all the gamma policy
    learns from it, handed over once the step ends (GammaPolicy.observe)."""

    target: str
    requests: list[StepRequest]  # as the step's gammas were chosen for them
    gammas: list[int]
    load: int  # requests on the target when it began, those still prefilling included
    started: float  # time.perf_counter()
    # per draft worker that answered: the rows and seconds of one of its passes (as the worker
    # reported them; 0 rows: not reported) and its phase's time beyond its passes (RPC, Python)
    drafts: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    draft_end: float = 0.0  # the draft phase's end (perf_counter)
    # per request that was made_ahead: whether its proposals were all there (no pass ran for it)
    found_made: dict[int, bool] = field(default_factory=dict)
    target_rows: int = 0  # rows of the target's pass (those of prefill chunks or other sessions included)
    target_pass_s: float = 0.0  # and its seconds
    own_rows: int = 0  # the rows this step brought to that pass
    tokens: int = 0  # what the step gave its requests (before a stop cut them)
    ended: float = 0.0
    overlapped: bool = False  # a prefill ran during the step: its waits hold the prefill's passes
    faulted: bool = False  # a worker call failed: its waits (a stalled worker's seconds) are no step's cost

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def own_pass(self) -> bool:
        """The target's pass ran this step's rows alone (no prefill chunks, no other sessions)."""
        return 0 < self.target_rows <= self.own_rows


@dataclass
class StepCosts:
    """What the in-step formula reads for one target: its pass line and each draft's (seconds of
    one forward pass against its rows, as the workers report them), the time a draft phase takes
    beyond its passes (its RPC, the orchestrator's work), acceptance per draft, and the step's
    other time."""

    target: LinearCost
    drafts: dict[str, LinearCost]
    acceptance: dict[str, Acceptance]
    overhead_s: float  # a step's time beyond the draft phase and the target's pass: RPC, sampling, Python
    draft_extra_s: dict[str, float] = field(default_factory=dict)  # per draft: its phase beyond its passes
    made: dict[str, float] = field(default_factory=dict)  # per draft: H, the share of made_ahead requests whose
    # proposals were there (0 where not known)


def expected(r: StepRequest, g: int, costs: StepCosts) -> float:
    """E_j(g) of one request: its own acceptance over its draft's pooled one, with OPTIMISM."""
    pooled = costs.acceptance.setdefault(r.draft, Acceptance())
    if r.acceptance is None:
        return pooled.expected_tokens(g, OPTIMISM)
    return r.acceptance.expected_tokens(g, OPTIMISM, prior=pooled)


def step_goodput(gammas: list[int], requests: list[StepRequest], costs: StepCosts) -> float:
    tokens, seconds = step_estimate(gammas, requests, costs)
    return tokens / seconds


def step_estimate(gammas: list[int], requests: list[StepRequest], costs: StepCosts) -> tuple[float, float]:
    """Expected tokens and seconds of one step in which request j drafts gammas[j] tokens: all
    drafting requests share the draft passes (draft step i of all of them in one pass) and all
    requests share the target's pass of sum(g_j + 1) rows:

        tokens  = sum_j E_j(g_j)
        seconds = overhead + max over drafts of [X max g_j * D(n) + extra] + T(sum_j (g_j + 1))

    with D the draft's pass line, n the requests drafting on it, X = 1 - prod_j H_j the chance
    that its passes run (H_j: request j's chance of finding its proposals made ahead, 0 unless
    made_ahead), extra its phase's time beyond its passes (Leviathan et al. 2023's E(g), acceptance by position, each request's own, taken with
    OPTIMISM). A drafting request whose draft lags (drafting was off for it, or its session opened
    lazily) adds its catch-up rows at the draft line's slope, spread over the steps it has left."""
    tokens, rows = 0.0, 0
    per_draft: dict[str, list[float]] = {}  # draft -> [requests drafting, most drafts, catch-up rows a step, prod H_j]
    for gj, r in zip(gammas, requests):
        rows += gj + 1
        if gj == 0 or r.draft is None:
            tokens += 1.0
            continue
        e = expected(r, gj, costs)
        tokens += e
        d = per_draft.setdefault(r.draft, [0, 0, 0.0, 1.0])
        d[0], d[1] = d[0] + 1, max(d[1], gj)
        d[3] *= costs.made.get(r.draft, 0.0) if r.made_ahead else 0.0
        if r.lag > 1:  # its draft first takes in what it missed: spread over the steps it has left
            d[2] += (r.lag - 1) / max(1.0, r.remaining / e) if r.remaining else r.lag - 1
    draft_s = 0.0
    for address, (n, steps, catch_up, made) in per_draft.items():
        line = draft_line(costs, address)
        if line is not None:
            alpha, beta = line
            draft_s = max(draft_s, (1 - made) * steps * max(alpha + beta * n, 1e-6) + beta * catch_up +
                          costs.draft_extra_s.get(address, 0.0))
    return tokens, costs.overhead_s + draft_s + costs.target(rows)


def draft_line(costs: StepCosts, address: str) -> tuple[float, float] | None:
    """A draft's pass line (alpha, beta): fitted on its passes, or before it has run any, PRIOR_DRAFT_COST
    of the target's 1-row pass at the prior slope (a draft that had not run cost nothing: a fresh
    orchestrator's first steps at sixteen requests drafted, predicted at 89 tok/s, measured 39).
    None while the target has not run either."""
    line = costs.drafts.get(address)
    if line is not None and line.known:
        return line.fit()
    if not costs.target.known:
        return None
    alpha = PRIOR_DRAFT_COST * costs.target(1)
    return alpha, PRIOR_SLOPE * alpha


class StepModel:
    """step_goodput for the candidate steps of one set of requests, cheaply: the pass lines fitted
    once, each request's E_j(g) and catch-up computed once, and a step that differs from the
    current one by one request left out evaluated from the current step's sums. The same numbers
    as step_goodput (tests/orchestrator/test_gamma.py checks), in O(1) a candidate instead of
    O(requests) with a refit each: the search below tries O(requests^2) of them every step."""

    def __init__(self, requests: list[StepRequest], costs: StepCosts):
        self.requests, self.overhead = requests, costs.overhead_s
        self.target = costs.target.fit()
        self.lines = {d: line for d in costs.drafts if (line := draft_line(costs, d)) is not None}
        self.extra = costs.draft_extra_s
        # H_j: request j's chance of finding its proposals made ahead
        self.made = [costs.made.get(r.draft, 0.0) if r.made_ahead else 0.0 for r in requests]
        self.caps = [max(r.cap, 0) if r.draft is not None else 0 for r in requests]
        self.e = [[1.0] + [expected(r, g, costs) for g in range(1, cap + 1)] for r, cap in zip(requests, self.caps)]

    def catch_up(self, j: int, g: int) -> float:
        """Request j's catch-up rows charged to a step in which it drafts g (step_goodput's rule)."""
        r = self.requests[j]
        if g == 0 or r.lag <= 1:
            return 0.0
        return (r.lag - 1) / max(1.0, r.remaining / self.e[j][g]) if r.remaining else r.lag - 1

    def _draft_s(self, address: str, n: int, steps: int, catch_up: float, made: float) -> float:
        line = self.lines.get(address)
        if line is None or n == 0:
            return 0.0
        alpha, beta = line
        return (1 - made) * steps * max(alpha + beta * n, 1e-6) + beta * catch_up + self.extra.get(address, 0.0)

    def goodput(self, tokens: float, rows: int, draft_s: float) -> float:
        alpha, beta = self.target
        return tokens / (self.overhead + draft_s + max(alpha + beta * rows, 1e-6))

    def sums(self, gammas: list[int]) -> tuple[float, int, dict[str, list]]:
        """tokens, rows, and per draft [requests drafting, {gamma: requests}, catch-up rows,
        {H_j: requests}] (step_estimate's prod H_j, kept as counts so that one request can leave)."""
        tokens, rows, per_draft = 0.0, 0, {}
        for j, (g, r) in enumerate(zip(gammas, self.requests)):
            rows += g + 1
            tokens += self.e[j][g]
            if g:
                d = per_draft.setdefault(r.draft, [0, {}, 0.0, {}])
                d[0] += 1
                d[1][g] = d[1].get(g, 0) + 1
                d[2] += self.catch_up(j, g)
                d[3][self.made[j]] = d[3].get(self.made[j], 0) + 1
        return tokens, rows, per_draft

    @staticmethod
    def _product(made: dict[float, int], leave: float | None = None) -> float:
        """prod H_j over the counts, with one request of H = leave left out."""
        product = 1.0
        for h, count in made.items():
            product *= h ** (count - (h == leave))
        return product

    def step(self, gammas: list[int]) -> float:
        """step_goodput(gammas, requests, costs)."""
        tokens, rows, per_draft = self.sums(gammas)
        draft_s = max((self._draft_s(a, n, max(gs), c, self._product(m)) for a, (n, gs, c, m) in per_draft.items()),
                      default=0.0)
        return self.goodput(tokens, rows, draft_s)

    def without(self, gammas: list[int], sums, j: int) -> float:
        """The goodput of `gammas` (whose sums are `sums`) with request j drafting none."""
        tokens, rows, per_draft = sums
        g, mine = gammas[j], self.requests[j].draft
        draft_s = 0.0
        for address, (n, gs, catch_up, made) in per_draft.items():
            if address == mine:
                left = [k for k, count in gs.items() if count > (k == g)]
                draft_s = max(draft_s, self._draft_s(address, n - 1, max(left, default=0),
                                                     catch_up - self.catch_up(j, g), self._product(made, self.made[j])))
            else:
                draft_s = max(draft_s, self._draft_s(address, n, max(gs), catch_up, self._product(made)))
        return self.goodput(tokens - self.e[j][g] + 1.0, rows - g, draft_s)


def drafting_gammas(requests: list[StepRequest], costs: StepCosts) -> list[int]:
    """The best step that drafts: a common g (each request min(g, cap)) with the best step_goodput,
    then, one at a time, the request whose drafts the step is better without (its acceptance is
    poor) drafts none. Nothing measured yet: every cap."""
    caps = [max(r.cap, 0) if r.draft is not None else 0 for r in requests]
    if max(caps, default=0) <= 0 or not costs.target.known:
        return caps
    model = StepModel(requests, costs)
    g = max(range(1, max(caps) + 1), key=lambda g: model.step([min(g, c) for c in caps]))
    gammas = [min(g, c) for c in caps]
    best = model.step(gammas)
    while sum(map(bool, gammas)) > 1:
        sums = model.sums(gammas)
        better = max(((model.without(gammas, sums, j), j) for j in range(len(gammas)) if gammas[j] > 0))
        if better[0] <= best:
            break
        best, gammas[better[1]] = better[0], 0
    return gammas


def best_step_gammas(requests: list[StepRequest], costs: StepCosts) -> list[int]:
    """The cost model's step: drafting_gammas where they promise MARGIN more goodput than no
    drafts (plain batched decoding), else none."""
    gammas = drafting_gammas(requests, costs)
    if not any(gammas) or not costs.target.known:
        return gammas
    plain = step_goodput([0] * len(requests), requests, costs)
    return gammas if step_goodput(gammas, requests, costs) > (1 + MARGIN) * plain else [0] * len(requests)


@dataclass
class Calibration:
    """Tokens accepted per token promised by suffix drafts' path probabilities (orchestrator/proposers/suffix.py),
    exponentially weighted by draft; before any, FREE_PRIOR counted as FREE_PRIOR_TOKENS promised tokens."""

    promised: float = 0.0
    accepted: float = 0.0

    def observe(self, promised: float, accepted: int) -> None:
        self.promised = self.promised * DECAY + promised
        self.accepted = self.accepted * DECAY + accepted

    def value(self, prior: "Calibration | None" = None) -> float:
        """The ratio, with the prior's (a request's own over the target's pooled one) or FREE_PRIOR
        counted as FREE_PRIOR_TOKENS tokens."""
        start = prior.value() if prior is not None else FREE_PRIOR
        return (self.accepted + FREE_PRIOR_TOKENS * start) / (self.promised + FREE_PRIOR_TOKENS)


@dataclass
class Average:
    """An exponentially weighted mean (DECAY per observation) that starts as the plain mean: the
    n-th observation weighs max(1 / n, 1 - DECAY), so the first one does not stand for the ~30
    before it (a first draft phase that also opened a session once kept drafting off for ~100
    probes)."""

    value: float = 0.0
    count: int = 0

    def observe(self, new: float) -> None:
        self.count += 1
        self.value += max(1.0 / self.count, 1 - DECAY) * (new - self.value)


class GammaPolicy:
    """Costs per worker address, acceptance per target/draft pair and the measured arms per target
    and load level (orchestrator/arms.py); thread-safe."""

    def __init__(self, adaptive: bool = True):
        self.adaptive = adaptive  # False: the fixed policy, each request's own gamma
        self._lock = threading.Lock()
        self._costs: dict[str, LinearCost] = {}
        self._acceptance: dict[tuple[str, str], Acceptance] = {}
        self._draft_extra: dict[str, Average] = {}  # draft address -> its phase beyond its passes
        self._made: dict[str, Average] = {}  # draft address -> H, the share of made_ahead requests that found theirs
        self._overhead: dict[str, Average] = {}  # target address -> a step's other time
        self._free: dict[str, Calibration] = {}  # target -> its suffix drafts' calibration, pooled
        self.arms = Arms()
        self.suffix_arms = Arms()  # per target and level: plain steps with suffix drafts ("draft") or without
        self._planned_free: dict[str, tuple[Level, str, bool, float]] = {}  # target -> its step's, as _planned
        # target -> its step's (level, arm, explored, predicted goodput)
        self._planned: dict[str, tuple[Level, str, bool, float]] = {}
        self._loads: dict[str, collections.deque[tuple[float, int]]] = {}  # target -> (time, load) of recent steps

    def _load(self, target: str, load: int) -> int:
        """The load whose level's measured arms decide a step on `target`: the most requests (those
        prefilling included) on it now or in the steps of the last LOAD_MEMORY_S seconds. Where one
        wave of requests ends and the next joins, the first to join runs alone for a step or two;
        taken as a light load, it drafted (a lazily opened draft taking its prompt in) while the
        others' prefills held the cores, and the step everyone joins at waited seconds for it."""
        loads = self._loads.get(target)
        if not loads:
            return load
        since = time.perf_counter() - LOAD_MEMORY_S
        while loads and loads[0][0] < since:
            loads.popleft()
        return max([load, *(n for _, n in loads)])

    def _cost(self, address: str) -> LinearCost:
        return self._costs.setdefault(address, LinearCost())

    def _step_costs(self, target: str, requests: list[StepRequest]) -> StepCosts:
        drafts = {r.draft for r in requests if r.draft is not None}
        return StepCosts(self._cost(target), {d: self._cost(d) for d in drafts},
                         {d: self._acceptance.setdefault((target, d), Acceptance()) for d in drafts},
                         self._overhead.get(target, Average()).value,
                         {d: a.value for d, a in self._draft_extra.items()},
                         {d: a.value for d, a in self._made.items()})

    def suffix_calibration(self, target: str) -> "Calibration":
        """The pooled calibration of suffix drafts on `target` (a request's own starts from it)."""
        with self._lock:
            return self._free.setdefault(target, Calibration())

    def choose_suffix(self, target: str, requests: list[StepRequest], gammas: list[int],
                    candidates: list[list[float]], calibrations: list["Calibration | None"],
                    load: int | None = None) -> list[int]:
        """How many tokens of each request's suffix draft (orchestrator/proposers/suffix.py: candidates[j],
        each position's path probability; [] for none) the step chosen (gammas) adds to the
        target's pass. A suffix draft costs no draft pass, only its rows: request j's k tokens are
        expected to add sum_{i<k} min(1, c_j p_i) tokens (c_j: how many tokens its suffix drafts
        gave per token their probabilities promised, its own over the target's pooled one) for
        beta k seconds (beta: the target's pass line's slope). Requests are taken in the order of
        that ratio, each with the k that gives the step the most goodput, while it adds any.

        The line's slope is a model: whether suffix drafts ride at all is then decided as drafting
        is, by measured goodput (orchestrator/arms.py): per load level, plain steps that carried
        suffix drafts against plain steps that did not, the worse explored within a budget. Only a
        step in which no request drafts with the model carries them (its rate is then theirs).
        (Starting them off where drafting measured worse at the load cost repeated prompts their
        gain at 4-8 clients: the one-request drafting verdict is noisy and reaches every heavier
        level through the neighbours' rule; docs/benchmarks/policy-under-load.)
        load: as choose_step's."""
        lengths = [0] * len(requests)
        if not self.adaptive or not any(candidates) or any(gammas):
            return lengths
        with self._lock:
            lengths, predicted = self._free_lengths(target, requests, gammas, candidates, calibrations)
            level = self.suffix_arms.level(target, self._load(target, max(load or 0, len(requests))))
            # the arm is "the model's suffix drafts": a step it would send none in is no choice
            arm, explored = self.suffix_arms.choose(level, DRAFT, can_draft=any(lengths))
            if arm == PLAIN:
                lengths = [0] * len(requests)
            self._planned_free[target] = (level, arm, explored, predicted)
            return lengths

    def _free_lengths(self, target: str, requests: list[StepRequest], gammas: list[int],
                      candidates: list[list[float]],
                      calibrations: list["Calibration | None"]) -> tuple[list[int], float]:
        """choose_suffix's model: the lengths, and the goodput it expects of the step with them."""
        lengths = [0] * len(requests)
        costs = self._step_costs(target, requests)
        if not costs.target.known:
            return lengths, 0.0
        tokens, seconds = step_estimate(gammas, requests, costs)
        beta = max(costs.target.fit()[1], 1e-9)
        pooled = self._free.setdefault(target, Calibration())
        offers = []
        for j, (probs, own) in enumerate(zip(candidates, calibrations)):
            if not probs:
                continue
            c = own.value(pooled) if own is not None else pooled.value()
            gains = list(itertools.accumulate(min(1.0, c * p) for p in probs))
            offers.append((max(g / (beta * (k + 1)) for k, g in enumerate(gains)), j, gains))
        for _, j, gains in sorted(offers, reverse=True):
            best, best_k = tokens / seconds, 0
            for k, gain in enumerate(gains, 1):
                rate = (tokens + gain) / (seconds + beta * k)
                if rate > best:
                    best, best_k = rate, k
            if best_k:
                lengths[j] = best_k
                tokens, seconds = tokens + gains[best_k - 1], seconds + beta * best_k
        return lengths, tokens / seconds

    def observe_suffix(self, target: str, promised: float, accepted: int) -> None:
        """A suffix draft's outcome: its tokens' path probabilities summed to `promised`, and
        `accepted` of them were kept."""
        if self.adaptive:
            with self._lock:
                self._free.setdefault(target, Calibration()).observe(promised, accepted)

    def choose_step(self, target: str, requests: list[StepRequest], load: int | None = None) -> list[int]:
        """Each request's gamma for one step of the step loop on `target` (orchestrator/steps.py),
        where all drafting requests share the draft passes and all requests the target's pass.
        Whether the step drafts is the measured arms' choice (arms.py: the cost model's until both
        arms are measured, the other arm explored within a budget); how much is the cost model's
        (drafting_gammas: a common g, requests with poor acceptance left out). A request's cap
        stays its upper bound; exploring drafts only the requests whose draft is nearly in step.
        load: the requests on the target, those still prefilling included (default: the step's),
        which picks the load level whose arms decide, with those of the steps of the last
        LOAD_MEMORY_S seconds (observe)."""
        if not self.adaptive:
            return [r.cap for r in requests]
        with self._lock:
            costs = self._step_costs(target, requests)
            load = self._load(target, max(load or 0, len(requests)))
            level = self.arms.level(target, load)
            # a request alone on the target explores even with its draft's catch-up, which delays no
            # one else: a level of one whose drafting measured worse on a noisy second otherwise never
            # drafted again, as its later requests' drafts open lazily and lag by their prompt
            alone = load == 1
            if not costs.target.known and not alone:
                # nothing priced yet (a fresh orchestrator: every pass so far ran prefills too): a draft
                # that must first take in a whole prompt (opened lazily) waits for measured passes. A
                # fresh stack's first wave of eight new requests drafted through eight prompts' catch-up
                # (two steps of 0.9-1.1 s where a plain step takes 85 ms): 0.75x of gamma 0's wave
                requests = [replace(r, cap=0) if r.lag > CATCH_UP_LAG else r for r in requests]
            caps = [r.cap for r in requests]
            # where measurement chose plain the model's arm is not asked (its search: ~2 ms at 32 requests)
            model = None if level.measured and level.running == PLAIN else \
                best_step_gammas(self._catch_ups_charged(level, alone, requests), costs)
            can_draft = any(c > 0 and r.draft is not None for c, r in zip(caps, requests))
            explorable = [r.explorable or alone for r in requests]
            can_explore = any(c > 0 and r.draft is not None and e for c, r, e in zip(caps, requests, explorable))
            running = level.running
            arm, explored = self.arms.choose(level, DRAFT if model and any(model) else PLAIN, can_draft, can_explore)
            if level.running != running and running is not None:
                log.info("steps on %s with %d requests: %s now (measured %.2f tok/s drafting, %.2f without)", target,
                         len(requests), level.running, level.rates[DRAFT].value, level.rates[PLAIN].value)
            if arm == DRAFT and model is None and not explored:  # drafting measured better just now
                model = best_step_gammas(requests, costs)
            if arm == PLAIN:
                gammas = [0] * len(requests)
            elif not explored and any(model):
                gammas = model
            else:  # drafting the model would not choose: only where the draft is in step (no catch-up)
                gammas = drafting_gammas([r if e else StepRequest(0, r.draft, r.lag) for r, e in zip(requests, explorable)],
                                         costs)
            predicted = step_goodput(gammas, requests, costs) if costs.target.known else 0.0
            self._planned[target] = (level, arm, explored, predicted)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("step on %s: %s%s, gammas %s (model %s) for %d requests (caps %s), target (alpha, beta) %s, "
                          "overhead %.4f, drafts (alpha, beta, extra, E(1..4)) %s, arms %s", target, arm,
                          " (exploring)" if explored else "", gammas, model, len(requests), caps,
                          costs.target.fit() if costs.target.known else None, costs.overhead_s,
                          {d: (line.fit() if line.known else None, round(costs.draft_extra_s.get(d, 0.0), 4),
                               [round(costs.acceptance[d].expected_tokens(k), 2) for k in range(1, 5)])
                           for d, line in costs.drafts.items()},
                          {a: round(r.value, 2) for a, r in level.rates.items()})
            return gammas

    def _catch_ups_charged(self, level: Level, alone: bool, requests: list[StepRequest]) -> list[StepRequest]:
        """The requests as the cost model should price the step: a draft's catch-up (a whole
        prompt, where the draft opened lazily) pays back only over later steps that draft, so the
        model spreads it over the steps a request has left only where drafting is established at
        this load: measured better there, a heavier level's verdict, or a request alone (whose
        catch-up delays no one else). Elsewhere the step that pays it is charged all of it: a
        fresh stack's first wave of four requests drafted through four prompts' catch-up (the
        draft phase 427 ms, a plain step 40 ms) before the arms measured that drafting loses there."""
        if alone or (level.running or self.arms.prior(level)) == DRAFT:
            return requests
        return [replace(r, remaining=0) if r.lag > 1 else r for r in requests]

    def observe(self, step: StepRecord) -> tuple[str, bool, float] | None:
        """All a step teaches, once it ended: its load (the next steps' level), the target's pass
        line (from a pass that ran the step's rows alone), each draft's (not from a draft phase in
        which a session caught up: a one-off), the time beyond the passes (from a step no prefill
        overlapped and no fault stalled: those waits are not the step's own; learnt, a prefill's
        made plain steps look ~10x dearer beside their passes), and its arm's rate (observe_outcome)."""
        if self.adaptive:  # (the fixed policy's observe_* keep nothing)
            with self._lock:
                self._loads.setdefault(step.target, collections.deque()).append((step.started, step.load))
        if step.own_pass:
            self.observe_pass(step.target, step.target_rows, step.target_pass_s)
        clean = not step.overlapped and not step.faulted  # the worker times its passes alone: those stand
        own = clean and step.own_pass
        catching_up = {r.draft for r, g in zip(step.requests, step.gammas) if g > 0 and r.lag > CATCH_UP_LAG}
        drafts = {address: (rows, pass_s, extra_s if clean else None)
                  for address, (rows, pass_s, extra_s) in step.drafts.items() if address not in catching_up}
        overhead = max(step.ended - step.draft_end - step.target_pass_s, 0.0) if own else None
        self.observe_step(step.target, overhead, drafts)
        if self.adaptive and step.found_made:  # requests whose proposals were drafted ahead: found or not
            with self._lock:
                for j, found in step.found_made.items():
                    self._made.setdefault(step.requests[j].draft, Average()).observe(1.0 if found else 0.0)
        return self.observe_outcome(step.target, step.tokens, step.seconds, measured=own)

    def observe_outcome(self, target: str, tokens: int, seconds: float,
                        measured: bool = True) -> tuple[str, bool, float] | None:
        """The step just chosen on `target` ended: its requests got `tokens` in `seconds`
        (measured: its passes ran its own work alone, so its rate is its arm's). Returns its arm,
        whether it explored, and the regret it added (None: the fixed policy)."""
        if not self.adaptive:
            return None
        with self._lock:
            planned = self._planned.pop(target, None)
            if planned is None:
                return None
            level, arm, explored, predicted = planned
            before = level.regret_s
            self.arms.observe(level, arm, explored, tokens, seconds, predicted if measured else None)
            regret = level.regret_s - before
            free = self._planned_free.pop(target, None)
            if free is not None:
                level, free_arm, free_explored, predicted = free
                before = level.regret_s
                self.suffix_arms.observe(level, free_arm, free_explored, tokens, seconds,
                                         predicted if measured else None)
                regret += level.regret_s - before
            return arm, explored, regret

    def snapshot(self) -> list[dict]:
        """The measured arms per target and load level (arms.Arms.snapshot)."""
        with self._lock:
            return [{**row, "kind": "drafting"} for row in self.arms.snapshot()] + \
                [{**row, "kind": "suffix drafts"} for row in self.suffix_arms.snapshot()]

    def observe_step(self, target: str, overhead_s: float | None,
                     drafts: dict[str, tuple[int, float, float | None]]) -> None:
        """A step's time beyond its draft phase and its target pass (None: not the step's own,
        a prefill overlapped it), and per draft that ran (the rows and seconds per pass of its
        passes, the phase's time beyond them, None where a prefill overlapped it)."""
        if not self.adaptive:
            return
        with self._lock:
            if overhead_s is not None:
                self._overhead.setdefault(target, Average()).observe(overhead_s)
            for address, (rows, pass_s, extra_s) in drafts.items():
                if rows:
                    self._cost(address).observe(rows, pass_s)
                if extra_s is not None:
                    self._draft_extra.setdefault(address, Average()).observe(extra_s)

    def observe_pass(self, address: str, rows: int, seconds: float) -> None:
        if not self.adaptive:  # the fixed policy uses none of it: keep the round path free of it
            return
        with self._lock:
            self._cost(address).observe(rows, seconds)

    def observe_round(self, target: str, draft: str, gamma: int, num_accepted: int) -> None:
        if gamma > 0 and self.adaptive:
            with self._lock:
                self._acceptance.setdefault((target, draft), Acceptance()).observe(gamma, num_accepted)
