"""The native kernels are built when the package is built or installed (setup.py), beside their
sources, and a worker loads that library instead of compiling its own."""

from __future__ import annotations

import ctypes
import re
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


C_TO_CTYPES = {"int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
               "int": ctypes.c_int}


def _header_signatures() -> dict[str, tuple[list, object]]:
    """Each entry point of specdec_kernels.h: its parameters' and result's ctypes types (a pointer
    is a c_void_p, as kernels.py passes tensors' addresses)."""
    text = re.sub(r"/\*.*?\*/", "", native_build.HEADER.read_text(), flags=re.S)
    signatures = {}
    for result, name, params in re.findall(r"^(\w+)\s+(specdec_\w+)\(([^)]*)\);", text, flags=re.M):
        kinds = [ctypes.c_void_p if "*" in p else C_TO_CTYPES[p.split()[-2]] for p in params.split(",")]
        signatures[name] = (kinds, C_TO_CTYPES[result])
    return signatures


def test_the_header_declares_what_the_library_is_called_with():
    """kernels.py's ctypes signatures are written by hand: they must match the header, which both
    C files include (so the compiler holds the definitions to it)."""
    from specdec.kernels import native_library

    library = native_library()
    if library is None:
        pytest.skip("the native kernels do not run here")
    signatures = _header_signatures()
    assert set(signatures) == {"specdec_native_isa", "specdec_int8_rows_linear", "specdec_q4k_rows_linear",
                               "specdec_q6k_rows_linear", "specdec_decoder_pass"}
    called = {"specdec_int8_rows_linear": library, "specdec_q4k_rows_linear": library.q4k,
              "specdec_q6k_rows_linear": library.q6k, "specdec_decoder_pass": library.decoder}
    for name, fn in called.items():
        assert (list(fn.argtypes), fn.restype) == signatures[name], name
