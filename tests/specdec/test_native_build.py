"""The native kernels are built when the package is built or installed (setup.py), beside their
sources, and a worker loads that library instead of compiling its own."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import native_build

ROOT = Path(__file__).resolve().parents[2]

@pytest.mark.skipif(not native_build.can_run_here() or not (shutil.which("cc") or shutil.which("gcc")),
                    reason="the kernels build on Linux x86-64 with a C compiler only")
def test_building_the_package_compiles_the_kernels_beside_their_sources(tmp_path):
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    built = tmp_path / "specdec" / "csrc" / native_build.library_name()
    assert built.exists() and (tmp_path / "specdec" / "csrc" / "int8_rows.c").exists()
    assert b"specdec_decoder_pass" in built.read_bytes()  # the kernels and the layers, one library


def test_a_library_is_named_by_its_sources_and_flags(monkeypatch):
    """A library built from other sources or flags is never loaded: its name differs."""
    name = native_build.library_name()
    monkeypatch.setattr(native_build, "CFLAGS", [*native_build.CFLAGS, "-DSOMETHING"])
    assert native_build.library_name() != name
