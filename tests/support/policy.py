"""The gamma policy fed synthetic step records (orchestrator/gamma.py learns from nothing else), so
that every policy test is a deterministic test of decisions: no pass is timed, no clock is read."""

from __future__ import annotations

from typing import Callable

from orchestrator.gamma import (Acceptance, DraftCosts, GammaPolicy, LinearCost, Ratio, StepCosts, StepRecord,
                                StepRequest)

ROWS = (1, 2, 4, 5, 8, 12, 16, 20, 30, 40)


def measured(cost_of_rows: Callable[[int], float], rows=ROWS) -> LinearCost:
    cost = LinearCost()
    for _ in range(3):
        for r in rows:
            cost.observe(r, cost_of_rows(r))
    return cost


def accepting(rate: float, gamma: int = 8) -> Acceptance:
    """Acceptance that has judged many drafts at each position, accepting `rate` of them."""
    return Acceptance([Ratio(1000.0 * rate, 1000.0) for _ in range(gamma)])


def costs(target: LinearCost, draft: LinearCost, acceptance: Acceptance, made: float = 0.0) -> StepCosts:
    """A target's costs with one draft, "d", found made_ahead `made` of the time."""
    step_costs = StepCosts(target)
    step_costs.drafts["d"] = DraftCosts(draft, acceptance, made=Ratio(made, 1.0))
    return step_costs


class Feed:
    """Steps of one target, each chosen by the policy and then reported as it ran; time is the
    records' own (`clock`, advanced by each step's seconds)."""

    def __init__(self, policy: GammaPolicy, target: str = "t", target_cost: Callable[[int], float] | None = None):
        self.policy, self.target, self.target_cost, self.clock = policy, target, target_cost, 0.0

    def record(self, requests: list[StepRequest], gammas: list[int], seconds: float, tokens: int, load: int = 0,
               **fields) -> tuple[str, bool, float] | None:
        rows = sum(g + 1 for g in gammas)
        pass_s = self.target_cost(rows) if self.target_cost else 0.0
        record = StepRecord(self.target, requests, gammas, load or len(requests), self.clock,
                            target_rows=rows if pass_s else 0, own_rows=rows, target_pass_s=pass_s, tokens=tokens,
                            draft_end=self.clock, **fields)
        self.clock += seconds
        record.ended = self.clock
        return self.policy.observe(record)

    def step(self, requests: list[StepRequest], seconds: Callable[[list[int], list[int]], float] | float,
             tokens: Callable[[list[int], list[int]], int] | int, load: int | None = None,
             suffix=None, **fields) -> tuple[list[int], list[int]]:
        """One step: the policy's choice, then its record with the seconds and tokens given (numbers,
        or functions of the gammas and suffix lengths)."""
        gammas, lengths = self.policy.choose_step(self.target, requests, load=load, suffix=suffix)
        s = seconds(gammas, lengths) if callable(seconds) else seconds
        n = tokens(gammas, lengths) if callable(tokens) else tokens
        self.record(requests, gammas, s, n, load=load or 0, **fields)
        return gammas, lengths


def learnt(target_cost: Callable[[int], float], draft_cost: Callable[[int], float] | None = None,
           acceptance: float | None = None, draft: str = "d", target: str = "t",
           policy: GammaPolicy | None = None) -> GammaPolicy:
    """A policy that has learnt, from step records only, the target's pass line, the draft's and
    the draft's acceptance (every position kept with probability `acceptance`, as counts)."""
    policy = policy or GammaPolicy()
    feed = Feed(policy, target, target_cost)
    for rows in ROWS * 2:  # a lone request's steps of every width (load 1)
        drafts = {draft: (rows, draft_cost(rows), 0.0)} if draft_cost else {}
        feed.record([StepRequest(0, None)], [rows - 1], target_cost(rows), 1, drafts=drafts)  # no time beyond it
    judge = Feed(policy, target)  # (these steps' passes are not timed)
    if acceptance is not None:  # 200 rounds of gamma 8: as many kept at least i drafts as acceptance^i says
        at_least = [round(200 * acceptance ** i) for i in range(9)] + [0]
        for kept in range(9):
            for _ in range(at_least[kept] - at_least[kept + 1]):
                judge.record([StepRequest(8, draft)], [8], 0.1, kept + 1, judged={0: (8, kept, 0.0)})
    return policy
