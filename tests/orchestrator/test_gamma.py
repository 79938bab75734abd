"""orchestrator.gamma: the goodput-maximizing gamma falls as the target's batch grows, from costs it
measures; it keeps the request's gamma where passes cost the same for any number of rows."""

from __future__ import annotations

import pytest

from orchestrator.gamma import Acceptance, GammaPolicy, LinearCost, StepCosts, StepRequest, best_step_gammas


def measured(cost_of_rows, rows=(1, 2, 4, 5, 8, 12, 16, 20, 30, 40)) -> LinearCost:
    cost = LinearCost()
    for _ in range(3):
        for r in rows:
            cost.observe(r, cost_of_rows(r))
    return cost


def accepting(rate: float, gamma: int = 8) -> Acceptance:
    """Acceptance that has judged many drafts at each position, accepting `rate` of them."""
    return Acceptance(drafted=[1000.0] * gamma, accepted=[1000.0 * rate] * gamma)


def best_gamma(cap: int, sessions: int, target: LinearCost, draft: LinearCost, acceptance: Acceptance) -> int:
    """The step policy's gamma for `sessions` requests of cap `cap` sharing one draft, with no
    time beyond the passes."""
    return max(best_step_gammas([StepRequest(cap, "d")] * sessions,
                                StepCosts(target, {"d": draft}, {"d": acceptance}, 0.0)))


def choose(policy: GammaPolicy, cap: int, target: str, draft: str, sessions: int) -> int:
    """The largest gamma the policy gives one of `sessions` like requests in a step."""
    return max(policy.choose_step(target, [StepRequest(cap, draft)] * sessions))


CPU_TARGET = measured(lambda r: 0.110 + 0.017 * r)  # this machine: 126 ms at 1 row, ~790 ms at 40
CPU_DRAFT = measured(lambda r: 0.040 + 0.004 * r)
FLAT_TARGET = measured(lambda r: 0.030 + 0.00001 * r)  # a GPU: rows are almost free
FLAT_DRAFT = measured(lambda r: 0.004 + 0.000001 * r)


def test_linear_cost_recovers_a_line_from_varied_rows():
    alpha, beta = CPU_TARGET.fit()
    assert alpha == pytest.approx(0.110, rel=0.05) and beta == pytest.approx(0.017, rel=0.05)


def test_with_one_row_count_the_prior_slope_fills_in():
    cost = LinearCost()
    for _ in range(20):
        cost.observe(5, 0.2)
    assert cost(5) == pytest.approx(0.2, rel=0.01)
    assert cost(40) > cost(5) * 2  # the CPU prior: 40 rows cost several 5-row passes


def test_acceptance_by_position_is_conditional():
    acc = Acceptance()
    for _ in range(100):
        acc.observe(4, 4)  # all accepted
        acc.observe(4, 1)  # first accepted, second rejected: positions 2, 3 not judged
    assert acc.rate(0) > 0.9
    assert acc.rate(1) == pytest.approx(0.5, abs=0.05)
    assert acc.expected_tokens(0) == 1.0
    assert acc.expected_tokens(2) == pytest.approx(1 + acc.rate(0) + acc.rate(0) * acc.rate(1))


def test_gamma_shrinks_as_the_batch_grows_on_a_cpu_and_reaches_zero():
    acc = accepting(0.8)
    chosen = [best_gamma(8, b, CPU_TARGET, CPU_DRAFT, acc) for b in (1, 2, 4, 8, 16, 32)]
    assert chosen[0] >= 2, chosen
    assert all(a >= b for a, b in zip(chosen, chosen[1:])), chosen
    assert chosen[-1] == 0, chosen


def test_on_flat_costs_a_lone_request_drafts_long_and_a_batch_keeps_drafting():
    """Where rows are nearly free (a GPU) a request alone drafts most of its gamma, and the B
    requests in step share the draft and target passes, so 32 of them still draft."""
    acc = accepting(0.8)
    assert best_gamma(8, 1, FLAT_TARGET, FLAT_DRAFT, acc) >= 4
    assert best_gamma(8, 32, FLAT_TARGET, FLAT_DRAFT, acc) >= 1


