"""The proto checks: buf lint over proto/ and buf breaking against the kept baseline of the API.

buf is npm's @bufbuild/buf at the exact version tools/buf/package.json pins (its
package-lock.json holds the integrity hashes); it installs into tools/buf/node_modules with
`npm ci` the first time a command needs it, and nothing is installed globally.

    python scripts/buf.py install          install buf (no-op when installed; `make test` runs it)
    python scripts/buf.py check            lint, breaking and a current baseline: what CI checks
    python scripts/buf.py lint             buf lint (rules: buf.yaml)
    python scripts/buf.py breaking         buf breaking against proto/baseline.txtpb
    python scripts/buf.py baseline         record the current protos as the baseline; refuses a
                                           breaking change unless --allow-breaking is given
    python scripts/buf.py run -- ARGS      any buf command, e.g. `run -- format -d`

The baseline, proto/baseline.txtpb, is the image `buf build --exclude-source-info` makes of
proto/ (text format: a breaking change shows in its diff; comments are not in it, so editing a
comment never touches it). tests/specdec/test_proto_checks.py fails when proto/ breaks it (a
field renumbered or removed, a message renamed, ...) and when it lags behind proto/ (an added
field not yet recorded), so every field the API has ever shipped stays protected.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL_DIR = ROOT / "tools" / "buf"
BASELINE = ROOT / "proto" / "baseline.txtpb"


class BufUnavailable(RuntimeError):
    """buf cannot be installed here: no npm (tests skip on this, and only on this)."""


def pinned_version() -> str:
    return json.loads((TOOL_DIR / "package.json").read_text())["dependencies"]["@bufbuild/buf"]


def binary() -> Path:
    """Where npm puts buf's launcher (it runs the platform package's native binary)."""
    return TOOL_DIR / "node_modules" / ".bin" / ("buf.cmd" if os.name == "nt" else "buf")


def _stamp() -> Path:
    lock = hashlib.sha256((TOOL_DIR / "package-lock.json").read_bytes()).hexdigest()[:16]
    return TOOL_DIR / "node_modules" / f".installed-{lock}"


@contextlib.contextmanager
def _install_lock():
    """One installer at a time (two test processes may start at once)."""
    TOOL_DIR.mkdir(parents=True, exist_ok=True)
    with open(TOOL_DIR / ".install.lock", "w") as handle:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no lock
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def install(quiet: bool = False) -> Path:
    """Installs the pinned buf into tools/buf/node_modules when it is not there; returns its path.
    Raises BufUnavailable without npm, CalledProcessError when npm fails."""
    if _stamp().exists() and binary().exists():
        return binary()
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise BufUnavailable("buf installs with npm (npm's @bufbuild/buf), and npm or node is not on PATH")
    with _install_lock():
        if not (_stamp().exists() and binary().exists()):
            if not quiet:
                print(f"installing buf {pinned_version()} into {TOOL_DIR.relative_to(ROOT)}/node_modules (npm ci)",
                      file=sys.stderr)
            # --ignore-scripts: the package's postinstall checks the platform binary's version (as below)
            # and, when that package is missing, fetches it outside the lockfile
            subprocess.run([npm, "ci", "--prefix", str(TOOL_DIR), "--ignore-scripts", "--no-audit", "--no-fund",
                            "--loglevel=error"], check=True, stdout=subprocess.DEVNULL if quiet else None)
            version = subprocess.run([str(binary()), "--version"], check=True, capture_output=True,
                                     text=True).stdout.strip()
            if version != pinned_version():
                raise RuntimeError(f"installed buf reports version {version}, expected {pinned_version()}")
            _stamp().touch()
    return binary()


def run(args: list[str], cwd: Path = ROOT, check: bool = False) -> subprocess.CompletedProcess:
    """buf ARGS in cwd (a folder with a buf.yaml), output captured."""
    return subprocess.run([str(install(quiet=True)), *args], cwd=cwd, capture_output=True, text=True, check=check)


def lint(cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return run(["lint", "--error-format=json"], cwd)


def breaking(cwd: Path = ROOT, against: Path = BASELINE) -> subprocess.CompletedProcess:
    return run(["breaking", "--error-format=json", "--against", str(against)], cwd)


def build_image(out: Path, cwd: Path = ROOT) -> None:
    """The baseline's form of the protos in cwd: an image without comments, in text format."""
    run(["build", "--exclude-source-info", "-o", str(out)], cwd, check=True)


