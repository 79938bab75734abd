"""How many drafts each step asks for: a cost model proposes, measured goodput decides.

For each step of a target's step loop (orchestrator/steps.py), one formula (StepModel) predicts
the step's goodput, expected tokens over expected seconds, from what earlier steps' records taught
(`GammaPolicy.observe`, the only door): each worker's pass cost against rows, acceptance by draft
position, the step's time beyond its passes and, for a draft on hardware of its own that drafts
while the target verifies, how often a request finds its proposals made. The step drafts the
common g per request that predicts the most, leaving out the requests it is better without,
where that promises MARGIN more than no drafts; a step drafting nothing carries the suffix
drafts whose calibrated tokens pay for their rows. A model can be wrong, so per target and load
level (1, 2-3, 4-7, ... requests) two arms are measured as steps run, drafting or not (and, in
steps that do not, suffix drafts or not): once both have MIN_STEPS measured steps, measurement
decides, and the arm not running is explored in short runs within EXPLORE_SHARE of the level's
time. Choices depend only on earlier rounds, never on the draws of the round they are made for,
so every round follows the target's distribution exactly.

    tokens  = sum_j E_j(g_j),    E(g) = 1 + a_0 + a_0 a_1 + ... (g terms; Leviathan et al. 2023)
    seconds = overhead + max over drafts [(1 - prod_j H_j) max_j g_j D(n) + catch-up + extra]
              + T(sum_j (g_j + 1))

D(n): a draft's pass with n requests' rows; T(r): the target's pass of r rows; H_j: request j's
chance of finding its proposals made ahead (0 unless its last round kept every draft); catch-up:
the tokens a lagging draft session takes in first, at the draft line's slope; extra: its phase's
time beyond its passes.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field, replace
from typing import Callable

from specdec.protocol import MAX_GAMMA

DECAY = 0.97  # every estimate follows its last ~30 observations
PRIOR_SLOPE = 0.15  # a row's cost as a share of a 1-row pass, until the rows seen vary enough to tell
PRIOR_DRAFT_COST = 0.25  # a draft's pass before it ran one, as a share of the target's: low, so that it is tried
PRIOR_ACCEPTANCE = 0.7  # the chance a draft (or a suffix draft's promised token) is kept, before any was judged
PRIOR_COUNT = 8.0  # ... counted as this many judged tokens, so that one bad round does not condemn a draft
MARGIN = 0.10  # the arm not running must measure this much more goodput to take over (and the model's drafts promise it)
MIN_STEPS = 5  # measured steps each arm needs before measurement outranks the model
EXPLORE_SHARE = 0.05  # at most this share of a level's time explores the arm not running
ARM_DECAY = 1 - 1 / (2 * MIN_STEPS)  # an arm's rate follows its last ~2 * MIN_STEPS steps
CATCH_UP_LAG = MAX_GAMMA  # a draft session behind by more than a round can draft is catching up
DRAFT, PLAIN = "draft", "plain"
OTHER = {DRAFT: PLAIN, PLAIN: DRAFT}


@dataclass
class Ratio:
    """A sum over a sum, both decayed per observation: a mean that starts as the plain mean, then
    follows the last ~1 / (1 - decay) observations. value(start): `start` counted as PRIOR_COUNT."""

    num: float = 0.0
    den: float = 0.0
    decay: float = DECAY
    steps: int = 0  # observations

    def observe(self, num: float, den: float = 1.0) -> None:
        self.num, self.den, self.steps = self.num * self.decay + num, self.den * self.decay + den, self.steps + 1

    def value(self, start: float | None = None) -> float:
        if start is None:
            return self.num / self.den if self.den else 0.0
        return (self.num + PRIOR_COUNT * start) / (self.den + PRIOR_COUNT)


Calibration = Ratio  # a suffix draft's tokens kept over those its path probabilities promised (proposers/suffix.py)


@dataclass
class LinearCost:
    """seconds(rows) = alpha + beta * rows, by least squares with DECAY per observation."""

    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # sum w, w r, w r^2, w y, w r y

    def observe(self, rows: int, seconds: float) -> None:
        if rows > 0 and seconds > 0:
            self.sums = [s * DECAY + v for s, v in zip(self.sums, (1, rows, rows * rows, seconds, rows * seconds))]

    @property
    def known(self) -> bool:
        return self.sums[0] > 0

    def fit(self) -> tuple[float, float]:
        """(alpha, beta), with two points of a PRIOR_SLOPE line through the data's mean (at 1 and 33
        rows) counted as one observation, less the more the rows seen spread."""
        w, wr, wrr, wy, wry = self.sums
        mean_r, mean_y = wr / w, wy / w
        base = mean_y / (1 + PRIOR_SLOPE * (mean_r - 1))
        prior = 1 / (1 + max(wrr / w - mean_r * mean_r, 0.0))
        for r in (1.0, 33.0):
            y = base * (1 + PRIOR_SLOPE * (r - 1))
            w, wr, wrr, wy, wry = w + prior, wr + prior * r, wrr + prior * r * r, wy + prior * y, wry + prior * r * y
        beta = max((w * wry - wr * wy) / (w * wrr - wr * wr), 0.0)  # more rows never make a pass cheaper
        return (wy - beta * wr) / w, beta

    def __call__(self, rows: float) -> float:
        alpha, beta = self.fit()
        return max(alpha + beta * rows, 1e-6)


@dataclass
class Acceptance:
    """a_i: of the drafts judged at position i (given 0..i-1 kept), the share kept; a position
    never judged is as likely as the last judged, and none judged is PRIOR_ACCEPTANCE."""

    positions: list[Ratio] = field(default_factory=list)

    def observe(self, gamma: int, num_accepted: int) -> None:
        judged = min(gamma, num_accepted + 1)  # position i is judged only when 0..i-1 were kept
        self.positions += [Ratio() for _ in range(judged - len(self.positions))]
        for i in range(judged):
            self.positions[i].observe(float(i < num_accepted))

    def rate(self, i: int) -> float:
        return self.positions[min(i, len(self.positions) - 1)].value(PRIOR_ACCEPTANCE) if self.positions \
            else PRIOR_ACCEPTANCE

    def expected_tokens(self, gamma: int) -> float:
        """E(g): the kept drafts plus the recovered or bonus token."""
        total = passed = 1.0
        for i in range(gamma):
            passed *= self.rate(i)
            total += passed
        return total


@dataclass(frozen=True)
class StepRequest:
    """What the policy knows of one request on the target when a step is chosen."""

    cap: int  # the most drafts its round may make (its gamma, fewer near the end, 0 without a draft)
    draft: str | None  # its draft worker's address
    lag: int = 1  # tokens its draft session must take in before drafting (a whole prompt when opened lazily)
    remaining: int = 0  # tokens it may still generate: a catch-up is spread over them (0: charged whole)
    holds_prompt: bool = True  # its draft session holds its prompt: it may draft in a step that explores
    made_ahead: bool = False  # its last round kept every draft and its draft drafted on while the target verified
    calibration: Calibration | None = None  # its own suffix drafts'


@dataclass
class StepRecord:
    """One step as it ran (orchestrator/steps.py): all the policy learns from it (`observe`)."""

    target: str
    requests: list[StepRequest]  # as the step's gammas were chosen for them
    gammas: list[int]
    load: int  # requests on the target when it began, those still prefilling included
    started: float  # seconds (the step loop's clock)
    # per draft that answered: (rows, seconds) of one of its passes (0 rows: not reported), its phase's other time
    drafts: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    draft_end: float = 0.0
    found_made: dict[int, bool] = field(default_factory=dict)  # per made_ahead request: were they all there
    judged: dict[int, tuple[int, int, float]] = field(default_factory=dict)  # j: drafts, kept, suffix's promise or 0
    target_rows: int = 0  # rows of the target's pass (prefill chunks and other sessions' included)
    target_pass_s: float = 0.0
    own_rows: int = 0  # the rows this step brought to that pass
    tokens: int = 0  # what the step gave its requests
    ended: float = 0.0
    overlapped: bool = False  # a prefill ran during the step: its waits hold the prefill's passes
    faulted: bool = False  # a worker call failed: its waits are no step's cost

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def own_pass(self) -> bool:  # the target's pass ran this step's rows alone
        return 0 < self.target_rows <= self.own_rows


@dataclass
class DraftCosts:
    """What a target's steps taught of one draft worker: its pass line, acceptance by position, its
    phase's time beyond its passes (RPC, Python), and H (the share of made_ahead requests that found
    their proposals made)."""

    line: LinearCost = field(default_factory=LinearCost)
    acceptance: Acceptance = field(default_factory=Acceptance)
    extra: Ratio = field(default_factory=Ratio)
    made: Ratio = field(default_factory=Ratio)


@dataclass
class StepCosts:
    """What the formula reads for one target, as its steps taught: its pass line, the step's time
    beyond the passes, each draft's costs, and its suffix drafts' calibration (pooled)."""

    target: LinearCost = field(default_factory=LinearCost)
    overhead: Ratio = field(default_factory=Ratio)
    drafts: dict[str, DraftCosts] = field(default_factory=lambda: collections.defaultdict(DraftCosts))
    suffix: Calibration = field(default_factory=Calibration)


class StepModel:
    """The formula (module docstring) for the candidate steps of one set of requests."""

    def __init__(self, requests: list[StepRequest], costs: StepCosts):
        self.requests, self.costs = requests, costs
        self.target = costs.target.fit() if costs.target.known else None
        self.caps = [max(r.cap, 0) if r.draft is not None else 0 for r in requests]
        drafts = {r.draft: costs.drafts[r.draft] for r in requests if r.draft is not None}
        self.lines = {d: self._line(c.line) for d, c in drafts.items()}
        e = {d: [c.acceptance.expected_tokens(g) for g in range(max(self.caps) + 1)] for d, c in drafts.items()}
        self.e = [e[r.draft] if r.draft is not None else [1.0] for r in requests]

    def _line(self, line: LinearCost) -> tuple[float, float] | None:
        """A draft's (alpha, beta); before it ran, PRIOR_DRAFT_COST of the target's 1-row pass."""
        if line.known:
            return line.fit()
        if self.target is None:
            return None
        alpha = PRIOR_DRAFT_COST * max(sum(self.target), 1e-6)
        return alpha, PRIOR_SLOPE * alpha

    def estimate(self, gammas: list[int]) -> tuple[float, float]:
        """Expected tokens and seconds of the step."""
        tokens, rows, per_draft = 0.0, 0, {}
        for j, (g, r) in enumerate(zip(gammas, self.requests)):
            rows += g + 1
            tokens += self.e[j][g]
            if g:
                d = per_draft.setdefault(r.draft, [0, 0, 0.0, 1.0])  # requests, most drafts, catch-up, prod H
                d[0], d[1] = d[0] + 1, max(d[1], g)
                d[3] *= self.costs.drafts[r.draft].made.value() if r.made_ahead else 0.0
                if r.lag > 1:  # spread over the steps it has left
                    d[2] += (r.lag - 1) / max(1.0, r.remaining / self.e[j][g]) if r.remaining else r.lag - 1
        draft_s = 0.0
        for address, (n, steps, catch_up, made) in per_draft.items():
            if (line := self.lines.get(address)) is not None:
                alpha, beta = line
                draft_s = max(draft_s, (1 - made) * steps * max(alpha + beta * n, 1e-6) + beta * catch_up +
                              self.costs.drafts[address].extra.value())
        alpha, beta = self.target or (0.0, 0.0)
        return tokens, self.costs.overhead.value() + draft_s + max(alpha + beta * rows, 1e-6)

    def goodput(self, gammas: list[int]) -> float:
        tokens, seconds = self.estimate(gammas)
        return tokens / seconds

    def drafting(self) -> list[int]:
        """The best step that drafts: a common g (each request min(g, cap)), then, one at a time,
        the request the step is better without drafts none. Nothing measured yet: every cap."""
        caps = self.caps
        if max(caps, default=0) <= 0 or self.target is None:
            return list(caps)
        g = max(range(1, max(caps) + 1), key=lambda g: self.goodput([min(g, c) for c in caps]))
        gammas = [min(g, c) for c in caps]
        best = self.goodput(gammas)
        while sum(map(bool, gammas)) > 1:
            better = max((self.goodput(gammas[:j] + [0] + gammas[j + 1:]), j) for j, g in enumerate(gammas) if g)
            if better[0] <= best:
                break
            best, gammas[better[1]] = better[0], 0
        return gammas

    def best(self) -> list[int]:
        """`drafting` where it promises MARGIN more goodput than no drafts, else none."""
        gammas = self.drafting()
        if not any(gammas) or self.target is None:
            return gammas
        plain = [0] * len(gammas)
        return gammas if self.goodput(gammas) > (1 + MARGIN) * self.goodput(plain) else plain

    def suffix(self, candidates: list[list[float]], calibrations: list[float]) -> list[int]:
        """How many tokens of each suffix draft (candidates[j]: each position's path probability p,
        non-increasing) ride a step that drafts nothing: those whose expected tokens, min(1, c_j p)
        (c_j: request j's calibration), beat what their row's time gives at the step's goodput."""
        if self.target is None:
            return [0] * len(candidates)
        tokens, seconds = self.estimate([0] * len(self.requests))
        worth = self.target[1] * tokens / seconds
        return [sum(min(1.0, c * p) > worth for p in probs) for probs, c in zip(candidates, calibrations)]


def level_of(requests: int) -> int:  # 1, 2-3, 4-7, 8-15, ... requests -> 1, 2, 3, 4, ...
    return max(requests, 1).bit_length()


@dataclass
class Level:
    """One target's two arms at one load level: tokens per second of the steps each ran (ARM_DECAY
    per step), which runs, its exploring, and its regret (time in the arm measured worse, weighted
    by its shortfall: `specdec.policy.regret`)."""

    rates: dict[str, Ratio] = field(default_factory=lambda: {a: Ratio(decay=ARM_DECAY) for a in (DRAFT, PLAIN)})
    running: str | None = None  # the arm measurement chose (None: not yet measured)
    last: str | None = None  # the arm the last step ran
    exploring: int = 0  # steps left of the current exploring run
    since_run: int = 0  # steps since the last exploring run ended
    steps: int = 0
    total_s: float = 0.0
    explore_s: float = 0.0
    regret_s: float = 0.0
    switches: int = 0
    chose: bool = True  # the last step could have speculated

    @property
    def measured(self) -> bool:
        return all(r.steps >= MIN_STEPS for r in self.rates.values())

    def choose(self, predicted: str, can_draft: bool, can_explore: bool = True) -> tuple[str, bool]:
        """The next step's arm (PLAIN where no request may draft) and whether it explores (only
        where can_explore). The other arm is explored in runs of MIN_STEPS + 1 steps, the first of
        which pays the draft sessions' catch-up and is not measured, within EXPLORE_SHARE of the
        time (four times that while it is not measured)."""
        self.chose = can_draft
        if not can_draft:
            self.exploring = 0
            return PLAIN, False
        arm = predicted
        if self.measured:
            arm = self.running or predicted
            if self.rates[OTHER[arm]].value() > (1 + MARGIN) * self.rates[arm].value():
                arm = OTHER[arm]
            self.switches += self.running not in (None, arm)
            self.running = arm
        explore = OTHER[arm]
        if explore == DRAFT and not can_explore:
            self.exploring = 0
            return arm, False
        if self.exploring > 0:
            self.exploring -= 1
            return explore, True
        self.since_run += 1
        share = EXPLORE_SHARE * (4 if self.rates[explore].steps < MIN_STEPS else 1)
        run_s = (MIN_STEPS + 1) * self.total_s / max(self.steps, 1)
        if self.since_run >= 4 * MIN_STEPS and self.explore_s + run_s <= share * self.total_s:
            self.exploring, self.since_run = MIN_STEPS, 0
            return explore, True
        return arm, False

    def observe(self, arm: str, explored: bool, tokens: int, seconds: float, measured: bool = True) -> None:
        """A step's outcome; not measured where its passes also ran other work (its time counts)."""
        self.steps, self.total_s = self.steps + 1, self.total_s + seconds
        self.explore_s += seconds if explored else 0.0
        if self.measured and self.chose:
            mine, theirs = self.rates[arm].value(), self.rates[OTHER[arm]].value()
            self.regret_s += seconds * (1 - mine / theirs) if theirs > mine else 0.0
        if arm == self.last and measured:  # a switch's first step pays a catch-up
            self.rates[arm].observe(tokens, seconds)
        self.last = arm


class GammaPolicy:
    """The costs, acceptance and arms of every target and draft; thread-safe."""

    def __init__(self, adaptive: bool = True):
        self.adaptive = adaptive  # False: the fixed policy, each request's own gamma
        self._lock = threading.Lock()
        self.costs: dict[str, StepCosts] = collections.defaultdict(StepCosts)  # per target
        self._loads: dict[str, collections.deque[int]] = {}  # per target: its last steps' loads
        self._planned: dict[str, list] = {}  # target -> [(level, arm, explored)] of its step under way
        self.levels: dict[tuple[str, str, int], Level] = {}  # (DRAFT or "suffix", target, level_of(load))

    def level(self, kind: str, target: str, load: int) -> Level:
        return self.levels.setdefault((kind, target, level_of(load)), Level())

    def choose_step(self, target: str, requests: list[StepRequest], load: int | None = None,
                    suffix: Callable[[], list[list[float]]] | None = None) -> tuple[list[int], list[int]]:
        """Each request's gamma for the next step on `target`, and the tokens of its suffix draft
        (suffix(): each request's candidate path probabilities, [] for none) that ride a step
        drafting nothing. load: the requests on the target, those still prefilling included; the
        level is the most of it and of the last MIN_STEPS steps' loads."""
        none = [0] * len(requests)
        if not self.adaptive:
            return [r.cap for r in requests], none
        with self._lock:
            load = max([load or 0, len(requests), *self._loads.get(target, ())])
            level, alone = self.level(DRAFT, target, load), load == 1
            if not self.costs[target].target.known and not alone:
                # nothing priced yet: a draft that must first take in a whole prompt waits
                requests = [replace(r, cap=0) if r.lag > CATCH_UP_LAG else r for r in requests]
            if not (alone or level.running == DRAFT):
                # a catch-up pays back over later steps only where drafting is established (or
                # delays no one else): elsewhere the step that pays it is charged all of it
                requests = [replace(r, remaining=0) if r.lag > 1 else r for r in requests]
            model = StepModel(requests, self.costs[target])
            gammas = model.best()
            can_explore = any(c and (r.holds_prompt or alone) for c, r in zip(model.caps, requests))
            arm, explored = level.choose(DRAFT if any(gammas) else PLAIN, any(model.caps), can_explore)
            if arm == PLAIN:
                gammas = none
            elif explored or not any(gammas):  # drafting where the model would not: with drafts in step
                gammas = StepModel([r if r.holds_prompt or alone else StepRequest(0, r.draft) for r in requests],
                                   model.costs).drafting()
            lengths, plans = none, [(level, arm, explored)]
            candidates = suffix() if suffix is not None and not any(gammas) else None
            if candidates and any(candidates):  # suffix drafts: arms of their own, per level
                start = model.costs.suffix.value(PRIOR_ACCEPTANCE)
                calibrations = [r.calibration.value(start) if r.calibration else start for r in requests]
                suffix_level = self.level("suffix", target, load)
                lengths = model.suffix(candidates, calibrations)
                suffix_arm, suffix_explored = suffix_level.choose(DRAFT, can_draft=any(lengths))
                lengths = lengths if suffix_arm == DRAFT else none
                plans.append((suffix_level, suffix_arm, suffix_explored))
            self._planned[target] = plans
            return gammas, lengths

    def observe(self, step: StepRecord) -> tuple[str, bool, float] | None:
        """All a step teaches, once it ended: its load, acceptance, the target's pass line (from a
        pass that ran the step's rows alone), each draft's (not from a phase in which a session
        caught up), the time beyond the passes (not from a step a prefill overlapped or a fault
        stalled), the made-ahead rate, and its arms' rates. Returns its arm, whether it explored,
        and the regret it added (None: the fixed policy, which learns nothing)."""
        if not self.adaptive:
            return None
        clean = not step.overlapped and not step.faulted
        own = clean and step.own_pass
        catching_up = {r.draft for r, g in zip(step.requests, step.gammas) if g > 0 and r.lag > CATCH_UP_LAG}
        with self._lock:
            costs = self.costs[step.target]
            self._loads.setdefault(step.target, collections.deque(maxlen=MIN_STEPS)).append(step.load)
            if step.own_pass:
                costs.target.observe(step.target_rows, step.target_pass_s)
            if own:
                costs.overhead.observe(max(step.ended - step.draft_end - step.target_pass_s, 0))
            for address, (rows, pass_s, extra_s) in step.drafts.items():
                if address not in catching_up:
                    costs.drafts[address].line.observe(rows, pass_s)
                    if clean:
                        costs.drafts[address].extra.observe(extra_s)
            for j, found in step.found_made.items():
                costs.drafts[step.requests[j].draft].made.observe(float(found))
            for j, (drafted, kept, promised) in step.judged.items():
                r = step.requests[j]
                if promised:
                    costs.suffix.observe(kept, promised)
                    if r.calibration is not None:
                        r.calibration.observe(kept, promised)
                elif r.draft is not None:
                    costs.drafts[r.draft].acceptance.observe(drafted, kept)
            plans, regret = self._planned.pop(step.target, []), 0.0
            for level, arm, explored in plans:
                regret -= level.regret_s
                level.observe(arm, explored, step.tokens, step.seconds, own)
                regret += level.regret_s
            return (plans[0][1], plans[0][2], regret) if plans else None

    def snapshot(self) -> list[dict]:
        """Per arms' kind, target and load level: the arm running, both measured rates, steps, the
        share spent exploring, regret and switches."""
        with self._lock:
            return [{"kind": "drafting" if kind == DRAFT else "suffix drafts", "target": target,
                     "level": f"{2 ** (lv - 1)}-{2 ** lv - 1}" if lv > 1 else "1", "running": level.running,
                     "draft_tok_s": round(level.rates[DRAFT].value(), 3),
                     "plain_tok_s": round(level.rates[PLAIN].value(), 3), "steps": level.steps,
                     "explore_share": round(level.explore_s / level.total_s, 4) if level.total_s else 0.0,
                     "regret_s": round(level.regret_s, 4), "switches": level.switches}
                    for (kind, target, lv), level in sorted(self.levels.items())]
