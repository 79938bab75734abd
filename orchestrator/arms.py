"""Whether a step speculates at all: decided by measured goodput, so the default cannot lose to gamma 0.

The cost model (orchestrator/gamma.py) predicts each step's goodput with and without drafts, and
a prediction can be wrong. So per target and load level (the requests on the target, those still
prefilling included: 1, 2-3, 4-7, 8-15, ...) two arms are measured as they run: the tokens per
second of steps that drafted ("draft") and of steps that did not ("plain"); gamma.py keeps one
such set for drafting with the model and one for suffix drafts in the steps that do not. Once
both have MIN_STEPS measured steps the better one runs, and the other takes over only when it
measures MARGIN better. Before that a level starts from its
measured neighbours (drafting pays less the more requests share the passes: where it lost at a
lighter load it starts off, where it won at a heavier load it starts on), else the model's arm.
The arm not running is explored in runs of MIN_STEPS + 1 steps while the time spent exploring
stays within EXPLORE_SHARE of the level's time (an arm not yet measured: four times that), so
the policy loses at most about that share to the worse arm. A run's first step pays the draft
sessions' catch-up (the tokens they missed while drafting was off) and is not measured; nor is
a step whose passes also ran other work (a prefill), whose time still counts.

Regret is the time spent in the arm that measured worse, weighted by its shortfall
(`specdec.policy.regret`; `snapshot` reports it with the rates and the model's predictions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MARGIN = 0.10  # the other arm must measure this much more goodput to take over (and the model's drafts promise it)
MIN_STEPS = 5  # measured steps each arm needs before measurement outranks the model
EXPLORE_SHARE = 0.05  # at most this share of a level's time explores the arm not running
ARM_DECAY = 1 - 1 / (2 * MIN_STEPS)  # an arm's rate follows its last ~2 * MIN_STEPS steps
DRAFT, PLAIN = "draft", "plain"


def level_of(requests: int) -> int:
    """The load level of a step with this many requests: 1, 2-3, 4-7, 8-15, ... -> 1, 2, 3, 4, ..."""
    return max(requests, 1).bit_length()


def other(arm: str) -> str:
    return PLAIN if arm == DRAFT else DRAFT


@dataclass
class Rate:
    """Tokens per second of an arm's steps, weighted by ARM_DECAY per step."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def observe(self, tokens: float, seconds: float) -> None:
        self.tokens = self.tokens * ARM_DECAY + tokens
        self.seconds = self.seconds * ARM_DECAY + seconds
        self.steps += 1

    @property
    def value(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Level:
    """One target's arms at one load level."""

    key: tuple[str, int] | None = None  # (target, level) in its Arms
    rates: dict[str, Rate] = field(default_factory=lambda: {DRAFT: Rate(), PLAIN: Rate()})
    predicted: dict[str, Rate] = field(default_factory=lambda: {DRAFT: Rate(), PLAIN: Rate()})  # the model's
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


class Arms:
    """The arms of every (target, level); not thread-safe (GammaPolicy holds its lock)."""

    def __init__(self):
        self.levels: dict[tuple[str, int], Level] = {}

    def level(self, target: str, requests: int) -> Level:
        key = (target, level_of(requests))
        return self.levels.setdefault(key, Level(key))

    def prior(self, level: Level) -> str | None:
        """A level's start from its measured neighbours on the same target (None: none says)."""
        if level.key is None:
            return None
        target, lv = level.key
        measured = [(n, other.running) for (t, n), other in self.levels.items() if t == target and other.measured]
        if any(n < lv and running == PLAIN for n, running in measured):
            return PLAIN
        if any(n > lv and running == DRAFT for n, running in measured):
            return DRAFT
        return None

    def choose(self, level: Level, predicted: str, can_draft: bool, can_explore: bool = True) -> tuple[str, bool]:
        """The arm of the next step and whether it explores. predicted: the model's arm; can_draft:
        whether any request may speculate (else the step is plain); can_explore: whether any may in
        a step that explores it."""
        level.chose = can_draft
        if not can_draft:
            level.exploring = 0
            return PLAIN, False
        prior = None if level.measured else self.prior(level)
        arm = prior or predicted
        if level.measured:
            arm = level.running or predicted
            if level.rates[other(arm)].value > (1 + MARGIN) * level.rates[arm].value:
                arm = other(arm)
            level.switches += level.running not in (None, arm)
            level.running = arm
        explore = other(arm)
        if explore == DRAFT and not can_explore:
            level.exploring = 0
            return arm, False
        if level.exploring > 0:
            level.exploring -= 1
            return explore, True
        level.since_run += 1
        share = EXPLORE_SHARE * (4 if level.rates[explore].steps < MIN_STEPS and prior is None else 1)
        run_s = (MIN_STEPS + 1) * level.total_s / max(level.steps, 1)
        if level.since_run >= 4 * MIN_STEPS and level.explore_s + run_s <= share * level.total_s:
            level.exploring, level.since_run = MIN_STEPS, 0
            return explore, True
        return arm, False

    def observe(self, level: Level, arm: str, explored: bool, tokens: int, seconds: float,
                predicted: float | None = 0.0) -> None:
        """A step's outcome and the goodput the model predicted for it; None: not measured (its
        passes also ran other work), its time still counts."""
        level.steps += 1
        level.total_s += seconds
        level.explore_s += seconds if explored else 0.0
        if level.measured and level.chose:
            mine, theirs = level.rates[arm].value, level.rates[other(arm)].value
            level.regret_s += seconds * (1 - mine / theirs) if theirs > mine else 0.0
        if arm == level.last and predicted is not None:  # a switch's first step pays a catch-up
            level.rates[arm].observe(tokens, seconds)
            if predicted > 0:
                level.predicted[arm].observe(predicted * seconds, seconds)
        level.last = arm

    def snapshot(self) -> list[dict]:
        """Per (target, level): the arm running, both rates and the model's, steps, exploring, regret."""
        return [{"target": target, "level": f"{2 ** (lv - 1)}-{2 ** lv - 1}" if lv > 1 else "1",
                 "running": level.running, "draft_tok_s": round(level.rates[DRAFT].value, 3),
                 "plain_tok_s": round(level.rates[PLAIN].value, 3),
                 "predicted_draft_tok_s": round(level.predicted[DRAFT].value, 3),
                 "predicted_plain_tok_s": round(level.predicted[PLAIN].value, 3), "steps": level.steps,
                 "explore_share": round(level.explore_s / level.total_s, 4) if level.total_s else 0.0,
                 "regret_s": round(level.regret_s, 4), "switches": level.switches}
                for (target, lv), level in sorted(self.levels.items())]