def test_poor_acceptance_means_no_drafts():
    assert best_gamma(8, 1, CPU_TARGET, CPU_DRAFT, accepting(0.05)) == 0


def test_the_requests_gamma_is_an_upper_bound_and_nothing_measured_keeps_it():
    acc = accepting(0.99)
    assert best_gamma(3, 1, FLAT_TARGET, FLAT_DRAFT, acc) <= 3
    assert best_gamma(5, 8, LinearCost(), LinearCost(), acc) == 5
    assert best_gamma(0, 1, CPU_TARGET, CPU_DRAFT, acc) == 0


def test_the_policy_can_be_turned_off_and_keys_costs_by_worker():
    policy = GammaPolicy(adaptive=True)
    for r in (1, 5, 10, 20, 40):
        policy.observe_pass("t:1", r, 0.110 + 0.017 * r)
        policy.observe_pass("d:1", r, 0.040 + 0.004 * r)
    for _ in range(50):
        policy.observe_round("t:1", "d:1", 4, 4)
    assert choose(policy, 4, "t:1", "d:1", sessions=1) == 4
    assert choose(policy, 4, "t:1", "d:1", sessions=64) < 4
    assert choose(policy, 4, "t:2", "d:1", sessions=64) == 4  # another target: nothing measured yet
    assert choose(GammaPolicy(adaptive=False), 4, "t:1", "d:1", sessions=64) == 4


def test_through_the_services_the_goodput_policy_stays_exact_and_reports_its_gammas(stack, target_engine):
    """On the tiny models a draft step costs as much as a target pass, so drafts never pay: the
    policy, once it has measured that, drafts less than asked, and greedy output is unchanged."""
    from orchestrator.client import Client
    from tests.orchestrator.test_greedy_equivalence import reference
    from tests.support.servers import start_orchestrator

    tport, dport, _ = stack["ports"]
    parts, address = start_orchestrator([f"127.0.0.1:{tport}"], [f"127.0.0.1:{dport}"], gamma_policy="goodput")
    ids = target_engine.tokenizer("def adapt(x):").input_ids
    try:
        with Client(address, timeout_s=120) as client:
            first = client.generate(token_ids=ids, max_new_tokens=30, temperature=0, gamma=4)
            later = client.generate(token_ids=ids, max_new_tokens=30, temperature=0, gamma=4)
        for r in (first, later):
            assert r.token_ids == reference(target_engine, ids, 30)
            assert r.stats["mean_gamma"] == pytest.approx(r.stats["drafted_tokens"] / r.stats["rounds"])
        model_drafts = later.stats["drafted_tokens"] - later.stats["suffix_drafted_tokens"]
        assert model_drafts < 4 * later.stats["rounds"] and later.stats["gamma"] == 4
    finally:
        parts.stop(None)


def test_the_fixed_policy_drafts_the_requests_gamma(client):
    """Every round drafts min(4, tokens left - 1): over 21 tokens that averages at least 3.2."""
    r = client.generate(prompt="abc", max_new_tokens=21, temperature=0, gamma=4)
    assert r.stats["mean_gamma"] >= 3.2 - 1e-9


def _dear_draft_policy() -> GammaPolicy:
    policy = GammaPolicy()
    for r in (1, 5, 10, 20, 40):
        policy.observe_pass("t", r, 0.110 + 0.017 * r)
        policy.observe_pass("d", r, 0.100 + 0.010 * r)  # a draft nearly as dear as the target
    return policy


def test_when_drafts_do_not_pay_the_policy_still_explores_them_within_its_budget():
    """The model says no drafts; drafting steps are explored now and then (acceptance and their
    goodput keep being measured), within the exploring budget of the time."""
    from orchestrator.arms import EXPLORE_SHARE

    policy = _dear_draft_policy()
    drafting_s = total_s = 0.0
    for _ in range(600):
        gammas = policy.choose_step("t", [StepRequest(4, "d")] * 16)
        seconds = 0.45 if any(gammas) else 0.38  # drafting: rows more to verify, a draft phase ...
        policy.observe_outcome("t", 17 if any(gammas) else 16, seconds)  # ... for a token more: 0.9x
        drafting_s += seconds if any(gammas) else 0.0
        total_s += seconds
    assert 0 < drafting_s <= (EXPLORE_SHARE + 0.02) * total_s, drafting_s / total_s


