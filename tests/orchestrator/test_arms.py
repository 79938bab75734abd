"""orchestrator/gamma.py Level: whether a step drafts follows measured goodput, so the policy loses at most
its exploration to the better arm, whichever way the cost model errs."""

from __future__ import annotations

import pytest

from orchestrator.gamma import DRAFT, EXPLORE_SHARE, MARGIN, MIN_STEPS, PLAIN, GammaPolicy, Level, level_of

EXPLORE_RUN = MIN_STEPS + 1
EXPLORE_GAP = 4 * MIN_STEPS


def run(level: Level, predicted: str, rate: dict[str, float], steps: int, step_s: float = 0.1,
        catch_up_s: float = 0.0, can_explore: bool = True) -> list[str]:
    """`steps` steps of `step_s` seconds; an arm gives rate[arm] tokens a second; the first
    drafting step after plain ones also pays catch_up_s. Returns the arm of each step."""
    arms_run, last = [], None
    for _ in range(steps):
        arm, explored = level.choose(predicted, can_draft=True, can_explore=can_explore)
        seconds = step_s + (catch_up_s if arm == DRAFT and last == PLAIN else 0.0)
        level.observe(arm, explored, round(rate[arm] * step_s), seconds)
        arms_run.append(arm)
        last = arm
    return arms_run


@pytest.mark.parametrize("predicted,better", [(DRAFT, PLAIN), (PLAIN, DRAFT)])
def test_whichever_way_the_model_errs_the_better_measured_arm_runs(predicted, better):
    """The model predicts one arm; the other measures twice as fast: after a few exploring runs
    the better one runs, and the worse one gets no more than the exploring budget."""
    level = Level()
    worse = DRAFT if better == PLAIN else PLAIN
    chosen = run(level, predicted, {better: 40.0, worse: 20.0}, steps=2000)
    assert level.running == better
    late = chosen[200:]
    assert late.count(worse) / len(late) <= EXPLORE_SHARE + EXPLORE_RUN / len(late), late.count(worse)
    assert late.count(worse) > 0  # it keeps being explored, in case things change
    # regret: the seconds lost to the worse arm, about half of the time spent there (half the rate)
    assert level.regret_s <= 0.5 * 0.1 * chosen.count(worse) + 1e-9
    assert level.explore_s / level.total_s <= EXPLORE_SHARE + 0.01


def test_arms_within_the_margin_do_not_flap():
    level = Level()
    run(level, DRAFT, {DRAFT: 30.0, PLAIN: 30.0 * (1 + MARGIN / 2)}, steps=2000)
    assert level.switches == 0 and level.running == DRAFT


def test_a_catch_up_after_plain_steps_is_charged_to_exploring_not_to_the_drafting_rate():
    """Each exploring run of drafts first pays the draft sessions' catch-up (here 5x a step):
    that step counts against the exploring budget, but the drafting rate is that of the steps
    after it, so drafting that pays in steady state still wins."""
    level = Level()
    run(level, PLAIN, {DRAFT: 40.0, PLAIN: 30.0}, steps=400, catch_up_s=0.5)
    assert level.running == DRAFT
    assert level.rates[DRAFT].value() == pytest.approx(40.0)


def test_without_a_request_that_may_explore_drafting_is_not_explored():
    level = Level()
    chosen = run(level, PLAIN, {DRAFT: 90.0, PLAIN: 30.0}, steps=500, can_explore=False)
    assert set(chosen) == {PLAIN} and level.rates[DRAFT].steps == 0


def test_until_both_arms_are_measured_the_models_arm_runs():
    level = Level()
    first = run(level, DRAFT, {DRAFT: 10.0, PLAIN: 30.0}, steps=15)
    assert first == [DRAFT] * 15 and not level.measured
    assert level.rates[PLAIN].steps < MIN_STEPS


def test_a_step_no_request_may_draft_in_is_plain():
    level = Level()
    assert level.choose(DRAFT, can_draft=False) == (PLAIN, False)


def test_load_levels_double():
    assert [level_of(n) for n in (1, 2, 3, 4, 7, 8, 15, 16)] == [1, 2, 2, 3, 3, 4, 4, 5]
    policy = GammaPolicy()
    assert policy.level(DRAFT, "t", 8) is policy.level(DRAFT, "t", 12)
    assert policy.level(DRAFT, "t", 8) is not policy.level(DRAFT, "t", 4)
    assert policy.level(DRAFT, "t", 8) is not policy.level(DRAFT, "u", 8)
    assert policy.level(DRAFT, "t", 8) is not policy.level("suffix", "t", 8)


def test_steps_no_request_could_draft_in_add_no_regret():
    """Requests that asked for gamma 0 run plain whatever the arms measured: no choice, no regret."""
    level = Level()
    run(level, DRAFT, {DRAFT: 40.0, PLAIN: 20.0}, steps=300)
    before = level.regret_s
    for _ in range(50):
        arm, explored = level.choose(DRAFT, can_draft=False)
        level.observe(arm, explored, 2, 0.1)
    assert arm == PLAIN and level.regret_s == before
