"""What the benchmarks (`specdec bench SCENARIO`) write: the results folder (--out), markdown
tables, CSV and JSON files, and the command line and machine a result records."""

from __future__ import annotations

import csv
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Iterable


def add_out_argument(p, prefix: str) -> None:  # its default: out_dir's
    p.add_argument("--out", default=None, help=f"results folder (default bench_results/{prefix}<time>)")


def out_dir(out: str | None, prefix: str = "") -> Path:
    """The results folder, made: `out`, or bench_results/<prefix><time> where it is None."""
    path = Path(out or f"bench_results/{prefix}{time.strftime('%Y%m%d-%H%M%S')}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def markdown_table(head: Iterable[str], rows: Iterable[Iterable], align: Iterable[str] | None = None) -> str:
    """head's titles, a row of str(cell)s per item of rows; align: each column's "---" or "---:"."""
    head = list(head)
    lines = ["| " + " | ".join(head) + " |", "|" + "".join(f"{a}|" for a in (align or ["---"] * len(head)))]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def write_table(out: Path, text: str, name: str = "table.md") -> None:
    """text (a table and its words) to out/name, and to stdout."""
    (out / name).write_text(text.rstrip("\n") + "\n")
    print(text, flush=True)


def write_csv(path: Path, rows: list[dict], fields: list[str] | None = None) -> None:
    """rows as CSV, with a header: fields, default every key of the rows in the order first seen."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields or list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)


def write_json(path: Path, obj, indent: int = 1) -> None:
    path.write_text(json.dumps(obj, indent=indent, default=str) + "\n")


def command_line() -> str:
    """The command this process runs, as a shell would take it (`specdec ...` where run so)."""
    if Path(sys.argv[0]).name == "specdec":
        return shlex.join(["specdec", *sys.argv[1:]])
    return shlex.join([sys.executable, *sys.argv])


def machine(**more) -> dict:  # the machine a result was measured on, and more
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
            "python": platform.python_version(), **more}
