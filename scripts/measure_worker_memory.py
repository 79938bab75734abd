"""A CPU worker's memory under each --quantize mode: each mode loads the default target in a
fresh process (`load_model`, as a worker does), then prints its resident memory once loaded
(VmRSS) and its peak while loading (ru_maxrss), the bytes its Linear layers hold, and the seconds
the load took. The draft: --model qwen2.5-coder-0.5b-instruct --head-rows 32768 (specdec run's
--draft-vocab).

    .venv/bin/python scripts/measure_worker_memory.py [--modes int4-rows,int8-rows] [--model NAME] [--head-rows N]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import gc, resource, sys, time, torch
from specdec.modeling import load_model
t0 = time.perf_counter()
loaded = load_model(sys.argv[1], quantization=sys.argv[2], head_rows=int(sys.argv[3]))
seconds = time.perf_counter() - t0
gc.collect()
rss = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS:')) / 2**20
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
linear = sum(b.numel() * b.element_size() for m in loaded.model.modules() if not list(m.children())
             and type(m).__name__.endswith('Linear') for b in list(m.buffers()) + list(m.parameters()))
print(f"| {loaded.quantization} | {rss:.2f} GiB | {peak:.2f} GiB | {linear / 2**30:.2f} GiB | {seconds:.1f} s |")
"""


def main() -> int:
    from specdec.model_store import DEFAULT_TARGET

    p = argparse.ArgumentParser()
    p.add_argument("--modes", default="int4-rows,int8-rows")
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--head-rows", type=int, default=0, help="the output head's rows (a draft's --draft-vocab; 0: all)")
    a = p.parse_args()
    print("| --quantize | RSS once loaded | peak while loading | Linear layers' tensors | load |\n|---|---|---|---|---|")
    for mode in a.modes.split(","):
        out = subprocess.run([sys.executable, "-c", CHILD, a.model, mode, str(a.head_rows)], cwd=ROOT, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        print(out.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
