"""Compiling the native kernels (specdec/csrc/: the int8 / Q4_K / Q6_K linears and the decoder
layers around them) into one shared library, without torch: setup.py runs it when the package is
built or installed, specdec/kernels.py when a worker starts and finds no library built.

The library is named by a hash of its sources and flags, so a stale one is never loaded. It is
looked for beside its sources first (where an install or an image built it: `python -m
specdec.native_build`), then in the cache, where it is compiled on first use.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
SOURCES = (SOURCE_DIR / "int8_rows.c", SOURCE_DIR / "decoder.c")  # one library: the kernels and the layers
HEADER = SOURCE_DIR / "specdec_kernels.h"  # its entry points and structs, which both include
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]


def can_run_here() -> bool:
    """Linux on x86-64: where the library can be built and loaded (AVX2 is checked when loaded)."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def library_name() -> str:
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, HEADER))
                            + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return f"int8_rows-{digest}.so"


def build(directory: Path) -> Path | None:
    """Compiles the sources into `directory` unless the library is there; its path, or None
    (logged) where no compiler builds it. Written to a temporary name and renamed: workers
    starting together each see a whole library."""
    target = Path(directory) / library_name()
    if target.exists():
        return target
    # CC is documented in specdec/envs.py; read here directly, as setup.py loads this file alone
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler: the native kernels are not built (set CC to build them)")
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run([compiler, *CFLAGS, *map(str, SOURCES), "-o", str(built)], capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("the native kernels did not build: %s", done.stderr.strip()[-2000:])
            return None
        os.replace(built, target)
    return target


if __name__ == "__main__":  # python -m specdec.native_build: the library beside its sources (images)
    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if can_run_here() and build(SOURCE_DIR) is not None else 1)
