"""Before/after table from ab.sh's runs: per level, each tree's aggregate tok/s (mean of its runs),
the ratio after/before of each pair (run i of both, back to back) and its mean, and where a round's
time went (call minus its passes: what a call costs beside the model).

    python docs/benchmarks/one-pass-per-call/summarize.py OUT_DIR
"""
import json
import statistics
import sys
from pathlib import Path

out = Path(sys.argv[1])
runs: dict[str, dict[int, dict]] = {"before": {}, "after": {}}
for path in sorted(out.glob("*/summary.json")):
    tree, i = path.parent.name.split("-")
    runs[tree][int(i)] = {lv["concurrency"]: lv for lv in json.loads(path.read_text())["levels"] if lv["mode"] == "on"}
pairs = sorted(set(runs["before"]) & set(runs["after"]))
levels = sorted(runs["before"][pairs[0]])
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # Student's t, n - 1 dof


def interval(ratios: list[float]) -> str:
    if len(ratios) < 2:
        return ""
    half = T95[len(ratios) - 1] * statistics.stdev(ratios) / len(ratios) ** 0.5
    m = statistics.mean(ratios)
    return f" ({m - half:.2f}-{m + half:.2f}x)"


print("| clients | before tok/s | after tok/s | after / before, each pair | mean (95% interval) | "
      "draft call beside its passes, ms (before / after) | verify call beside its pass, ms | round ms | "
      "acceptance | greedy outputs differ from c=1 (after) |")
print("|---|---|---|---|---|---|---|---|---|---|")
for c in levels:
    b = [runs["before"][i][c] for i in pairs]
    a = [runs["after"][i][c] for i in pairs]
    ratios = [x["aggregate_tok_s"] / y["aggregate_tok_s"] for x, y in zip(a, b)]
    mean = lambda rows, k: statistics.mean(r[k] or 0 for r in rows)  # noqa: E731
    over = lambda rows, call, passes: mean(rows, call) - mean(rows, passes)  # noqa: E731
    print(f"| {c} | {mean(b, 'aggregate_tok_s'):.2f} | {mean(a, 'aggregate_tok_s'):.2f} | "
          f"{', '.join(f'{r:.3f}' for r in ratios)} | {statistics.mean(ratios):.3f}x{interval(ratios)} | "
          f"{over(b, 'split_draft_ms', 'split_draft_pass_ms'):.2f} / {over(a, 'split_draft_ms', 'split_draft_pass_ms'):.2f} | "
          f"{over(b, 'split_verify_ms', 'split_verify_pass_ms'):.2f} / {over(a, 'split_verify_ms', 'split_verify_pass_ms'):.2f} | "
          f"{mean(b, 'split_round_ms'):.1f} / {mean(a, 'split_round_ms'):.1f} | "
          f"{mean(b, 'acceptance_rate'):.3f} / {mean(a, 'acceptance_rate'):.3f} | "
          f"{', '.join(x['outputs_differ'] or '-' for x in a)} |")