def test_exploring_drafts_only_requests_whose_draft_is_in_step():
    """A request whose draft would first take in many tokens (or its whole prompt) is not
    drafted for in an exploring step: the others are."""
    policy = _dear_draft_policy()
    requests = [StepRequest(4, "d", lag=300, explorable=False), StepRequest(4, "d", lag=2)]
    seen = []
    for _ in range(200):
        gammas = policy.choose_step("t", requests)
        policy.observe_outcome("t", 2, 0.3)
        seen.append(gammas)
    assert all(g[0] == 0 for g in seen) and any(g[1] > 0 for g in seen)
    lagging = [policy.choose_step("t", [requests[0]] * 2) for _ in range(200)]
    assert lagging == [[0, 0]] * 200  # no request to explore with: no exploring


def test_a_request_alone_explores_drafting_even_with_its_drafts_catch_up():
    """At one request nobody else waits for a draft's catch-up: where plain steps measured better,
    drafting is still explored with a request whose draft lags by its whole prompt (a level of one
    that measured drafting worse on a noisy second otherwise never drafted again)."""
    policy = _dear_draft_policy()
    lagging = StepRequest(4, "d", lag=300, explorable=False)
    seen = []
    for _ in range(300):
        gammas = policy.choose_step("t", [lagging], load=1)
        policy.observe_outcome("t", 1, 0.1)
        seen.append(gammas[0])
    level = policy.arms.level("t", 1)
    assert level.running == "plain" and any(seen[-200:])  # measured plain, and drafting explored since
    # not where a prefill of another request is running (it counts toward the load)
    assert all(policy.choose_step("t", [lagging], load=2) == [0] for _ in range(200))


def test_a_request_whose_drafts_keep_failing_stops_drafting_while_the_others_go_on():
    """Acceptance per request over its draft's pooled one: where the others' drafts pay, the one
    whose drafts are mostly rejected drafts none."""
    policy = GammaPolicy()
    for r in (1, 5, 10, 20, 40):
        policy.observe_pass("t", r, 0.030 + 0.003 * r)  # a row costs a tenth of a pass: rows are not free
        policy.observe_pass("d", r, 0.004 + 0.0002 * r)
    for _ in range(200):
        policy.observe_round("t", "d", 4, 4)
    failing, good = Acceptance(), Acceptance()
    for _ in range(60):
        failing.observe(4, 0)
        good.observe(4, 4)
    gammas = policy.choose_step("t", [StepRequest(4, "d", acceptance=failing)] +
                                [StepRequest(4, "d", acceptance=good)] * 3)
    assert gammas[0] == 0 and min(gammas[1:]) > 0, gammas
    # a request with no drafts judged yet takes its draft's pooled acceptance
    assert policy.choose_step("t", [StepRequest(4, "d", acceptance=Acceptance())] * 4) == \
        policy.choose_step("t", [StepRequest(4, "d")] * 4)


def test_drafting_must_promise_a_margin_over_plain_decoding():
    """Where drafting is predicted only a few percent ahead of gamma 0, the policy keeps gamma 0:
    the model's error should not cost throughput."""
    from orchestrator.gamma import MARGIN, OPTIMISM

    def goodput(acc, g):  # one request alone: the formula the step policy evaluates
        return acc.expected_tokens(g, OPTIMISM) / (g * CPU_DRAFT(1) + CPU_TARGET(g + 1))

    rates = [i / 100 for i in range(101)]
    first = next(r for r in rates if best_gamma(4, 1, CPU_TARGET, CPU_DRAFT, accepting(r)) > 0)
    below = accepting(first - 0.01)  # the last rate at which it kept gamma 0 ...
    ratio = max(goodput(below, g) for g in range(1, 5)) / goodput(below, 0)
    assert 1 < ratio <= 1 + MARGIN  # ... although drafting promised more than gamma 0


