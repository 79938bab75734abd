"""The committed generated code matches proto/: a stale clients/python/specdec_client/v1/ fails here."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
