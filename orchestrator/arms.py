"""Whether a step drafts at all: decided by measured goodput, so the default cannot lose to gamma 0.

The cost model (orchestrator/gamma.py) predicts each step's goodput with and without drafts. A
prediction can be wrong (a pass line fitted on other rows, acceptance that changed, time the
model does not see), and a wrong "draft" costs throughput at every step. So per target and load
level (the requests on the target, those still prefilling included, so that a wave of arrivals
counts at once: 1, 2-3, 4-7, 8-15, ...) two arms are measured as they
run: the tokens per second of steps that drafted ("draft") and of steps that did not ("plain").
Once both arms have MIN_STEPS measured steps, the better one runs, and the other takes over only
when it measures HYSTERESIS better. Before that a level starts from its measured neighbours, as
drafting pays less the more requests share the passes: where it lost at a lighter load it starts
off, where it won at a heavier load it starts on; else the model's choice runs. The cost model
still picks gamma inside the drafting arm. A step that overlapped a prefill, or whose target pass also
ran other work, counts toward the level's time but not toward either rate (steps.py decides).

The arm not running is explored with a bounded budget: a run of EXPLORE_RUN steps when the time
spent exploring, with the run's expected cost, fits in EXPLORE_SHARE of the level's time (and at
least EXPLORE_GAP steps after the last run; an arm not yet measured, with no neighbour's verdict,
sooner; an arm that measured more than FAR worse, at a quarter of the share: it is unlikely to
have become the better one), so the policy cannot lose more than about that share to the worse
arm. The
first step of a run that switches arms is not measured: it pays the draft sessions' catch-up
(the tokens they missed while drafting was off), which the budget charges instead.

Regret is the time spent in the arm that measured worse (each step in the worse arm adds its
seconds times the shortfall of its rate): the orchestrator's metrics count it
(`specdec.policy.regret`), and `snapshot` reports it with the rates (logged when the orchestrator
stops).

Not owned here: the cost model and acceptance (gamma.py), which requests may draft (gamma.py's
choose_step), when steps run (steps.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_STEPS = 5  # measured steps each arm needs before measurement outranks the model
HYSTERESIS = 0.05  # the other arm must measure this much more goodput to take over
EXPLORE_SHARE = 0.05  # at most this share of a level's time explores the arm not running
EXPLORE_RUN = 6  # steps of one exploring run (the first, which pays a catch-up, is not measured)
EXPLORE_GAP = 24  # steps at a level before its first run, and between runs
ARM_DECAY = 0.9  # per measured step of an arm: its rate follows its last ~10 steps
FAR = 0.2  # an arm measured this much slower than the running one is explored at a quarter of the share
EXPLORE_MAX_LAG = 64  # a request whose draft lags more (or lacks its prompt) drafts in no exploring step, unless
# it is alone on its target (gamma.py's choose_step)
DRAFT, PLAIN = "draft", "plain"


def level_of(requests: int) -> int:
    """The load level of a step with this many requests: 1, 2-3, 4-7, 8-15, ... -> 1, 2, 3, 4, ..."""
    return max(requests, 1).bit_length()


def other(arm: str) -> str:
    return PLAIN if arm == DRAFT else DRAFT


@dataclass
class Rate:
    """Tokens per second of an arm's steps, exponentially weighted by step."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def observe(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * ARM_DECAY + tokens
        self.seconds = self.seconds * ARM_DECAY + seconds
        self.steps += 1

    @property
    def value(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Level:
    """One target's arms at one load level."""

    rates: dict[str, Rate] = field(default_factory=lambda: {DRAFT: Rate(), PLAIN: Rate()})
    predicted: dict[str, Rate] = field(default_factory=lambda: {DRAFT: Rate(), PLAIN: Rate()})  # the model's
    running: str | None = None  # the arm measurement chose (None: the model's, until both are measured)
    last: str | None = None  # the arm the last step ran
    exploring: int = 0  # steps left of the current exploring run
    since_run: int = 0  # steps since the last exploring run ended
    steps: int = 0
    total_s: float = 0.0
    explore_s: float = 0.0
    regret_s: float = 0.0
    switches: int = 0
    chose: bool = True  # the last step chosen could have drafted
    key: tuple[str, int] | None = None  # (target, level of load) in its Arms (None: a level on its own)

    @property
    def measured(self) -> bool:
        return all(r.steps >= MIN_STEPS for r in self.rates.values())


class Arms:
    """The arms of every (target, level); not thread-safe (GammaPolicy holds its lock)."""

    def __init__(self):
        self.levels: dict[tuple[str, int], Level] = {}

    def level(self, target: str, requests: int) -> Level:
        key = (target, level_of(requests))
        level = self.levels.get(key)
        if level is None:
            level = self.levels[key] = Level(key=key)
        return level

    def prior(self, level: Level) -> str | None:
        """The arm a level not yet measured starts with, from its measured neighbours on the same
        target: plain where drafting measured worse at a lighter load (more requests in a pass only
        make the drafts' rows dearer), drafting where it measured better at a heavier one; None:
        no neighbour says (the model's choice runs)."""
        if level.key is None:
            return None
        target, lv = level.key
        measured = [(n, other_level.running) for (t, n), other_level in self.levels.items()
                    if t == target and n != lv and other_level.measured]
        if any(n < lv and running == PLAIN for n, running in measured):
            return PLAIN
        if any(n > lv and running == DRAFT for n, running in measured):
            return DRAFT
        return None

    def choose(self, level: Level, predicted: str, can_draft: bool, can_explore: bool = True) -> tuple[str, bool]:
        """The arm of the next step and whether it explores. predicted: the cost model's arm;
        can_draft: whether any request may draft in this step (else it is plain, unexplored);
        can_explore: whether any may draft in a step that explores drafting."""
        level.chose = can_draft  # a step no request may draft in is no choice: it adds no regret
        if not can_draft:
            level.exploring = 0
            return PLAIN, False
        prior = None if level.measured else self.prior(level)
        if level.exploring > 0:
            level.exploring -= 1
            arm = other(level.running or prior or predicted)
            if arm == PLAIN or can_explore:
                return arm, True
            level.exploring = 0
        arm = prior or predicted
        if level.measured:
            arm = level.running or predicted
            if level.rates[other(arm)].value > (1 + HYSTERESIS) * level.rates[arm].value:
                arm = other(arm)
            if arm != level.running:
                level.switches += level.running is not None
                level.running = arm
        level.since_run += 1
        if level.since_run >= EXPLORE_GAP and self._budget_allows(level, other(arm), prior is not None) and \
                (other(arm) == PLAIN or can_explore):
            level.exploring, level.since_run = EXPLORE_RUN - 1, 0
            return other(arm), True
        return arm, False

    @staticmethod
    def _budget_allows(level: Level, arm: str, informed: bool = False) -> bool:
        """An arm not yet measured is explored early (EXPLORE_GAP steps in, within four times the
        budget) unless a neighbouring level's verdict chose the arm running (informed); after that
        a run starts only if it fits the budget with its expected cost (EXPLORE_RUN mean steps),
        a quarter of it for an arm that measured more than FAR worse than the running one."""
        if level.rates[arm].steps < MIN_STEPS and not informed:  # (steps whose passes ran others' work measure nothing)
            return level.explore_s <= 4 * EXPLORE_SHARE * level.total_s
        share = EXPLORE_SHARE
        if level.measured and level.rates[arm].value < (1 - FAR) * level.rates[other(arm)].value:
            share /= 4
        run_s = EXPLORE_RUN * level.total_s / max(level.steps, 1)
        return level.explore_s + run_s <= share * level.total_s

    def observe(self, level: Level, arm: str, explored: bool, tokens: int, seconds: float,
                predicted: float | None = 0.0) -> None:
        """A step's outcome: the tokens its requests got and its seconds, and the goodput the cost
        model predicted for it (kept beside the measured rate to show the model's error); None:
        the step is not measured (its passes also ran other work), its time still counts."""
        level.steps += 1
        level.total_s += seconds
        if explored:
            level.explore_s += seconds
        if level.measured and level.chose:
            mine, theirs = level.rates[arm].value, level.rates[other(arm)].value
            if theirs > mine:
                level.regret_s += seconds * (1 - mine / theirs)
        # the first step after a switch pays the draft sessions' catch-up: not the arm's rate
        if arm == level.last and predicted is not None:
            level.rates[arm].observe(tokens, seconds)
            if predicted > 0:
                level.predicted[arm].observe(predicted * seconds, seconds)
        level.last = arm

    def snapshot(self) -> list[dict]:
        """Per (target, level): the arm running, both rates, steps, exploring share, regret."""
        return [{"target": target, "level": f"{2 ** (lv - 1)}-{2 ** lv - 1}" if lv > 1 else "1",
                 "running": level.running, "draft_tok_s": round(level.rates[DRAFT].value, 3),
                 "plain_tok_s": round(level.rates[PLAIN].value, 3),
                 "predicted_draft_tok_s": round(level.predicted[DRAFT].value, 3),
                 "predicted_plain_tok_s": round(level.predicted[PLAIN].value, 3), "steps": level.steps,
                 "explore_share": round(level.explore_s / level.total_s, 4) if level.total_s else 0.0,
                 "regret_s": round(level.regret_s, 4), "switches": level.switches}
                for (target, lv), level in sorted(self.levels.items())]