def baseline_is_current() -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "image.txtpb"
        build_image(fresh)
        return BASELINE.exists() and fresh.read_bytes() == BASELINE.read_bytes()


def rule_ids(result: subprocess.CompletedProcess) -> list[str]:
    """The rule of each problem buf reported in --error-format=json output."""
    return [json.loads(line)["type"] for line in result.stdout.splitlines() if line.strip().startswith("{")]


def _report(name: str, result: subprocess.CompletedProcess) -> bool:
    if result.returncode == 0:
        print(f"buf {name}: ok")
        return True
    print(f"buf {name}: FAILED", file=sys.stderr)
    for line in result.stdout.splitlines():
        try:
            p = json.loads(line)
            print(f"  {p['path']}:{p.get('start_line', 0)}:{p.get('start_column', 0)}: {p['message']} ({p['type']})",
                  file=sys.stderr)
        except (ValueError, KeyError):
            print(f"  {line}", file=sys.stderr)
    if result.stderr.strip():
        print(result.stderr.rstrip(), file=sys.stderr)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install", help="install the pinned buf into tools/buf/node_modules")
    p.add_argument("--if-npm", action="store_true", help="without npm, say so and succeed (make test)")
    sub.add_parser("check", help="lint, breaking against the baseline, and a current baseline")
    sub.add_parser("lint", help="buf lint over proto/ (buf.yaml)")
    sub.add_parser("breaking", help="buf breaking against proto/baseline.txtpb")
    p = sub.add_parser("baseline", help="record the current protos as proto/baseline.txtpb")
    p.add_argument("--allow-breaking", action="store_true",
                   help="record it even though it breaks the old baseline (a deliberate breaking change)")
    p = sub.add_parser("run", help="any buf command: run -- ARGS")
    p.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)

    try:
        if args.command == "install":
            print(f"buf {pinned_version()}: {install().relative_to(ROOT)}")
            return 0
        if args.command == "run":
            extra = args.args[1:] if args.args[:1] == ["--"] else args.args
            return subprocess.run([str(install()), *extra], cwd=ROOT).returncode
        if args.command == "lint":
            return 0 if _report("lint", lint()) else 1
        if args.command == "breaking":
            return 0 if _report("breaking", breaking()) else 1
        if args.command == "check":
            ok = _report("lint", lint())
            if not _report("breaking (against proto/baseline.txtpb)", breaking()):
                print("undo the breaking change; if it is intended, see README.md (The gRPC API): python "
                      "scripts/buf.py baseline --allow-breaking", file=sys.stderr)
                ok = False
            if ok and not baseline_is_current():
                print("proto/baseline.txtpb lags behind proto/ (additions not recorded): run "
                      "python scripts/buf.py baseline", file=sys.stderr)
                ok = False
            return 0 if ok else 1
        if args.command == "baseline":
            if BASELINE.exists():
                result = breaking()
                if result.returncode != 0 and not args.allow_breaking:
                    _report("breaking (against proto/baseline.txtpb)", result)
                    print("refusing to record a breaking change as the baseline; if it is intended (clients "
                          "must change too), run again with --allow-breaking", file=sys.stderr)
                    return 1
            build_image(BASELINE)
            print(f"wrote {BASELINE.relative_to(ROOT)}")
            return 0
    except BufUnavailable as exc:
        if args.command == "install" and args.if_npm:
            print(f"{exc}: the buf tests of tests/specdec/test_proto_checks.py will be skipped")
            return 0
        print(exc, file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