def test_on_shared_cores_a_request_served_at_gamma_0_never_prefills_its_draft(stack, target_engine, draft_engine):
    """--prefill sequential opens the draft's session on one token; once the policy has measured
    that drafts do not pay (tiny models: a draft step costs a target pass), a new request runs
    at gamma 0 and the draft runs no pass for it at all, while the output stays exact."""
    from orchestrator.client import Client
    from tests.orchestrator.test_greedy_equivalence import reference
    from tests.support.servers import start_orchestrator

    tport, dport, _ = stack["ports"]
    parts, address = start_orchestrator([f"127.0.0.1:{tport}"], [f"127.0.0.1:{dport}"], gamma_policy="goodput",
                                        prefill="sequential")
    ids = target_engine.tokenizer("def lazy(x): return x * 2  # a prompt longer than a probe's lag").input_ids
    assert len(ids) > 16
    try:
        with Client(address, timeout_s=120) as client:
            first = client.generate(token_ids=ids, max_new_tokens=30, temperature=0, gamma=4)  # learns the costs
            passes = draft_engine.runner.batcher.passes
            later = client.generate(token_ids=ids, max_new_tokens=30, temperature=0, gamma=4)
        assert first.stats["drafted_tokens"] > 0  # nothing measured yet: the first round drafts (and catches up)
        # (suffix drafts, which make no draft pass, may still ride in its verify passes)
        model_drafts = later.stats["drafted_tokens"] - later.stats["suffix_drafted_tokens"]
        assert model_drafts == 0 and draft_engine.runner.batcher.passes == passes
        # what the draft took in, in the stats: the first request's prompt (its catch-up), none for the later
        assert first.stats["draft_prefill_tokens"] >= len(ids) - 1 and later.stats["draft_prefill_tokens"] == 0
        for r in (first, later):
            assert r.token_ids == reference(target_engine, ids, 30)
    finally:
        parts.stop(None)


def test_acceptance_judged_from_few_drafts_is_taken_optimistically():
    """One bad round (a short warm-up) must not stop drafting for good: with few drafts judged the
    bound sits well above the estimate; after many it nearly meets it."""
    few, many = Acceptance(), accepting(0.6)
    few.observe(3, 0)
    assert few.rate(0, optimism=0.6) > few.rate(0) + 0.15
    assert many.rate(0, optimism=0.6) - many.rate(0) < 0.02
    assert few.rate(5, optimism=0.6) == few.rate(0, optimism=0.6)  # never judged: like the last judged


def test_a_step_cost_average_starts_as_the_plain_mean_then_forgets_slowly():
    """The first observation must not stand for the ~30 before it: one slow first draft phase,
    then normal ones, gives their mean (an EWMA seeded with the first value would stay near it for
    dozens of steps, which kept drafting off while drafting off meant no new observations)."""
    from orchestrator.gamma import DECAY, Average

    extra = Average()
    for seconds in [0.040] + [0.004] * 9:
        extra.observe(seconds)
    assert extra.value == pytest.approx((0.040 + 9 * 0.004) / 10)
    for _ in range(500):
        extra.observe(0.002)
    assert extra.value == pytest.approx(0.002, abs=1e-6)  # by then an EWMA with DECAY per observation
    late = Average(value=0.002, count=1000)
    late.observe(0.102)
    assert late.value == pytest.approx(0.002 + (1 - DECAY) * 0.1)


def drafting_lost_at_eight() -> GammaPolicy:
    """A policy whose model would draft, but whose arms at eight requests measured that drafting loses."""
    from orchestrator.arms import PLAIN

    policy = GammaPolicy()
    policy._costs["t"], policy._costs["d"] = FLAT_TARGET, FLAT_DRAFT  # the model would draft
    policy._acceptance[("t", "d")] = accepting(0.8)
    eight = policy.arms.level("t", 8)
    eight.running = PLAIN
    for arm, rate in (("draft", 20.0), ("plain", 40.0)):
        for _ in range(10):
            eight.rates[arm].observe(rate, 1.0)
    return policy


def test_the_load_level_counts_requests_still_prefilling():
    """A wave of arrivals: one request already decodes, seven still prefill. The step is judged
    at the level of eight (whose arms have measured that drafting loses there), not of one."""
    policy = drafting_lost_at_eight()
    assert policy.choose_step("t", [StepRequest(4, "d")], load=8) == [0]
    policy.observe_outcome("t", 1, 0.1)
    assert policy.choose_step("t", [StepRequest(4, "d")]) == [4]  # alone: the model's choice


