"""The package's one build step beyond pyproject.toml: the native kernels (specdec/csrc/) are
compiled when the package is built or installed (`pip install .`, a wheel, `pip install -e .`),
beside their sources, where Linux x86-64 and a C compiler are there. A worker then loads them at
start instead of compiling them on its first start (or a test run at collection). Where they
cannot build here, the install goes on: a worker compiles them on first use, or runs fbgemm's
kernels, and says which in its log and its ModelInfo.kernels.
"""

import importlib.util
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def native_build():
    """specdec/native_build.py, loaded from its file: the package (and torch) is not importable here."""
    spec = importlib.util.spec_from_file_location("specdec_native_build", ROOT / "specdec" / "native_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        build = native_build()
        if not build.can_run_here():
            return
        # an editable install runs the sources in place; a wheel carries what build_lib holds
        where = ROOT if self.editable_mode else Path(self.build_lib)
        try:
            built = build.build(where / "specdec" / "csrc")
        except Exception as exc:  # noqa: BLE001 - the kernels are an optimisation: never fail the install
            print(f"specdec: the native kernels were not built ({exc}); a worker compiles them on first use")
            return
        if built is not None:
            print(f"specdec: native kernels built: {built}")


class KernelsDistribution(Distribution):
    def has_ext_modules(self):
        """Where the kernels build, the wheel carries a shared library: tag it for this platform."""
        return native_build().can_run_here()


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=KernelsDistribution)
