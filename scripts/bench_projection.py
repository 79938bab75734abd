"""One int8-rows projection, the native kernel's AVX2 path against its AVX-512 VNNI path, side by side.

    .venv/bin/python scripts/bench_projection.py [--copies 8] [--repeats 40]

For each shape of the default target (1536 -> 8960, 8960 -> 1536, 1536 -> 1536) and rows 1..32: ms per
call, median, with `--copies` weight copies cycled so that each call reads its weights from memory
(one hot copy is 2-5x faster at one row and misleads), the two paths alternated twice and the best
median kept. The paths give the same bits (tests/specdec/test_kernels.py); only the time differs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--repeats", type=int, default=40)
    a = p.parse_args()
    import torch

    from specdec import kernels

    lib = kernels.native_library()
    if lib is None or lib.set_isa("best") != "avx512-vnni":
        print("needs the native kernel on a CPU with AVX-512 VNNI")
        return 1
    torch.manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}, ms per call\n")
    print("| shape | rows | AVX2 | AVX-512 VNNI | AVX2 / VNNI |\n|---|---|---|---|---|")
    for k, n in [(1536, 8960), (8960, 1536), (1536, 1536)]:
        mods = [kernels.Int8RowLinear(torch.nn.Linear(k, n, bias=False)) for _ in range(a.copies)]
        for rows in (1, 2, 5, 9, 17, 32):
            x = torch.randn(rows, k)
            best = {}
            for isa in ("avx2", "best", "avx2", "best"):
                lib.set_isa(isa)
                times = []
                for i in range(a.repeats):
                    t0 = time.perf_counter()
                    mods[i % a.copies](x)
                    times.append(time.perf_counter() - t0)
                best[isa] = min(best.get(isa, float("inf")), statistics.median(times[a.repeats // 5:]) * 1e3)
            print(f"| {k} -> {n} | {rows} | {best['avx2']:.3f} | {best['best']:.3f} | {best['avx2'] / best['best']:.2f}x |",
                  flush=True)
    lib.set_isa("best")
    return 0


if __name__ == "__main__":
    sys.exit(main())