def test_the_step_search_computes_step_goodput_and_finds_what_a_plain_search_finds():
    """StepModel evaluates candidate steps from sums (O(1) each, the search tries O(B^2) a step):
    the same goodput as step_goodput for every candidate, and drafting_gammas' answer equals that
    of the plain search over step_goodput it replaces."""
    import random

    from orchestrator.gamma import StepModel, drafting_gammas, step_goodput

    def plain_search(requests, costs):
        caps = [max(r.cap, 0) if r.draft is not None else 0 for r in requests]
        g = max(range(1, max(caps) + 1), key=lambda g: step_goodput([min(g, c) for c in caps], requests, costs))
        gammas = [min(g, c) for c in caps]
        best = step_goodput(gammas, requests, costs)
        while sum(map(bool, gammas)) > 1:
            better = max((step_goodput(gammas[:j] + [0] + gammas[j + 1:], requests, costs), j)
                         for j in range(len(gammas)) if gammas[j] > 0)
            if better[0] <= best:
                break
            best, gammas[better[1]] = better[0], 0
        return gammas

    rng = random.Random(5)
    for _ in range(200):
        drafts = ["d1", "d2"][: rng.randint(1, 2)]
        costs = StepCosts(measured(lambda r, a=rng.uniform(0.01, 0.1), b=rng.uniform(0, 0.01): a + b * r),
                          {d: measured(lambda r, a=rng.uniform(0.002, 0.04), b=rng.uniform(0, 0.004): a + b * r)
                           for d in drafts}, {d: accepting(rng.uniform(0.2, 0.95)) for d in drafts},
                          rng.uniform(0, 0.01), {d: rng.uniform(0, 0.005) for d in drafts})
        requests = []
        for _ in range(rng.randint(1, 12)):
            own = Acceptance()
            for _ in range(rng.randint(0, 30)):
                own.observe(4, rng.randint(0, 4))
            requests.append(StepRequest(rng.randint(0, 6), rng.choice(drafts + [None]), rng.choice([1, 1, 5, 60]),
                                        own if rng.random() < 0.7 else None, rng.choice([0, 10, 200])))
        if max((r.cap for r in requests if r.draft), default=0) == 0:
            continue
        model = StepModel(requests, costs)
        gammas = [min(rng.randint(0, 6), c) for c in model.caps]
        assert model.step(gammas) == pytest.approx(step_goodput(gammas, requests, costs), rel=1e-12)
        sums = model.sums(gammas)
        for j in (j for j in range(len(gammas)) if gammas[j]):
            left = gammas[:j] + [0] + gammas[j + 1:]
            assert model.without(gammas, sums, j) == pytest.approx(step_goodput(left, requests, costs), rel=1e-12)
        assert drafting_gammas(requests, costs) == plain_search(requests, costs)



def test_where_plain_steps_measure_better_the_model_is_not_searched_until_drafting_is_chosen(monkeypatch):
    """The cost model's search (best_step_gammas: ~2 ms a step at 32 requests) is skipped in steps
    whose level measured plain steps better, but for a step that drafts by the model's gammas: its
    gammas are still the model's once drafting measures better."""
    import orchestrator.gamma as gamma

    searched = []
    real = gamma.best_step_gammas
    monkeypatch.setattr(gamma, "best_step_gammas", lambda *a: searched.append(1) or real(*a))
    policy = GammaPolicy()
    for r in (1, 5, 10, 20, 40):
        policy.observe_pass("t", r, 0.040 + 0.002 * r)
        policy.observe_pass("d", r, 0.004 + 0.0005 * r)  # a cheap draft: the model would draft
    for _ in range(40):
        policy.observe_round("t", "d", 4, 4)
    requests = [StepRequest(4, "d")] * 8
    for _ in range(300):  # drafting steps measure less goodput than plain ones: plain runs
        gammas = policy.choose_step("t", requests)
        policy.observe_outcome("t", 7 if any(gammas) else 8, 0.1)
    assert policy.arms.level("t", 8).running == "plain"
    searched.clear()
    plain = [policy.choose_step("t", requests) for _ in range(20)]
    for _ in plain:
        policy.observe_outcome("t", 8, 0.1)
    assert plain == [[0] * 8] * 20 and not searched
    for _ in range(600):  # now drafting steps measure five times better
        gammas = policy.choose_step("t", requests)
        policy.observe_outcome("t", 40 if any(gammas) else 8, 0.1)
    assert policy.arms.level("t", 8).running == "draft"
    searched.clear()
    drafting = policy.choose_step("t", requests)
    assert searched and drafting == real(requests, policy._step_costs("t", requests))


