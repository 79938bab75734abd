#!/usr/bin/env bash
# Before and after, alternating: two checkouts (git worktrees) of the trees to compare, each
# running the project's benchmark with the default policy, new users, 1 / 4 / 8 / 16 clients,
# back to back, PAIRS times (before, after, before, after, ...).
#   bash docs/benchmarks/one-pass-per-call/ab.sh BEFORE_DIR AFTER_DIR OUT_DIR [PAIRS] [FIRST]
# (FIRST: the number of the first pair, to add pairs to an OUT_DIR)
set -euo pipefail
before=$1 after=$2 out=$3 pairs=${4:-3} first=${5:-1}
python=$(cd "$(dirname "$0")/../../.." && pwd)/.venv/bin/python
mkdir -p "$out"
for i in $(seq "$first" $((first + pairs - 1))); do
  for tree in before after; do
    dir=$before; [ "$tree" = after ] && dir=$after
    (cd "$dir" && PYTHONPATH="$dir" "$python" -m orchestrator.cli bench-serve \
      --concurrency 1,4,8,16 --gamma on --max-new-tokens 48 --out "$out/$tree-$i" \
      > "$out/$tree-$i.log" 2>&1)
    echo "$tree $i done $(date +%T)"
  done
done
