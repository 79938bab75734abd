"""What the default pair costs on first use and once serving: conversion time, peak RAM, disk,
and each worker's resident memory (anonymous and file-mapped) after it reports SERVING.

    .venv/bin/python scripts/measure_model_store.py [--out docs/benchmarks/model-store]

Converts the default pair into a fresh cache (the verified GGUF files of the usual cache are
linked in, so nothing is downloaded), each conversion in a child process under /usr/bin/time;
then starts each worker on its converted directory and reads /proc/PID/status once it serves.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _peak_kib(stderr: str) -> int:
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr).group(1))


def convert(name: str, cache: Path) -> dict:
    code = ("import sys; from specdec.model_store import resolve_model; "
            f"print(resolve_model({name!r}, progress=False))")
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "SPECDEC_CACHE": str(cache)}, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"converting {name} failed:\n{proc.stderr[-3000:]}")
    seconds = time.perf_counter() - t0
    path = Path(proc.stdout.strip().splitlines()[-1])
    disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {"model": name, "convert_s": round(seconds, 1), "convert_peak_rss_gib": round(_peak_kib(proc.stderr) / 2**20, 2),
            "converted_gib": round(disk / 2**30, 2), "path": str(path)}


def serving_memory(role: str, path: str) -> dict:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec_tools.stack import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", f"{role}_service", "--model", path, "--host", "127.0.0.1",
                             "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 900
            while True:
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                        break
                except grpc.RpcError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, f"{role} did not serve"
                time.sleep(0.5)
        time.sleep(2)
        status = Path(f"/proc/{proc.pid}/status").read_text()
        kib = {k: int(v) for k, v in re.findall(r"^(VmRSS|RssAnon|RssFile|VmHWM):\s+(\d+) kB", status, re.M)}
        return {"role": role, **{f"{k}_gib": round(v / 2**20, 2) for k, v in kib.items()}}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET, cache_root

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_results/model-store")
    a = p.parse_args()
    rows = {"conversions": [], "serving": []}
    with tempfile.TemporaryDirectory(prefix="specdec-measure-") as tmp:
        cache = Path(tmp)
        (cache / "gguf").mkdir()
        for gguf in (cache_root() / "gguf").glob("*.gguf"):  # no download: the verified files of the usual cache
            os.link(gguf, cache / "gguf" / gguf.name) if gguf.stat().st_dev == cache.stat().st_dev else \
                shutil.copy(gguf, cache / "gguf" / gguf.name)
        for name, role in ((DEFAULT_TARGET, "target"), (DEFAULT_DRAFT, "draft")):
            conv = convert(name, cache)
            print(json.dumps(conv), flush=True)
            rows["conversions"].append(conv)
            mem = serving_memory(role, conv["path"])
            print(json.dumps(mem), flush=True)
            rows["serving"].append(mem)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_store.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"results in {out}/model_store.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