def test_a_draft_that_has_not_run_yet_is_not_taken_as_free():
    """A fresh orchestrator knows its target's passes before its draft's: the draft is priced at
    PRIOR_DRAFT_COST of a target pass, not at nothing (its first steps at sixteen requests drafted,
    predicted 89 tok/s, measured 39). Alone a request still starts drafting, for the arms to measure."""
    policy = GammaPolicy(adaptive=True)
    policy._costs["t"] = measured(lambda r: 0.040 + 0.002 * r)  # rows cheap enough that a free draft would pay
    assert policy.choose_step("t", [StepRequest(4, "d")] * 16) == [0] * 16
    assert policy.choose_step("t", [StepRequest(4, "d")])[0] > 0
    policy._costs["d"] = measured(lambda r: 0.0005 + 0.00001 * r)  # a draft measured nearly free: then it drafts
    assert min(policy.choose_step("t", [StepRequest(4, "d")] * 16)) > 0


def test_a_catch_up_is_spread_over_later_steps_only_where_drafting_is_established():
    """Four requests whose drafts opened lazily (each must first take in its 60-token prompt): the
    catch-up pays back only over later steps that draft. At a load whose arms have not shown that
    drafting pays, the model charges the step all of it and runs plain (a fresh stack's first wave
    drafted through four prompts' catch-up, 0.56 s for a 40 ms step's work). Where drafting is
    established (measured better at this load, or a request alone) it is spread as before."""
    from orchestrator.arms import DRAFT

    def policy() -> GammaPolicy:
        p = GammaPolicy()
        p._costs["t"], p._costs["d"] = FLAT_TARGET, measured(lambda r: 0.002 + 0.0005 * r)
        p._acceptance[("t", "d")] = accepting(0.9)
        return p

    lagging = [StepRequest(4, "d", lag=60, remaining=48, explorable=False)] * 4
    assert policy().choose_step("t", lagging) == [0] * 4
    assert min(policy().choose_step("t", [StepRequest(4, "d", remaining=48)] * 4)) > 0  # in step: it drafts
    assert policy().choose_step("t", lagging[:1])[0] > 0  # alone: nobody waits for its catch-up
    established = policy()
    four = established.arms.level("t", 4)
    four.running = DRAFT
    for arm, rate in (("draft", 40.0), ("plain", 20.0)):
        for _ in range(10):
            four.rates[arm].observe(rate, 1.0)
    assert min(established.choose_step("t", lagging)) > 0


def test_before_any_pass_is_measured_no_draft_catches_up_under_load():
    """A fresh orchestrator has measured no pass when its first wave of new requests steps (their
    prefills overlapped every pass): requests whose drafts opened lazily (a whole prompt to take
    in) do not draft then, unless one is alone on the target; drafts in step still do."""
    lagging = StepRequest(4, "d", lag=55, remaining=48, explorable=False)
    assert GammaPolicy().choose_step("t", [lagging] * 8) == [0] * 8
    assert GammaPolicy().choose_step("t", [lagging] * 8, load=8) == [0] * 8
    assert GammaPolicy().choose_step("t", [lagging], load=1) == [4]  # alone: nobody waits for its catch-up
    in_step = StepRequest(4, "d", lag=1, remaining=48)
    assert GammaPolicy().choose_step("t", [lagging, in_step]) == [0, 4]


