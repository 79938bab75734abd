"""Fixtures of the fault tests (test_faults.py, test_partitions.py): a prompt and its greedy
continuation, long enough that a fault after the first chunk lands mid-request."""

from __future__ import annotations

import pytest

from tests.orchestrator.test_greedy_equivalence import reference

LONG = 300  # tokens: enough rounds that a kill after the first chunk lands mid-request


@pytest.fixture(scope="module")
def prompt(target_engine):
    return target_engine.tokenizer("The quick brown fox").input_ids  # no EOS within LONG tokens


@pytest.fixture(scope="module")
def expected(target_engine, prompt):
    out = reference(target_engine, prompt, LONG)
    assert len(out) == LONG, "the reference must not stop early, or the kill may come after the end"
    return out
