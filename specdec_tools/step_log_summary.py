"""Where a `specdec bench serve` run's time went, step by step, from the orchestrator's debug log.

Run `specdec bench serve` with the orchestrator at debug level, its output kept:

    specdec bench serve --concurrency 4,8 --gamma on,off --setups log-level=debug > run.log 2>&1
    python -m specdec_tools.step_log_summary run.log [--steps]

Per timed level and mode: the steps' seconds and tokens per second by kind (D: drafted with the
draft model, S: carried suffix drafts, p: plain), and with --steps every step as
KIND<requests>:<target pass ms>/<rest of the step ms> (a step whose rest is hundreds of ms
waited for a prefill; one whose target pass is several times its neighbours' ran beside one, or
on a disturbed machine). The lines parsed are orchestrator/steps.py's "step on ..." debug lines.
"""

from __future__ import annotations

import argparse
import re

STEP = re.compile(r"(\d+) requests \((\d+) prefilling\), gammas \[([^\]]*)\], suffix \[([^\]]*)\], (\d+) rows"
                  r".*?(\d+) tokens in ([\d.]+) ms \(target ([\d.]+) ms")
LEVEL = re.compile(r"^\[bench-serve\] (?:\[[^\]]*\] )?\s*(\S+) c=(\d+)(?:\s+(round \d+))?")


def summarize(lines: list[str], steps: bool = False) -> list[str]:
    out, kinds, seen, passes = [], {}, [], 0.0
    for line in lines:
        level = LEVEL.match(line)
        if level and " requests in " in line:  # a timed level (or one round of it) ended: its steps are those since the last
            if not kinds:  # a level's summary line after its rounds
                continue
            total = sum(v[1] for v in kinds.values())
            rates = ", ".join(f"{k}: {n} steps {ms / 1e3:.2f} s {tok / ms * 1e3:.1f} tok/s"
                              for k, (n, ms, tok) in sorted(kinds.items()))
            steps_n = sum(v[0] for v in kinds.values())
            out.append(f"{level.group(1)} c={level.group(2)}{' ' + level.group(3) if level.group(3) else ''}: {total / 1e3:.1f} s of steps "
                       f"({rates}); the target's passes {passes / 1e3:.2f} s, the rest {(total - passes) / steps_n:.2f} "
                       f"ms a step")
            if steps:
                out.append("    " + " ".join(seen))
            kinds, seen, passes = {}, [], 0.0
            continue
        m = STEP.search(line)
        if not m:
            continue
        requests, _, gammas, suffix, _, tokens, ms, target = m.groups()
        kind = "D" if any(int(g) for g in gammas.split(",") if g.strip()) else "S" if suffix.strip() else "p"
        n, total, tok = kinds.get(kind, (0, 0.0, 0))
        kinds[kind] = (n + 1, total + float(ms), tok + int(tokens))
        passes += float(target)
        seen.append(f"{kind}{requests}:{float(target):.0f}/{float(ms) - float(target):.0f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log", help="`specdec bench serve`'s output, the orchestrator at --log-level debug")
    p.add_argument("--steps", action="store_true", help="every step, in order")
    a = p.parse_args()
    with open(a.log) as f:
        print("\n".join(summarize(f.read().splitlines(), a.steps)))


if __name__ == "__main__":
    main()
