"""Hypothesis settings of the fuzz tests (tests/orchestrator/test_fuzz.py, test_http_fuzz.py): no
deadline, derandomized (CI runs the same inputs every time), no example database."""

from __future__ import annotations

from hypothesis import HealthCheck

SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])
