"""What many tests share (a test module imports its helpers from here, never from another test
module): real servers on free ports (servers.py), worker processes (processes.py), faults
mid-request (faults.py), drafts that fail on cue (drafts.py), the references the service must meet
(reference.py), the chi-square machinery (distribution.py), engine probes (engines.py), small
random models (models.py), the gamma policy's synthetic records (policy.py), hypothesis settings
(fuzz.py), tools (tools.py), this process's memory (memory.py), a file's imports (imports.py)."""

import pkgutil

import pytest

# the helpers' asserts (assert_matches' chi-square, the fault fixtures') fail with pytest's
# introspection, as they did in the test modules they came from
pytest.register_assert_rewrite(*(f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__)))