def test_a_steps_load_is_remembered_for_the_next_steps():
    """Where one wave of requests ends and the next joins, the first to join runs alone for a step
    or two: it is judged at the level of the wave just seen (the steps of the last LOAD_MEMORY_S
    seconds, from their records), not at a level of one, and alone again once that has passed."""
    import time

    from orchestrator.gamma import LOAD_MEMORY_S, StepRecord

    policy = drafting_lost_at_eight()
    lone = [StepRequest(4, "d")]
    assert policy.choose_step("t", lone) == [4]  # nothing remembered: alone
    policy.observe_outcome("t", 1, 0.1)
    now = time.perf_counter()
    policy.observe(StepRecord("t", [StepRequest(4, "d")] * 8, [0] * 8, load=8, started=now, ended=now + 0.1))
    assert policy.choose_step("t", lone) == [0]  # the wave's level
    policy.observe_outcome("t", 1, 0.1)
    policy._loads["t"][0] = (now - LOAD_MEMORY_S - 1, 8)  # as if the wave's last step were older
    assert policy.choose_step("t", lone) == [4]


def test_a_draft_drafting_ahead_is_charged_only_where_the_proposals_may_be_missing():
    """A draft with hardware of its own drafts the next round while the target verifies. After a
    round that kept every draft (made_ahead) its proposals are likely there and the step costs
    no draft time; after a rejection they are not. Charged in full, a draft costing 0.6 of the
    target per step does not pay at acceptance 0.6; found made 4 times in 5, it does."""
    from orchestrator.gamma import step_estimate

    target, draft = measured(lambda r: 0.100 + 0.017 * r), measured(lambda r: 0.060 + 0.002 * r)
    missed, made = [StepRequest(8, "d")], [StepRequest(8, "d", made_ahead=True)]
    costs = StepCosts(target, {"d": draft}, {"d": accepting(0.6)}, 0.0, made={"d": 0.8})
    assert best_step_gammas(missed, costs) == [0]
    assert best_step_gammas(made, costs)[0] >= 2
    tokens, seconds = step_estimate([3], missed, costs)
    tokens_made, seconds_made = step_estimate([3], made, costs)
    assert tokens == tokens_made and seconds - seconds_made == pytest.approx(0.8 * 3 * draft(1), rel=1e-6)
    # several requests on one draft: its passes are skipped only if every one finds its proposals
    both = [StepRequest(8, "d", made_ahead=True), StepRequest(8, "d", made_ahead=True)]
    one = [StepRequest(8, "d", made_ahead=True), StepRequest(8, "d")]
    full = step_estimate([3, 3], one, costs)[1]
    assert full - step_estimate([3, 3], both, costs)[1] == pytest.approx(0.64 * 3 * draft(2), rel=1e-6)


def test_the_search_prices_a_request_left_out_with_the_chances_of_the_others():
    """StepModel's shortcut for a step without request j equals step_goodput of that step."""
    from orchestrator.gamma import StepModel, step_goodput

    target, draft = measured(lambda r: 0.100 + 0.017 * r), measured(lambda r: 0.060 + 0.002 * r)
    requests = [StepRequest(4, "d", made_ahead=True), StepRequest(4, "d"), StepRequest(4, "d", made_ahead=True)]
    costs = StepCosts(target, {"d": draft}, {"d": accepting(0.7)}, 0.0, made={"d": 0.7})
    model, gammas = StepModel(requests, costs), [3, 3, 2]
    sums = model.sums(gammas)
    assert model.step(gammas) == pytest.approx(step_goodput(gammas, requests, costs))
    for j in range(3):
        left = [0 if k == j else g for k, g in enumerate(gammas)]
        assert model.without(gammas, sums, j) == pytest.approx(step_goodput(left, requests, costs))


def test_the_chance_of_finding_proposals_made_is_learnt_from_the_records():
    """Only requests the step expected to find their proposals made teach it (StepRecord.found_made)."""
    from orchestrator.gamma import StepRecord

    policy = GammaPolicy()
    request = StepRequest(4, "d", made_ahead=True)
    for found in [True, True, True, False] * 10:
        policy.choose_step("t", [request])
        policy.observe(StepRecord("t", [request], [4], 1, 0.0, found_made={0: found}, ended=0.1))
    made = policy._step_costs("t", [request, StepRequest(4, "e")]).made
    assert made["d"] == pytest.approx(0.75, abs=0.05) and "e" not in made
