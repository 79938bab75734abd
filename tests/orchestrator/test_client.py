"""orchestrator.client stays light: a gRPC client of the service needs none of the ML stack."""

from __future__ import annotations

import json
import subprocess
import sys


def test_importing_the_client_loads_neither_torch_nor_transformers():
    code = ("import json, sys; import orchestrator.client; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'numpy'})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []


def test_the_check_above_can_fail():
    """The same probe sees torch when a module that needs it is imported (the check has teeth)."""
    code = "import json, sys; import specdec.sampling; print(json.dumps('torch' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) is True
