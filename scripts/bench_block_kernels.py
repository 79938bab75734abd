"""The Q4_K and Q6_K row kernels of specdec/csrc/int8_rows.c at one git revision against the working
tree's, interleaved in one process: 28 projections of 8960 x 1536 (the default target's MLP
up-projections: ~216 MB of Q4_K weights, ~316 MB of Q6_K, far more than any cache) called one after
another as a pass calls them, 1 to 8 rows each, random blocks on huge pages as the worker holds
them. Prints ms for the 28 calls (median of --repeats, each version's calls alternating) and the
weight bytes read per second, and whether both versions return the same bits.

    .venv/bin/python scripts/bench_block_kernels.py [--base HEAD] [--rows 1,2,3,5,8]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYERS, N, K = 28, 8960, 1536
BYTES_PER_BLOCK = {"Q4_K": 128 + 20, "Q6_K": 192 + 20}  # the native layout's weights + meta per 256 columns


def build(source: str, out: Path):
    """The kernel library from `source` (C text); its q4k/q6k entry points and whether they take Kp."""
    from specdec.native_build import CFLAGS, SOURCE_DIR

    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["cc", *CFLAGS, f"-I{SOURCE_DIR}", str(src), "-o", str(out)], check=True)  # its header
    return ctypes.CDLL(str(out)), "int64_t K, int64_t Kp, const uint8_t *qs" in source


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="HEAD", help="the git revision to compare the working tree's kernels with")
    p.add_argument("--rows", default="1,2,3,5,8")
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args()
    import torch

    from specdec.kernels import weight_memory

    torch.set_num_threads(2)
    base = subprocess.run(["git", "show", f"{a.base}:specdec/csrc/int8_rows.c"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    here = (ROOT / "specdec/csrc/int8_rows.c").read_text()
    tmp = Path(tempfile.mkdtemp())
    libs = {a.base: build(base, tmp / "base.so"), "working tree": build(here, tmp / "here.so")}
    nb = K // 256
    print(f"| format | rows | {a.base} ms | working tree ms | {a.base} GB/s | working tree GB/s | same bits |")
    print("|---|---|---|---|---|---|---|")
    for fmt, entry in (("Q4_K", "specdec_q4k_rows_linear"), ("Q6_K", "specdec_q6k_rows_linear")):
        per_block = BYTES_PER_BLOCK[fmt]
        weights = [weight_memory.take(N * nb * (per_block - 20)).copy_(
            torch.randint(0, 256, (N * nb * (per_block - 20),), dtype=torch.uint8)) for _ in range(LAYERS)]
        meta = [weight_memory.take(N * nb * 20).copy_(torch.randint(0, 60, (N * nb * 20,), dtype=torch.uint8))
                for _ in range(LAYERS)]
        for rows in (int(r) for r in a.rows.split(",")):
            x = torch.randn(rows, K)
            times = {name: [] for name in libs}
            outputs = {}
            for _ in range(a.repeats):
                for name, (lib, padded) in libs.items():
                    y = torch.empty(rows, N)
                    fn = getattr(lib, entry)
                    width = [ctypes.c_int64(K)] * (2 if padded else 1)
                    t0 = time.perf_counter()
                    for w, m in zip(weights, meta):
                        fn(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(rows), *width, ctypes.c_void_p(w.data_ptr()),
                           ctypes.c_void_p(m.data_ptr()), ctypes.c_int64(N), None, ctypes.c_void_p(y.data_ptr()),
                           ctypes.c_int32(2))
                    times[name].append(time.perf_counter() - t0)
                    outputs[name] = y
            ms = [statistics.median(t) * 1e3 for t in times.values()]
            gbs = [LAYERS * N * nb * per_block / (m / 1e3) / 1e9 for m in ms]
            same = torch.equal(*outputs.values())
            print(f"| {fmt} | {rows} | {ms[0]:.2f} | {ms[1]:.2f} | {gbs[0]:.1f} | {gbs[1]:.1f} | {same} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
