"""Fixtures of the fault tests (test_faults.py, test_partitions.py, test_hosts_apart.py): a prompt
and its greedy continuation, long enough that a fault after the first chunk lands mid-request; and
the stack with its HTTP door (test_http.py, test_http_fuzz.py)."""

from __future__ import annotations

import pytest

from tests.support.faults import LONG
from tests.support.reference import greedy as reference
from tests.support.servers import start_stack, stop_stack


@pytest.fixture(scope="module")
def prompt(target_engine):
    return target_engine.tokenizer("The quick brown fox").input_ids  # no EOS within LONG tokens


@pytest.fixture(scope="module")
def expected(target_engine, prompt):
    out = reference(target_engine, prompt, LONG)
    assert len(out) == LONG, "the reference must not stop early, or the kill may come after the end"
    return out


@pytest.fixture(scope="module")
def http_stack(target_engine, draft_engine):
    """The stack with its HTTP door on a free port (test_http.py, test_http_fuzz.py): "http" its
    base URL, "model" the name it serves."""
    stack = start_stack(target_engine, draft_engine, http_port=0)
    stack["http"] = f"http://127.0.0.1:{stack['orchestrator'].http.port}"
    stack["model"] = stack["orchestrator"].slot.decoder.target_info.model_name
    yield stack
    stop_stack(stack)
