"""One projection of the default target under the native kernels, side by side.

    .venv/bin/python scripts/bench_projection.py [--copies 24] [--repeats 48] [--kernels int8|q4k]

--kernels int8: int8-rows, the native kernel's AVX2 path against its AVX-512 VNNI path, for the
default target's shapes (1536 -> 8960, 8960 -> 1536, 1536 -> 1536), random weights.
--kernels q4k: int4-rows on the default target's own Q4_K blocks (layer 1's ffn_up and the first
Q4_K ffn_down, read from the GGUF), its AVX2 and VNNI paths, beside int8-rows (VNNI) of the same shape.

For rows 1..32: ms per call, median, with `--copies` weight copies cycled so that each call reads
its weights from memory (one hot copy is 2-5x faster at one row and misleads; 8 copies of an int4
projection still fit this VM's caches in part), each setup timed twice, interleaved, the best median
kept. Each kernel's paths give the same bits (tests/specdec/test_kernels.py); only the time differs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = (1, 2, 5, 9, 17, 32)


def _time(lib, setups: dict, x, copies: int, repeats: int) -> dict[str, float]:
    best: dict[str, float] = {}
    for label, (mods, isa) in list(setups.items()) * 2:
        lib.set_isa(isa)
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            mods[i % copies](x)
            times.append(time.perf_counter() - t0)
        best[label] = min(best.get(label, float("inf")), statistics.median(times[repeats // 5:]) * 1e3)
    lib.set_isa("best")
    return best


def _shapes(kind: str, copies: int):
    """(label, in, out, {setup: ([modules], isa)}) for each shape."""
    import numpy as np
    import torch

    from specdec import kernels

    if kind == "int8":
        for k, n in [(1536, 8960), (8960, 1536), (1536, 1536)]:
            mods = [kernels.Int8RowLinear(torch.nn.Linear(k, n, bias=False)) for _ in range(copies)]
            yield f"{k} -> {n}", k, {"AVX2": (mods, "avx2"), "AVX-512 VNNI": (mods, "best")}
        return
    from gguf import GGMLQuantizationType, GGUFReader

    from specdec.model_store import DEFAULT_TARGET, resolve_model

    gguf = json.loads((resolve_model(DEFAULT_TARGET) / "source.json").read_text())["source_gguf"]
    tensors = GGUFReader(gguf).tensors
    up = next(t for t in tensors if t.name == "blk.1.ffn_up.weight")
    down = next(t for t in tensors if t.name.endswith("ffn_down.weight") and t.tensor_type == GGMLQuantizationType.Q4_K)
    for t in (up, down):
        k, n = int(t.shape[0]), int(t.shape[1])
        blocks = torch.from_numpy(np.array(t.data))
        q4k = [kernels.Q4KRowLinear(k, n, blocks) for _ in range(copies)]
        i8 = [kernels.Int8RowLinear(torch.nn.Linear(k, n, bias=False)) for _ in range(copies)]
        yield f"{t.name} {k} -> {n}", k, {"int4-rows AVX2": (q4k, "avx2"), "int4-rows VNNI": (q4k, "best"),
                                          "int8-rows VNNI": (i8, "best")}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--copies", type=int, default=24)
    p.add_argument("--repeats", type=int, default=48)
    p.add_argument("--kernels", default="int8", choices=["int8", "q4k"])
    a = p.parse_args()
    import torch

    from specdec import kernels

    lib = kernels.native_library()
    if lib is None or lib.set_isa("best") != "avx512-vnni":
        print("needs the native kernel on a CPU with AVX-512 VNNI")
        return 1
    torch.manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}, ms per call, {a.copies} weight copies cycled\n")
    header = False
    for label, k, setups in _shapes(a.kernels, a.copies):
        if not header:
            names = list(setups)
            print("| shape | rows | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names))
            header = True
        for rows in ROWS:
            best = _time(lib, setups, torch.randn(rows, k), a.copies, a.repeats)
            print(f"| {label} | {rows} | " + " | ".join(f"{best[n]:.3f}" for n in names) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
